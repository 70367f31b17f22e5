"""Executes a step's `TokenBatch` on one rank of a pipeline stage (tprt.model.stage).

Every rank of the pipeline receives the step from rank 0 (stage 0's TP rank 0, which schedules
and samples: the engine's control group is the whole pipeline, `PipelineMesh.replica`). The
step is split into micro-batches of consecutive rows (`TokenBatch.split`; by default up to four
per stage while each keeps MIN_MICROBATCH_TOKENS, so decode steps stay whole); each stage runs
them in order over its own layers and its own KV cache (the scheduler's block tables are the
same on every stage, the cache of each holds its layers only): the first
embeds their tokens, every stage but the last sends its hidden states to the same TP rank of
the next stage (asynchronously: it goes on with the next micro-batch while its neighbour
computes this one, so with m micro-batches and p stages each stage idles (p - 1) / (m + p - 1)
of a step), and the last computes the logits. Its TP rank 0 sends the step's result (argmax ids,
or full-vocabulary logits) to rank 0 in one message.

A row's tokens are computed as without stages: the same layers in the same order, its attention
over its own cache positions; a step's result is identical to the whole model's.

Rank 0 `launch`es a step (its own stage's part, the result's receive posted) and `collect`s it
later, so it can launch the next step, for other rows, while later stages still work on this
one (tprt.engine.core keeps one step in flight per stage); every stage takes the steps in order.

Not taken on a stage: CPU prepacking and the compiled decode layers, CUDA graphs (they capture
the whole model's step) and prefill's sequence parallelism; the runner says so at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from tprt.distributed.context import log0
from tprt.distributed.pipeline_mesh import PipelineMesh
from tprt.engine.runner import ModelRunner, RunnerConfig, StepResult
from tprt.errors import ConfigError
from tprt.model.batch import TokenBatch
from tprt.model.stage import TPLlamaStage, forward_through

if TYPE_CHECKING:
    from torch.distributed import Work

T = TypeVar("T")


@dataclass
class Launched:
    """A step this rank has launched: its sends to the next stage and, on rank 0, the posted
    receive of its result (with their buffers, kept alive until `StageRunner.collect`)."""

    full_logits: bool
    sending: list[tuple[Work, torch.Tensor]]
    receiving: tuple[Work, torch.Tensor] | None


# A step is split into micro-batches of at least this many tokens by default: below it a
# micro-batch's per-call costs (its weights read again, its dispatch, its transfer) outweigh
# the overlap it buys (bench/pp_generate_bench.py: decode steps lose, prefill gains; PERF.md).
MIN_MICROBATCH_TOKENS = 256
# ... and into at most this many per stage: the bubble (p - 1) / (m + p - 1) is small by then.
MAX_MICROBATCHES_PER_STAGE = 4


class StageRunner(ModelRunner):
    """This rank's stage of the model and its KV cache, driven by the pipeline's token batches."""

    def __init__(self, model: TPLlamaStage, mesh: PipelineMesh, n_blocks: int, block_size: int, max_batch: int,
                 max_seq_len: int, config: RunnerConfig = RunnerConfig(), microbatches: int | None = None) -> None:
        if mesh.stages < 2:
            raise ConfigError("a stage runner serves a pipeline of at least two stages; one is the ModelRunner's")
        if microbatches is not None and microbatches < 1:
            raise ConfigError(f"pipeline micro-batches must be at least 1, got {microbatches}")
        if config.cpu_prepack or config.cuda_graphs not in ("auto", "off") or config.sequence_parallel_tokens:
            log0(model.tp, "pipeline stages run eagerly: no CPU prepacking, compiled decode layers, CUDA graphs "
                 "or sequence parallelism")
        super().__init__(model, n_blocks, block_size, max_batch, max_seq_len,
                         replace(config, cpu_prepack=False, cuda_graphs="off", sequence_parallel_tokens=0))
        self.stage_model, self.mesh = model, mesh
        self.previous, self.next, self.wire = mesh.previous, mesh.next, mesh.wire
        self.driver, self.reporter = mesh.stage_rank(0), mesh.stage_rank(mesh.stages - 1)
        self.me = mesh.tp.global_rank
        self.microbatches = microbatches  # None: `_parts` decides per step

    @torch.inference_mode()
    def execute(self, batch: TokenBatch) -> StepResult:
        """Runs this stage's part of the step (see the module docstring); rank 0 gets the result,
        the other ranks StepResult(None, None). Collective over the pipeline."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: TokenBatch) -> Launched:
        """This stage's part of the step, its hidden states on their way to the next stage; on
        rank 0 the receive of the step's result is posted. `collect` finishes it. Rank 0 can
        launch further steps before collecting this one (they reach every stage in order)."""
        model = self.stage_model
        sending: list[tuple[Work, torch.Tensor]] = []
        results: list[StepResult] = []
        for part in batch.split(self._parts(batch)):
            self._route(part)
            step = self.attention.prepare(part, self.cache)
            if self.previous is None:
                x = torch.tensor(part.tokens, dtype=torch.long, device=self.device)  # [tokens]
            else:
                x = torch.empty(part.num_tokens, model.config.hidden_size, dtype=model.dtype, device=self.wire)
                dist.recv(x, self.previous)
            hidden = model.forward_hidden(x, attention=step)  # [tokens, hidden]
            if self.next is not None:
                out = hidden.to(self.wire).contiguous()
                work = dist.isend(out, self.next)
                assert work is not None  # None only for ranks outside the group
                sending.append((work, out))
            elif part.num_logits:
                if part.num_logits != part.num_tokens:
                    hidden = hidden.index_select(0, torch.tensor(part.logits_indices, device=self.device))
                results.append(self._finish(model.logits(hidden), batch.full_logits))
        if self.me == self.reporter and batch.num_logits:  # the last stage's TP rank 0 reports
            out = torch.cat([t for p in results for t in ((p.logits,) if batch.full_logits else (p.ids,))
                             if t is not None])
            dist.send(out.to(self.wire).contiguous(), self.driver)
        receiving = None
        if self.me == self.driver and batch.num_logits:
            shape = (batch.num_logits, self.model.config.vocab_size) if batch.full_logits else (batch.num_logits,)
            buffer = torch.empty(shape, dtype=torch.float32 if batch.full_logits else torch.long, device=self.wire)
            work = dist.irecv(buffer, self.reporter)
            assert work is not None
            receiving = (work, buffer)
        return Launched(batch.full_logits, sending, receiving)

    def collect(self, launched: Launched) -> StepResult:
        """Waits for a launched step's sends and, on rank 0, for its result."""
        for work, _ in launched.sending:
            work.wait()
        if launched.receiving is None:
            return StepResult(None, None)
        work, buffer = launched.receiving
        work.wait()
        result = buffer.to(self.device)
        return StepResult(None, result) if launched.full_logits else StepResult(result, None)

    def _parts(self, batch: TokenBatch) -> int:
        """The step's micro-batches: the configured count, else up to MAX_MICROBATCHES_PER_STAGE
        per stage of MIN_MICROBATCH_TOKENS tokens or more each."""
        if self.microbatches is not None:
            return self.microbatches
        return max(1, min(MAX_MICROBATCHES_PER_STAGE * self.mesh.stages, batch.num_tokens // MIN_MICROBATCH_TOKENS))

    @torch.inference_mode()
    def forward_whole(self, ids: list[int]) -> torch.Tensor | None:
        """One uncached causal pass of a sequence through the stages (scoring a prompt between
        steps): the last stage's hidden states [len(ids), hidden] there, None on the others.
        Collective over the pipeline."""
        hidden = forward_through(self.stage_model, self.mesh, torch.tensor([ids], device=self.device))
        return None if hidden is None else hidden[0]

    def to_driver(self, value: T | None) -> T | None:
        """The last stage's TP rank 0's `value` on rank 0 (None on the other ranks): what a
        command computed on the last stage, returned by rank 0."""
        box: list[object] = [value]
        device = self.wire if self.wire.type == "cuda" else None
        if self.me == self.reporter:
            dist.send_object_list(box, self.driver, device=device)
        elif self.me == self.driver:
            dist.recv_object_list(box, self.reporter, device=device)
            return box[0]  # type: ignore[return-value]
        return None
