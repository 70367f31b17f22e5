"""One step's tokens as one flat, ragged batch: what every rank's model runs in one forward call.

A `TokenBatch` holds every scheduled token of every row back to back, with per row its first
position (`starts`: the context already in its KV blocks), its token count (`lens`), its KV
block table and its adapter, and how many of its last tokens return logits (`logits`). A
prompt chunk, a plain decode row (its last sampled token) and a verifying row (the last token
and a draft) are all rows of the same batch: a chunk that ends its prompt wants its last
token's logits, a chunk that does not wants none, a decode or verifying row wants every one.
Nothing is padded: a step costs its tokens.

It is plain data (host ints), built by rank 0's scheduler (tprt.engine.scheduler) and sent to
the other TP ranks as a list of ints (`encode` / `decode_from`) in a STEP message of the rank
protocol (tprt.distributed.protocol); every rank's runner (tprt.engine.runner.ModelRunner)
executes it, its attention backend (tprt.model.attention) building the per-step tensors once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple


class BatchRow(NamedTuple):
    """One row as a caller describes it (`TokenBatch.of`)."""

    table: tuple[int, ...]  # the row's KV blocks in order, covering start + len(tokens) positions
    start: int  # the position of its first token
    tokens: tuple[int, ...]  # its new tokens: a prompt chunk, or a last token and a draft
    logits: int  # how many of its last tokens return logits (0 .. len(tokens))
    adapter: int = 0  # adapter index (tprt.lora.routing); 0: the base model


@dataclass(frozen=True)
class TokenBatch:
    """Every scheduled token of one step, rows back to back (see the module docstring)."""

    tokens: tuple[int, ...]  # every row's tokens, in row order
    starts: tuple[int, ...]  # each row's first position
    lens: tuple[int, ...]  # each row's token count (>= 1)
    tables: tuple[tuple[int, ...], ...]  # each row's KV blocks, in order
    logits: tuple[int, ...]  # each row's count of last tokens that return logits
    full_logits: bool = False  # gather full-vocabulary logits (sampling, logprobs) rather than argmax ids
    adapters: tuple[int, ...] = ()  # each row's adapter index; () = the base model for every row

    def __post_init__(self) -> None:
        n = len(self.starts)
        if not n or not len(self.lens) == len(self.tables) == len(self.logits) == n:
            raise ValueError("TokenBatch: starts, lens, tables and logits must be non-empty, one per row")
        if min(self.lens) < 1 or sum(self.lens) != len(self.tokens):
            raise ValueError("TokenBatch: every row needs a token, and the tokens must be the rows' lens")
        if any(not 0 <= k <= n for k, n in zip(self.logits, self.lens)) or min(self.starts) < 0:
            raise ValueError("TokenBatch: a row's logits count must lie in [0, its tokens], its start >= 0")
        if self.adapters and len(self.adapters) != n:
            raise ValueError("TokenBatch: adapters must be empty or one per row")

    @classmethod
    def of(cls, rows: list[BatchRow], full_logits: bool = False) -> TokenBatch:
        """The batch of `rows`, in order."""
        adapters = tuple(r.adapter for r in rows)
        return cls(tuple(t for r in rows for t in r.tokens), tuple(r.start for r in rows),
                   tuple(len(r.tokens) for r in rows), tuple(tuple(r.table) for r in rows),
                   tuple(r.logits for r in rows), full_logits, adapters if any(adapters) else ())

    @property
    def num_rows(self) -> int:
        return len(self.starts)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @cached_property
    def num_logits(self) -> int:
        """Tokens that return logits (the result's rows)."""
        return sum(self.logits)

    @cached_property
    def max_query_len(self) -> int:
        return max(self.lens)

    @cached_property
    def kv_len(self) -> int:
        """1 + the largest position the batch writes."""
        return max(s + n for s, n in zip(self.starts, self.lens))

    @cached_property
    def query_starts(self) -> tuple[int, ...]:
        """Each row's first token's index in `tokens`, then the token count: [rows + 1]."""
        return (0, *accumulate(self.lens))

    @cached_property
    def positions(self) -> tuple[int, ...]:
        """Each token's position in its sequence."""
        return tuple(p for s, n in zip(self.starts, self.lens) for p in range(s, s + n))

    @cached_property
    def logits_indices(self) -> tuple[int, ...]:
        """The indices in `tokens` of the tokens that return logits, rows in order."""
        return tuple(i for end, k in zip(self.query_starts[1:], self.logits) for i in range(end - k, end))

    def row_tokens(self, row: int) -> tuple[int, ...]:
        return self.tokens[self.query_starts[row] : self.query_starts[row + 1]]

    def token_adapters(self) -> tuple[int, ...]:
        """Each token's adapter index (its row's); () when every row is the base model."""
        if not self.adapters:
            return ()
        return tuple(a for a, n in zip(self.adapters, self.lens) for _ in range(n))

    def split(self, parts: int) -> list[TokenBatch]:
        """The batch as at most `parts` batches of consecutive rows with about as many tokens
        each (pipeline stages pass one along while the next is computed); their results, in
        order, are this batch's."""
        if parts <= 1 or self.num_rows == 1:
            return [self]
        target, bounds, total = self.num_tokens / min(parts, self.num_rows), [0], 0
        for row, n in enumerate(self.lens[:-1]):
            total += n
            rows_left, parts_left = self.num_rows - row - 1, min(parts, self.num_rows) - len(bounds)
            if parts_left > 0 and (total >= target * len(bounds) or rows_left == parts_left):
                bounds.append(row + 1)
        bounds.append(self.num_rows)
        return [self._rows(a, b) for a, b in zip(bounds, bounds[1:])]

    def _rows(self, a: int, b: int) -> TokenBatch:
        q = self.query_starts
        return TokenBatch(self.tokens[q[a]:q[b]], self.starts[a:b], self.lens[a:b], self.tables[a:b],
                          self.logits[a:b], self.full_logits, self.adapters[a:b] if self.adapters else ())

    def encode(self) -> list[int]:
        n = self.num_rows
        out = [n, int(self.full_logits), int(bool(self.adapters)), *self.starts, *self.lens, *self.logits,
               *(len(t) for t in self.tables), *self.adapters, *self.tokens]
        for table in self.tables:
            out.extend(table)
        assert len(out) == 3 + 4 * n + len(self.adapters) + len(self.tokens) + sum(len(t) for t in self.tables)
        return out

    @classmethod
    def decode_from(cls, data: list[int]) -> TokenBatch:
        """The batch `encode` wrote."""
        n, full, routed = data[0], bool(data[1]), bool(data[2])
        i = 3
        starts, lens, logits, table_lens = (tuple(data[i + k * n : i + (k + 1) * n]) for k in range(4))
        i += 4 * n
        adapters = tuple(data[i : i + n]) if routed else ()
        i += len(adapters)
        tokens = tuple(data[i : i + sum(lens)])
        i += len(tokens)
        tables = []
        for length in table_lens:
            tables.append(tuple(data[i : i + length]))
            i += length
        return cls(tokens, starts, lens, tuple(tables), logits, full, adapters)
