"""KV-cache events (serve/kv_events.py, issue 43): what the block pool records as it names and
evicts blocks, and the stream a router reads, decoded here the way vLLM's documented subscriber
decodes it (msgspec structs, tagged arrays) over real ZeroMQ sockets, replay included. A real
server publishing them is tests/test_fleet.py's."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from serve.kv_events import END_SEQ, KVEventPublisher, KVEventsError, block_hash, wire_events
from tprt.engine.prefix_cache import BlockEvicted, BlockNamed, BlockPool


# The stream's schema as a subscriber declares it (vLLM's documented example subscriber).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def test_the_pool_records_named_and_evicted_blocks() -> None:
    pool = BlockPool(n_blocks=4, block_size=2)  # three usable blocks
    pool.events = []
    a: list[int] = []
    digests: list[bytes] = []
    tokens = [1, 2, 3, 4, 5]
    assert pool.grow(a, len(tokens))
    pool.name(a, digests, tokens, (0, 0))
    assert [type(e) for e in pool.events] == [BlockNamed, BlockNamed]  # two full blocks; the third is not full
    first, second = pool.events
    assert first.parent == b"" and first.tokens == (1, 2) and second.parent == first.digest and second.tokens == (3, 4)
    pool.events.clear()
    matched, shared = pool.match(tokens, (0, 0), len(tokens))  # a sequence with the same prefix shares them
    pool.name(matched, shared, tokens[:4], (0, 0))
    assert len(matched) == 2 and pool.events == []  # nothing is stored again
    pool.release(matched)
    pool.release(a)
    other: list[int] = []
    assert pool.grow(other, 6)  # needs all three blocks: the two cached ones are evicted
    assert sorted(pool.events, key=lambda e: e.digest) == sorted([BlockEvicted(first.digest),
                                                                  BlockEvicted(second.digest)], key=lambda e: e.digest)


def test_consecutive_blocks_of_a_sequence_are_one_block_stored() -> None:
    d = [bytes([i]) * 16 for i in range(1, 6)]
    events = [BlockNamed(d[0], b"", (1, 2), (0, 0)), BlockNamed(d[1], d[0], (3, 4), (0, 0)),
              BlockNamed(d[2], b"", (9, 9), (3, 1)),  # another sequence, under adapter index 3
              BlockEvicted(d[3]), BlockEvicted(d[4])]
    wire = wire_events(events, 2, "GPU", {3: "tea"}.get)
    assert wire == [["BlockStored", [block_hash(d[0]), block_hash(d[1])], None, [1, 2, 3, 4], 2, None, "GPU", None],
                    ["BlockStored", [block_hash(d[2])], None, [9, 9], 2, 3, "GPU", "tea"],
                    ["BlockRemoved", [block_hash(d[3]), block_hash(d[4])], "GPU"]]
    assert block_hash(d[0]) == int.from_bytes(d[0][:8], "big") < 2**64


def _subscribe(ctx: zmq.Context[Any], endpoint: str, topic: bytes = b"") -> zmq.Socket[Any]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    return sub


def test_a_subscriber_decodes_the_stream_and_replays_what_it_missed() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tprt", 2, "CPU", lambda index: None)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        d = [bytes([i]) * 16 for i in range(1, 4)]
        sub = _subscribe(ctx, publisher.endpoint, b"tprt")
        time.sleep(0.3)  # PUB drops what is sent before a subscription arrives: why replay exists
        publisher.publish([BlockNamed(d[0], b"", (5, 6), (0, 0)), BlockNamed(d[1], d[0], (7, 8), (0, 0))])
        publisher.publish([BlockEvicted(d[1])])
        seen = []
        while len(seen) < 2:
            topic, seq, payload = sub.recv_multipart()
            batch = DECODE.decode(payload)
            assert topic == b"tprt" and batch.ts > 0
            seen.append((int.from_bytes(seq, "big"), batch.events))
        (s1, e1), (s2, e2) = seen[-2:]
        assert s2 == s1 + 1
        assert e1 == [BlockStored([block_hash(d[0]), block_hash(d[1])], None, [5, 6, 7, 8], 2, None, "CPU")]
        assert e2 == [BlockRemoved([block_hash(d[1])], "CPU")]
        # A subscriber that joined late asks for everything from sequence 0: the start's clear first.
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, 10_000)
        replay.connect(publisher.replay_endpoint)  # type: ignore[arg-type]
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            _, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append(DECODE.decode(payload).events)
        assert replayed == [[AllBlocksCleared()], e1, e2]
    finally:
        ctx.destroy(linger=0)
        publisher.close()


def test_an_endpoint_that_cannot_be_bound_is_one_clear_error() -> None:
    first = KVEventPublisher("tcp://127.0.0.1:*", None, "", 16, "CPU", lambda index: None)
    try:
        with pytest.raises(KVEventsError, match=r"--kv-events tcp://127\.0\.0\.1:\d+: cannot bind there"):
            KVEventPublisher(first.endpoint, None, "", 16, "CPU", lambda index: None)
        with pytest.raises(KVEventsError, match="--kv-events-replay nonsense: cannot bind there"):
            KVEventPublisher("tcp://127.0.0.1:*", "nonsense", "", 16, "CPU", lambda index: None)
    finally:
        first.close()
