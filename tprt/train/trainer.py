"""The fine-tuning loop: full or LoRA, DP x TP, accumulation, clipping, eval, checkpoints.

A full fine-tune launched by `train_rank` shards its training state over the DP ranks with FSDP2
(`tprt.train.fsdp`) and checkpoints through torch.distributed.checkpoint; LoRA runs, and Trainers
built on a bare context (the server's jobs, which have no DP ranks), replicate over DP and
average gradients (`tprt.train.grads.sync_gradients`).

One `Trainer` per rank. A step takes the next global batch (`BatchStream`: batch_size x
grad_accum x dp rows), of which this DP rank computes its contiguous share, micro-batch by
micro-batch; each micro-batch's loss sum is scaled by dp_size / (target tokens of the whole
global batch) before its backward, so after `sync_gradients` (TP sums, DP average) the gradient
is that of the token mean over the global batch, whatever the accumulation and DP split. Then
the gradients are clipped by their global norm and AdamW (fp32 masters) steps.

A non-finite loss or gradient norm stops the run before the optimizer touches the weights: the
error names the step and the last good checkpoint, and every rank raises it (the loss is
all-reduced, so they agree).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tprt.checkpoint.format import TPCheckpoint
from tprt.distributed.context import TPContext, init_distributed
from tprt.distributed.together import run_together
from tprt.errors import ConfigError, TprtError
from tprt.checkpoint.loading import load_model, load_stage, parse_dtype, shared_twin
from tprt.distributed.pipeline_mesh import PipelineMesh
from tprt.model.stage import TPLlamaStage
from tprt.parallel.stages import stages
from tprt.lora.config import LoRASettings
from tprt.model.llama import TPLlamaForCausalLM
from tprt.train import checkpointing as ckpt
from tprt.train.data import BatchStream, Dataset
from tprt.train.dpo import DPOConfig, Preference, load_initial_adapter
from tprt.train.fsdp import ShardedModel
from tprt.train.objective import Objective, Supervised
from tprt.train.pipeline import PipelineSupervised, sync_and_clip
from tprt.train.plot import METRICS_FILE, PLOT_FILE, MetricsLog, plot_loss

log = logging.getLogger("tprt")


class TrainingDiverged(TprtError):
    """The loss or the gradient norm became NaN/inf."""


@dataclass(frozen=True)
class OptimSettings:
    """AdamW and its schedule (--lr, --min-lr-ratio, --warmup-steps, --weight-decay, --max-grad-norm)."""

    lr: float = 2e-4
    min_lr_ratio: float = 0.1  # the cosine's floor, as a share of lr
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class FinetuneConfig:
    """Everything `tprt finetune` was asked to do: the run's own flags, and the LoRA, objective and
    optimizer settings as their own configs."""

    model: Path
    data: Path
    out: Path
    full: bool = False
    lora: LoRASettings = LoRASettings()  # unused by a full fine-tune
    dpo: DPOConfig | None = None  # None: supervised (SFT); else preference pairs (tprt.train.dpo)
    optim: OptimSettings = OptimSettings()
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 4  # rows per micro-batch per DP rank
    grad_accum: int = 1
    seq_len: int = 512
    save_every: int = 0  # 0: no intermediate checkpoints
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: evaluate at the end only (when there is eval data)
    eval_fraction: float = 0.0
    eval_data: Path | None = None
    seed: int = 0
    dtype: str = "fp32"
    activation_checkpointing: bool = False
    sequence_parallel: bool = False  # tprt.train.step.enable_sequence_parallel
    # A full fine-tune's TP backward overlapped (tprt.train.step.enable_tp_comm_overlap): "on", "off",
    # or "auto": on for CUDA devices (NCCL runs beside the kernels), off on CPU, where the ranks
    # share the cores and the shared-memory all-reduce beats an overlapped gloo one (docs/PERF.md).
    tp_comm_overlap: str = "auto"
    offload_optimizer: str = "none"  # "cpu": FSDP's fp32 shards, gradients and AdamW state in host memory
    dp: int = 1  # data-parallel ranks the local launcher starts (torchrun: WORLD_SIZE / tp)
    pp: int = 1  # pipeline stages of tp ranks each (tprt.train.pipeline)
    resume: bool = False
    truncate: bool = True
    progress: bool = True

    @property
    def method(self) -> str:
        return "full" if self.full else "lora"

    @property
    def objective(self) -> str:
        return "sft" if self.dpo is None else "dpo"

    def objective_of(self) -> Objective:
        """The objective handed to the trainer (tprt.train.objective)."""
        if self.dpo is None:
            return Supervised()
        # LoRA from scratch: the reference is the base, the adapter switched off per micro-batch.
        # Otherwise the starting weights are, scored once before any step or resume.
        return Preference(self.dpo, adapter_is_reference=not self.full and self.lora.init is None)


def run_config(cfg: FinetuneConfig, tp: int, data_digest: str) -> dict[str, Any]:
    """The JSON-able run description stored in checkpoints (and compared on resume): one flat
    object under the flags' names, as runs have always recorded it."""
    d: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in ("lora", "dpo", "optim")}
    d.update(asdict(cfg.optim))
    lora = cfg.lora
    d.update(lora_rank=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, lora_targets=list(lora.targets),
             init_adapter=lora.init)
    if cfg.full:
        d.update(lora_rank=None, lora_alpha=None, lora_targets=None)
    dpo = cfg.dpo
    if dpo is None:  # as runs before DPO existed recorded them
        d.update(objective=None, beta=None, dpo_loss=None, label_smoothing=None, rpo_alpha=None)
    else:
        d.update(objective="dpo", beta=dpo.beta, dpo_loss=dpo.loss, label_smoothing=dpo.label_smoothing,
                 rpo_alpha=dpo.rpo_alpha)
    d = {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}
    d.update(tp=tp, method=cfg.method, data_digest=data_digest,
             model_fingerprint=ckpt.model_fingerprint(Path(cfg.model)))
    return d


def check_pipeline(cfg: FinetuneConfig, pp: int) -> None:
    """What a pipeline-parallel run cannot do, refused naming the flag."""
    if cfg.dpo is not None:
        raise ConfigError(f"--pp {pp}: preference tuning (--objective dpo) does not run over pipeline stages")
    if cfg.sequence_parallel:
        raise ConfigError(f"--pp {pp}: --sequence-parallel does not run over pipeline stages yet")
    if cfg.offload_optimizer != "none":
        raise ConfigError(f"--pp {pp}: --offload-optimizer shards over DP with FSDP, which stages do not use")
    if cfg.grad_accum < pp:
        raise ConfigError(f"--pp {pp}: the 1F1B schedule needs at least one micro-batch per stage; "
                          f"give --grad-accum {pp} or more (got {cfg.grad_accum})")


def total_steps(cfg: FinetuneConfig, n_examples: int, dp_size: int) -> int:
    """--steps, else ceil(--epochs (default 1) x examples / examples per step); an example is a
    row, or with DPO a pair."""
    if cfg.steps is not None:
        return cfg.steps
    per_step = cfg.batch_size * cfg.grad_accum * dp_size
    return max(1, math.ceil((cfg.epochs or 1.0) * n_examples / per_step))


def watch_parent(pid: int | None, poll_s: float = 1.0) -> None:
    """Exits this process when the process `pid` (the launcher) is gone, so that no orphaned
    rank trains on after its parent was killed."""
    if pid is None:
        return

    def run() -> None:
        while True:
            time.sleep(poll_s)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=run, name="tprt-parent-watch", daemon=True).start()


def train_rank(cfg: FinetuneConfig, dataset: Dataset, launcher_pid: int | None = None) -> dict[str, Any]:
    """One rank of `tprt finetune` (under torchrun or tprt's launcher); returns a summary."""
    watch_parent(launcher_pid)
    tp = TPCheckpoint(cfg.model).tp_size
    if cfg.pp > 1:
        from tprt.distributed.pipeline_mesh import init_pipeline

        pipeline = init_pipeline(tp, cfg.pp)
        return Trainer(cfg, pipeline.tp, dataset, pipeline=pipeline).run()
    ctx = init_distributed(tp_size=tp)
    mesh = None
    if cfg.full:
        from tprt.train.fsdp import make_mesh

        mesh = make_mesh(ctx)
    return Trainer(cfg, ctx, dataset, mesh=mesh).run()


class Trainer:
    """The training state of one rank and the loop over it."""

    def __init__(self, cfg: FinetuneConfig, ctx: TPContext, dataset: Dataset,
                 base: TPLlamaForCausalLM | None = None, mesh: DeviceMesh | None = None,
                 pipeline: PipelineMesh | None = None) -> None:
        """`base`: for LoRA, a loaded model of cfg.model in cfg.dtype (the server's) whose frozen
        weights the trainer uses instead of loading its own copy (`shared_twin`). `mesh`: the
        world as a [dp, tp] DeviceMesh; a full fine-tune then shards over its `dp` dimension.
        `pipeline`: this rank trains its stage of the model (tprt.train.pipeline) over this mesh."""
        from tprt.train.optim import AdamW, warmup_cosine
        from tprt.train.step import (enable_activation_checkpointing, enable_sequence_parallel,
                                     enable_tp_comm_overlap)

        self.cfg, self.ctx, self.data, self.pipeline = cfg, ctx, dataset, pipeline
        self.out = Path(cfg.out)
        self.run_cfg = run_config(cfg, ctx.world_size, dataset.digest)
        self.sharded: ShardedModel | None = None
        if cfg.offload_optimizer != "none" and (mesh is None or not cfg.full):
            raise ConfigError("--offload-optimizer needs --full (a sharded full fine-tune)")
        if pipeline is not None:
            check_pipeline(cfg, pipeline.stages)
            stage = stages(TPCheckpoint(cfg.model).config.num_hidden_layers, pipeline.stages)[pipeline.stage_index]
            self.model: TPLlamaForCausalLM = load_stage(cfg.model, ctx, stage, dtype=cfg.dtype, requires_grad=cfg.full)
        elif base is not None:
            if cfg.full or base.dtype != parse_dtype(cfg.dtype) or base.tp != ctx:
                raise ConfigError("only a LoRA job in the base model's dtype and TP context can share its weights")
            self.model = shared_twin(base)
        elif cfg.full and mesh is not None:
            from tprt.train.fsdp import shard_model

            # float32 shards are the master weights; FSDP casts to cfg.dtype for compute
            fp32 = load_model(cfg.model, ctx, dtype="fp32", requires_grad=True)
            enable_sequence_parallel(fp32, cfg.sequence_parallel)  # before sharding records the layouts
            self.sharded = shard_model(fp32, ctx, mesh, parse_dtype(cfg.dtype), cfg.offload_optimizer)
            self.model = fp32
        else:
            self.model = load_model(cfg.model, ctx, dtype=cfg.dtype, requires_grad=cfg.full)
        if pipeline is None:  # (refused over stages: check_pipeline)
            enable_sequence_parallel(self.model, cfg.sequence_parallel)
        overlap = cfg.tp_comm_overlap == "on" or (cfg.tp_comm_overlap == "auto" and ctx.device.type == "cuda")
        enable_tp_comm_overlap(self.model, cfg.full and overlap)
        self.shares_base = base is not None
        self.params = self._trainable()
        self.model.train()
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        self.steps = total_steps(cfg, dataset.n_examples, ctx.dp_size)
        optim = cfg.optim
        self.optimizer = AdamW(self.params, lr=optim.lr, weight_decay=optim.weight_decay)
        self.scheduler = warmup_cosine(self.optimizer, optim.warmup_steps, self.steps, optim.min_lr_ratio)
        self.stream = BatchStream(dataset.n_examples, cfg.seed, cfg.batch_size * cfg.grad_accum * ctx.dp_size)
        self.step = 0
        self.step_tokens = 0  # tokens of the last step's rows
        self.step_metrics: dict[str, float] = {}  # beyond the loss: DPO's rewards of the last step
        self.eval_metrics: dict[str, float] = {}  # beyond the eval loss: DPO's of the last evaluation
        self.last_saved: Path | None = None
        self.metrics = MetricsLog(self.out)
        self.objective: Objective = (cfg.objective_of() if pipeline is None
                                     else PipelineSupervised(pipeline, cfg.grad_accum))
        self.objective.prepare(self)
        torch.manual_seed(cfg.seed + 7919 * (1 + ctx.dp_rank))  # dropout: the same over TP, not over DP

    def _trainable(self) -> list[torch.nn.Parameter]:
        if self.cfg.full:
            return [p for p in self.model.parameters() if p.requires_grad]
        from tprt.cpu.fast_linear import prepack
        from tprt.lora.attach import apply_lora

        lora = self.cfg.lora
        params = apply_lora(self.model, list(lora.targets), lora.rank, lora.alpha, lora.dropout, seed=self.cfg.seed)
        if lora.init is not None:
            load_initial_adapter(self.model, Path(lora.init), lora.targets, lora.rank, lora.alpha, self.ctx)
        if not self.shares_base:
            # On CPU the frozen base runs forward and input-gradient from oneDNN-packed copies: faster
            # steps for one more copy of the base weights (docs/PERF.md). A shared twin already has
            # the served model's methods.
            prepack(self.model, tune=False)
        return params

    def named_trainable(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    # ------------------------------------------------------------------ resume and save

    def resume(self) -> None:
        """Restores the newest complete checkpoint under --out, if any (every rank)."""
        if self.ctx.is_main:
            ckpt.remove_partial(self.out)
        path = ckpt.latest_checkpoint(self.out)
        if path is None:  # nothing to resume: start over (dropping what a crashed start logged)
            if self.ctx.is_main:
                self.metrics.truncate_after(0)
            return
        state = ckpt.read_train_state(path)
        ckpt.check_resume(path, state.run, self.run_cfg)
        if self.sharded is not None:
            rng = self._load_sharded(path)
        else:
            rng = self._load_replicated(path)

        self.scheduler.load_state_dict(state.scheduler)
        self.stream.load_state_dict(state.data)
        self.step = state.step
        self.last_saved = path
        if rng is not None:
            ckpt.set_rng_state(rng)
        if self.ctx.is_main:
            self.metrics.truncate_after(self.step)
            log.info("resumed from %s (step %d)", path, self.step)

    def _load_replicated(self, path: Path) -> dict[str, Any] | None:
        weights, optim, rng = ckpt.load_rank_state(path, self.ctx, self.stage_index)
        with torch.no_grad():
            for name, p in self.named_trainable().items():
                if name not in weights:
                    raise TprtError(f"{path}: no value for trainable parameter {name} (TP rank {self.ctx.rank})")
                p.copy_(weights[name])
        self.optimizer.load_state_dict(optim)
        return rng

    def _load_sharded(self, path: Path) -> dict[str, Any] | None:
        """Weights and optimizer state from the checkpoint's DCP shards, resharded to this run's DP
        degree by torch.distributed.checkpoint."""
        from tprt.train.fsdp import load_state_dicts, state_dicts

        assert self.sharded is not None
        state = state_dicts(self.sharded, self.optimizer)
        ckpt.load_sharded(path, self.ctx, state, self.sharded.dp_mesh.get_group())
        load_state_dicts(self.sharded, self.optimizer, state)
        return ckpt.load_rng(path, self.ctx)

    def save(self) -> None:
        state = ckpt.TrainState(self.step, self.stream.state_dict(), self.run_cfg, self.scheduler.state_dict())
        if self.sharded is not None:
            from tprt.train.fsdp import state_dicts

            sharded = ckpt.ShardedState(state_dicts(self.sharded, self.optimizer), self.sharded.dp_mesh.get_group())
            self.last_saved = ckpt.save_checkpoint(self.out, self.ctx, state, {}, {}, self.cfg.keep_checkpoints,
                                                   sharded)
            return
        self.last_saved = ckpt.save_checkpoint(self.out, self.ctx, state, self.named_trainable(),
                                               self.optimizer.state_dict(), self.cfg.keep_checkpoints,
                                               stage=self.stage_index)

    @property
    def stage_index(self) -> int | None:
        """This rank's pipeline stage (None without stages): its checkpoint files carry it."""
        return None if self.pipeline is None else self.pipeline.stage_index

    # ------------------------------------------------------------------ steps

    @property
    def batch_size(self) -> int:
        """Rows (DPO: pairs) per micro-batch per DP rank (tprt.train.objective.TrainRun)."""
        return self.cfg.batch_size

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.ctx.dp_group is not None and self.ctx.dp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.ctx.dp_group)
        return t

    def train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (mean loss over the global batch, gradient norm)."""
        from tprt.train.grads import clip_grad_norm, sync_gradients

        rows = self.stream.next_step()
        outcome = self.objective.forward_backward(self, rows)
        loss, self.step_tokens, self.step_metrics = outcome.loss, outcome.tokens, outcome.metrics
        if self.sharded is not None:  # FSDP reduce-scattered (averaged over DP) in the backward
            from tprt.train.fsdp import clip_sharded_grad_norm, sync_tp_gradients

            sync_tp_gradients(self.sharded)
            grad_norm = clip_sharded_grad_norm(self.sharded, self.cfg.optim.max_grad_norm)
        elif self.pipeline is not None:  # the norm spans the stages; tied embeddings' copies summed
            assert isinstance(self.model, TPLlamaStage)
            grad_norm = sync_and_clip(self.model, self.pipeline, self.cfg.optim.max_grad_norm)
        else:
            sync_gradients(self.model, self.ctx)
            grad_norm = clip_grad_norm(self.params, self.cfg.optim.max_grad_norm, self.ctx)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
            kept = f"the last good checkpoint is {self.last_saved}" if self.last_saved else "no checkpoint was saved"
            raise TrainingDiverged(
                f"step {self.step + 1}: {what}; training stopped before the update ({kept}; "
                "resume with --resume and a lower --lr)"
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss, grad_norm

    @torch.no_grad()
    def evaluate_if_due(self) -> float | None:
        """The eval loss after an evaluation step (every `eval_every` steps and the last), else None."""
        return self.evaluate() if self._due(self.cfg.eval_every) else None

    def evaluate(self) -> float | None:
        """The objective's held-out loss (None without held-out data); its metrics beyond the
        loss go to `eval_metrics`."""
        outcome = self.objective.evaluate(self)
        if outcome is None:
            return None
        self.eval_metrics = outcome.metrics
        return outcome.loss

    # ------------------------------------------------------------------ the loop

    def _progress(self) -> Any:
        from tqdm import tqdm

        return tqdm(total=self.steps, initial=self.step, desc="finetune", unit="step", file=sys.stderr,
                    disable=not (self.ctx.is_main and self.cfg.progress), dynamic_ncols=True)

    def _log_step(self, loss: float, grad_norm: float, lr: float, seconds: float, eval_loss: float | None) -> float:
        tok_s = self.step_tokens / max(seconds, 1e-9)
        if self.ctx.is_main:
            self.metrics.write({"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                "tokens_per_s": round(tok_s, 1), "eval_loss": eval_loss,
                                **self.logged_metrics(eval_loss)})
        return tok_s

    def logged_metrics(self, eval_loss: float | None) -> dict[str, float]:
        """The last step's metrics beyond loss and eval_loss (DPO's), for metrics.jsonl."""
        return {**self.step_metrics, **(self.eval_metrics if eval_loss is not None else {})}

    def _due(self, every: int) -> bool:
        return self.step == self.steps or (every > 0 and self.step % every == 0)

    def run(self) -> dict[str, Any]:
        """Trains to the last step, then writes the outputs; returns a summary (rank 0's is printed)."""
        def make_out() -> None:
            if self.ctx.is_main:
                self.out.mkdir(parents=True, exist_ok=True)

        run_together(make_out, f"creating {self.out}")
        if self.cfg.resume:
            self.resume()
        loss, eval_loss = float("nan"), None
        with self._progress() as bar:
            while self.step < self.steps:
                t0 = time.perf_counter()
                lr = self.optimizer.param_groups[0]["lr"]
                loss, grad_norm = self.train_step()
                seconds = time.perf_counter() - t0
                step_eval = self.evaluate_if_due()
                eval_loss = step_eval if step_eval is not None else eval_loss
                tok_s = self._log_step(loss, grad_norm, lr, seconds, step_eval)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:.0f}", refresh=False)
                bar.update(1)
                if self.cfg.save_every > 0 and self._due(self.cfg.save_every):
                    self.save()
        return self.finish(loss, eval_loss)

    def finish(self, loss: float, eval_loss: float | None) -> dict[str, Any]:
        """Writes the fine-tuned model (TP checkpoint) or the adapter, and the loss curve."""
        from tprt.train.export import write_adapter, write_tp_checkpoint

        if self.cfg.full:
            from tprt.train.fsdp import full_state

            tensors = full_state(self.sharded) if self.sharded is not None else None  # all-gathered over DP
            output = write_tp_checkpoint(self.model, self.ctx, Path(self.cfg.model), self.out / "model",
                                         {"finetune": {"steps": self.step, "lr": self.cfg.optim.lr}}, tensors,
                                         self.pipeline)
        else:
            output = write_adapter(self.model, self.ctx, self.out / "adapter", self.adapter_config(), self.pipeline)
        summary = {"steps": self.step, "loss": loss, "eval_loss": eval_loss, "output": str(output),
                   "metrics": str(self.out / METRICS_FILE), "plot": None, **self.step_metrics, **self.eval_metrics}
        if self.ctx.is_main:
            summary["plot"] = str(plot_loss(self.out / METRICS_FILE, self.out / PLOT_FILE))
        return summary

    def adapter_config(self) -> dict[str, Any]:
        from tprt.lora.peft_io import adapter_config

        lora = self.cfg.lora
        return dict(adapter_config(lora.targets, lora.rank, lora.alpha, lora.dropout, str(self.cfg.model)))
