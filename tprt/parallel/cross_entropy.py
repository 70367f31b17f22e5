"""Vocab-parallel cross-entropy (Megatron-style): the full-vocabulary logits are never gathered.

Each rank holds logits for its block of the (padded) vocabulary, [..., local_vocab], columns
`rank * local_vocab ...`. The loss of token t is `logsumexp(all logits) - logit[t]`, built from
three collectives over the TP group, each of size [N] (N = number of tokens), never [N, vocab]:

1. all-reduce MAX of each row's local maximum (numerical stability),
2. all-reduce SUM of each row's local sum of exp(logit - max) and of the target logit (which
   only the rank owning the target contributes; the others add 0).

Padded vocabulary columns (global id >= `vocab_size`) are excluded. Rows whose target equals
`ignore_index` get loss 0 and gradient 0. The backward needs no communication: the gradient of
the local logits is `(softmax - onehot(target)) * grad_loss`, where the softmax saved by the
forward uses the global max and sum.

These collectives are issued here, inside the autograd Function (as in Megatron-LM), rather than
through `tprt.parallel.mappings`: the three reductions belong to one formula and need a MAX.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext

IGNORE_INDEX = -100


def _all_reduce(x: torch.Tensor, ctx: TPContext, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if ctx.world_size > 1:
        dist.all_reduce(x, op=op, group=ctx.group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        fctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        ctx: TPContext,
        vocab_size: int | None,
        ignore_index: int,
    ) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        start = ctx.rank * local_vocab
        x = logits.reshape(-1, local_vocab).float()  # [N, local_vocab]
        t = target.reshape(-1)  # [N]
        valid = local_vocab if vocab_size is None else max(0, min(local_vocab, vocab_size - start))
        if valid < local_vocab:
            x = x.clone() if x.data_ptr() == logits.data_ptr() else x
            x[:, valid:] = float("-inf")
        row_max = _all_reduce(x.max(dim=-1).values, ctx, dist.ReduceOp.MAX)  # [N]
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        exp = (x - row_max[:, None]).exp_()  # [N, local_vocab]: this rank's unnormalised probabilities
        ignored = t == ignore_index
        local_t = t - start
        mine = (local_t >= 0) & (local_t < valid) & ~ignored  # [N]: this rank owns the target
        safe_t = torch.where(mine, local_t, torch.zeros_like(local_t))
        target_logit = torch.where(mine, x.gather(1, safe_t[:, None]).squeeze(1), torch.zeros_like(row_max))
        sums = torch.stack((exp.sum(dim=-1), target_logit))  # [2, N]
        _all_reduce(sums, ctx, dist.ReduceOp.SUM)
        sum_exp, target_logit = sums[0], sums[1]
        loss = sum_exp.log() + row_max - target_logit  # [N]
        loss = torch.where(ignored, torch.zeros_like(loss), loss)
        exp.div_(sum_exp[:, None])  # softmax over the whole vocabulary, this rank's columns
        fctx.save_for_backward(exp, safe_t, mine, ignored)
        fctx.out_dtype = logits.dtype
        fctx.shape = logits.shape
        return loss.reshape(target.shape)

    @staticmethod
    def backward(fctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        softmax, safe_t, mine, ignored = fctx.saved_tensors
        g = grad_loss.reshape(-1).float()  # [N]
        g = torch.where(ignored, torch.zeros_like(g), g)
        grad = softmax * g[:, None]  # [N, local_vocab]
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe_t] -= torch.where(mine, g, torch.zeros_like(g))
        return grad.to(fctx.out_dtype).reshape(fctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    ctx: TPContext,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token loss, -log softmax(logits)[target], from this rank's vocabulary block.

    local_logits [..., local_vocab] (any float dtype; computed in float32), the rank's columns
    `ctx.rank * local_vocab ...` of the padded vocabulary; target [...] global token ids.
    Returns float32 [...]: 0 where target == ignore_index. Columns with global id >= vocab_size
    (TP padding) are left out. Collective over the TP group (three reductions of size [...]);
    differentiable with respect to `local_logits`.
    """
    if local_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {list(local_logits.shape)} and target {list(target.shape)} do not match")
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(local_logits, target, ctx, vocab_size, ignore_index)
    return out


def vocab_parallel_logprobs(
    local_logits: torch.Tensor, target: torch.Tensor, ctx: TPContext, vocab_size: int | None = None
) -> torch.Tensor:
    """log softmax(logits)[target] over the whole vocabulary, [...] float32; collective (see above)."""
    return -vocab_parallel_cross_entropy(local_logits, target, ctx, vocab_size)
