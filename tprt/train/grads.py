"""Gradients that are correct under tensor (and data) parallelism, and their global norm.

After `loss.backward()` each rank holds gradients of its own shard. Three kinds of parameter
need more than that (ARCHITECTURE.md, TP rules):

- **replicated, full gradient** (RMSNorm weights): every TP rank already holds the whole
  gradient; it is averaged over the TP group only so the copies stay bitwise identical.
- **replicated, partial gradient** (LoRA A of a column-parallel layer, LoRA B of a row-parallel
  one): each rank's gradient is its shard's share; the true gradient is the sum over the TP group.
- **replicated kv heads** (TP > n_kv_heads): the k/v rows of `qkv_proj` (and their LoRA B rows)
  on the `kv_replication` ranks holding the same head each see only their query heads; the true
  gradient is the sum over those ranks.

How each parameter is laid out is recorded on it as a `TPSpec` (`tprt.parallel.spec`:
`mark_tp_params` for the base model, `tprt.lora.attach.build_lora` for adapters), so that
`clip_grad_norm` can count every replicated value exactly once when it takes the global norm.

Collectives are issued here directly (torch.distributed, flattened per dtype): they act on
gradients between backward and the optimizer step, not on activations inside the model.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tprt.distributed.context import TPContext
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.spec import TPSpec, get_spec, mark_tp_params

_BUCKET_ELEMS = 1 << 24  # float32 elements per flattened all-reduce (64 MiB)
# TP group -> {kv_replication: the group of ranks holding this rank's kv head}
_KV_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def kv_group(ctx: TPContext, replication: int) -> dist.ProcessGroup:
    """The ranks of this TP group that hold the same kv head as this rank (consecutive TP ranks
    `replication` at a time), created on first use; only its members take part in creating it."""
    assert ctx.group is not None and replication > 1
    cache = _KV_GROUPS.setdefault(ctx.group, {})
    if replication not in cache:
        first = ctx.rank // replication * replication
        ranks = [dist.get_global_rank(ctx.group, r) for r in range(first, first + replication)]
        cache[replication] = dist.new_group(ranks, use_local_synchronization=True)
    return cache[replication]


def sync_gradients(model: TPLlamaForCausalLM, ctx: TPContext, dp_group: dist.ProcessGroup | None = None) -> None:
    """Turns each rank's gradients into its slice of the unsharded model's gradient.

    Over the TP group: k/v rows (of `qkv_proj` and of LoRA's k/v B) are summed over the ranks
    sharing a kv head, partial gradients of replicated parameters (LoRA) are summed, and full
    gradients of replicated parameters (norms) are averaged so every copy is bitwise identical.
    Then every gradient is averaged over the DP group (`dp_group`, else `ctx.dp_group`): scale
    each replica's loss so that this average is the gradient wanted (`tprt.train.step.dp_loss`).
    Collective over the TP group, the kv-head groups and the DP group: every rank must call it.
    """
    mark_tp_params(model)
    params = [p for p in model.parameters() if p.grad is not None]
    if ctx.world_size > 1:
        _sync_tp(params, ctx)
    group = dp_group if dp_group is not None else ctx.dp_group
    if group is not None and dist.get_world_size(group) > 1:
        _all_reduce_flat([_grad(p) for p in params], group, 1.0 / dist.get_world_size(group))


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def _sync_tp(params: Sequence[nn.Parameter], ctx: TPContext) -> None:
    """The TP part of `sync_gradients`: kv-head sums, replicated sums and averages."""
    kv: dict[int, list[torch.Tensor]] = {}
    partial: list[torch.Tensor] = []
    full: list[torch.Tensor] = []
    for p in params:
        spec, g = _spec(p, ctx), _grad(p)
        if spec.replicated:
            (partial if spec.partial_grad else full).append(g)
        elif spec.kv_rows is not None and spec.kv_replication > 1:
            kv.setdefault(spec.kv_replication, []).append(g[spec.kv_rows[0] : spec.kv_rows[1]])
    for rep in sorted(kv):
        _all_reduce_flat(kv[rep], kv_group(ctx, rep))
    _all_reduce_flat(partial, ctx.group)
    _all_reduce_flat(full, ctx.group, 1.0 / ctx.world_size)


def _spec(p: torch.Tensor, ctx: TPContext) -> TPSpec:
    spec = get_spec(p)
    if spec is None:
        if ctx.world_size > 1:
            raise ValueError(
                f"a parameter of shape {list(p.shape)} has no TP layout; call "
                "tprt.parallel.spec.mark_tp_params(model) (sync_gradients does) before clipping"
            )
        return TPSpec()
    return spec


def _all_reduce_flat(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, scale: float = 1.0) -> None:
    """Sums `tensors` over `group` in place and multiplies them by `scale`, through flattened
    float32 buffers of at most `_BUCKET_ELEMS` elements (low-precision gradients are summed in fp32)."""
    start = 0
    while start < len(tensors):
        stop, size = start, 0
        while stop < len(tensors) and (stop == start or size + tensors[stop].numel() <= _BUCKET_ELEMS):
            size += tensors[stop].numel()
            stop += 1
        bucket = tensors[start:stop]
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        start = stop


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, ctx: TPContext,
                   across: Sequence[dist.ProcessGroup] = (), counted_elsewhere: Sequence[torch.Tensor] = ()) -> float:
    """Scales the gradients so that their global L2 norm is at most `max_norm` (as
    torch.nn.utils.clip_grad_norm_: by max_norm / (norm + 1e-6) when that is below 1) and
    returns the norm before clipping.

    The norm is the unsharded model's: sharded values summed over the TP group, replicated ones
    (norm weights, LoRA's replicated factors, kv rows held by several ranks) counted once, by one
    owner rank. Call after `sync_gradients`, which makes the copies (and DP replicas) agree.
    All-reduces one scalar over the TP group, then over each group of `across` (pipeline stages,
    each holding other parameters); the parameters in `counted_elsewhere` are scaled but their
    values counted by another rank (a tied embedding's second copy).
    """
    grads = [(p, _grad(p)) for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for p, g in grads:
        if not any(p is q for q in counted_elsewhere):
            sq += _owned_sq_norm(g, _spec(p, ctx), ctx.rank)
    if ctx.world_size > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=ctx.group)
    for group in across:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for _, g in grads:
        g.mul_(coef.to(g.dtype))
    return float(total)


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()


def _owned_sq_norm(g: torch.Tensor, spec: TPSpec, rank: int) -> torch.Tensor:
    """This rank's share of the squared norm: replicated values only on the first rank holding them."""
    if spec.replicated:
        return _sq_norm(g) if rank == 0 else torch.zeros((), dtype=torch.float32, device=g.device)
    if spec.kv_rows is None or spec.kv_replication == 1:
        return _sq_norm(g)
    a, b = spec.kv_rows
    out = _sq_norm(g[:a]) + _sq_norm(g[b:])
    return out + _sq_norm(g[a:b]) if rank % spec.kv_replication == 0 else out
