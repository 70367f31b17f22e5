"""Linear methods (tprt.parallel.layers.LinearMethod) for quantized weights: int8 weight-only and
FP8 e4m3, each a `QuantLinear` of its `QuantSpec` (tprt.quant.formats).

A layer gets two parameters under the names the converter writes: `weight` [out, in] in the
storage dtype and `weight_scale` float32 [out, groups] (this rank's rows, or this rank's groups of
a row-parallel layer, each rank holding its own scales). They are frozen (integer and float8
tensors take no gradient). The product is taken in float32 on the dequantized weight, so the
input's gradient flows (a LoRA trained on a quantized base, tprt.lora) and sums accumulate in
float32 whatever the activations' dtype. On a CUDA GPU, FP8 layers use torch._scaled_mm (the
activations quantized per row on the fly, no host sync: CUDA graphs capture it). On CPU the
decode path uses the compiled int8 kernels instead (`tprt.cpu.fast_linear.prepack` gives int8
layers a `NativeInt8Linear`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tprt.errors import ConfigError
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.layers import WEIGHT_FORMATS, LinearMethod, ParallelLinear, set_base_method
from tprt.quant.formats import FP8_MAX, QUANT_FORMATS, QuantSpec, dequantize, quantize, spec_from_extra


class QuantLinear(LinearMethod):
    """Weights stored quantized as `spec` says; products in float32 on the dequantized weight
    (FP8 on a GPU: torch._scaled_mm). Stateless: one instance serves every layer."""

    frozen = True

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.name = spec.name

    def cpu_method(self) -> LinearMethod | None:
        """int8: tprt's compiled int8 products where they built (tprt.cpu.quant_linear); FP8 keeps
        its torch path on CPU (no FP8 arithmetic there to gain from)."""
        from tprt.cpu import native
        from tprt.cpu.quant_linear import NativeInt8Linear

        return NativeInt8Linear(self.spec) if self.spec.name == "int8" and native.available() else None

    def cpu_head_method(self) -> LinearMethod | None:
        """int8: the head quantized in the decoder's format (tprt.cpu.quant_linear.Int8Head)."""
        from tprt.cpu import native
        from tprt.cpu.quant_linear import Int8Head

        return Int8Head(self.spec) if self.spec.name == "int8" and native.available() else None

    def create_weights(self, layer: ParallelLinear, out_features: int, in_features: int,
                       dtype: torch.dtype | None) -> None:
        g = self.spec.group_size
        if g is not None and in_features % g:
            raise ConfigError(f"a linear layer with {in_features} input columns on this rank does not hold "
                              f"whole groups of group_size {g}")
        # Allocated on the ambient device: build under `torch.device("meta")` and load with assign.
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.spec.storage),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(out_features, self.spec.groups(in_features),
                                                      dtype=torch.float32), requires_grad=False)

    def dense_weight(self, layer: ParallelLinear, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The layer's weight dequantized: [out, in] in `dtype`."""
        return dequantize(*quantized(layer), dtype)

    def apply(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        weight, scale = quantized(layer)
        if self.spec.name == "fp8" and scaled_mm_applies(weight, x):
            return scaled_mm_fp8(x, weight, scale)
        return F.linear(x.to(torch.float32), dequantize(weight, scale)).to(x.dtype)


def quantized(layer: ParallelLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized layer's (weight [out, in], weight_scale [out, groups])."""
    return cast(torch.Tensor, layer.weight), cast(torch.Tensor, layer.weight_scale)


def scaled_mm_applies(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether torch._scaled_mm takes this product: CUDA, bf16/fp16 activations, sizes in 16s."""
    return (x.is_cuda and hasattr(torch, "_scaled_mm") and x.dtype in (torch.bfloat16, torch.float16)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] -> (float8_e4m3fn [rows, k], float32 scales [rows, 1]); no host sync."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp_(min=1e-12)  # [rows, 1]
    scale = amax / FP8_MAX
    return (x.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def scaled_mm_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ (weight [n, k] * weight_scale [n, 1])^T through torch._scaled_mm, row-wise scales."""
    k = x.shape[-1]
    xq, xs = quantize_rows_fp8(x.reshape(-1, k))  # [rows, k], [rows, 1]
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.reshape(1, -1),
                         out_dtype=x.dtype)  # [rows, n]
    return y.view(*x.shape[:-1], weight.shape[0])


@torch.no_grad()
def quantize_linears(model: TPLlamaForCausalLM, spec: QuantSpec) -> None:
    """Quantizes a loaded dense model's decoder linear layers in place (each rank its own shard,
    per row or group of it): for benches and GPU checks on random weights; checkpoints are
    quantized by the converter (`tprt-convert hf-to-tp --quantize`)."""
    method = QuantLinear(spec)
    for layer in model.linears():
        q, scale = quantize(layer.weight_matrix(), spec)
        del layer.weight
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        set_base_method(layer, method)
    model.weight_method = method


def _quantized_format(extra: Mapping[str, Any], where: str) -> LinearMethod:
    """A quantized format's method from a manifest's `extra` (its group size and storage)."""
    spec = spec_from_extra(dict(extra), where)
    assert spec is not None
    return QuantLinear(spec)


for _name in QUANT_FORMATS:  # the one registry of weight formats (tprt.parallel.layers)
    WEIGHT_FORMATS[_name] = _quantized_format
