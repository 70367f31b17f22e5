"""Faster inference matmuls on CPU: the linear layers' weights repacked once for oneDNN.

On CPU, `F.linear` with bf16 weights and a few rows of input (decode) runs a generic kernel well
below memory bandwidth; oneDNN's linear on a weight reordered ahead of time uses the CPU's bf16
dot-product instructions: about 1.5x faster bf16 decode steps in our measurements (docs/PERF.md).
In fp32 it makes prefill about 1.3x faster (batch-1 decode about the same); results differ from
F.linear's in rounding only (another summation order).

`prepack(model)` sets each layer's `fast_linear` hook (tprt.parallel.layers); the hook is used
only with autograd off, so training is unaffected. Cost: a second copy of the weights in memory.
"""

from __future__ import annotations

import torch

from tprt.model import TPLlamaForCausalLM
from tprt.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead

PACKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PackedLinear:
    """y = x @ W^T through oneDNN with W reordered once (a callable, not a module: the opaque
    packed tensor must stay out of state_dict)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return out


def supported(model: TPLlamaForCausalLM) -> bool:
    """CPU weights in bf16/fp16 with oneDNN support for the dtype."""
    if model.tp.device.type != "cpu" or model.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if model.dtype == torch.float32:
        return True
    if model.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def prepack(model: TPLlamaForCausalLM) -> int:
    """Packs every linear layer's weight when `supported(model)`; returns how many were packed."""
    if not supported(model):
        return 0
    n = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.fast_linear = PackedLinear(module.weight)
            elif isinstance(module, VocabParallelLMHead):
                module.fast_linear = PackedLinear(module.head_weight())
            else:
                continue
            n += 1
    return n
