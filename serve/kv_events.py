"""KV-cache events for routers that route on exact prefixes (`tprt serve --kv-events tcp://*:5557`).

A router that knows which prompt prefixes each replica holds in its KV cache can send a request
to the replica that will not recompute it (llm-d's KV-cache indexer, NVIDIA Dynamo's KV router,
SGLang's gateway with event-driven routing). vLLM documents the stream these consume, and SGLang
emits it too; tprt publishes the same:

- a ZeroMQ PUB socket bound at `--kv-events`: each message has three frames, the topic
  (`--kv-events-topic`, empty by default), a sequence number (8 bytes, big-endian, from 0 at each
  start) and the payload;
- the payload is MessagePack: an event batch `[ts, events]` (seconds since the epoch), each
  event an array whose first element names it:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`,
  `["BlockRemoved", block_hashes, medium]` and `["AllBlocksCleared"]`;
- with `--kv-events-replay`, a ROUTER socket there answers a request `[b"", start_seq]` with
  every buffered message from that sequence number on (`[b"", seq, payload]` each), then
  `[b"", -1, b""]`, so a subscriber that missed messages catches up (the last `REPLAY_BATCHES`).

A block is one KV block of the engine (`--kv-block-size` positions): stored when every position
is computed and it is named for prefix sharing (tprt.engine.prefix_cache), removed when the pool
evicts it. Consecutive blocks of one sequence go out as one BlockStored (the hashes in order, the
parent of the first, all their tokens). A block's hash is the first 8 bytes of its chained digest
as an unsigned integer: it names the block and its whole prefix, under the adapter it was
computed with (`lora_id`: the adapter's index in this server, `lora_name`: its id; both None for
the base model). `medium` is "GPU" for a CUDA device's cache and "CPU" for host memory. The first
message after a start is AllBlocksCleared: a subscriber drops what it knew of this replica.

The engine loop hands each step's events over (`publish`); a thread of the publisher's own
encodes and sends them, so a slow network never stalls a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from tprt.engine.prefix_cache import ROOT, BlockEvicted, BlockNamed, Digest, KVEvent

log = logging.getLogger("tprt.serve")

REPLAY_BATCHES = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventsError(Exception):
    """The publisher cannot start (the packages missing, an endpoint that cannot be bound)."""


def block_hash(digest: Digest) -> int:
    """The 64-bit name of a block in the events (see the module docstring)."""
    return int.from_bytes(digest[:8], "big")


def wire_events(events: Sequence[KVEvent], block_size: int, medium: str,
                lora_name: Callable[[int], str | None]) -> list[list[Any]]:
    """The engine's events as the stream's event arrays, consecutive blocks of one sequence
    (each the parent of the next, under one key) merged into one BlockStored."""
    out: list[list[Any]] = []
    last: Digest | None = None  # the digest the previous BlockStored ended with
    last_key: Hashable = None
    for ev in events:
        if isinstance(ev, BlockNamed):
            if out and out[-1][0] == "BlockStored" and ev.parent == last and ev.key == last_key:
                out[-1][1].append(block_hash(ev.digest))
                out[-1][3].extend(ev.tokens)
            else:
                index = _adapter_index(ev.key)
                out.append(["BlockStored", [block_hash(ev.digest)],
                            block_hash(ev.parent) if ev.parent != ROOT else None, list(ev.tokens), block_size,
                            index or None, medium, lora_name(index) if index else None])
            last, last_key = ev.digest, ev.key
        elif isinstance(ev, BlockEvicted):
            if out and out[-1][0] == "BlockRemoved":
                out[-1][1].append(block_hash(ev.digest))
            else:
                out.append(["BlockRemoved", [block_hash(ev.digest)], medium])
            last = None
    return out


def _adapter_index(key: Hashable) -> int:
    """The adapter's index in a cache key ((index, load generation); 0: the base model)."""
    return int(key[0]) if isinstance(key, tuple) and key else 0


class KVEventPublisher:
    """See the module docstring. `lora_name` maps an adapter's index to its id."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size: int, medium: str,
                 lora_name: Callable[[int], str | None]) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise KVEventsError(f"--kv-events needs {e.name}: pip install 'tprt[fleet]'") from None
        self._packb = msgpack.packb
        self._zmq = zmq
        self.block_size = block_size
        self.medium = medium
        self.lora_name = lora_name
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        try:
            self._pub = self._bind(zmq.PUB, endpoint, "--kv-events")
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._replay = self._bind(zmq.ROUTER, replay_endpoint, "--kv-events-replay") if replay_endpoint else None
        except KVEventsError:
            self._ctx.destroy(linger=0)  # closes the socket bound already
            raise
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()  # the port, when "*:0" asked for any
        self.replay_endpoint = (self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
                                if self._replay is not None else None)
        self._queue: queue.Queue[list[list[Any]] | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._seq = 0
        self._queue.put([["AllBlocksCleared"]])
        self._thread = threading.Thread(target=self._run, daemon=True, name="tprt-kv-events")
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, flag: str) -> Any:
        sock = self._ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as e:
            raise KVEventsError(f"{flag} {endpoint}: cannot bind there ({e}); give a ZeroMQ endpoint such as "
                                "tcp://*:5557 that is free on this host") from None
        return sock

    def publish(self, events: Sequence[KVEvent]) -> None:
        """One engine step's events (any thread; returns at once)."""
        if events:
            self._queue.put(wire_events(events, self.block_size, self.medium, self.lora_name))

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._packb([time.time(), batch])
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames ignored (expected [b'', start_seq])", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((identity, b"", END_SEQ, b""))  # type: ignore[union-attr]

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(5)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()
