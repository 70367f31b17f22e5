"""What one engine step does, as plain data that rank 0 decides and every rank executes.

A `StepPlan` holds only model inputs (no sampling state, no text): one prefill batch and one
decode batch, each row with its KV block table (tprt.model.kv_cache) and its new tokens: a
prompt chunk (prefill), or a decode row's last sampled token and any drafted tokens after it.
Rank 0's scheduler (tprt.engine.scheduler) builds it; it travels to the other TP ranks as a list
of ints (`encode` / `decode_from`) in a STEP message of the rank protocol
(`tprt.distributed.protocol`: a header, then the ints as one int64 tensor); every rank then runs
`tprt.engine.runner.ModelRunner.execute(plan)` and so issues the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """One forward call over rows of (block table, start position, token ids)."""

    tables: tuple[tuple[int, ...], ...]  # each row's KV-cache blocks, in order (covering its tokens)
    starts: tuple[int, ...]  # position of each row's first token
    tokens: tuple[tuple[int, ...], ...]  # each row's tokens (a prompt chunk, or the last sampled id and a draft)
    full_logits: bool  # gather full-vocabulary logits (sampling, logprobs) rather than argmax ids only
    adapters: tuple[int, ...] = ()  # each row's adapter index (tprt.lora.routing); () = the base model for all

    def __post_init__(self) -> None:
        if not len(self.tables) == len(self.starts) == len(self.tokens) or not self.tables:
            raise ValueError("BatchPlan: tables, starts and tokens must be non-empty and of equal length")
        if self.adapters and len(self.adapters) != len(self.tables):
            raise ValueError("BatchPlan: adapters must be empty or one per row")

    @property
    def width(self) -> int:
        """Padded sequence length of the batch."""
        return max(len(t) for t in self.tokens)

    @property
    def kv_len(self) -> int:
        """1 + the largest position the batch writes (padding included)."""
        return max(self.starts) + self.width

    @property
    def rows(self) -> int:
        return len(self.tables)

    def encode(self) -> list[int]:
        out = [len(self.tables), int(self.full_logits), int(bool(self.adapters)), *self.starts,
               *(len(t) for t in self.tokens), *(len(t) for t in self.tables), *self.adapters]
        for t in (*self.tokens, *self.tables):
            out.extend(t)
        return out

    @classmethod
    def decode_from(cls, data: list[int], i: int) -> tuple[BatchPlan, int]:
        """Reads a batch written by `encode` at data[i:]; returns it and the index after it."""
        n, full, routed = data[i], bool(data[i + 1]), bool(data[i + 2])
        i += 3
        starts, lens, table_lens = data[i : i + n], data[i + n : i + 2 * n], data[i + 2 * n : i + 3 * n]
        i += 3 * n
        adapters = tuple(data[i : i + n]) if routed else ()
        i += n if routed else 0
        runs = []
        for length in (*lens, *table_lens):
            runs.append(tuple(data[i : i + length]))
            i += length
        return cls(tuple(runs[n:]), tuple(starts), tuple(runs[:n]), full, adapters), i


@dataclass(frozen=True)
class StepPlan:
    """Everything every rank must do for one engine step, in order: prefill, then decode."""

    prefill: BatchPlan | None = None
    decode: BatchPlan | None = None

    @property
    def empty(self) -> bool:
        return self.prefill is None and self.decode is None

    def encode(self) -> list[int]:
        out = []
        for batch in (self.prefill, self.decode):
            out.append(int(batch is not None))
            if batch is not None:
                out.extend(batch.encode())
        return out

    @classmethod
    def decode_from(cls, data: list[int]) -> StepPlan:
        i = 0
        batches: list[BatchPlan | None] = []
        for _ in range(2):
            present, i = data[i], i + 1
            batch = None
            if present:
                batch, i = BatchPlan.decode_from(data, i)
            batches.append(batch)
        return cls(batches[0], batches[1])
