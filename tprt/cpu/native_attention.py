"""The attention backend of tprt's compiled CPU kernels (tprt.cpu.native): the torch reference's
steps (tprt.model.attention), whose plain decode steps (every row one token) attend with
`decode_attention_kernel`: each row up to its own position through its block table, every kv
head's keys and values read once for its group of query heads, and no keys gathered. Steps with
rows of several tokens (prompt chunks, verifying rows) attend as the reference does.

It runs on a CPU over a float32 or int8 cache (`tprt.cpu.native.supports_cache`) where the
kernels compiled; `tprt.model.attention.backend("auto", ...)` picks it there.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from tprt.cpu import native
from tprt.model.attention import AttentionStep, TorchAttention
from tprt.model.kv_cache import KVCache


class NativeAttentionStep(AttentionStep):
    """An AttentionStep whose one-token rows attend through `decode_attention_kernel` when every
    row of the step holds one token."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.single_tokens:
            return super().attend(layer, q, k, v)
        self.cache.write(layer, torch.stack((k, v), dim=1)[:, None].to(self.cache.dtype), self.groups[0].cache_step)
        return self.attend_cached(layer, q, q.dtype)

    def attend_cached(self, layer: int, q: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        kernel = _decode_attention(out_dtype or self.cache.dtype)
        if not self.single_tokens or kernel is None:
            return super().attend_cached(layer, q, out_dtype)
        tokens, heads, d = q.shape
        out = kernel(q.float()[:, :, None], self.cache, self.token_rows, layer)  # [tokens, 1, heads * d]
        return out.view(tokens, heads, d)


class NativeCPUAttention(TorchAttention):
    """Plain decode steps through the compiled kernel; the rest as the reference."""

    name = "native"
    step_class = NativeAttentionStep

    @staticmethod
    def available(device: torch.device, cache: KVCache) -> bool:
        """A CPU cache the kernel reads: float32 or int8 (sliding windows and soft-capped scores
        included)."""
        return device.type == "cpu" and native.supports_cache(cache) and native.available()



@cache
def _decode_attention(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """The decode attention kernel writing `dtype` (None where it has none)."""
    return native.decode_attention_kernel(dtype)
