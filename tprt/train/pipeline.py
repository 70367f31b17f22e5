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

The world is a [dp, pp, tp] mesh (tprt.distributed.context.ParallelDims): stage s of DP replica d
is a TP group of consecutive ranks, and TP rank r of every stage of a replica forms one pipeline,
so each TP rank exchanges only its own stage neighbours' hidden states (every TP rank holds them
whole). DP replicas train their own rows of each batch; the loss is scaled by the whole batch's
target tokens, so that averaging the gradients over DP gives the whole batch's.

`tprt finetune --pp` runs it through the trainer (tprt.train.trainer) as `PipelineSupervised`,
the objective that hands each step's rows to the schedule and evaluates through the stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tprt.distributed.pipeline_mesh import PipelineMesh, pipeline_mesh
from tprt.model.stage import TPLlamaStage, forward_through, stage_loss
from tprt.parallel.cross_entropy import IGNORE_INDEX
from tprt.parallel.stages import Stage
from tprt.train.data import rank_share
from tprt.train.grads import clip_grad_norm, sync_gradients
from tprt.train.objective import EvalOutcome, StepOutcome, TrainRun

__all__ = ["PipelineMesh", "PipelineSupervised", "PipelineTrainer", "pipeline_mesh", "sync_and_clip",
           "tied_embedding_grads"]


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
        return loss_sum * self.mesh.tp.dp_size / self._total  # DP averages the gradients: dp / total each

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float | None:
        """Forward and backward of this DP replica's rows of a batch (every stage of the replica
        gets the same ids and labels; the first uses the ids, the last the labels). Returns the
        whole batch's mean loss on the last stage, None on the others; the gradients are this
        stage's (average them over DP: `sync_and_clip`)."""
        ctx = self.mesh.tp
        total = (labels[:, 1:] != IGNORE_INDEX).sum().to(torch.float32)
        if ctx.dp_group is not None:  # every replica's target tokens
            dist.all_reduce(total, group=ctx.dp_group)
        self._total = total.clamp(min=1)
        if self.stage.first:
            self.schedule.step(input_ids)
            return None
        if not self.stage.last:
            self.schedule.step()
            return None
        losses: list[torch.Tensor] = []
        self.schedule.step(target=labels, losses=losses)
        mean = torch.stack([loss.detach() for loss in losses]).sum() / ctx.dp_size
        if ctx.dp_group is not None:
            dist.all_reduce(mean, group=ctx.dp_group)
        return float(mean)


def tied_embedding_grads(model: TPLlamaStage, mesh: PipelineMesh) -> None:
    """With tied embeddings over several stages, the first stage's copy (the lookup) and the
    last's (the head) are one parameter: each gets the sum of both gradients (Megatron's
    embedding group)."""
    if not model.config.tie_word_embeddings or mesh.ends_group is None or model.embed_tokens is None:
        return
    weight = model.embed_tokens.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=mesh.ends_group)


def sync_and_clip(model: TPLlamaStage, mesh: PipelineMesh, max_norm: float) -> float:
    """The gradient sync on this stage (TP, then the average over DP), then clipping by the
    global norm over every stage (replicated values counted once); returns the norm before
    clipping."""
    ctx = mesh.tp
    tied_embedding_grads(model, mesh)
    sync_gradients(model, ctx)  # type: ignore[arg-type]  # a stage has the parameters sync reads
    # a tied embedding's second copy (the last stage's head) is counted once, by the first stage
    twin = [model.embed_tokens.weight] if (model.embed_tokens is not None and model.stage.last
                                           and not model.stage.first) else []
    return clip_grad_norm(model.parameters(), max_norm, ctx, across=[mesh.pp_group], counted_elsewhere=twin)


class PipelineSupervised:
    """The supervised objective (tprt.train.objective.Supervised) over pipeline stages: a step's
    rows of this DP replica go through the 1F1B schedule in `n_microbatches` micro-batches; the
    loss, known on the last stage, is handed to every rank. Evaluation passes the held-out rows
    forward through the stages (`forward_through`)."""

    def __init__(self, mesh: PipelineMesh, n_microbatches: int) -> None:
        self.mesh, self.n_microbatches = mesh, n_microbatches
        self.trainer: PipelineTrainer | None = None

    def prepare(self, run: TrainRun) -> None:
        assert isinstance(run.model, TPLlamaStage)
        self.trainer = PipelineTrainer(run.model, self.mesh, self.n_microbatches)

    def forward_backward(self, run: TrainRun, rows: list[int]) -> StepOutcome:
        assert self.trainer is not None, "prepare() first"
        train, ctx = run.data.train, run.ctx
        mine = torch.tensor([r for micro in rank_share(rows, ctx.dp_rank, ctx.dp_size, run.batch_size) for r in micro])
        loss = self.trainer.step(train.input_ids[mine].to(ctx.device), train.labels[mine].to(ctx.device))
        return StepOutcome(self._from_last_stage(loss), train.n_tokens(rows))

    def evaluate(self, run: TrainRun) -> EvalOutcome | None:
        """Mean loss per target token over the eval rows (each DP replica its share)."""
        rows = run.data.eval
        if rows is None:
            return None
        ctx, model = run.ctx, run.model
        assert isinstance(model, TPLlamaStage)
        idx = list(range(ctx.dp_rank, len(rows), ctx.dp_size))
        sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        model.eval()
        try:
            with torch.no_grad():
                for i in range(0, len(idx), run.batch_size):
                    micro = torch.tensor(idx[i : i + run.batch_size])
                    hidden = forward_through(model, self.mesh, rows.input_ids[micro].to(ctx.device))
                    if hidden is not None:
                        loss_sum, n = stage_loss(model, hidden, rows.labels[micro])
                        sums += torch.stack((loss_sum.double(), n.double()))
        finally:
            model.train()
        dist.all_reduce(sums, group=self.mesh.pp_group)  # the last stage's sums, on every stage
        run.dp_sum(sums)
        return EvalOutcome(float(sums[0] / sums[1].clamp(min=1)))

    def _from_last_stage(self, value: float | None) -> float:
        t = torch.tensor([value or 0.0], dtype=torch.float64, device=self.mesh.tp.device)
        dist.all_reduce(t, group=self.mesh.pp_group)  # only the last stage's is non-zero
        return float(t)
