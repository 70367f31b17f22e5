"""The rank protocol: what TP rank 0 tells the other ranks of its group, and how it travels.

Rank 0 decides, every rank executes. Every message from rank 0 opens with a header, one
broadcast of three int64s [magic, tag, size], whose tag says what follows:

- STEP: a generation step's plan (`tprt.engine.plan.StepPlan.encode()`), `size` int64s in one
  more broadcast. The per-step fast path: two broadcasts a step, nothing pickled.
- COMMAND: one `Command` (a fine-tuning step, loading an adapter), pickled by
  `broadcast_object_list`. Every rank executes it together (`tprt.distributed.ranks`); its type
  says what rank 0 gets back: a `Command[R]` returns an R.
- KEEPALIVE: nothing follows. Rank 0 is idle but alive; a follower never waits in a collective
  for long, so the collective timeout can stay short and a dead rank 0 is noticed.
- EXIT: nothing follows. The followers' life ends.

On one rank nothing is sent. The magic number catches a follower reading something that is not a
header (ranks out of step).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext

if TYPE_CHECKING:  # only for annotations: a follower unpickles them when a job starts
    from tprt.train.data import Dataset
    from tprt.train.trainer import FinetuneConfig

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
    size: int = 0  # STEP: the plan's length in int64s; 0 otherwise

    def encode(self) -> list[int]:
        return [_MAGIC, int(self.tag), self.size]

    @classmethod
    def decode(cls, data: list[int]) -> Header:
        if len(data) != 3 or data[0] != _MAGIC or data[1] not in _TAGS:
            raise RuntimeError("received a malformed message header (ranks out of step?)")
        return cls(Tag(data[1]), data[2])


# ----------------------------------------------------------------- commands and their results


class Command(Generic[R_co]):
    """An action every rank performs together, besides generation steps. Subclasses are frozen
    dataclasses of picklable data; R_co is what the command returns (rank 0's is the caller's)."""


@dataclass(frozen=True)
class TrainStarted:
    step: int  # the step the job starts from (> 0 when it resumed)
    total: int  # its optimizer steps in all


@dataclass(frozen=True)
class TrainStepResult:
    step: int
    loss: float
    grad_norm: float
    seconds: float
    tokens: int  # tokens in the global batch
    eval_loss: float | None = None  # measured after this step (the last, with held-out data), else None
    metrics: dict[str, float] | None = None  # DPO: rewards, reward accuracy and margin (tprt.train.dpo)


@dataclass(frozen=True)
class AdapterLoaded:
    rank: int
    alpha: float
    index: int  # where the ranks hold the adapter: what a step plan routes rows to
    targets: tuple[str, ...] = ()  # the projections it adapts (q, k, v, o, gate, up, down)


@dataclass(frozen=True)
class TrainStart(Command[TrainStarted]):
    """Builds each rank's trainer for a fine-tuning job, resuming from its checkpoint if asked."""

    config: FinetuneConfig
    dataset: Dataset
    resume: bool


@dataclass(frozen=True)
class TrainStep(Command[TrainStepResult]):
    """One optimizer step of the running job."""


@dataclass(frozen=True)
class TrainSave(Command[str]):
    """A training checkpoint of the running job; returns its path."""


@dataclass(frozen=True)
class TrainFinish(Command[str]):
    """Writes the job's output (a LoRA adapter or a TP checkpoint), frees the trainer; returns the output's path."""

    loss: float  # the last step's, for the summary


@dataclass(frozen=True)
class TrainAbort(Command[None]):
    """Frees the running job's trainer (cancelled, or checkpointed for a shutdown)."""


@dataclass(frozen=True)
class LoadAdapter(Command[AdapterLoaded]):
    """Loads a PEFT LoRA adapter into the served model under `index` (rank 0 gives every load a
    new one, so keys and values cached for an earlier load are never matched), on the device.
    index 0: the executor picks one (a new index per id)."""

    adapter_id: str
    path: str
    index: int = 0


@dataclass(frozen=True)
class MoveAdapter(Command[None]):
    """Moves a loaded adapter between tiers: "device" (routable), "host" (host memory) or "drop" (forgotten)."""

    index: int
    tier: str


RankCommand = TrainStart | TrainStep | TrainSave | TrainFinish | TrainAbort | LoadAdapter | MoveAdapter


# ----------------------------------------------------------------- transport (TP group, from rank 0)


def _device(ctx: TPContext) -> torch.device:
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def _send_header(header: Header, ctx: TPContext) -> None:
    dist.broadcast(torch.tensor(header.encode(), dtype=torch.int64, device=_device(ctx)), group=ctx.group, group_src=0)


class IntEncodable(Protocol):
    """A step plan, as far as the transport is concerned (tprt.engine.plan.StepPlan)."""

    def encode(self) -> list[int]: ...


def send_step(plan: IntEncodable, ctx: TPContext) -> None:
    """Rank 0: a STEP message carrying `plan.encode()`. Collective over the TP group."""
    if ctx.world_size == 1:
        return  # nothing to encode either: this is every step of a one-rank engine
    data = torch.tensor(plan.encode(), dtype=torch.int64, device=_device(ctx))
    _send_header(Header(Tag.STEP, data.numel()), ctx)
    dist.broadcast(data, group=ctx.group, group_src=0)


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


def receive_command(ctx: TPContext) -> RankCommand:
    """A follower, after a COMMAND header: the command."""
    box: list[Any] = [None]
    device = ctx.device if ctx.backend == "nccl" else None
    dist.broadcast_object_list(box, group=ctx.group, group_src=0, device=device)
    cmd = box[0]
    if not isinstance(cmd, RankCommand):
        raise RuntimeError(f"received a {type(cmd).__name__} where a command was due (ranks out of step?)")
    return cmd
