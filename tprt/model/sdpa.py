"""Scaled-dot-product attention for the model and the cache's reference path: torch's SDPA, or
where scores are soft-capped (Gemma 2), the same math written out (SDPA has no soft-capping)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                   causal: bool = False, gqa: bool = False, softcap: float | None = None) -> torch.Tensor:
    """SDPA of q [batch, heads, seq, d] over k, v [batch, kv_heads, keys, d] (scale 1/sqrt(d);
    mask: bool, True where seen, or additive), or with `softcap` the same written out, each score
    through cap * tanh(score / cap) before the mask (Gemma 2; SDPA has no soft-capping), in float32."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [batch, heads, seq, keys]
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        seq, keys = scores.shape[-2:]
        mask = torch.ones(seq, keys, dtype=torch.bool, device=q.device).tril(keys - seq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(dim=-1) @ v.float()).to(v.dtype)
