"""The int8 weight format on CPU with tprt's compiled kernels: `NativeInt8Linear` is the int8
`QuantLinear` (tprt.quant.methods) whose decode products (up to 32 rows, no autograd) run in
`tprt.cpu.native.q8_kernel`, reading one byte per weight; other products (prefill, training
through a frozen base) take QuantLinear's torch path. `tprt.cpu.fast_linear.prepack` gives every
int8 layer one."""

from __future__ import annotations

import torch

from tprt.cpu import native
from tprt.parallel.layers import ParallelLinear
from tprt.quant.formats import QuantSpec
from tprt.quant.methods import QuantLinear, quantized


class NativeInt8Linear(QuantLinear):
    """One per layer: it holds the layer's compiled product (made in `process_after_loading`)."""

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__(spec)
        self.kernel: native.Kernel | None = None

    def process_after_loading(self, layer: ParallelLinear) -> None:
        self.kernel = native.q8_kernel(*quantized(layer))

    def apply(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (self.kernel is None or (torch.is_grad_enabled() and x.requires_grad) or rows > native.MAX_Q8_ROWS
                or x.dtype not in (torch.float32, torch.bfloat16)):
            return super().apply(layer, x)  # prefill: one dequantization for all its rows
        return self.kernel(x)
