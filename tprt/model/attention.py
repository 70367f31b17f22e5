"""Attention over the paged KV cache for one `TokenBatch`: the backend interface and the torch reference.

A backend turns a step's `tprt.model.batch.TokenBatch` into an `AttentionStep` once per step
(`prepare`: every tensor the layers need, on the cache's device); each layer then calls the
step's `attend(layer, q, k, v)`, which writes the new keys and values into the cache and
attends every token to its row's positions up to its own, reading the cache through the rows'
block tables. The model never sees rows, padding or masks.

`TorchAttention`, the reference, is what the other backends are tested against. It splits the
batch into groups and runs scaled-dot-product attention per group over the keys and values it
reads through the group's tables (`tprt.model.kv_cache.CacheStep`):

- the rows of one token (plain decode), all together, each under a mask by its own position;
- each run of consecutive rows of several tokens sharing a start and a length (prompt chunks,
  verifying rows), causal within a row, under one staircase mask (queries in blocks where the
  mask would exceed MASK_ELEMENTS).

Every token belongs to one group, and no two rows of a step write the same block (a block is
shared only once full, and full blocks are never written), so writing per group before the
group attends is writing the whole batch first.

`tprt.cpu.native_attention.NativeCPUAttention` runs the one-token rows with tprt's compiled CPU
kernel; `tprt.gpu.attention.TritonAttention` runs every row in one paged Triton kernel per layer
(on CUDA); `backend(name, ...)` picks one by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from tprt.errors import ConfigError
from tprt.model.batch import TokenBatch
from tprt.model.kv_cache import SCRATCH_BLOCK, CacheStep, KVCache, TokenRows, blocks_for


@dataclass(frozen=True)
class _Group:
    """Rows attended in one call: their tokens (`index` into the batch, or the slice [lo, hi)),
    as `rows` x `width`, and their cache view."""

    index: torch.Tensor | None  # [rows * width] the tokens' indices; None: the slice below
    lo: int
    hi: int
    rows: int
    width: int
    cache_step: CacheStep

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, ...] -> this group's [rows, width, ...]."""
        part = x[self.lo : self.hi] if self.index is None else x.index_select(0, self.index)
        return part.view(self.rows, self.width, *x.shape[1:])


class AttentionStep:
    """One step's attention over the paged cache (module docstring): built once by a backend's
    `prepare`, used by every layer."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, groups: list[_Group], tokens: int,
                 logits_index: torch.Tensor | None, batch: TokenBatch | None = None) -> None:
        self.cache = cache
        self.positions = positions  # [tokens] int64 on the cache's device
        self.groups = groups
        self.tokens = tokens
        self.logits_index = logits_index  # [logits] the tokens whose logits are returned; None: all
        self.batch = batch  # the host description, where there is one (not for static steps)
        # Every row holds one token (a plain decode step): one group, in token order.
        self.single_tokens = len(groups) == 1 and groups[0].width == 1 and groups[0].index is None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Writes k, v [tokens, kv_heads, head_dim] at their positions and attends q [tokens,
        heads, head_dim] (rotated) -> [tokens, heads, head_dim] in the cache's compute dtype."""
        cache = self.cache
        kv = torch.stack((k, v), dim=1).to(cache.dtype)  # [tokens, 2, kv_heads, head_dim]
        outs = []
        for g in self.groups:
            keys, values = cache.update(layer, g.take(kv), g.cache_step, rotated_keys=True)
            outs.append(self._attend_group(layer, g, q, keys, values))
        return self._merge(outs, q)

    def attend_cached(self, layer: int, q: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Attention of q [tokens, heads, head_dim] over the cache, whose keys and values for this
        step are written already (a fused kernel wrote them); same result as `attend`, in
        `out_dtype` where given."""
        outs = []
        for g in self.groups:
            keys, values = self.cache.read(layer, g.cache_step, rotated_keys=True)
            outs.append(self._attend_group(layer, g, q, keys, values))
        out = self._merge(outs, q)
        return out if out_dtype is None else out.to(out_dtype)

    def _attend_group(self, layer: int, g: _Group, q: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        queries = cache.rotate_queries(g.take(q).to(cache.dtype)).transpose(1, 2)  # [rows, heads, width, d]
        out = g.cache_step.attend(queries, keys, values, queries.shape[1] != keys.shape[1], cache.windows[layer],
                                  cache.softcap)
        return out.transpose(1, 2).reshape(g.rows * g.width, *q.shape[1:])  # [rows * width, heads, d]

    def _merge(self, outs: list[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
        if len(outs) == 1 and self.groups[0].index is None and self.groups[0].hi - self.groups[0].lo == self.tokens:
            return outs[0]
        out = q.new_empty(self.tokens, *q.shape[1:], dtype=outs[0].dtype)
        for g, part in zip(self.groups, outs):
            if g.index is None:
                out[g.lo : g.hi] = part
            else:
                out.index_copy_(0, g.index, part)
        return out

    @cached_property
    def token_rows(self) -> TokenRows | CacheStep:
        """Every token as a row of its own (its row's block table, its position, its write slot),
        for the compiled kernels that take one token per row and write every token's keys and
        values before any token attends (tprt.cpu.native). A plain decode step's cache view is
        that already (the same attributes)."""
        if self.single_tokens:
            return self.groups[0].cache_step
        assert self.batch is not None, "token rows of a step built without its batch"
        return token_rows(self.batch, self.cache, self.positions.device)


def token_rows(batch: TokenBatch, cache: KVCache, device: torch.device) -> TokenRows:
    """`AttentionStep.token_rows` of any batch, built on the host (checked in range: the kernels
    index by raw pointer)."""
    kv_len, size = batch.kv_len, cache.block_size
    row_of = torch.tensor([r for r, n in enumerate(batch.lens) for _ in range(n)])
    tables = _tables(batch.tables, kv_len, cache, torch.device("cpu"))[row_of]  # [tokens, blocks]
    positions = torch.tensor(batch.positions, dtype=torch.long)
    blocks = tables.gather(1, torch.div(positions, size, rounding_mode="floor")[:, None]).reshape(-1)
    return TokenRows(blocks.to(device), (positions % size).to(device), tables.to(device), positions.to(device), kv_len)


@dataclass(frozen=True)
class StaticRows:
    """A step on static shapes (tprt.engine.step_graphs: what a CUDA graph captures), as views of
    fixed device buffers filled before each replay: `tokens` token slots and as many row slots.
    Rows past the batch's are padding: one-token rows at position 0 whose tables are all scratch
    block (they write there, which no sequence reads), then empty rows (length 0)."""

    positions: torch.Tensor  # [tokens] int64: each token's position
    write_blocks: torch.Tensor  # [tokens, 1] int64: the block each token's keys and values go to
    write_offsets: torch.Tensor  # [tokens, 1] int64: the offset in it
    tables: torch.Tensor  # [rows, blocks of max_seq_len] int64: each row's blocks, scratch-padded
    query_starts: torch.Tensor  # [rows + 1] int64: each row's first token
    starts: torch.Tensor  # [rows] int64: its first position
    lens: torch.Tensor  # [rows] int64: its tokens (0 for an empty slot)
    width: int  # no row has more tokens than this
    kv_len: int  # backends that attend over a fixed key count read keys 0..kv_len-1 (a bucket)


class AttentionBackend(Protocol):
    """Builds a step's attention from its batch (module docstring)."""

    name: str
    static_needs_kv_len: bool  # its static steps attend over a fixed key count (`StaticRows.kv_len`)

    def prepare(self, batch: TokenBatch, cache: KVCache) -> AttentionStep: ...

    def static(self, cache: KVCache, rows: StaticRows) -> AttentionStep:
        """The step over `rows` from device tensors alone (no host synchronisation)."""
        ...


class TorchAttention:
    """The reference: SDPA per group over the keys and values read through the block tables."""

    name = "torch"
    step_class = AttentionStep
    static_needs_kv_len = True

    def prepare(self, batch: TokenBatch, cache: KVCache) -> AttentionStep:
        check_batch(batch, cache)
        device = cache.kv.device
        if batch.max_query_len == 1:  # plain decode: one group, in token order
            positions = torch.tensor(batch.starts, dtype=torch.long, device=device)
            groups = [_decode_group(cache, positions, _tables(batch.tables, batch.kv_len, cache, device), batch.kv_len)]
        else:
            positions = torch.tensor(batch.positions, dtype=torch.long, device=device)
            groups = self._single_group(batch, cache, device) + self._run_groups(batch, cache, device)
            groups.sort(key=lambda g: g.lo)
        index = None if batch.num_logits == batch.num_tokens else _indices(batch, device)
        return self.step_class(cache, positions, groups, batch.num_tokens, index, batch)

    def static(self, cache: KVCache, rows: StaticRows) -> AttentionStep:
        """Every token as a one-token row over `rows.kv_len` keys (a decode group): its row's
        table, its own position. Each token is written before any attends, so a verifying row's
        tokens see the row's earlier ones of the same step."""
        tables = rows.tables[:, : blocks_for(rows.kv_len, cache.block_size)]
        n = rows.positions.shape[0]
        if rows.width > 1:  # each token's row, found on the device (no host synchronisation)
            row_of = torch.repeat_interleave(torch.arange(rows.lens.shape[0], device=rows.lens.device), rows.lens,
                                             output_size=n)
            tables = tables[row_of]
        return self.step_class(cache, rows.positions, [_decode_group(cache, rows.positions, tables, rows.kv_len)], n,
                               None)

    @staticmethod
    def _single_group(batch: TokenBatch, cache: KVCache, device: torch.device) -> list[_Group]:
        rows = [r for r, n in enumerate(batch.lens) if n == 1]
        if not rows:
            return []
        firsts = [batch.query_starts[r] for r in rows]
        positions = torch.tensor([[batch.starts[r]] for r in rows], dtype=torch.long, device=device)
        kv_len = max(batch.starts[r] for r in rows) + 1
        step = cache.prepare(positions, _tables([batch.tables[r] for r in rows], kv_len, cache, device), kv_len)
        contiguous = firsts == list(range(firsts[0], firsts[0] + len(rows)))
        index = None if contiguous else torch.tensor(firsts, dtype=torch.long, device=device)
        return [_Group(index, firsts[0], firsts[0] + len(rows), len(rows), 1, step)]

    @staticmethod
    def _run_groups(batch: TokenBatch, cache: KVCache, device: torch.device) -> list[_Group]:
        groups: list[_Group] = []
        r = 0
        while r < batch.num_rows:
            start, width = batch.starts[r], batch.lens[r]
            end = r
            while end < batch.num_rows and (batch.starts[end], batch.lens[end]) == (start, width):
                end += 1
            if width > 1:
                kv_len = start + width
                positions = torch.arange(start, kv_len, device=device).expand(end - r, width)
                tables = _tables(batch.tables[r:end], kv_len, cache, device)
                step = cache.prepare(positions, tables, kv_len, (start,) * (end - r))
                lo, hi = batch.query_starts[r], batch.query_starts[end]
                groups.append(_Group(None, lo, hi, end - r, width, step))
            r = end
        return groups


def _decode_group(cache: KVCache, positions: torch.Tensor, tables: torch.Tensor, kv_len: int) -> _Group:
    """Rows of one token each (positions [rows], tables [rows, blocks]), in token order."""
    rows = positions.shape[0]
    return _Group(None, 0, rows, rows, 1, cache.prepare(positions[:, None], tables, kv_len))


def _indices(batch: TokenBatch, device: torch.device) -> torch.Tensor:
    return torch.tensor(batch.logits_indices, dtype=torch.long, device=device)


def _tables(tables: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], kv_len: int, cache: KVCache,
            device: torch.device) -> torch.Tensor:
    """Rows' block tables as one [rows, blocks for kv_len] int64 tensor, padded with the scratch block."""
    need = blocks_for(kv_len, cache.block_size)
    rows = [list(t[:need]) + [SCRATCH_BLOCK] * (need - len(t[:need])) for t in tables]
    return torch.tensor(rows, dtype=torch.long, device=device)


def check_batch(batch: TokenBatch, cache: KVCache) -> None:
    """Every row's tokens inside its blocks: the kernels write through these indices (some by raw
    pointer). On the host, from the batch's ints; the block ids a step reads are checked against
    the pool by `KVCache.prepare` (on CPU, on the tables' tensor)."""
    size = cache.block_size
    for r, (start, n, table) in enumerate(zip(batch.starts, batch.lens, batch.tables)):
        if start + n > len(table) * size:
            raise ValueError(f"TokenBatch row {r}: positions up to {start + n - 1} but {len(table)} blocks "
                             f"of {size} positions")


ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")


def backend(name: str, device: torch.device, cache: KVCache) -> AttentionBackend:
    """The attention backend `name` names for a cache on `device`. "auto": tprt's Triton kernels
    on CUDA where Triton runs, its compiled CPU kernels on a CPU (float32 or int8 caches), else
    the torch reference."""
    from tprt.cpu.native_attention import NativeCPUAttention
    from tprt.gpu.attention import TritonAttention

    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    native = NativeCPUAttention.available(device, cache)
    if name == "native" and not native:
        raise ConfigError(f"attention backend native: tprt's CPU kernels do not run here ({device.type} device, "
                          f"{cache.format_name} cache, or no C compiler); use torch")
    # Asked only where it could be chosen: deciding imports Triton (~100 MiB of a process).
    triton = (name == "triton" or device.type == "cuda") and TritonAttention.available(device, cache)
    if name == "triton" and not triton:
        raise ConfigError(f"attention backend triton: needs Triton, a CUDA device (or TRITON_INTERPRET=1) and a "
                          f"power-of-2 head_dim and block size, at least 16 compiled ({device.type} device, head_dim "
                          f"{cache.kv.shape[-1]}, blocks of {cache.block_size} here); use torch")
    if name == "triton" or (name == "auto" and triton):  # `triton` is asked on CUDA alone unless named
        return TritonAttention()
    return NativeCPUAttention() if name == "native" or (name == "auto" and native) else TorchAttention()
