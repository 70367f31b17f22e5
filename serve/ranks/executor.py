"""What every serving rank does besides generation steps: fine-tuning steps and LoRA adapters.

`RankExecutor.execute(command)` runs each of serve's rank commands (serve/ranks/commands.py)
on every rank in the same order (rank 0 from the engine loop's thread through `RankGroup.run`, the
followers from `follower_loop`). If it fails on any rank, every rank learns of it
(tprt.distributed.ranks), drops what the command started (`abandon`), and rank 0's caller gets
`CommandFailed` (the job fails; the server keeps serving). A rank that fails *inside* a
collective leaves its peers waiting until the collective timeout; the engine loop then marks the
world broken (NOT_SERVING).

Fine-tuning never touches the served model's modules, so generation and training interleave
step by step with no state to swap. A LoRA job trains in the served model's dtype on a
`shared_twin` of it: its own modules (adapters, train mode, activation checkpointing) over the
served model's frozen weight tensors and packed matmuls, so a job costs its adapter, optimizer
state and activations, not a second copy of the rank's shard. A full fine-tune changes the
weights, so it loads its own float32 copy of the checkpoint (the price: one more copy of the
shard plus optimizer state while it runs).

Adapters: an adapter (a finished LoRA job's, or one loaded by name) is read for the *served*
model on every rank (`tprt.lora.peft_io.read_adapter`) and installed under the integer index rank
0 gave this load in the engine's adapter pool (`tprt.lora.routing.AdapterSlots`); each row of a
batch is routed to its request's adapter (or none) by the step plan, so requests for different
adapters and for the base model share batches. `MoveAdapter` moves a loaded adapter between the
device and host tiers or drops it, as rank 0's pool (serve/adapters/pool.py) decides.
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from tprt.distributed.protocol import Command
from serve.ranks.commands import (AdapterLoaded, LoadAdapter, MoveAdapter, PromptLogprobs, PromptTokenLogprobs,
                                  TrainAbort, TrainFinish, TrainSave, TrainStart, TrainStarted, TrainStep,
                                  TrainStepResult)
from tprt.errors import TprtError
from tprt.model.llama import TPLlamaForCausalLM

# Served dtypes a LoRA job trains in directly, sharing the weights (fp16 would need loss scaling).
SHAREABLE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}

R = TypeVar("R")
PROMPT_HEAD_CHUNK = 128  # prompt positions per gathered LM-head call: [chunk, vocab] float32 on rank 0


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

    def execute(self, cmd: Command[R]) -> R:
        """Runs `cmd` on this rank (every rank runs it; see tprt.distributed.ranks.run_command)."""
        return cast(R, self._dispatch(cmd))

    def _dispatch(self, cmd: Command[Any]) -> object:
        match cmd:
            case TrainStart(config, dataset, resume):
                return self._cmd_train_start(config, dataset, resume)
            case TrainStep():
                return self._cmd_train_step()
            case TrainSave():
                return self._cmd_train_save()
            case TrainFinish(loss):
                return self._cmd_train_finish(loss)
            case TrainAbort():
                self._cmd_train_abort()
                return None
            case LoadAdapter(adapter_id, path, index):
                return self._cmd_load_adapter(adapter_id, path, index)
            case MoveAdapter(index, tier):
                self._cmd_move_adapter(index, tier)
                return None
            case PromptLogprobs(ids, top):
                return self._cmd_prompt_logprobs(ids, top)
        raise TprtError(f"unknown command {type(cmd).__name__}")

    def abandon(self) -> None:
        """A command failed on some rank: a job it started or ran is dropped here too."""
        self._drop_trainer()

    # ----------------------------------------------------------------- fine-tuning

    def _cmd_train_start(self, config: Any, dataset: Any, resume: bool) -> TrainStarted:
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
        return TrainStarted(int(self.trainer.step), int(self.trainer.steps))

    def _cmd_train_step(self) -> TrainStepResult:
        """One optimizer step; its loss, grad norm, seconds and tokens."""
        t = self._need_trainer()
        lr = float(t.optimizer.param_groups[0]["lr"])
        t0 = time.perf_counter()
        with torch.enable_grad():
            loss, grad_norm = t.train_step()
        seconds = time.perf_counter() - t0
        eval_loss = t.evaluate_if_due()  # with held-out data: after the last step
        tokens = t.step_tokens
        if self.ctx.rank == 0:
            t.metrics.write({"step": t.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                             "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "eval_loss": eval_loss,
                             **t.logged_metrics(eval_loss),
                             "time_unix_ms": int(time.time() * 1000)})  # when: the OpenAI API's job events
        return TrainStepResult(int(t.step), float(loss), float(grad_norm), seconds, int(tokens), eval_loss,
                               t.logged_metrics(eval_loss) or None)

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

    def _cmd_load_adapter(self, adapter_id: str, path: str, index: int) -> AdapterLoaded:
        """Loads a PEFT LoRA adapter into the engine's adapter pool under `index` (0: a new index
        for a new id, the same for a reload); returns its rank, alpha, index and targets, the
        index being what a plan routes rows to (the same on every rank: commands run in the same
        order everywhere)."""
        from tprt.lora.peft_io import read_adapter

        adapter = read_adapter(self.model, path, self.ctx)
        if not index:
            index = self.adapters.get(adapter_id) or max(self.adapters.values(), default=0) + 1
        self.engine.runner.adapters.install(index, adapter)  # replaces a previous version
        self.adapters[adapter_id] = index
        self._forget_prefixes(index)  # a reload under an index: its old keys/values are stale
        return AdapterLoaded(adapter.rank, adapter.alpha, index, adapter.targets)

    # ----------------------------------------------------------------- scoring

    @torch.inference_mode()
    def _cmd_prompt_logprobs(self, ids: tuple[int, ...], top: int) -> PromptTokenLogprobs | None:
        """One causal pass over the prompt (no KV cache: the engine's blocks stay its own), the LM
        head over PROMPT_HEAD_CHUNK positions at a time; rank 0 gathers each chunk's logits and
        returns the result (the others None)."""
        from tprt.engine.stage_runner import StageRunner

        runner = self.engine.runner
        if isinstance(runner, StageRunner):  # over pipeline stages: the last one scores, rank 0 returns it
            hidden = runner.forward_whole(list(ids))
            return runner.to_driver(None if hidden is None else self._score(hidden, ids, top))
        return self._score(self.model.forward_hidden(torch.tensor([ids]))[0], ids, top)

    def _score(self, hidden: torch.Tensor, ids: tuple[int, ...], top: int) -> PromptTokenLogprobs | None:
        """The prompt's hidden states [n, hidden] -> its logprobs on TP rank 0 (None elsewhere)."""
        model = self.model
        chosen: list[float] = []
        ranks: list[int] = []
        tops: list[tuple[tuple[int, float], ...]] = []
        for a in range(0, len(ids) - 1, PROMPT_HEAD_CHUNK):
            b = min(a + PROMPT_HEAD_CHUNK, len(ids) - 1)
            full = model.gather_logits_to_first(model.logits(hidden[a:b]))  # rank 0: [b - a, vocab]
            if full is None:
                continue
            logprobs = torch.log_softmax(full.float(), dim=-1)
            following = torch.tensor(ids[a + 1 : b + 1], device=logprobs.device)
            picked = logprobs.gather(1, following[:, None])  # [b - a, 1]
            chosen += picked[:, 0].tolist()
            ranks += ((logprobs > picked).sum(-1) + 1).tolist()  # 1: the likeliest token
            if top:
                values, indices = logprobs.topk(top, dim=-1)
                tops += [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        return PromptTokenLogprobs(tuple(chosen), tuple(tops), tuple(ranks)) if model.tp.rank == 0 else None

    def _cmd_move_adapter(self, index: int, tier: str) -> None:
        pool = self.engine.runner.adapters
        if tier == "device":
            pool.restore(index)
        elif tier == "host":
            pool.offload(index)
        elif tier == "drop":
            pool.drop(index)
            self._forget_prefixes(index)
            self.adapters = {a: i for a, i in self.adapters.items() if i != index}
        else:
            raise TprtError(f"unknown adapter tier {tier!r}")

    def _forget_prefixes(self, index: int) -> None:
        if self.engine.is_driver:  # rank 0 schedules and holds the prefix records
            self.engine.forget_prefixes(index)
