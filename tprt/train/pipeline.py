"""Pipeline-parallel training: the decoder's layers split into stages over PP ranks, each stage a
TP group, micro-batches on a 1F1B schedule.

The schedule is torch's (`torch.distributed.pipelining.Schedule1F1B`): it splits each batch into
micro-batches, runs the stages' forwards and backwards in the one-forward-one-backward order
(stage i keeps at most `stages - i` micro-batches' activations), and passes activations and
their gradients between neighbouring stages point to point. What is ours: the stage models
(tprt.model.stage: their layers under the whole model's names, read from the same TP
checkpoint), the process groups (`PipelineMesh`), the loss (the vocabulary-parallel
cross-entropy, scaled by the whole batch's target tokens so that the micro-batches' gradients sum
to the whole batch's), and the gradient synchronisation and clipping, whose norm spans the
stages.

The world is [pp, tp]: stage s is the TP group of ranks s * tp .. s * tp + tp - 1, and TP rank r
of every stage forms one pipeline (the PP group of ranks r, tp + r, ...), so each TP rank
exchanges only its own stage neighbours' hidden states (every TP rank holds them whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext
from tprt.model.stage import TPLlamaStage, stage_loss
from tprt.parallel.cross_entropy import IGNORE_INDEX
from tprt.parallel.stages import Stage
from tprt.train.grads import _owned_sq_norm, _spec, sync_gradients


@dataclass(frozen=True)
class PipelineMesh:
    """This rank's place in a [pp, tp] world: its TP context and its pipeline's group."""

    tp: TPContext
    pp_group: dist.ProcessGroup
    stage_index: int
    stages: int


def pipeline_mesh(tp: int, pp: int, device: torch.device | None = None) -> PipelineMesh:
    """The groups of a [pp, tp] world of pp * tp ranks (every rank calls it, in the same order)."""
    world, me = dist.get_world_size(), dist.get_rank()
    if world != pp * tp:
        raise ValueError(f"a [pp {pp}, tp {tp}] mesh needs {pp * tp} ranks; the world has {world}")
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    pp_groups = [dist.new_group(list(range(r, world, tp))) for r in range(tp)]
    stage_index, tp_rank = divmod(me, tp)
    backend = dist.get_backend()
    ctx = TPContext(group=tp_groups[stage_index] if tp > 1 else None, rank=tp_rank, world_size=tp,
                    device=device or torch.device("cpu"), backend=backend, global_rank=me)
    return PipelineMesh(ctx, pp_groups[tp_rank], stage_index, pp)


class PipelineTrainer:
    """Steps of one stage of a pipeline (see the module docstring): `step` runs a batch's
    micro-batches through the schedule and leaves this stage's gradients summed over the batch."""

    def __init__(self, model: TPLlamaStage, mesh: PipelineMesh, n_microbatches: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.model, self.mesh = model, mesh
        self._total = torch.ones(())  # the batch's target tokens: what each micro-batch's loss is scaled by
        stage = PipelineStage(model, mesh.stage_index, mesh.stages, mesh.tp.device, group=mesh.pp_group)
        self.schedule = Schedule1F1B(stage, n_microbatches, loss_fn=self._loss, scale_grads=False)

    @property
    def stage(self) -> Stage:
        return self.model.stage

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, _ = stage_loss(self.model, hidden, labels)
        return loss_sum / self._total

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float | None:
        """Forward and backward of one batch (every stage gets the same ids and labels; the
        first uses the ids, the last the labels). Returns the batch's mean loss on the last
        stage, None on the others; the gradients are this stage's, summed over the batch."""
        self._total = (labels[:, 1:] != IGNORE_INDEX).sum().clamp(min=1).to(torch.float32)
        if self.stage.first:
            self.schedule.step(input_ids)
            return None
        if not self.stage.last:
            self.schedule.step()
            return None
        losses: list[torch.Tensor] = []
        self.schedule.step(target=labels, losses=losses)
        return float(sum(loss.detach() for loss in losses))


def sync_and_clip(model: TPLlamaStage, mesh: PipelineMesh, max_norm: float) -> float:
    """The TP part of the gradient sync on this stage, then clipping by the global norm over
    every stage (replicated values counted once); returns the norm before clipping."""
    ctx = mesh.tp
    sync_gradients(model, ctx)  # type: ignore[arg-type]  # a stage has the parameters sync reads
    params = [p for p in model.parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for p in params:
        assert p.grad is not None
        sq += _owned_sq_norm(p.grad, _spec(p, ctx), ctx.rank)
    if ctx.world_size > 1:
        dist.all_reduce(sq, group=ctx.group)
    dist.all_reduce(sq, group=mesh.pp_group)  # every stage's share
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        assert p.grad is not None
        p.grad.mul_(coef.to(p.grad.dtype))
    return float(total)
