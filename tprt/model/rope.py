"""Rotary position embedding in the rotate-half form (HF's q/k row order; no permute needed).

The frequencies follow transformers' rope types "default", "linear" and "llama3" exactly, and
the angles are computed in float32 from the positions at each step (no [max_positions, dim]
table: Llama 3.1's 128K context would make that table larger than a small model).
"""

from __future__ import annotations

import math

import torch

from tprt.model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu", local: bool = False) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, scaled as `cfg.rope_scaling` says; `local`: the
    windowed layers' own plain ones (`cfg.local_rope_theta`, Gemma 3)."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    if local:
        assert cfg.local_rope_theta is not None, "no local rope base"
        return 1.0 / (cfg.local_rope_theta**exponents)
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    if rs.rope_type == "llama3":
        return _llama3_scale(inv_freq, rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                             rs.original_max_position_embeddings)
    raise ValueError(f"rope type {rs.rope_type!r} is not supported")


def _llama3_scale(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    low_freq_wavelen = original / low
    high_freq_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each [batch, seq, 1, head_dim], for positions [batch, seq].

    cos is transformers' cos(cat(freqs, freqs)); the sin's first half is negated so that
    rotate-half becomes one roll: x * cos + roll(x, head_dim / 2) * sin.
    """
    freqs = positions[..., None].to(torch.float32) * inv_freq  # [batch, seq, head_dim / 2]
    freqs = freqs.unsqueeze(2)  # [batch, seq, 1, head_dim / 2]: broadcasts over heads
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1)  # [batch, seq, 1, head_dim]
    sin = torch.cat((-sin, sin), dim=-1)  # [batch, seq, 1, head_dim]
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope_` out of place: what autograd wants (an in-place write into a view of a larger
    output would cost a CopySlices and a zero-filled gradient of the whole output)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [batch, seq, heads, head_dim] in place by the angles of `rope_angles` (rotate-half:
    feature i pairs with i + head_dim / 2) and returns it. x may be a view (e.g. of a fused qkv)."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1], a copy taken before x changes
    return x.mul_(cos).addcmul_(rotated, sin)
