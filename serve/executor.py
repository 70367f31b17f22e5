"""What every serving rank does besides generation steps: fine-tuning steps and LoRA adapters.

`RankExecutor.execute(Command)` runs on every rank in the same order (rank 0 from the scheduler
thread, the followers from `follower_loop`). After each command the ranks exchange a one-line
error or None (`all_gather_object`): if any rank failed, every rank knows it, drops what the
command started, and rank 0 raises `CommandFailed` (the job fails; the server keeps serving).
A rank that fails *inside* a collective leaves its peers waiting until the collective timeout;
the scheduler then marks the world broken (NOT_SERVING).

Fine-tuning never touches the served model's modules, so generation and training interleave
step by step with no state to swap. A LoRA job trains in the served model's dtype on a
`shared_twin` of it: its own modules (adapters, train mode, activation checkpointing) over the
served model's frozen weight tensors and packed matmuls, so a job costs its adapter, optimizer
state and activations, not a second copy of the rank's shard. A full fine-tune changes the
weights, so it loads its own float32 copy of the checkpoint (the price: one more copy of the
shard plus optimizer state while it runs).

Adapters: a finished LoRA job's adapter is read for the *served* model on every rank
(`tprt.lora.peft_io.read_adapter`) and installed under a small integer index in the engine's
adapter pool (`tprt.lora.routing.AdapterPool`); every loaded adapter stays installed, and each
row of a batch is routed to its request's adapter (or none) by the step plan, so requests for
different adapters and for the base model share batches.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from serve.ranks import Command
from tprt.errors import TprtError
from tprt.distributed.launcher import one_line
from tprt.model.llama import TPLlamaForCausalLM

log = logging.getLogger("tprt.serve")

# Served dtypes a LoRA job trains in directly, sharing the weights (fp16 would need loss scaling).
SHAREABLE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class CommandFailed(TprtError):
    """A command failed on at least one rank; the message names the rank and its error."""


class RankExecutor:
    """One rank's side of every non-generation command (see the module docstring)."""

    def __init__(self, model: TPLlamaForCausalLM, engine: Any, model_dir: Path, data_dir: Path) -> None:
        self.model = model
        self.engine = engine
        self.ctx = model.tp
        self.model_dir = Path(model_dir)
        self.data_dir = Path(data_dir)
        self.trainer: Any = None
        self.adapters: dict[str, int] = {}  # adapter id -> its index in the engine's adapter pool

    def execute(self, cmd: Command) -> Any:
        """Runs `cmd` here; collective. Raises CommandFailed on rank 0 if any rank failed."""
        fn = getattr(self, f"_cmd_{cmd.kind}", None)
        error: str | None = None
        result: Any = None
        try:
            if fn is None:
                raise TprtError(f"unknown command {cmd.kind!r}")
            result = fn(**cmd.args)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = one_line(e)
            log.debug("command %s failed on rank %d", cmd.kind, self.ctx.rank, exc_info=True)
        errors = self._gather(error)
        failed = [(r, msg) for r, msg in enumerate(errors) if msg is not None]
        if failed:
            self._drop_trainer()
            if self.ctx.rank == 0:
                r, msg = failed[0]
                raise CommandFailed(msg if r == 0 else f"rank {r}: {msg}")
            return None
        return result

    def _gather(self, error: str | None) -> list[str | None]:
        if self.ctx.world_size == 1:
            return [error]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, error, group=self.ctx.group)
        return out

    # ----------------------------------------------------------------- fine-tuning

    def _cmd_train_start(self, config: Any, dataset: Any, resume: bool) -> tuple[int, int]:
        """Builds this rank's trainer (LoRA: over the served weights); resumes if asked."""
        from tprt.train.trainer import Trainer

        self._drop_trainer()
        Path(config.out).mkdir(parents=True, exist_ok=True)
        base = None
        if not config.full and self.model.dtype in SHAREABLE_DTYPES:
            config = replace(config, dtype=SHAREABLE_DTYPES[self.model.dtype])
            base = self.model
        self.trainer = Trainer(config, self.ctx, dataset, base=base)
        if resume:
            self.trainer.resume()
        return int(self.trainer.step), int(self.trainer.steps)

    def _cmd_train_step(self) -> dict[str, float]:
        """One optimizer step; (loss, grad norm, seconds, tokens)."""
        t = self._need_trainer()
        lr = float(t.optimizer.param_groups[0]["lr"])
        t0 = time.perf_counter()
        with torch.enable_grad():
            loss, grad_norm = t.train_step()
        seconds = time.perf_counter() - t0
        cfg = t.cfg
        tokens = cfg.batch_size * cfg.grad_accum * self.ctx.dp_size * t.data.train.seq_len
        if self.ctx.rank == 0:
            t.metrics.write({"step": t.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                             "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "eval_loss": None})
        return {"step": t.step, "loss": loss, "grad_norm": grad_norm, "seconds": seconds, "tokens": tokens}

    def _cmd_train_save(self) -> str:
        t = self._need_trainer()
        t.save()
        return str(t.last_saved)

    def _cmd_train_finish(self, loss: float) -> str:
        """Writes the adapter (LoRA) or the TP checkpoint (full); frees the trainer."""
        t = self._need_trainer()
        summary = t.finish(loss, None)
        self._drop_trainer()
        return str(summary["output"])

    def _cmd_train_abort(self) -> None:
        self._drop_trainer()

    def _need_trainer(self) -> Any:
        if self.trainer is None:
            raise TprtError("no fine-tuning job is running on this rank")
        return self.trainer

    def _drop_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer = None
            gc.collect()

    # ----------------------------------------------------------------- adapters

    def _cmd_load_adapter(self, adapter_id: str, path: str) -> tuple[int, float, int]:
        """Loads a PEFT LoRA adapter into the engine's adapter pool; returns (rank, alpha, index),
        the index being what a plan routes rows to (the same on every rank: commands run in the
        same order everywhere)."""
        from tprt.lora.peft_io import read_adapter

        adapter = read_adapter(self.model, path, self.ctx)
        index = self.adapters.get(adapter_id) or len(self.adapters) + 1  # reloading keeps its index
        self.engine.runner.adapters.install(index, adapter)  # replaces a previous version
        self.adapters[adapter_id] = index
        if self.engine.is_driver:  # rank 0 schedules: a reloaded adapter's old keys/values are stale
            self.engine.forget_prefixes(index)
        return adapter.rank, adapter.alpha, index
