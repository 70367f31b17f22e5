"""Where LoRA attaches on a model, and how each attachment point shards the adapter's factors.

A `Site` is one decoder layer's fused projection (qkv_proj, o_proj, gate_up_proj, down_proj)
with the targets it can take and their rows in this rank's output. A factor's *full* shape is
the unsharded one PEFT stores; this rank holds B rows of a column target (a kv head's rows on
each of the `kv_replication` ranks holding it) and A columns of a row target; the rest is
replicated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext
from tprt.lora.config import target_name
from tprt.lora.modules import Segment
from tprt.model.llama import DecoderLayer, TPLlamaForCausalLM
from tprt.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tprt.parallel.sharding import KV, LAYER_LINEARS, ROW, module_rule


@dataclass(frozen=True)
class Site:
    """One base layer of one decoder layer that LoRA may target."""

    layer: int
    linear: ColumnParallelLinear | RowParallelLinear
    segments: tuple[Segment, ...]  # every target this layer can take, with its local rows
    full_in: int  # the unsharded weight's input size
    kv_replication: int  # >1: k/v segments are held by that many ranks each

    @property
    def column(self) -> bool:
        return isinstance(self.linear, ColumnParallelLinear)

    def replication(self, target: str) -> int:
        """How many ranks hold the same rows of this target (>1 only for k/v of a replicated kv head)."""
        return self.kv_replication if target in ("k", "v") else 1


def sites(model: TPLlamaForCausalLM) -> Iterator[Site]:
    """Every site of the model, in layer order (qkv, o, gate_up, down within a layer), its
    targets laid out as tprt.parallel.sharding says."""
    cfg, tp, rep = model.config, model.tp.world_size, model.layout.kv_replication
    for i, layer in enumerate(model.layers):
        if not isinstance(layer, DecoderLayer):  # held by another pipeline stage (tprt.model.stage)
            continue
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.n_heads * attn.head_dim, attn.n_kv * attn.head_dim
        inter = mlp.down_proj.weight.shape[1]
        rows = {"q": q, "k": kv, "v": kv, "gate": inter, "up": inter}  # this rank's rows of each column target
        for name, parts in LAYER_LINEARS.items():
            linear = layer.get_submodule(name)
            assert isinstance(linear, (ColumnParallelLinear, RowParallelLinear))
            targets = [target_name(m) for m in parts]
            if module_rule(parts[0]).kind == ROW:  # one target: every output row; input split over ranks
                yield Site(i, linear, (Segment(targets[0], 0, cfg.hidden_size),), linear.weight.shape[1] * tp, 1)
                continue
            starts = [sum(rows[t] for t in targets[:j]) for j in range(len(targets) + 1)]
            segments = tuple(Segment(t, starts[j], starts[j + 1]) for j, t in enumerate(targets))
            kv_rep = rep if any(module_rule(m).kind == KV for m in parts) else 1
            yield Site(i, linear, segments, cfg.hidden_size, kv_rep)


def _block(full: torch.Tensor, dim: int, blocks: int, index: int) -> torch.Tensor:
    """Block `index` of `blocks` equal blocks of `full` along `dim`."""
    n = full.shape[dim] // blocks
    return full.narrow(dim, index * n, n)


def local_factor(full: torch.Tensor, site: Site, target: str, factor: str, ctx: TPContext) -> torch.Tensor:
    """This rank's part of a full (unsharded) factor ("A" or "B") of `target` at `site`."""
    if site.column and factor == "B":
        rep = site.replication(target)
        return _block(full, 0, ctx.world_size // rep, ctx.rank // rep)
    if not site.column and factor == "A":
        return _block(full, 1, ctx.world_size, ctx.rank)
    return full


def full_shape(site: Site, seg: Segment, factor: str, rank: int, tp: int) -> tuple[int, int]:
    """The unsharded shape of factor "A" or "B" of segment `seg`'s target at `site`, for LoRA rank `rank`."""
    if factor == "A":
        return rank, site.full_in
    if not site.column:
        return site.linear.weight.shape[0], rank
    return (seg.stop - seg.start) * tp // site.replication(seg.target), rank


def _all_gather(t: torch.Tensor, ctx: TPContext) -> list[torch.Tensor]:
    if ctx.world_size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group)
    return parts


def full_factor(param: torch.Tensor, site: Site, target: str, factor: str, ctx: TPContext) -> torch.Tensor:
    """The unsharded factor from every rank's part (collective when the factor is sharded)."""
    if site.column and factor == "B":
        return torch.cat(_all_gather(param, ctx)[:: site.replication(target)], dim=0)
    if not site.column and factor == "A":
        return torch.cat(_all_gather(param, ctx), dim=1)
    return param
