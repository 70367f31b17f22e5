"""What a fine-tuning step optimises, handed to the trainer (tprt.train.trainer.Trainer):
`Supervised`, the token-mean loss, or `tprt.train.dpo.Preference`, DPO on preference pairs.

The trainer owns the optimizer, the update, checkpoints and logs, and gives an objective what it
needs of the run (`TrainRun`: the model, the data, the TP/DP context) with each call; an
objective keeps no reference to the trainer. It returns one step's mean loss with the tokens it
trained on and any metrics beyond the loss (`StepOutcome`), and the held-out loss with its
metrics (`EvalOutcome`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tprt.distributed.context import TPContext
from tprt.model.llama import TPLlamaForCausalLM
from tprt.train.data import PackedRows, rank_share


class TrainRun(Protocol):
    """What an objective reads of the run (the Trainer is one)."""

    @property
    def model(self) -> TPLlamaForCausalLM: ...

    @property
    def sharded(self) -> Any: ...  # tprt.train.fsdp.ShardedModel, or None (replicated)

    @property
    def ctx(self) -> TPContext: ...

    @property
    def data(self) -> Any: ...  # tprt.train.data.Dataset

    @property
    def batch_size(self) -> int: ...  # rows (DPO: pairs) per micro-batch per DP rank

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepOutcome:
    loss: float  # the mean over the global batch
    tokens: int  # the step's rows' tokens, padding left out
    metrics: dict[str, float] = field(default_factory=dict)  # beyond the loss (DPO's rewards)


@dataclass(frozen=True)
class EvalOutcome:
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)  # beyond the eval loss (DPO's)


class Objective(Protocol):
    def prepare(self, run: TrainRun) -> None:
        """Once, before any step or resume (DPO scores its reference here)."""

    def forward_backward(self, run: TrainRun, rows: list[int]) -> StepOutcome:
        """The gradients of one step over the global batch `rows` (this DP rank's share)."""

    def evaluate(self, run: TrainRun) -> EvalOutcome | None:
        """The held-out loss (None without held-out data)."""


class Supervised:
    """The token-mean cross-entropy of the completions (labels -100 elsewhere)."""

    def prepare(self, run: TrainRun) -> None:
        pass

    @staticmethod
    def micro_loss(run: TrainRun, rows: PackedRows, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, target tokens) of rows `idx`."""
        from tprt.train.step import compute_loss

        sel = torch.tensor(idx, dtype=torch.long)
        ids = rows.input_ids[sel].to(run.ctx.device)
        labels = rows.labels[sel].to(run.ctx.device)
        if run.sharded is not None:
            return run.sharded.root(ids, labels)  # type: ignore[no-any-return]
        return compute_loss(run.model, ids, labels)

    def forward_backward(self, run: TrainRun, rows: list[int]) -> StepOutcome:
        train = run.data.train
        n_global = max(1, int((train.labels[torch.tensor(rows)][:, 1:] != -100).sum()))
        scale = run.ctx.dp_size / n_global
        loss_sum = torch.zeros((), dtype=torch.float32, device=run.ctx.device)
        for micro in rank_share(rows, run.ctx.dp_rank, run.ctx.dp_size, run.batch_size):
            ls, _ = self.micro_loss(run, train, micro)
            (ls * scale).backward()
            loss_sum += ls.detach()
        return StepOutcome(float(run.dp_sum(loss_sum)) / n_global, train.n_tokens(rows))

    def evaluate(self, run: TrainRun) -> EvalOutcome | None:
        """Mean loss per target token over the eval rows (each DP rank its share)."""
        rows = run.data.eval
        if rows is None:
            return None
        ctx = run.ctx
        run.model.eval()
        try:
            idx = list(range(ctx.dp_rank, len(rows), ctx.dp_size))
            sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)
            # Sharded, every DP rank runs the same number of forwards (each all-gathers over DP);
            # a rank short of rows scores row 0 and counts nothing.
            most = -(-len(rows) // ctx.dp_size) if run.sharded is not None else len(idx)
            for i in range(0, most, run.batch_size):
                micro = idx[i : i + run.batch_size]
                ls, n = self.micro_loss(run, rows, micro or [0])
                sums += torch.stack((ls.double(), n.double())) * (1.0 if micro else 0.0)
            run.dp_sum(sums)
        finally:
            run.model.train()
        return EvalOutcome(float(sums[0] / sums[1].clamp(min=1)))
