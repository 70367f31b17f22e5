"""Paged attention in Triton: every token of a ragged batch attends to its row's cached positions
up to its own, reading the paged KV cache in place through the rows' block tables.

One kernel serves every step shape: plain decode rows (one token), prompt chunks over cached
prefix blocks and k-token verifying rows (causal within the row). A program takes one row, one KV
head and a tile of that row's tokens, and holds the queries of all the query heads of the KV
head's GQA group, so each key and value block is loaded once for the group. It walks the row's
blocks in order with an online softmax in float32 (FlashAttention's recurrence) and stops at the
tile's last position. int8 and FP8 caches are dequantized in the kernel, by the per-vector scales
stored beside them or by static per-head scales; FP8 keys stay in their rotated basis and the
caller passes rotated queries (tprt.model.kv_cache: `rotate_queries`).

Long contexts split: `splits` > 1 gives each program a contiguous share of a row's blocks and a
second kernel merges the shares' partial results by their log-sum-exp (flash decoding), so a
batch of few long rows still fills the GPU.

Cache layout (tprt.model.kv_cache.KVCache): values [n_blocks, 2 (k/v), kv_heads, block_size,
head_dim]; per-vector scales [n_blocks, 2, kv_heads, block_size]; static scales [2, kv_heads].

Triton ships with CUDA builds of torch; on the CPU the same kernels run under Triton's
interpreter (TRITON_INTERPRET=1), which is how the tests check them against the torch reference.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

MIN_TILE_ROWS = 16  # tl.dot's smallest M: decode tiles pad their GQA group up to it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # on the CPU, through Triton's interpreter


def fits(head_dim: int, block_size: int) -> bool:
    """Whether the kernel takes this cache shape: powers of 2, compiled at least 16 (tl.dot's
    smallest operands; the interpreter has no such floor)."""
    powers = not head_dim & (head_dim - 1) and not block_size & (block_size - 1)
    return powers and (INTERPRETED or min(head_dim, block_size) >= 16)


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, kv_ptr, scale_ptr, fixed_ptr, tables_ptr, query_starts_ptr, starts_ptr, lens_ptr,
    part_out_ptr, part_lse_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kkv, stride_kh, stride_kp,
    stride_sb, stride_skv, stride_sh,
    stride_table, sm_scale, blocks_per_split, n_all_tokens, window, softcap,
    SOFTCAP: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, SCALES: tl.constexpr, FIXED: tl.constexpr, SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2) % SPLIT
    tile = tl.program_id(2) // SPLIT

    q_start = tl.load(query_starts_ptr + row)
    start = tl.load(starts_ptr + row)  # position of the row's first query token
    n_tokens = tl.load(lens_ptr + row)
    first = tile * TILE_TOKENS
    if first >= n_tokens:
        return

    # Tile rows: token t of the tile x query head g of the group (t * GROUP_P2 + g).
    r = tl.arange(0, TILE_TOKENS * GROUP_P2)
    t = first + r // GROUP_P2
    g = r % GROUP_P2
    valid = (t < n_tokens) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q_off = (q_start + t)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=valid[:, None], other=0.0)
    if DOT_F32:  # the interpreter's tl.dot misreads bfloat16 operands: its products in float32
        q = q.to(tl.float32)
    pos_q = start + t  # each tile row's position: it sees positions <= its own

    last = start + tl.minimum(first + TILE_TOKENS, n_tokens) - 1  # the tile's last position
    n_blocks = last // BLOCK_SIZE + 1
    lo = split * blocks_per_split
    hi = tl.minimum(n_blocks, lo + blocks_per_split)
    if window > 0:  # a sliding window: blocks wholly before the tile's first query's window are skipped
        lo = tl.maximum(lo, tl.maximum(start + first - window + 1, 0) // BLOCK_SIZE)

    m = tl.full([TILE_TOKENS * GROUP_P2], float("-inf"), tl.float32)
    l = tl.zeros([TILE_TOKENS * GROUP_P2], tl.float32)
    acc = tl.zeros([TILE_TOKENS * GROUP_P2, HEAD_DIM], tl.float32)
    p_in = tl.arange(0, BLOCK_SIZE)
    if FIXED:
        k_fixed = tl.load(fixed_ptr + kv_head)
        v_fixed = tl.load(fixed_ptr + tl.num_programs(1) + kv_head)  # static scales [2, kv_heads]
    for j in range(lo, hi):
        block = tl.load(tables_ptr + row * stride_table + j).to(tl.int64)
        base = kv_ptr + block * stride_kb + kv_head * stride_kh
        kv_off = p_in[:, None] * stride_kp + d[None, :]
        k = tl.load(base + kv_off)
        v = tl.load(base + stride_kkv + kv_off)
        if SCALES:
            s_base = scale_ptr + block * stride_sb + kv_head * stride_sh + p_in
            k = k.to(tl.float32) * tl.load(s_base).to(tl.float32)[:, None]
            v = v.to(tl.float32) * tl.load(s_base + stride_skv).to(tl.float32)[:, None]
        elif FIXED:
            k = k.to(tl.float32) * k_fixed
            v = v.to(tl.float32) * v_fixed
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if IEEE:  # a float32 cache: full-precision products, not TF32 (the reference's numbers)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # [tile rows, BLOCK_SIZE]
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
        if SOFTCAP:  # cap * tanh(s / cap), tanh written with exp (as the interpreter has it too)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        pos_k = j * BLOCK_SIZE + p_in
        seen = pos_k[None, :] <= pos_q[:, None]
        if window > 0:
            seen = seen & (pos_k[None, :] > pos_q[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile row with nothing seen yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new

    if SPLIT == 1:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        o_off = (q_start + t)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        # partials [split, tokens, heads, head_dim] and log-sum-exp [split, tokens, heads], contiguous
        n_heads = tl.num_programs(1) * GROUP
        cell = (split * n_all_tokens + q_start + t) * n_heads + head
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        lse = tl.where(l == 0.0, float("-inf"), m + tl.log(tl.where(l == 0.0, 1.0, l)))
        tl.store(part_out_ptr + cell[:, None] * HEAD_DIM + d[None, :], out, mask=valid[:, None])
        tl.store(part_lse_ptr + cell, lse, mask=valid)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, n_tokens, n_heads,
                         SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLIT_P2)
    d = tl.arange(0, HEAD_DIM)
    cell = (s * n_tokens + token) * n_heads + head
    lse = tl.load(part_lse_ptr + cell, mask=s < SPLIT, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
    parts = tl.load(part_out_ptr + cell[:, None] * HEAD_DIM + d[None, :], mask=(s < SPLIT)[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    tables: torch.Tensor,
    query_starts: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    max_query_len: int,
    scales: torch.Tensor | None = None,
    fixed_scales: torch.Tensor | None = None,
    splits: int = 1,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q [tokens, heads, head_dim] over one layer's paged cache kv [n_blocks, 2,
    kv_heads, block_size, head_dim] -> [tokens, heads, head_dim] in q's dtype.

    Row r's tokens are q[query_starts[r]:query_starts[r + 1]] (lens[r] of them) at positions
    starts[r], starts[r] + 1, ...; its keys and values (those tokens' own included, written
    before) lie in the blocks tables[r] [rows, max_blocks] names, in order. `scales` [n_blocks,
    2, kv_heads, block_size] or `fixed_scales` [2, kv_heads] dequantize an int8/FP8 cache.
    `splits`: shares of each row's blocks run apart and merged (long contexts, few rows).
    `window`: each token sees its row's last `window` positions only (a sliding window); blocks
    wholly outside it are not read. `softcap`: scores go through cap * tanh(score / cap) (Gemma 2).
    """
    tokens, heads, head_dim = q.shape
    _, two, kv_heads, block_size, kv_dim = kv.shape
    if two != 2 or kv_dim != head_dim or heads % kv_heads:
        raise ValueError(f"paged_attention: q {list(q.shape)} does not fit the cache {list(kv.shape)}")
    if not fits(head_dim, block_size):
        raise ValueError(f"paged_attention: head_dim {head_dim} and block_size {block_size} must be powers of 2"
                         f"{'' if INTERPRETED else ' of at least 16 (tl.dot smallest operands)'}")
    group = heads // kv_heads
    group_p2 = triton.next_power_of_2(group)
    # Tokens per tile: up to 64 tile rows, at least MIN_TILE_ROWS (a decode tile pads its group).
    tile_tokens = min(triton.next_power_of_2(max(1, max_query_len)), max(1, 64 // group_p2))
    tile_tokens = max(tile_tokens, math.ceil(MIN_TILE_ROWS / group_p2))
    rows = lens.shape[0]
    tiles = max(1, math.ceil(max_query_len / tile_tokens))
    max_blocks = tables.shape[1]
    splits = max(1, min(splits, max_blocks))
    blocks_per_split = math.ceil(max_blocks / splits)
    out = torch.empty_like(q)
    if splits > 1:
        part_out = torch.empty((splits, tokens, heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    dummy = kv  # pointer arguments a configuration does not read
    scale_strides = scales.stride()[:3] if scales is not None else (0, 0, 0)
    if fixed_scales is not None:
        fixed_scales = fixed_scales.to(torch.float32).contiguous()
    _paged_attention_kernel[(rows, kv_heads, tiles * splits)](
        q, out, kv, scales if scales is not None else dummy, fixed_scales if fixed_scales is not None else dummy,
        tables, query_starts, starts, lens, part_out, part_lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        *scale_strides,
        tables.stride(0), 1.0 / math.sqrt(head_dim), blocks_per_split, tokens, window or 0, softcap or 1.0,
        SOFTCAP=softcap is not None, GROUP=group, GROUP_P2=group_p2, TILE_TOKENS=tile_tokens, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        SCALES=scales is not None, FIXED=fixed_scales is not None, SPLIT=splits, DOT_F32=INTERPRETED,
        IEEE=INTERPRETED or q.dtype == torch.float32,
    )
    if splits > 1:
        _merge_splits_kernel[(tokens, heads)](part_out, part_lse, out, out.stride(0), out.stride(1), tokens, heads,
                                              SPLIT=splits, SPLIT_P2=triton.next_power_of_2(splits),
                                              HEAD_DIM=head_dim)
    return out
