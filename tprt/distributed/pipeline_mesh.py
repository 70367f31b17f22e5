"""The process groups of a [dp, pp, tp] world (tprt.distributed.context.ParallelDims): each
stage of each DP replica a TP group of consecutive ranks, TP rank r of every stage of a replica
one pipeline (its ranks pass hidden states to their stage neighbours), the first and last stage
of a pipeline (tied embeddings' two copies), and a replica's whole pipeline (generation's steps
go to all of its ranks). Training (tprt.train.pipeline) and generation (tprt.engine.stage_runner)
both run on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tprt.distributed.context import ParallelDims, TPContext, join_world
from tprt.errors import ConfigError


@dataclass(frozen=True)
class PipelineMesh:
    """This rank's place in a [dp, pp, tp] world: its TP context (with its DP group), its
    pipeline's group and its stage, and the group of its pipeline's first and last stage (whose
    copies of tied embeddings are one parameter)."""

    tp: TPContext
    pp_group: dist.ProcessGroup
    stage_index: int
    stages: int
    ends_group: dist.ProcessGroup | None = None  # None with one stage
    # Generation's: every rank of this DP replica's pipeline, rank 0 (stage 0's TP rank 0) first,
    # which sends each step to all of them (tprt.engine.stage_runner).
    replica_group: dist.ProcessGroup | None = None
    dims: ParallelDims = ParallelDims()

    @property
    def pipeline(self) -> list[int]:
        """The global ranks of this TP rank's pipeline, in stage order."""
        me = self.tp.global_rank
        return self.dims.pp_group_ranks(self.dims.dp_rank(me), self.dims.tp_rank(me))

    @property
    def previous(self) -> int | None:
        """The global rank this one receives hidden states from (None on the first stage)."""
        return self.pipeline[self.stage_index - 1] if self.stage_index > 0 else None

    @property
    def next(self) -> int | None:
        """The global rank this one sends hidden states to (None on the last stage)."""
        return self.pipeline[self.stage_index + 1] if self.stage_index + 1 < self.stages else None

    @property
    def wire(self) -> torch.device:
        """Where tensors passed between ranks live: gloo sends host tensors, NCCL the device's."""
        return self.tp.device if self.tp.backend == "nccl" else torch.device("cpu")

    def stage_rank(self, stage: int, tp_rank: int = 0) -> int:
        """The global rank of TP rank `tp_rank` of stage `stage` of this DP replica."""
        return self.dims.pp_group_ranks(self.dims.dp_rank(self.tp.global_rank), tp_rank)[stage]

    def replica(self) -> TPContext:
        """This DP replica's whole pipeline as one context (its rank 0 is stage 0's TP rank 0):
        the group generation's steps and commands are sent over."""
        me, dims = self.tp.global_rank, self.dims
        return TPContext(group=self.replica_group, rank=me - dims.dp_rank(me) * dims.tp * dims.pp,
                         world_size=dims.tp * dims.pp, device=self.tp.device, backend=self.tp.backend, global_rank=me)


def pipeline_mesh(tp: int, pp: int, dp: int = 1, device: torch.device | None = None) -> PipelineMesh:
    """The groups of a [dp, pp, tp] world (every rank calls it: group creation is collective)."""
    dims = ParallelDims(tp=tp, dp=dp, pp=pp)
    world, me = dist.get_world_size(), dist.get_rank()
    if world != dims.world:
        raise ConfigError(f"a [dp {dp}, pp {pp}, tp {tp}] mesh needs {dims.world} ranks; the world has {world}")
    d, s, t = dims.dp_rank(me), dims.pp_rank(me), dims.tp_rank(me)
    mine: dict[str, dist.ProcessGroup] = {}
    def ends(dp_rank: int, tp_rank: int) -> list[int]:
        pipeline = dims.pp_group_ranks(dp_rank, tp_rank)
        return [pipeline[0], pipeline[-1]]

    for kind, ranks_of, keys in (("tp", dims.tp_group_ranks, [(x, y) for x in range(dp) for y in range(pp)]),
                                 ("pp", dims.pp_group_ranks, [(x, y) for x in range(dp) for y in range(tp)]),
                                 ("dp", dims.dp_group_ranks, [(y, x) for x in range(pp) for y in range(tp)]),
                                 ("ends", ends, [(x, y) for x in range(dp) for y in range(tp)] if pp > 1 else [])):
        for key in keys:
            ranks = ranks_of(*key)
            group = dist.new_group(ranks)
            if me in ranks:
                mine[kind] = group
    for replica in range(dp):  # generation's control group: one pipeline replica's ranks
        ranks = list(range(replica * tp * pp, (replica + 1) * tp * pp))
        group = dist.new_group(ranks)
        if me in ranks:
            mine["replica"] = group
    ctx = TPContext(group=mine["tp"] if tp > 1 else None, rank=t, world_size=tp,
                    device=device or torch.device("cpu"), backend=dist.get_backend(), global_rank=me,
                    dp_group=mine["dp"] if dp > 1 else None, dp_rank=d, dp_size=dp)
    return PipelineMesh(ctx, mine["pp"], s, pp, mine.get("ends"), mine["replica"] if tp * pp > 1 else None, dims)


def init_pipeline(tp: int, pp: int, backend: str | None = None, timeout_s: float = 600.0) -> PipelineMesh:
    """Joins the world the environment describes (torchrun's, or tprt's local launcher's) and
    lays it out as pipelines of `pp` stages of `tp` ranks each, one per DP replica."""
    _, world, _, device = join_world(backend, timeout_s)
    return pipeline_mesh(tp, pp, max(1, world // (tp * pp)), device=device)
