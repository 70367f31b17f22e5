"""What one engine step does, as plain data that rank 0 decides and every rank executes.

A `StepPlan` holds only model inputs (no sampling state, no text): KV-cache slot moves, one
prefill batch and one decode batch. Rank 0's scheduler builds it; `broadcast_plan` sends it to
the other TP ranks as two small int64 tensors (its length, then its contents); every rank then
runs `tprt.engine.runner.ModelRunner.execute(plan)` and so issues the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext

_MAGIC = 0x7470_7274  # "tprt": catches a follower reading something that is not a plan


@dataclass(frozen=True)
class BatchPlan:
    """One forward call over rows of (slot, start position, token ids)."""

    slots: tuple[int, ...]  # KV-cache slot of each row
    starts: tuple[int, ...]  # position of each row's first token
    tokens: tuple[tuple[int, ...], ...]  # each row's tokens (a prompt chunk, or the last sampled id)
    full_logits: bool  # gather full-vocabulary logits (sampling, logprobs) rather than argmax ids only
    adapters: tuple[int, ...] = ()  # each row's adapter index (tprt.lora.routing); () = the base model for all

    def __post_init__(self) -> None:
        if not len(self.slots) == len(self.starts) == len(self.tokens) or not self.slots:
            raise ValueError("BatchPlan: slots, starts and tokens must be non-empty and of equal length")
        if self.adapters and len(self.adapters) != len(self.slots):
            raise ValueError("BatchPlan: adapters must be empty or one per row")

    @property
    def width(self) -> int:
        """Padded sequence length of the batch."""
        return max(len(t) for t in self.tokens)

    @property
    def kv_len(self) -> int:
        """1 + the largest position the batch writes (padding included)."""
        return max(self.starts) + self.width

    def encode(self) -> list[int]:
        out = [len(self.slots), int(self.full_logits), int(bool(self.adapters)), *self.slots, *self.starts,
               *(len(t) for t in self.tokens), *self.adapters]
        for t in self.tokens:
            out.extend(t)
        return out

    @classmethod
    def decode(cls, data: list[int], i: int) -> tuple[BatchPlan, int]:
        """Reads a batch written by `encode` at data[i:]; returns it and the index after it."""
        n, full, routed = data[i], bool(data[i + 1]), bool(data[i + 2])
        i += 3
        slots, starts, lens = data[i : i + n], data[i + n : i + 2 * n], data[i + 2 * n : i + 3 * n]
        i += 3 * n
        adapters = tuple(data[i : i + n]) if routed else ()
        i += n if routed else 0
        tokens = []
        for length in lens:
            tokens.append(tuple(data[i : i + length]))
            i += length
        return cls(tuple(slots), tuple(starts), tuple(tokens), full, adapters), i


@dataclass(frozen=True)
class StepPlan:
    """Everything every rank must do for one engine step, in order: moves, prefill, decode."""

    moves: tuple[tuple[int, int, int], ...] = ()  # (src slot, dst slot, positions) KV copies
    prefill: BatchPlan | None = None
    decode: BatchPlan | None = None
    stop: bool = False  # followers leave their loop

    @property
    def empty(self) -> bool:
        return not self.moves and self.prefill is None and self.decode is None and not self.stop

    def encode(self) -> list[int]:
        out = [_MAGIC, int(self.stop), len(self.moves)]
        for move in self.moves:
            out.extend(move)
        for batch in (self.prefill, self.decode):
            out.append(int(batch is not None))
            if batch is not None:
                out.extend(batch.encode())
        return out

    @classmethod
    def decode_from(cls, data: list[int]) -> StepPlan:
        if not data or data[0] != _MAGIC:
            raise RuntimeError("received a malformed step plan (ranks out of step?)")
        stop, n_moves = bool(data[1]), data[2]
        moves = tuple((data[3 + 3 * k], data[4 + 3 * k], data[5 + 3 * k]) for k in range(n_moves))
        i = 3 + 3 * n_moves
        batches: list[BatchPlan | None] = []
        for _ in range(2):
            present, i = data[i], i + 1
            batch = None
            if present:
                batch, i = BatchPlan.decode(data, i)
            batches.append(batch)
        return cls(moves, batches[0], batches[1], stop)


def broadcast_plan(plan: StepPlan | None, ctx: TPContext) -> StepPlan:
    """Rank 0 passes its plan, the other ranks None; every rank returns rank 0's plan.

    Collective over the TP group (two broadcasts from TP rank 0). With one rank, returns `plan`.
    """
    if ctx.world_size == 1:
        assert plan is not None
        return plan
    cpu = ctx.backend != "nccl"
    device = torch.device("cpu") if cpu else ctx.device
    if ctx.rank == 0:
        assert plan is not None
        payload = torch.tensor(plan.encode(), dtype=torch.int64, device=device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, group=ctx.group, group_src=0)
    if ctx.rank != 0:
        payload = torch.empty(int(size.item()), dtype=torch.int64, device=device)
    dist.broadcast(payload, group=ctx.group, group_src=0)
    return plan if plan is not None else StepPlan.decode_from(payload.tolist())
