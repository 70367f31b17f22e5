"""serve's rank commands: what rank 0 asks every serving rank to do besides generation steps.

Fine-tuning (TrainStart ... TrainAbort, from serve/jobs/manager.py), LoRA adapters
(LoadAdapter, MoveAdapter, from serve/adapters/pool.py) and a prompt's own log-probabilities
(PromptLogprobs, for OpenAI's `echo`, from serve/openai/app.py), each executed on every rank by
serve/ranks/executor.py; they travel as tprt.distributed.protocol's COMMAND messages. Each is a
`Command[R]`: R is what it returns (rank 0's result is the caller's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tprt.distributed.protocol import Command

if TYPE_CHECKING:  # only for annotations: a follower unpickles them when a job starts
    from tprt.train.data import Dataset
    from tprt.train.trainer import FinetuneConfig


@dataclass(frozen=True)
class TrainStarted:
    step: int  # the step the job starts from (> 0 when it resumed)
    total: int  # its optimizer steps in all


@dataclass(frozen=True)
class TrainStepResult:
    step: int
    loss: float
    grad_norm: float
    seconds: float
    tokens: int  # tokens in the global batch
    eval_loss: float | None = None  # measured after this step (the last, with held-out data), else None
    metrics: dict[str, float] | None = None  # DPO: rewards, reward accuracy and margin (tprt.train.dpo)


@dataclass(frozen=True)
class AdapterLoaded:
    rank: int
    alpha: float
    index: int  # where the ranks hold the adapter: what a step plan routes rows to
    targets: tuple[str, ...] = ()  # the projections it adapts (q, k, v, o, gate, up, down)


@dataclass(frozen=True)
class TrainStart(Command[TrainStarted]):
    """Builds each rank's trainer for a fine-tuning job, resuming from its checkpoint if asked."""

    config: FinetuneConfig
    dataset: Dataset
    resume: bool


@dataclass(frozen=True)
class TrainStep(Command[TrainStepResult]):
    """One optimizer step of the running job."""


@dataclass(frozen=True)
class TrainSave(Command[str]):
    """A training checkpoint of the running job; returns its path."""


@dataclass(frozen=True)
class TrainFinish(Command[str]):
    """Writes the job's output (a LoRA adapter or a TP checkpoint), frees the trainer; returns the output's path."""

    loss: float  # the last step's, for the summary


@dataclass(frozen=True)
class TrainAbort(Command[None]):
    """Frees the running job's trainer (cancelled, or checkpointed for a shutdown)."""


@dataclass(frozen=True)
class LoadAdapter(Command[AdapterLoaded]):
    """Loads a PEFT LoRA adapter into the served model under `index` (rank 0 gives every load a
    new one, so keys and values cached for an earlier load are never matched), on the device.
    index 0: the executor picks one (a new index per id)."""

    adapter_id: str
    path: str
    index: int = 0


@dataclass(frozen=True)
class MoveAdapter(Command[None]):
    """Moves a loaded adapter between tiers: "device" (routable), "host" (host memory) or "drop" (forgotten)."""

    index: int
    tier: str


@dataclass(frozen=True)
class PromptTokenLogprobs:
    """Each prompt token's log-probability given the tokens before it (the first token has none),
    its rank in the vocabulary (1: the likeliest), and where asked its `top` most likely
    alternatives, as (id, logprob) pairs."""

    logprobs: tuple[float, ...]  # for tokens 1 .. n-1
    top: tuple[tuple[tuple[int, float], ...], ...]  # per token 1 .. n-1; empty when not asked
    ranks: tuple[int, ...] = ()  # per token 1 .. n-1


@dataclass(frozen=True)
class PromptLogprobs(Command[PromptTokenLogprobs]):
    """The base model's log-probabilities of a prompt's tokens (one uncached forward pass)."""

    ids: tuple[int, ...]
    top: int = 0


RankCommand = (TrainStart | TrainStep | TrainSave | TrainFinish | TrainAbort | LoadAdapter | MoveAdapter
               | PromptLogprobs)
