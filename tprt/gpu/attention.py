"""The Triton attention backend: tprt.model.attention's interface over tprt.gpu.triton_attention's
paged kernel, which reads the KV cache in place through the block tables (no per-row gather).

`prepare` turns the step's `TokenBatch` into device tensors once (the rows' tables, query
starts, first positions and lengths, and each token's write slot); every layer then writes its new
keys and values into the cache and runs one kernel over the whole ragged batch. `static` builds
the same from a static step's device buffers alone (no host synchronisation), for CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from functools import cached_property

import torch

from tprt.model.attention import AttentionStep, StaticRows, _indices, _tables, check_batch, token_rows
from tprt.model.batch import TokenBatch
from tprt.model.kv_cache import KVCache, TokenRows

# Flash-decoding split: a row's blocks are shared among this many programs at most, and only while
# rows x kv heads leave the GPU's multiprocessors idle (132 on an H100 SXM).
MAX_SPLITS = 16
BLOCKS_PER_SPLIT_MIN = 8
BUSY_PROGRAMS = 132


def splits_for(rows: int, kv_heads: int, blocks: int) -> int:
    """How many shares of each row's blocks to run apart: enough programs to fill the GPU, each
    share at least BLOCKS_PER_SPLIT_MIN blocks."""
    programs = rows * kv_heads
    if programs >= BUSY_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, math.ceil(BUSY_PROGRAMS / programs), blocks // BLOCKS_PER_SPLIT_MIN))


@dataclass(frozen=True)
class _Rows:
    """The kernel's view of a step's rows (int32 on the device; int64 in a static step's buffers),
    and where each token is written (int64 [tokens, 1] block and offset: what KVCache.write reads
    of a step)."""

    tables: torch.Tensor  # [rows, blocks]
    query_starts: torch.Tensor  # [rows + 1]
    starts: torch.Tensor  # [rows]
    lens: torch.Tensor  # [rows]
    max_query_len: int
    splits: int
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor


class TritonAttentionStep(AttentionStep):
    """One step over the paged kernel: every layer writes its keys and values, then one launch."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, tokens: int, logits_index: torch.Tensor | None,
                 batch: TokenBatch | None, rows: _Rows) -> None:
        super().__init__(cache, positions, [], tokens, logits_index, batch)
        self.rows = rows
        self.single_tokens = rows.max_query_len == 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = torch.stack((k, v), dim=1).to(self.cache.dtype)[:, None]  # [tokens, 1, 2, kv_heads, head_dim]
        self.cache.write(layer, kv, self.rows)
        return self.attend_cached(layer, q)

    def attend_cached(self, layer: int, q: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        from tprt.gpu.triton_attention import paged_attention

        cache, rows = self.cache, self.rows
        queries = cache.rotate_queries(q.to(cache.dtype)).contiguous()
        out = paged_attention(
            queries, cache.kv[layer], rows.tables, rows.query_starts, rows.starts, rows.lens, rows.max_query_len,
            scales=None if cache.scales is None else cache.scales[layer],
            fixed_scales=None if cache.fixed_scales is None else cache.fixed_scales[layer],
            splits=rows.splits, window=cache.windows[layer], softcap=cache.softcap)
        return out if out_dtype is None else out.to(out_dtype)

    @cached_property
    def token_rows(self) -> TokenRows:  # type: ignore[override]
        if self.batch is not None:
            return token_rows(self.batch, self.cache, self.positions.device)
        rows = self.rows  # a static step: each token's row found on the device
        row_of = torch.repeat_interleave(torch.arange(rows.lens.shape[0], device=rows.lens.device), rows.lens,
                                         output_size=self.tokens)
        return TokenRows(rows.write_blocks.view(-1), rows.write_offsets.view(-1), rows.tables[row_of].long(),
                         self.positions, rows.tables.shape[1] * self.cache.block_size)


class TritonAttention:
    """Paged attention in Triton on CUDA (and, for tests, on the CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    static_needs_kv_len = False

    @staticmethod
    def available(device: torch.device, cache: KVCache) -> bool:
        """Triton importable, a CUDA device (or the interpreter), and a cache shape the kernel
        takes (tprt.gpu.triton_attention.fits)."""
        if importlib.util.find_spec("triton") is None:
            return False
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return False
        from tprt.gpu.triton_attention import fits

        return fits(cache.kv.shape[-1], cache.block_size)

    def prepare(self, batch: TokenBatch, cache: KVCache) -> TritonAttentionStep:
        check_batch(batch, cache)
        device, size = cache.kv.device, cache.block_size

        def ints(values: list[int] | tuple[int, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        tables = _tables(batch.tables, batch.kv_len, cache, device)  # [rows, blocks] int64
        lens = ints(batch.lens)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=device)  # [tokens]
        row_of = torch.repeat_interleave(torch.arange(batch.num_rows, device=device), lens,
                                         output_size=batch.num_tokens)  # no host synchronisation
        write_blocks = tables[row_of, torch.div(positions, size, rounding_mode="floor")]
        rows = _Rows(tables.to(torch.int32), ints(batch.query_starts), ints(batch.starts), lens, batch.max_query_len,
                     splits_for(batch.num_rows, cache.kv.shape[2], tables.shape[1]),
                     write_blocks[:, None], (positions % size)[:, None])
        index = None if batch.num_logits == batch.num_tokens else _indices(batch, device)
        return TritonAttentionStep(cache, positions, batch.num_tokens, index, batch, rows)

    def static(self, cache: KVCache, rows: StaticRows) -> TritonAttentionStep:
        """The step over a static step's buffers (tprt.engine.step_graphs captures it): the kernel
        reads each row's length on the device, so neither padding nor a key bucket costs reads."""
        n = rows.positions.shape[0]
        splits = splits_for(rows.lens.shape[0], cache.kv.shape[2], rows.tables.shape[1])
        return TritonAttentionStep(cache, rows.positions, n, None, None, _Rows(
            rows.tables, rows.query_starts, rows.starts, rows.lens, rows.width, splits, rows.write_blocks,
            rows.write_offsets))
