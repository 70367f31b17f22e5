"""A column-parallel dense product whose backward overlaps its communication (Megatron's
"asynchronous tensor-parallel all-reduce" and sequence parallelism's saved chunk).

The backward of y = x W^T needs two products, the input's gradient (dy W) and the weight's
(dy^T x). The input's gradient must then be summed over the TP group (an all-reduce; under
sequence parallelism a reduce-scatter along the sequence); the weight's needs no collective. The
plain autograd path computes both in one node and sums afterwards, so the collective waits on
the weight's product. Here the input's gradient is computed first, its collective launched
asynchronously, and the weight's product runs while it travels.

Under sequence parallelism the forward all-gathers this rank's chunk of the positions; only the
chunk is saved, and the backward all-gathers it again (launched before the input's product, so
that it too travels under computation). The activations a column-parallel layer keeps are then
1 / TP of the gathered input's.

Used for trainable dense weights (full fine-tuning: `ColumnParallelLinear.overlap_comm`); other
weight methods (LoRA over a frozen base, quantized formats) take the plain path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tprt.distributed.context import TPContext
from tprt.parallel.mappings import SEQ_DIM, _all_gather_seq, all_gather_into, reduce_scatter_into


def _gather_async(x: torch.Tensor, ctx: TPContext) -> tuple[torch.Tensor, Any]:
    """Starts the all-gather of `x` along the sequence: (the buffer, in [seq, ...] order; its work)."""
    first = x.movedim(SEQ_DIM, 0).contiguous()
    out = first.new_empty((ctx.world_size * first.shape[0], *first.shape[1:]))
    return out, all_gather_into(out, first, ctx, async_op=True)


class _ColumnParallelDense(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ctx: TPContext,
                sequence_parallel: bool) -> torch.Tensor:
        total = _all_gather_seq(x, ctx) if sequence_parallel else x
        fctx.save_for_backward(x, weight)  # under sequence parallelism: this rank's chunk only
        fctx.tp, fctx.sp, fctx.has_bias = ctx, sequence_parallel, bias is not None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = fctx.saved_tensors
        ctx, sp = fctx.tp, fctx.sp
        gathering = _gather_async(x, ctx) if sp and fctx.needs_input_grad[1] else None
        grad_total = grad.matmul(weight)  # [..., in]: this rank's share of the input's gradient
        if sp:  # reduce-scatter along the sequence
            first = grad_total.movedim(SEQ_DIM, 0).contiguous()
            grad_x = first.new_empty((first.shape[0] // ctx.world_size, *first.shape[1:]))
            summing = reduce_scatter_into(grad_x, first, ctx, async_op=True)
        else:
            grad_x = grad_total
            summing = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        grad_w = grad_b = None
        if fctx.needs_input_grad[1]:  # while the input's gradient travels
            if gathering is not None:
                buf, work = gathering
                work.wait()
                total = buf.movedim(0, SEQ_DIM)
            else:
                total = x
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        if fctx.has_bias and fctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        summing.wait()
        if sp:
            grad_x = grad_x.movedim(0, SEQ_DIM)
        return grad_x, grad_w, grad_b, None, None


def column_parallel_dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ctx: TPContext,
                          sequence_parallel: bool) -> torch.Tensor:
    """x (this rank's chunk of the positions under sequence parallelism) @ weight^T + bias, the
    input's gradient summed over the TP group in the backward, overlapped (module docstring)."""
    out: torch.Tensor = _ColumnParallelDense.apply(x, weight, bias, ctx, sequence_parallel)
    return out
