"""Direct preference optimisation (DPO): the loss, sequence log-probabilities and one step.

For a prompt x with a preferred completion y_w and a non-preferred y_l, let
`logits = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))`, the sequence
log-probabilities summed over the completion's tokens. Per pair (Rafailov et al. 2023; Azar et al.
2023 for IPO; cDPO for label smoothing eps):

    sigmoid   -(1 - eps) log sigmoid(beta logits) - eps log sigmoid(-beta logits)
    ipo       (logits - 1 / (2 beta))^2

With `rpo_alpha` a > 0 (RPO, Pang et al. 2024; TRL's `rpo_alpha`), each pair's loss also holds
a times the preferred completion's negative log-likelihood per token under the policy. Pure DPO
only widens the margin and may lower both completions while doing so: when the two share most of
their tokens it learns "the non-preferred words are bad" wherever they come, and greedy answers
collapse (bench/dpo_bench.py measured "Sure!Sure!Sure!"). The NLL term keeps the preferred answer
likely as a whole.

The implicit rewards are beta (log pi - log ref) of each completion; a pair is "won" when the
preferred one's reward is the larger. The loss of a batch is the mean over its pairs.

A pair is two rows of the preference rows (`tprt.train.preference`): row 2i the preferred and row
2i + 1 the non-preferred completion of pair i, so both are always in one micro-batch. The
log-probabilities come from the vocab-parallel cross-entropy: the full-vocabulary logits are never
gathered, and the result is identical on every TP rank.

The reference: a LoRA run without a starting adapter scores each micro-batch a second time with
its adapter switched off (`tprt.lora.attach.adapter_off`): the same weights, no second copy. A full
run, or a LoRA run that starts from an earlier adapter (the reference is then that adapter, not
the bare base), scores every pair once before the first step and keeps the numbers beside the rows
(`reference_logps`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tprt.distributed.context import TPContext
from tprt.errors import ConfigError
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_logprobs
from tprt.train.data import PackedRows, rank_share
from tprt.train.objective import EvalOutcome, StepOutcome, TrainRun


LOSS_KINDS = ("sigmoid", "ipo")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, kind: str = "sigmoid",
             label_smoothing: float = 0.0, rpo_alpha: float = 0.0,
             chosen_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward), each [pairs], from summed sequence
    log-probabilities [pairs] (float32). Differentiable in the policy's; the rewards are detached.
    rpo_alpha > 0 adds that times the preferred completion's mean per-token NLL, which needs
    `chosen_tokens` [pairs], its target-token counts."""
    logits = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # [pairs]
    if kind == "sigmoid":
        loss = (-(1.0 - label_smoothing) * F.logsigmoid(beta * logits)
                - label_smoothing * F.logsigmoid(-beta * logits))
    elif kind == "ipo":
        loss = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {kind!r}; expected one of {', '.join(LOSS_KINDS)}")
    if rpo_alpha:
        if chosen_tokens is None:
            raise ValueError("rpo_alpha needs chosen_tokens, the preferred completions' token counts")
        loss = loss + rpo_alpha * (-policy_chosen / chosen_tokens.clamp(min=1).to(policy_chosen.dtype))
    chosen = beta * (policy_chosen - ref_chosen).detach()
    rejected = beta * (policy_rejected - ref_rejected).detach()
    return loss, chosen, rejected


def sequence_logps(model: TPLlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of log p(token) over its target tokens (labels != -100): [rows] float32,
    identical on every TP rank. Labels aligned with input_ids as `compute_loss` takes them. The LM
    head runs only on positions whose next token is a target; collective over the TP group."""
    h = model.forward_hidden(input_ids)  # [rows, seq, hidden]
    target = labels[:, 1:]  # [rows, seq - 1]
    keep = target != IGNORE_INDEX
    hidden = h[:, :-1][keep]  # [n_targets, hidden]
    row_of = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(target)[keep]  # [n_targets]
    local_logits = model.lm_head(model.norm(hidden))  # [n_targets, local_vocab]
    logp = vocab_parallel_logprobs(local_logits, target[keep], model.tp, vocab_size=model.config.vocab_size)
    out = torch.zeros(labels.shape[0], dtype=torch.float32, device=logp.device)
    out = out.index_add(0, row_of, logp)  # [rows]
    return out + h.sum() * 0.0 if hidden.shape[0] == 0 else out  # no target: a zero that reaches every parameter


@dataclass
class DPOStats:
    """Sums over pairs (divided by `pairs` for means): what a step or an evaluation reports."""

    loss: float = 0.0
    chosen: float = 0.0
    rejected: float = 0.0
    won: float = 0.0
    pairs: int = 0

    def add(self, loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        self.loss += float(loss.detach().sum())
        self.chosen += float(chosen.sum())
        self.rejected += float(rejected.sum())
        self.won += float((chosen > rejected).float().sum())
        self.pairs += int(chosen.numel())

    def reduced(self, group: dist.ProcessGroup | None) -> DPOStats:
        """The sums over the DP group (every rank gets them)."""
        t = torch.tensor([self.loss, self.chosen, self.rejected, self.won, float(self.pairs)], dtype=torch.float64)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return DPOStats(float(t[0]), float(t[1]), float(t[2]), float(t[3]), int(t[4]))

    def means(self, prefix: str = "") -> dict[str, float]:
        """loss, rewards of chosen and rejected, reward accuracy and margin: means over the pairs."""
        n = max(1, self.pairs)
        out = {"loss": self.loss / n, "rewards_chosen": self.chosen / n, "rewards_rejected": self.rejected / n,
               "reward_accuracy": self.won / n, "reward_margin": (self.chosen - self.rejected) / n}
        return {prefix + k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}


def pair_rows(pairs: Sequence[int]) -> list[int]:
    """The rows of pairs: 2i (preferred) and 2i + 1 (non-preferred), pair by pair."""
    return [r for p in pairs for r in (2 * p, 2 * p + 1)]


def load_initial_adapter(model: TPLlamaForCausalLM, path: Path, targets: Sequence[str], rank: int, alpha: float,
                         ctx: TPContext) -> None:
    """Fills the model's freshly attached LoRA modules with the adapter at `path` (an earlier
    run's): its targets, rank and alpha must be this run's (`targets`, `rank`, `alpha`)."""
    from tprt.lora.attach import attached
    from tprt.lora.peft_io import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_lora_state_dict, read_adapter_config,
                                   read_adapter_weights, read_config_file)

    shown = str(path / ADAPTER_CONFIG)
    its_targets, its_rank, its_alpha, _ = read_adapter_config(read_config_file(path, shown, ConfigError), shown)
    if (set(its_targets), its_rank, its_alpha) != (set(targets), rank, alpha):
        raise ConfigError(f"--init-adapter {path}: targets {','.join(its_targets)}, rank {its_rank}, alpha "
                          f"{its_alpha:g}; this run has {','.join(targets)}, {rank}, {alpha:g}")
    with torch.no_grad():
        load_lora_state_dict(attached(model), read_adapter_weights(path, str(path / ADAPTER_WEIGHTS)), ctx)


@dataclass(frozen=True)
class DPOConfig:
    """The DPO objective's settings (tprt finetune --objective dpo's flags)."""

    beta: float = 0.1  # strength of the pull towards the reference
    loss: str = "sigmoid"  # or "ipo"
    label_smoothing: float = 0.0  # sigmoid: the share of pairs assumed mislabelled
    rpo_alpha: float = 0.0  # weight of the preferred completion's per-token NLL (RPO)

    def __post_init__(self) -> None:
        if self.loss not in LOSS_KINDS:
            raise ConfigError(f"--dpo-loss must be one of {', '.join(LOSS_KINDS)}, got {self.loss!r}")


class Preference:
    """DPO as the trainer's objective (tprt.train.objective): the reference log-probabilities,
    one step's gradients and the held-out evaluation; it keeps only its settings."""

    def __init__(self, config: DPOConfig, adapter_is_reference: bool) -> None:
        """`adapter_is_reference`: the reference is the base with the adapter switched off (a LoRA
        run from scratch), else the starting weights, scored once before the first step."""
        self.config = config
        self.adapter_is_reference = adapter_is_reference

    def prepare(self, run: TrainRun) -> None:
        """Checks the data; scores the reference once unless it is the adapter switched off."""
        if not run.data.pairs:
            raise ConfigError("--objective dpo needs preference pairs (tprt.train.preference.prepare_preferences)")
        if self.adapter_is_reference:
            return
        for split in ("train", "eval"):
            rows = getattr(run.data, split)
            if rows is not None and split not in run.data.reference:
                run.data.reference[split] = self._score_all(run, rows)

    @staticmethod
    def _logps(run: TrainRun, rows: PackedRows, idx: Sequence[int]) -> torch.Tensor:
        """The rows' summed completion log-probabilities [len(idx)], padding trimmed to the
        longest of them."""
        sel = torch.tensor(list(idx), dtype=torch.long)
        n = int(rows.lengths[sel].max()) if rows.lengths is not None else rows.seq_len
        ids = rows.input_ids[sel, :n].to(run.ctx.device)  # [len(idx), n]
        labels = rows.labels[sel, :n].to(run.ctx.device)
        if run.sharded is not None:
            return run.sharded.root(ids, labels, per_sequence=True)  # type: ignore[no-any-return]
        return sequence_logps(run.model, ids, labels)

    def _reference(self, run: TrainRun, split: str, rows: PackedRows, idx: Sequence[int]) -> torch.Tensor:
        stored = run.data.reference.get(split)
        if stored is not None:
            return stored[torch.tensor(list(idx), dtype=torch.long)].to(run.ctx.device)  # type: ignore[no-any-return]
        from tprt.lora.attach import adapter_off

        with torch.no_grad(), adapter_off(run.model):
            return self._logps(run, rows, idx)

    @torch.no_grad()
    def _score_all(self, run: TrainRun, rows: PackedRows) -> torch.Tensor:
        """Every row's log-probability under the current weights: each DP rank scores its share of
        the pairs, an all-reduce over DP gives every rank all of them. [rows] float32 on the CPU."""
        ctx = run.ctx
        n_pairs = len(rows) // 2
        out = torch.zeros(len(rows), dtype=torch.float32, device=ctx.device)
        mine = list(range(ctx.dp_rank, n_pairs, ctx.dp_size))
        # sharded, every DP rank runs the same number of forwards (each all-gathers over DP)
        most = -(-n_pairs // ctx.dp_size) if run.sharded is not None else len(mine)
        run.model.eval()
        try:
            for i in range(0, most, run.batch_size):
                micro = mine[i : i + run.batch_size]
                idx = pair_rows(micro or [0])
                logps = self._logps(run, rows, idx)
                if micro:
                    out[torch.tensor(idx, device=out.device)] = logps
        finally:
            run.model.train()
        run.dp_sum(out)
        return out.cpu()

    def _pairs_loss(self, run: TrainRun, split: str, rows: PackedRows,
                    pairs: Sequence[int]) -> tuple[torch.Tensor, ...]:
        c = self.config
        idx = pair_rows(pairs)
        policy = self._logps(run, rows, idx)  # [2 * pairs]: preferred, non-preferred, ...
        ref = self._reference(run, split, rows, idx)
        chosen_tokens = None
        if c.rpo_alpha:
            chosen_tokens = (rows.labels[torch.tensor(idx[0::2]), 1:] != IGNORE_INDEX).sum(1).to(policy.device)
        return dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], c.beta, c.loss, c.label_smoothing,
                        c.rpo_alpha, chosen_tokens)

    def forward_backward(self, run: TrainRun, pairs: list[int]) -> StepOutcome:
        """The gradients of the mean DPO loss over the global batch of `pairs` (this DP rank's
        share, micro-batch by micro-batch); the step's rewards as its metrics."""
        rows, ctx = run.data.train, run.ctx
        scale = ctx.dp_size / len(pairs)  # after the DP average: the mean over the global batch
        stats = DPOStats()
        for micro in rank_share(pairs, ctx.dp_rank, ctx.dp_size, run.batch_size):
            loss, chosen, rejected = self._pairs_loss(run, "train", rows, micro)
            (loss.sum() * scale).backward()
            stats.add(loss, chosen, rejected)
        means = stats.reduced(ctx.dp_group).means()
        return StepOutcome(means["loss"], rows.n_tokens(pair_rows(pairs)),
                           {k: v for k, v in means.items() if k != "loss"})

    @torch.no_grad()
    def evaluate(self, run: TrainRun) -> EvalOutcome | None:
        """The mean DPO loss over the held-out pairs, with their reward accuracy, margin and
        rewards (eval_reward_accuracy, ...)."""
        rows, ctx = run.data.eval, run.ctx
        if rows is None:
            return None
        n_pairs = len(rows) // 2
        mine = list(range(ctx.dp_rank, n_pairs, ctx.dp_size))
        most = -(-n_pairs // ctx.dp_size) if run.sharded is not None else len(mine)
        stats = DPOStats()
        run.model.eval()
        try:
            for i in range(0, most, run.batch_size):
                micro = mine[i : i + run.batch_size]
                loss, chosen, rejected = self._pairs_loss(run, "eval", rows, micro or [0])
                if micro:
                    stats.add(loss, chosen, rejected)
        finally:
            run.model.train()
        means = stats.reduced(ctx.dp_group).means("eval_")
        return EvalOutcome(means["eval_loss"], {k: v for k, v in means.items() if k != "eval_loss"})
