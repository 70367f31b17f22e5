"""The rank protocol: what TP rank 0 tells the other ranks of its group, and how it travels.

Rank 0 decides, every rank executes. Every message from rank 0 opens with a header, one
broadcast of three int64s [magic, tag, size], whose tag says what follows:

- STEP: a generation step's batch (`tprt.model.batch.TokenBatch.encode()`), `size` int64s in one
  more broadcast. The per-step fast path: two broadcasts a step, nothing pickled.
- COMMAND: one `Command`, pickled by `broadcast_object_list`. Every rank executes it together
  (`tprt.distributed.ranks`); its type says what rank 0 gets back: a `Command[R]` returns an R.
  The commands themselves belong to the layer that sends them (serve's: serve/ranks/commands.py).
- KEEPALIVE: nothing follows. Rank 0 is idle but alive; a follower never waits in a collective
  for long, so the collective timeout can stay short and a dead rank 0 is noticed.
- EXIT: nothing follows. The followers' life ends.

On one rank nothing is sent. The magic number catches a follower reading something that is not a
header (ranks out of step).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext

_MAGIC = 0x7470_7274  # "tprt"

R_co = TypeVar("R_co", covariant=True)


class Tag(IntEnum):
    """What follows a header."""

    STEP = 1
    COMMAND = 2
    KEEPALIVE = 3
    EXIT = 4


_TAGS = frozenset(int(t) for t in Tag)


@dataclass(frozen=True)
class Header:
    tag: Tag
    size: int = 0  # STEP: the batch's length in int64s; 0 otherwise

    def encode(self) -> list[int]:
        return [_MAGIC, int(self.tag), self.size]

    @classmethod
    def decode(cls, data: list[int]) -> Header:
        if len(data) != 3 or data[0] != _MAGIC or data[1] not in _TAGS:
            raise RuntimeError("received a malformed message header (ranks out of step?)")
        return cls(Tag(data[1]), data[2])


# ----------------------------------------------------------------- commands


class Command(Generic[R_co]):
    """An action every rank performs together, besides generation steps. Subclasses are frozen
    dataclasses of picklable data; R_co is what the command returns (rank 0's is the caller's)."""


# ----------------------------------------------------------------- transport (TP group, from rank 0)


def _device(ctx: TPContext) -> torch.device:
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def _send_header(header: Header, ctx: TPContext) -> None:
    dist.broadcast(torch.tensor(header.encode(), dtype=torch.int64, device=_device(ctx)), group=ctx.group, group_src=0)


class IntEncodable(Protocol):
    """A step's batch, as far as the transport is concerned (tprt.model.batch.TokenBatch)."""

    def encode(self) -> list[int]: ...


def send_step(plan: IntEncodable, ctx: TPContext) -> None:
    """Rank 0: a STEP message carrying `plan.encode()`. Collective over the TP group."""
    if ctx.world_size == 1:
        return  # nothing to encode either: this is every step of a one-rank engine
    data = torch.tensor(plan.encode(), dtype=torch.int64, device=_device(ctx))
    _send_header(Header(Tag.STEP, data.numel()), ctx)
    dist.broadcast(data, group=ctx.group, group_src=0)


def post_step(plan: IntEncodable, ctx: TPContext) -> list[tuple[Any, torch.Tensor]]:
    """Rank 0: `send_step` without waiting for the followers to take it (a pipeline's later
    stages are still busy with earlier steps); returns the sends and their buffers, to be kept
    until `wait_sent`. Messages still arrive in the order they were sent."""
    if ctx.world_size == 1:
        return []
    data = torch.tensor(plan.encode(), dtype=torch.int64, device=_device(ctx))
    header = torch.tensor(Header(Tag.STEP, data.numel()).encode(), dtype=torch.int64, device=_device(ctx))
    return [(dist.broadcast(t, group=ctx.group, group_src=0, async_op=True), t) for t in (header, data)]


def wait_sent(sends: list[tuple[Any, torch.Tensor]]) -> None:
    """Waits for `post_step`'s sends."""
    for work, _ in sends:
        work.wait()


def send_command(cmd: Command[Any], ctx: TPContext) -> None:
    """Rank 0: a COMMAND message. Collective over the TP group."""
    if ctx.world_size == 1:
        return
    _send_header(Header(Tag.COMMAND), ctx)
    device = ctx.device if ctx.backend == "nccl" else None
    dist.broadcast_object_list([cmd], group=ctx.group, group_src=0, device=device)


def send_signal(tag: Tag, ctx: TPContext) -> None:
    """Rank 0: a message that is its header alone (KEEPALIVE or EXIT). Collective over the TP group."""
    if tag not in (Tag.KEEPALIVE, Tag.EXIT):
        raise ValueError(f"{tag.name} carries a payload; use send_step or send_command")
    if ctx.world_size > 1:
        _send_header(Header(tag), ctx)


def receive_header(ctx: TPContext) -> Header:
    """A follower: waits for rank 0's next message and returns its header."""
    data = torch.zeros(3, dtype=torch.int64, device=_device(ctx))
    dist.broadcast(data, group=ctx.group, group_src=0)
    return Header.decode(data.tolist())


def receive_step(header: Header, ctx: TPContext) -> list[int]:
    """A follower, after a STEP header: the encoded plan."""
    data = torch.empty(header.size, dtype=torch.int64, device=_device(ctx))
    dist.broadcast(data, group=ctx.group, group_src=0)
    return data.tolist()


def receive_command(ctx: TPContext) -> Command[Any]:
    """A follower, after a COMMAND header: the command."""
    box: list[Any] = [None]
    device = ctx.device if ctx.backend == "nccl" else None
    dist.broadcast_object_list(box, group=ctx.group, group_src=0, device=device)
    cmd = box[0]
    if not isinstance(cmd, Command):
        raise RuntimeError(f"received a {type(cmd).__name__} where a command was due (ranks out of step?)")
    return cmd
