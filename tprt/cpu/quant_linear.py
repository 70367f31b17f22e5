"""The int8 weight format on CPU with tprt's compiled kernels: `NativeInt8Linear` is the int8
`QuantLinear` (tprt.quant.methods) whose decode products (up to 32 rows, no autograd) run in
`tprt.cpu.native.q8_kernel`, reading one byte per weight; other products (prefill, training
through a frozen base) take QuantLinear's torch path. `tprt.cpu.fast_linear.prepack` gives every
int8 layer one, and the LM head of a model whose decoder is int8 an `Int8Head`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tprt.cpu import native
from tprt.parallel.layers import DenseLinear, LinearMethod, ParallelLinear
from tprt.quant.formats import QuantSpec, dequantize, quantize
from tprt.quant.methods import QuantLinear, quantized


class NativeInt8Linear(QuantLinear):
    """One per layer: it holds the layer's compiled product (made in `process_after_loading`)."""

    def __init__(self, spec: QuantSpec) -> None:
        super().__init__(spec)
        self.kernel: native.Kernel | None = None

    def process_after_loading(self, layer: ParallelLinear) -> None:
        self.kernel = native.q8_kernel(*quantized(layer))

    def cpu_method(self) -> LinearMethod | None:
        return None  # already

    def stack_scales(self, layer: ParallelLinear) -> torch.Tensor | None:
        return quantized(layer)[1]

    def apply(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (self.kernel is None or (torch.is_grad_enabled() and x.requires_grad) or rows > native.MAX_Q8_ROWS
                or x.dtype not in (torch.float32, torch.bfloat16)):
            return super().apply(layer, x)  # prefill: one dequantization for all its rows
        return self.kernel(x)


class Int8Head(DenseLinear):
    """The LM head of a model whose decoder weights are int8, at inference: its dense weight
    quantized at load in the decoder's format (`spec`), as llama.cpp's Q8_0 files store
    `output.weight`. The head is a fifth of SmolLM2's weight bytes, so reading it as bf16 held
    batch-1 int8 decode well under 2x bf16's speed (docs/PERF.md). Products with autograd off
    use the int8 copy (the compiled kernel, MAX_Q8_ROWS rows a call), so decode, verification
    and scoring see the same weights; products that
    autograd records (training through the head) use the dense weight, which stays the
    checkpoint's (tied embeddings included)."""

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.q8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kernel: native.Kernel | None = None

    def process_after_loading(self, layer: ParallelLinear) -> None:
        self.q8 = quantize(layer.weight_matrix().detach(), self.spec)
        self.kernel = native.q8_kernel(*self.q8)

    def apply(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        weight = layer.weight_matrix()
        if self.q8 is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return F.linear(x, weight)
        if self.kernel is None or x.dtype not in (torch.float32, torch.bfloat16):
            return F.linear(x.to(torch.float32), dequantize(*self.q8)).to(x.dtype)
        rows = x.numel() // x.shape[-1]
        if rows <= native.MAX_Q8_ROWS:
            return self.kernel(x)
        # Many rows (scoring a prompt): the kernel over chunks, not a float32 copy of the head per call.
        flat = x.reshape(rows, x.shape[-1])
        out = torch.cat([self.kernel(flat[i : i + native.MAX_Q8_ROWS]) for i in range(0, rows, native.MAX_Q8_ROWS)])
        return out.view(*x.shape[:-1], out.shape[-1])
