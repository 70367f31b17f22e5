"""The four communication operators of tensor parallelism, as autograd functions.

Each is a pair (forward collective, backward collective) over the TP group of a `TPContext`:

- copy_to_region:     fwd identity       / bwd all-reduce      (input of a column-parallel layer)
- reduce_from_region: fwd all-reduce     / bwd identity        (output of a row-parallel layer)
- gather_from_region: fwd all-gather(-1) / bwd split(-1)       (column-parallel output made whole)
- scatter_to_region:  fwd split(-1)      / bwd all-gather(-1)  (whole input made column-parallel)
- gather_to_first:    fwd gather(-1) to TP rank 0, None elsewhere / no backward (rank 0 samples)

and Megatron's sequence-parallel pair, over the sequence dimension (dim 1 of [batch, seq, ...]),
for the regions between the TP blocks where each rank keeps seq / TP positions:

- gather_from_sequence:   fwd all-gather(seq) / bwd reduce-scatter(seq) (input of a column-parallel
                          layer: replaces copy_to_region)
- reduce_scatter_to_sequence: fwd reduce-scatter(seq) / bwd all-gather(seq) (output of a
                          row-parallel layer or the embedding: replaces reduce_from_region)
- gather_sequence:        fwd all-gather(seq) / bwd split(seq) (the last hidden states made whole
                          for the LM head, whose copy_to_region already sums the gradient)

With one rank every operator is the identity. When autograd is off (inference) the collective
runs directly, without the cost of an autograd.Function. Only `tprt.parallel.layers` calls these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext


def _all_reduce(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Sums `x` over the TP group, in place: through shared memory where the group has it (CPU
    ranks on one host, float32/bfloat16), else through the process group."""
    if ctx.shm is not None and ctx.shm.supports(x):
        return ctx.shm.all_reduce(x)
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=ctx.group)
    return x


def _all_gather_last(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Concatenates every rank's `x` along the last dim, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(parts, x, group=ctx.group)
    return torch.cat(parts, dim=-1)


def _split_last(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """This rank's chunk of the last dim (which must divide evenly)."""
    size = x.shape[-1]
    if size % ctx.world_size:
        raise ValueError(f"last dim {size} does not split over {ctx.world_size} ranks")
    n = size // ctx.world_size
    return x[..., ctx.rank * n : (ctx.rank + 1) * n].contiguous()


SEQ_DIM = 1  # [batch, seq, ...]


def all_gather_into(out: torch.Tensor, x: torch.Tensor, ctx: TPContext, async_op: bool = False) -> Any:
    """Every rank's `x` concatenated along dim 0 into `out` (torch's all_gather_single, named
    all_gather_into_tensor before torch 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=ctx.group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, ctx: TPContext, async_op: bool = False) -> Any:
    """The sum over ranks of `x`, this rank's chunk of dim 0 into `out` (reduce_scatter_single,
    named reduce_scatter_tensor before torch 2.13)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, group=ctx.group, async_op=async_op)


def _all_gather_seq(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Every rank's `x` concatenated along the sequence, in rank order."""
    first = x.movedim(SEQ_DIM, 0).contiguous()  # the collective concatenates along dim 0
    out = first.new_empty((ctx.world_size * first.shape[0], *first.shape[1:]))
    all_gather_into(out, first, ctx)
    return out.movedim(0, SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """The sum over ranks of `x`, this rank keeping its chunk of the sequence."""
    if x.shape[SEQ_DIM] % ctx.world_size:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} does not split over {ctx.world_size} ranks")
    first = x.movedim(SEQ_DIM, 0).contiguous()
    out = first.new_empty((first.shape[0] // ctx.world_size, *first.shape[1:]))
    reduce_scatter_into(out, first, ctx)
    return out.movedim(0, SEQ_DIM)


def _split_seq(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    n = x.shape[SEQ_DIM] // ctx.world_size
    return x.narrow(SEQ_DIM, ctx.rank * n, n).contiguous()


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
        fctx.tp = ctx
        return _all_gather_seq(x, ctx)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_seq(grad, fctx.tp), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
        fctx.tp = ctx
        return _reduce_scatter_seq(x, ctx)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_seq(grad, fctx.tp), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
        fctx.tp = ctx
        return _all_gather_seq(x, ctx)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_seq(grad, fctx.tp), None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
        fctx.tp = ctx
        return x.view_as(x)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), fctx.tp), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
        return _all_reduce(x.clone(), ctx)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
        fctx.tp = ctx
        return _all_gather_last(x, ctx)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, fctx.tp), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
        fctx.tp = ctx
        return _split_last(x, ctx)

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_last(grad, fctx.tp), None


def _tracked(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def copy_to_region(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce the gradient over the TP group."""
    if ctx.world_size == 1 or not _tracked(x):
        return x
    out: torch.Tensor = _CopyToRegion.apply(x, ctx)
    return out


def reduce_from_region(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Forward: all-reduce (sum) over the TP group. Backward: identity.

    Without autograd the sum is taken in place in `x` (a fresh matmul output in every caller).
    """
    if ctx.world_size == 1:
        return x
    if not _tracked(x):
        return _all_reduce(x, ctx)
    out: torch.Tensor = _ReduceFromRegion.apply(x, ctx)
    return out


def gather_from_region(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Forward: all-gather along the last dim (rank order). Backward: keep this rank's split."""
    if ctx.world_size == 1:
        return x
    if not _tracked(x):
        return _all_gather_last(x, ctx)
    out: torch.Tensor = _GatherFromRegion.apply(x, ctx)
    return out


def scatter_to_region(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Forward: keep this rank's split of the last dim. Backward: all-gather along the last dim."""
    if ctx.world_size == 1:
        return x
    if not _tracked(x):
        return _split_last(x, ctx)
    out: torch.Tensor = _ScatterToRegion.apply(x, ctx)
    return out


def gather_from_sequence(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Sequence parallelism's input of a column-parallel layer. Forward: all-gather along the
    sequence. Backward: reduce-scatter along it (each rank's layer gives a share of the gradient)."""
    if ctx.world_size == 1:
        return x
    if not _tracked(x):
        return _all_gather_seq(x, ctx)
    out: torch.Tensor = _GatherFromSequence.apply(x, ctx)
    return out


def reduce_scatter_to_sequence(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """Sequence parallelism's output of a row-parallel layer. Forward: reduce-scatter along the
    sequence. Backward: all-gather along it."""
    if ctx.world_size == 1:
        return x
    if not _tracked(x):
        return _reduce_scatter_seq(x, ctx)
    out: torch.Tensor = _ReduceScatterToSequence.apply(x, ctx)
    return out


def gather_sequence(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """The last sequence-parallel hidden states made whole. Forward: all-gather along the
    sequence. Backward: this rank's chunk (the gradient arrives whole and summed)."""
    if ctx.world_size == 1:
        return x
    if not _tracked(x):
        return _all_gather_seq(x, ctx)
    out: torch.Tensor = _GatherSequence.apply(x, ctx)
    return out


def gather_to_first(x: torch.Tensor, ctx: TPContext) -> torch.Tensor | None:
    """Inference only: every rank's `x` concatenated along the last dim (rank order) on TP rank 0;
    None on the other ranks, which so never hold the whole."""
    if ctx.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.world_size)] if ctx.rank == 0 else None
    dist.gather(x, parts, group=ctx.group, group_dst=0)
    return None if parts is None else torch.cat(parts, dim=-1)
