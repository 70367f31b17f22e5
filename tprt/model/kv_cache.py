"""A paged KV cache: a pool of fixed-size blocks per rank, read and written through block tables.

Layout: one tensor [n_layers, n_blocks, 2 (k, v), n_local_kv_heads, block_size, head_dim] (this
rank's kv heads only). A sequence's keys and values live in the blocks its block table lists, in
order: position p is at offset p % block_size of block table[p // block_size]. Which blocks a
sequence holds, and which it shares with others (a common prompt prefix), is rank 0's
bookkeeping (tprt.engine.prefix_cache.BlockPool); every rank gets the tables in the step plan.

Block 0 is scratch, never handed to a sequence: a table is padded with it, so the writes of
padding tokens (right padding of a prefill batch, the padding rows of a static decode batch) land
there and are never read. Nothing records lengths: the model writes each token at its position
before attending, and a query at position p sees positions <= p only, so whatever a block held
before (or a padding token left in a sequence's last, partly filled block) is never read before
it is overwritten. The same holds for positions a sequence gives back (drafted tokens it did not
keep: tprt.engine.scheduler): they are written again before any query sees them. A full block of
kept positions is never written again, which is what lets sequences share it.

A row may carry several new tokens (a prefill chunk, or a decode row of a last token and a draft):
each is written at its position, and a query at position p attends to the row's positions <= p,
the others of its own row included (causal within the row).

Quantized storage (`QUANTIZED`: int8, FP8 e4m3): each written key or value head vector [head_dim]
is stored with its own scale in `scales` [n_layers, n_blocks, 2, n_kv_heads, block_size], indexed
like `kv` without head_dim: amax / 127 (amax / 448 for e4m3) rounded up to a bfloat16, two bytes
where float32 took four (1.94x bf16's positions at head_dim 64, 1.97x at 128, instead of 1.88x and
1.94x), rounded up so that the largest value lands within 2^-7 of the format's largest. Writes
quantize, reads dequantize to `dtype` (the attention's dtype). A scale per token and head, not
per block, keeps every write independent of the others: a position is quantized once, when
written, never re-scaled by a later token of its block, so shared blocks keep their scales and a
position given back is simply written again (docs/DESIGN.md has the measurement).

Static int8 scales (`fixed_scales`, opt-in: tprt.model.kv_scales calibrates them): one float32
scale per layer, k/v and kv head, fixed before serving, instead of one per vector. Nothing is
stored per position, so the cache holds exactly 2x bf16's positions (a per-vector scale costs 2
bytes per head_dim values: 1.94x at 64). A value beyond the head's calibrated range is clipped to
+-127 steps; on SmolLM2, scales calibrated on one text with a 1.25x margin cost -0.11% / +0.26%
perplexity on two others, at 4-6x the per-vector scale's KL divergence (docs/DESIGN.md).

FP8 keys are stored multiplied by a fixed orthogonal matrix (`key_rotation`, a Hadamard matrix),
exact up to rounding: `read` multiplies them back, or, for attention, leaves them so
(`rotated_keys`) while `rotate_queries` puts the queries in the same basis. On SmolLM2 the keys
carry nearly all of FP8's error (FP8 keys alone: +1.95% perplexity; FP8 values alone: -0.02%). e4m3
keeps about two significant digits of every value but the largest of its vector; spread by the
rotation over every channel, the keys' errors cost the whole FP8 cache +0.24-0.32% instead of
+1.91% on the bench text, and 0.40% instead of 0.99% averaged over three texts (docs/PERF.md: FP8
rounding makes these figures move by about 0.2% under float32-level changes). This is measured, not
derived: random signs before the Hadamard did worse (+0.73% to +1.18%). int8 keys, whose error is
already small, are stored as given (rotated they measured slightly worse).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import groupby
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from tprt.cpu.hugepages import huge_tensors
from tprt.errors import ConfigError
from tprt.model.sdpa import attention_math


# The most elements a prefill's attention mask holds (64 MiB in float32): a chunk whose mask
# [chunk, kv_len] would be larger attends in blocks of queries (2048 x 128K keys: blocks of 128).
MASK_ELEMENTS = 1 << 24

SCRATCH_BLOCK = 0  # never holds a sequence's keys and values (see the module docstring)

# Storage dtypes kept quantized, with the largest magnitude each represents (the scale maps amax to it).
QUANTIZED = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    QUANTIZED[torch.float8_e4m3fn] = 448.0

# A quantized head vector's scale: bfloat16, float32's range in half its bytes (`quantize`).
SCALE_DTYPE = torch.bfloat16

# `--kv-cache-dtype` names: "auto" is None (the model's default_cache_dtype).
KV_CACHE_DTYPES = ("auto", "bf16", "fp32", "int8", "fp8")
# Storage dtypes by name (fp16: a float16 model's default cache, not a flag value); fp8 where torch has it.
_NAMED = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
if hasattr(torch, "float8_e4m3fn"):
    _NAMED["fp8"] = torch.float8_e4m3fn


def kv_cache_dtype(name: str, flag: str = "--kv-cache-dtype") -> torch.dtype | None:
    """The KV cache storage dtype a `--kv-cache-dtype` value names (None for auto); a ConfigError
    naming `flag` for any other value, or for fp8 where this torch has no float8_e4m3fn."""
    if name == "auto":
        return None
    if name == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise ConfigError(f"{flag} fp8: this torch ({torch.__version__}) has no torch.float8_e4m3fn; "
                              f"use int8")
        return torch.float8_e4m3fn
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"{flag} must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return _NAMED[name]


def kv_bytes_per_position(dtype: torch.dtype, head_dim: int, static_scales: bool = False) -> int:
    """Bytes one key or value head vector of `head_dim` takes in a cache stored in `dtype`, its
    scale included when quantized with a scale per vector (not with `static_scales`)."""
    return head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if dtype in QUANTIZED and not static_scales else 0)


def key_rotation(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The orthogonal [head_dim, head_dim] matrix FP8 keys are stored multiplied by: Sylvester's
    Hadamard matrix over sqrt(head_dim), the same on every rank and in every run; None (keys
    stored as given) where head_dim is not a power of 2. (Random signs before it did worse on
    SmolLM2, +0.73% to +1.18% perplexity for three seeds against +0.24%: docs/PERF.md.)"""
    if head_dim < 2 or head_dim & (head_dim - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / head_dim ** 0.5).to(device)


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks hold `tokens` positions."""
    return -(-tokens // block_size)


class WriteSlots(Protocol):
    """Where a step's tokens are written: [batch, seq] block ids and offsets in them (a
    `CacheStep`, or a backend's own)."""

    @property
    def write_blocks(self) -> torch.Tensor: ...

    @property
    def write_offsets(self) -> torch.Tensor: ...

class KVCache:
    """k/v storage for every layer in `n_blocks` blocks of `block_size` positions (block 0: scratch)."""

    def __init__(
        self,
        n_layers: int,
        n_blocks: int,
        n_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.float32,
        fixed_scales: torch.Tensor | None = None,
        windows: Sequence[int | None] | None = None,
        softcap: float | None = None,
    ) -> None:
        """dtype: the storage dtype; a QUANTIZED one stores scales too and reads as `compute_dtype`.
        fixed_scales [n_layers, 2, n_kv_heads] (int8 only): static scales, none stored per vector.
        windows: per layer, each position attends to the last `window` positions only (a sliding
        window, itself included), or with None to every earlier one; None: no layer has a window.
        softcap: attention scores go through cap * tanh(score / cap) (Gemma 2)."""
        self.windows = tuple(windows) if windows is not None else (None,) * n_layers
        if len(self.windows) != n_layers:
            raise ValueError(f"a KV cache of {n_layers} layers got {len(self.windows)} windows")
        self.softcap = softcap
        if n_blocks < 2 or block_size < 1:
            raise ValueError(f"a KV cache needs at least 2 blocks (one is scratch) of at least 1 position, "
                             f"got {n_blocks} of {block_size}")
        if fixed_scales is not None and (dtype != torch.int8 or tuple(fixed_scales.shape) != (n_layers, 2, n_kv_heads)):
            raise ValueError(f"static KV scales need an int8 cache and the shape {[n_layers, 2, n_kv_heads]}, "
                             f"got a {dtype} cache and {list(fixed_scales.shape)}")
        shape = (n_layers, n_blocks, 2, n_kv_heads, block_size, head_dim)
        # [layer, block, k/v, kv_head, offset, head_dim]; on CPU on huge pages (attention streams it).
        # Zeros, not empty: masked-out entries still enter SDPA's weighted sum (with weight 0),
        # and 0 * NaN from uninitialised memory would poison the output.
        if torch.device(device).type == "cpu":
            self.kv = huge_tensors([shape], dtype)[0].zero_()
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        # Quantized: one scale per written head vector (module docstring), zeros read as 0; or
        # static ones per layer, k/v and head (float32, contiguous: the C kernels index them).
        per_vector = dtype in QUANTIZED and fixed_scales is None
        self.scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if per_vector else None
        self.fixed_scales = (None if fixed_scales is None
                             else fixed_scales.to(device=device, dtype=torch.float32).contiguous())
        self._dtype = compute_dtype if dtype in QUANTIZED else dtype
        # FP8 keys are stored rotated (module docstring); None: stored as given.
        self.key_rotation = key_rotation(head_dim, device) if dtype in QUANTIZED and dtype != torch.int8 else None
        self.n_blocks = n_blocks
        self.block_size = block_size

    @property
    def dtype(self) -> torch.dtype:
        """The dtype reads return and attention runs in (the storage dtype unless quantized)."""
        return self._dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def quantized(self) -> bool:
        return self.kv.dtype in QUANTIZED

    @property
    def format_name(self) -> str:
        """The storage as `--kv-cache-dtype` names it: fp32, bf16, fp16, int8, fp8, or int8-static
        (int8 with static scales, `--kv-scales`)."""
        name = next(n for n, dtype in _NAMED.items() if dtype == self.kv.dtype)
        return name + "-static" if self.fixed_scales is not None else name

    @property
    def positions(self) -> int:
        """The positions sequences can hold (block 0 is scratch)."""
        return (self.n_blocks - 1) * self.block_size

    def nbytes(self) -> int:
        return self.kv.nbytes + sum(x.nbytes for x in (self.scales, self.fixed_scales) if x is not None)

    def prepare(
        self, positions: torch.Tensor, tables: torch.Tensor, kv_len: int | None = None,
        starts: tuple[int, ...] | None = None,
    ) -> CacheStep:
        """What every layer needs for one forward step, built once: the write indices, the block
        tables to read through and the mask.

        positions [batch, seq]: each token's position in its sequence (right padding continues
        the count). tables [batch, n] int64: each row's blocks in order; positions past a row's
        blocks write to the scratch block (padding). kv_len: 1 + the largest position in the batch
        (computed, with a host sync, when not given; the engine knows it). starts: when row b's
        positions are starts[b], starts[b] + 1, ... (a prefill chunk; found by itself on CPU),
        the mask is one staircase of at most MASK_ELEMENTS, whatever the rows, chunk and context
        (`CacheStep.attend`).
        """
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        need = blocks_for(kv_len, self.block_size)
        if tables.shape[1] < need:  # padding positions past every row's blocks: the scratch block
            tables = F.pad(tables, (0, need - tables.shape[1]), value=SCRATCH_BLOCK)
        tables = tables[:, :need]
        if positions.device.type == "cpu":
            self._check_in_range(positions, tables, kv_len)
        write_blocks = tables.gather(1, torch.div(positions, self.block_size, rounding_mode="floor"))
        write_offsets = positions % self.block_size
        if starts is None and positions.device.type == "cpu" and positions.shape[1] > 1:
            starts = self._chunk_starts(positions)
        if starts is not None:  # a prefill of consecutive positions: the mask is one staircase
            return self._staircase_step(write_blocks, write_offsets, tables, positions, kv_len, starts)
        keys = torch.arange(kv_len, device=positions.device)
        masks = {w: self._additive(self._hidden(keys, positions[:, None, :, None], w))  # [batch, 1, seq, kv_len]
                 for w in set(self.windows)}
        return CacheStep(write_blocks, write_offsets, tables, positions, kv_len, masks, self.block_size)

    def _staircase_step(self, write_blocks: torch.Tensor, write_offsets: torch.Tensor, tables: torch.Tensor,
                        positions: torch.Tensor, kv_len: int, starts: tuple[int, ...]) -> CacheStep:
        """The mask of a chunk whose row b holds positions starts[b], starts[b] + 1, ...: one
        staircase T [block, width], T[i, c] hidden when c > corner + i, of which each row's (or
        query block's) mask is a view (`CacheStep.attend`). When the chunk's whole mask fits in
        MASK_ELEMENTS, block = the chunk and every row attends over all kv_len keys, as it would
        under a mask per row; otherwise queries go in blocks over the keys up to the block's end."""
        seq, spread = positions.shape[1], max(starts) - min(starts)
        if seq * (kv_len + spread) <= MASK_ELEMENTS:
            block, width, corner = seq, kv_len + spread, max(starts)
        else:
            block = min(seq, max(1, MASK_ELEMENTS // kv_len))
            width, corner = kv_len, kv_len - block
        keys = torch.arange(width, device=positions.device)
        stairs = {w: self._additive(self._hidden(keys, keys[corner : corner + block, None], w))  # [block, width]
                  for w in set(self.windows)}
        return CacheStep(write_blocks, write_offsets, tables, positions, kv_len, stairs,
                         self.block_size, starts=starts, corner=corner)

    @staticmethod
    def _hidden(keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
        """Which keys each query position does not see: later ones, and with a window those at
        least `window` before it (the staircase stays a band, the same at every shift)."""
        hidden = keys > queries
        return hidden if window is None else hidden | (keys <= queries - window)

    def _additive(self, hidden: torch.Tensor) -> torch.Tensor:
        """0 where attention is allowed, -inf where `hidden`, in the cache dtype (SDPA would
        otherwise convert a bool mask into a new float one in every layer)."""
        mask = torch.zeros(hidden.shape, dtype=self.dtype, device=hidden.device)
        return mask.masked_fill_(hidden, float("-inf"))

    @staticmethod
    def _chunk_starts(positions: torch.Tensor) -> tuple[int, ...] | None:
        """On the host: each row's first position when every row holds consecutive positions."""
        first = positions[:, :1]
        if not bool((positions == first + torch.arange(positions.shape[1])).all()):
            return None
        return tuple(first.reshape(-1).tolist())

    def _check_in_range(self, positions: torch.Tensor, tables: torch.Tensor, kv_len: int) -> None:
        """Once per step on CPU, where the native decode path (tprt.cpu.native.rope_cache_kernel)
        writes into the cache through raw pointers: no layer may write outside it. (On GPU the
        checks would cost a device sync per step, and CUDA-graph capture forbids them.)"""
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= kv_len):
            raise ValueError(f"positions must lie in [0, kv_len={kv_len})")
        if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= self.n_blocks):
            raise ValueError(f"block ids must lie in [0, {self.n_blocks})")

    def update(self, layer: int, kv: torch.Tensor, step: CacheStep,
               rotated_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`write`, then `read(layer, step, rotated_keys)`."""
        self.write(layer, kv, step)
        return self.read(layer, step, rotated_keys)

    def write(self, layer: int, kv: torch.Tensor, step: WriteSlots) -> None:
        """Writes kv [batch, seq, 2, n_kv_heads, head_dim] (keys, then values) at each token's
        (block, offset); quantized with a scale per head vector when the storage is
        (`quantize`), or with the static ones (`quantize_fixed`)."""
        if self.fixed_scales is not None:
            values = quantize_fixed(kv, self.fixed_scales[layer])
            self.kv[layer][step.write_blocks, :, :, step.write_offsets] = values
        elif self.scales is None:
            self.kv[layer][step.write_blocks, :, :, step.write_offsets] = kv  # [block, k/v, kv_head, offset, head_dim]
        else:
            if self.key_rotation is not None:
                kv = torch.stack((kv[..., 0, :, :].float() @ self.key_rotation, kv[..., 1, :, :].float()), dim=-3)
            values, scales = quantize(kv, self.kv.dtype)
            self.kv[layer][step.write_blocks, :, :, step.write_offsets] = values
            self.scales[layer][step.write_blocks, :, :, step.write_offsets] = scales  # [block, k/v, kv_head, offset]

    def read(self, layer: int, step: CacheStep, rotated_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values up to kv_len, gathered from its blocks in order, each
        [batch, n_kv_heads, kv_len, head_dim]. `rotated_keys`: keys stored rotated (FP8) stay
        so, for queries put in the same basis by `rotate_queries` (the scores are the same, and
        only the queries are multiplied, not every key in the cache)."""
        blocks = self.kv[layer][step.tables]  # [batch, n, k/v, kv_head, block_size, head_dim]
        if self.fixed_scales is not None:
            blocks = blocks.to(self.dtype) * self.fixed_scales[layer][:, :, None, None].to(self.dtype)
        elif self.scales is not None:  # dequantized on read
            scales = self.scales[layer][step.tables].unsqueeze(-1)  # [batch, n, k/v, kv_head, block_size, 1]
            if self.key_rotation is None or rotated_keys:
                blocks = blocks.to(self.dtype) * scales.to(self.dtype)
            else:  # keys rotated back (module docstring), in float32 before the cast
                keys = (blocks[:, :, 0].float() * scales[:, :, 0]) @ self.key_rotation.T
                blocks = torch.stack((keys, blocks[:, :, 1].float() * scales[:, :, 1]), dim=2).to(self.dtype)
        batch, n, _, nkv, size, d = blocks.shape
        both = blocks.permute(0, 2, 3, 1, 4, 5).reshape(batch, 2, nkv, n * size, d)[:, :, :, : step.kv_len]
        return both[:, 0], both[:, 1]

    def rotate_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [..., head_dim] in the basis `read(..., rotated_keys=True)` returns keys in."""
        if self.key_rotation is None:
            return q
        return (q.float() @ self.key_rotation).to(q.dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values [..., head_dim] in the QUANTIZED `dtype`, SCALE_DTYPE scales
    [...]): symmetric, one scale per vector, amax / QUANTIZED[dtype] rounded up to the next
    bfloat16 (1 for an all-zero vector), values = round(x / scale) for int8 (to nearest even, as
    tprt.cpu.native's kernels round) and x / scale cast for FP8, both in float32. x * scale reads
    them back. Rounding the scale up, not to nearest, keeps amax / scale within the format (for
    e4m3 in (444, 448], so the largest value stays nearly exact: a scale on a coarser grid, one
    byte of exponent, cost FP8 about +1% perplexity on SmolLM2, docs/DESIGN.md)."""
    x = x.float()
    ratio = x.abs().amax(dim=-1) / QUANTIZED[dtype]  # >= 0 (NaN propagates)
    # Up to the next bfloat16 (a no-op on one): the float32 bits plus 0xFFFF, truncated to the top 16.
    scales = ((ratio.view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32)
    scales = torch.where(ratio == 0, torch.ones_like(scales), scales)
    scaled = x / scales.unsqueeze(-1)
    if dtype == torch.int8:
        return scaled.round_().clamp_(-127, 127).to(torch.int8), scales.to(SCALE_DTYPE)
    return scaled.clamp_(-QUANTIZED[dtype], QUANTIZED[dtype]).to(dtype), scales.to(SCALE_DTYPE)


def quantize_fixed(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., 2, n_kv_heads, head_dim] (keys, then values) -> int8 round(x / scale) with one
    static float32 scale per k/v and kv head, scales [2, n_kv_heads]; values beyond +-127 steps
    are clipped. In float32, rounding to nearest even, as tprt.cpu.native's kernels round."""
    scaled = x.float() / scales[:, :, None]
    return scaled.round_().clamp_(-127, 127).to(torch.int8)


@dataclass(frozen=True)
class CacheStep:
    """One forward step's view of the cache, shared by every layer."""

    write_blocks: torch.Tensor  # [batch, seq] the block each token's k/v is written to
    write_offsets: torch.Tensor  # [batch, seq] its offset in that block
    tables: torch.Tensor  # [batch, ceil(kv_len / block_size)] each row's blocks, read in order
    positions: torch.Tensor  # [batch, seq] position of each token
    kv_len: int  # keys 0..kv_len-1 are read
    # Per sliding window of the cache's layers (None: none), the additive mask (0 where attention
    # is allowed, -inf elsewhere): [batch, 1, seq, kv_len], or with `starts` a staircase [block,
    # kv_len] whose bottom-right corner every query block slices.
    masks: dict[int | None, torch.Tensor]
    block_size: int
    starts: tuple[int, ...] | None = None  # row b's positions are starts[b], starts[b] + 1, ...
    corner: int = 0  # with `starts`: the staircase's first row hides the keys after `corner`

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """SDPA of q [batch, heads, seq, head_dim] over k, v [batch, kv_heads, kv_len, head_dim]
        under the mask of `window` (soft-capped scores with `softcap`). With `starts`, per run of
        rows sharing a start and per block of queries, over the keys up to the block's last
        position: those after it are hidden from every query of the block, so leaving them out
        changes no value, and a block's mask is a view of the staircase. (One call when the rows
        share a start and the chunk fits one block.)"""
        if self.starts is None:
            return attention_math(q, k, v, _aligned(self.masks[window]), gqa=enable_gqa, softcap=softcap)
        stairs = self.masks[window]
        block, seq = stairs.shape[0], q.shape[2]
        runs, lo = [], 0
        for start, rows in groupby(self.starts):
            hi = lo + len(list(rows))
            parts = []
            for a in range(0, seq, block):
                n = min(block, seq - a)
                keys = self.kv_len if block == seq else start + a + n  # blocks: up to the block's last position
                first = self.corner + block - n - start - a  # the column of key 0 in the staircase
                mask = _aligned(stairs[block - n :, first : first + keys])  # [n, keys]
                parts.append(attention_math(q[lo:hi, :, a : a + n], k[lo:hi, :, :keys], v[lo:hi, :, :keys], mask,
                                            gqa=enable_gqa, softcap=softcap))
            runs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
            lo = hi
        return runs[0] if len(runs) == 1 else torch.cat(runs, dim=0)

    # For tprt.cpu.native's decode kernels, which index by raw pointer: built once per step, not per layer.
    @cached_property
    def flat_write_blocks(self) -> torch.Tensor:
        """[batch * seq] int64, contiguous: each token's block."""
        return self.write_blocks.reshape(-1).to(torch.int64).contiguous()

    @cached_property
    def flat_write_offsets(self) -> torch.Tensor:
        """[batch * seq] int64, contiguous: each token's offset in its block."""
        return self.write_offsets.reshape(-1).to(torch.int64).contiguous()

    @cached_property
    def flat_positions(self) -> torch.Tensor:
        """[batch * seq] int64, contiguous: each token's position."""
        return self.positions.reshape(-1).to(torch.int64).contiguous()


def _aligned(mask: torch.Tensor) -> torch.Tensor:
    """`mask`, or on CUDA a copy of it when its data does not start on 16 bytes: torch's
    memory-efficient attention picks its vectorised kernel from the strides alone, and a view
    starting mid-row (a block of the staircase) then faults with "misaligned address" (seen on an
    H100 and an H200 with torch 2.11, 2026-11-28). The copy is [queries, keys], small beside k/v."""
    if mask.is_cuda and mask.data_ptr() % 16:
        return mask.clone()
    return mask


@dataclass(frozen=True)
class TokenRows:
    """A step's tokens as one-token rows (tprt.model.attention.token_rows): what the native
    decode kernels (tprt.cpu.native) read of a cache step (a plain decode step's `CacheStep`
    has the same attributes)."""

    flat_write_blocks: torch.Tensor  # [tokens] int64: each token's block
    flat_write_offsets: torch.Tensor  # [tokens] int64: its offset in that block
    tables: torch.Tensor  # [tokens, blocks] int64: each token's row's block table
    flat_positions: torch.Tensor  # [tokens] int64: each token's position
    kv_len: int
