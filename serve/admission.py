"""Admission of fine-tuning jobs by memory: a conservative estimate against what the server can spare.

A stand-in for the memory planner (docs/DESIGN.md) until it lands: the same terms, each rounded
up. Per rank, for a job of `batch_size` rows of `max_seq_len` tokens on a TP-`tp` shard:

    trainable state   full: the shard's parameters x 16 bytes (fp32 copy, gradient, AdamW m and v);
                      LoRA: r x (in + out) per adapted projection (q, k, v, o) x 16 bytes, unsharded
    activations       fp32, nothing recomputed: per layer and token 8 x hidden + 4 x intermediate/tp
                      values, attention probabilities (rows x heads/tp x seq^2, twice), and the logits
                      (tokens x vocab/tp, three times: logits, softmax, gradient)

The job needs `ranks` times that (local ranks share the host's memory) and is refused with
RESOURCE_EXHAUSTED when that exceeds the budget: --job-memory-limit, or else the memory the
machine has available at the time of the request (MemAvailable; free device memory on CUDA),
which already leaves out what the server holds. The message names the field that made the job
too large and the limit.

Generation requests need no such check: the KV cache is allocated whole at start-up (every slot
at --max-seq-len tokens) and a step's prefill is bounded by --token-budget, so a request that
passes the context and queue checks fits by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from serve.errors import ServeError
from tprt.model.config import ModelConfig

MiB = 1 << 20
_STATE_BYTES = 16  # per trainable parameter: fp32 value, gradient, AdamW's two moments
_ACT_BYTES = 4  # fp32 activations
_LORA_TARGETS = 4  # q, k, v, o


class TooLarge(ServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class JobMemory:
    """A job's estimated bytes per rank, by term."""

    state: int
    activations: int

    @property
    def per_rank(self) -> int:
        return self.state + self.activations


def shard_parameters(c: ModelConfig, tp: int) -> int:
    """Parameters held by one rank (every sharded matrix split over `tp`, norms whole)."""
    attn = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    return -(-(c.num_hidden_layers * (attn + mlp) + embed) // tp) + norms


def job_memory(c: ModelConfig, tp: int, method: str, hp: dict[str, Any]) -> JobMemory:
    """The estimate of the module's docstring, for stored hyper-parameters."""
    batch, seq = int(hp["batch_size"]), int(hp["max_seq_len"])
    if method == "full":
        trainable = shard_parameters(c, tp)
    else:
        r = int(hp["lora_rank"])
        per_layer = r * ((c.hidden_size + c.q_size) * 2 + (c.hidden_size + c.kv_size) * 2)
        trainable = c.num_hidden_layers * per_layer
    heads = -(-c.num_attention_heads // tp)
    tokens = batch * seq
    per_layer_act = tokens * (8 * c.hidden_size + 4 * -(-c.intermediate_size // tp)) + 2 * batch * heads * seq * seq
    logits = 3 * tokens * -(-c.vocab_size // tp)
    return JobMemory(trainable * _STATE_BYTES, (c.num_hidden_layers * per_layer_act + logits) * _ACT_BYTES)


def available_bytes(device: Any) -> int:
    """What the machine can spare now: free device memory on CUDA, else the host's MemAvailable."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


class JobAdmission:
    """Refuses a job whose estimate does not fit the budget (TooLarge naming the field)."""

    def __init__(self, config: ModelConfig, tp: int, ranks: int, device: Any, limit: int | None) -> None:
        self.config, self.tp, self.ranks, self.device, self.limit = config, tp, ranks, device, limit

    def budget(self) -> tuple[int, str]:
        if self.limit is not None:
            return self.limit, "--job-memory-limit"
        return available_bytes(self.device), "the memory available now"

    def __call__(self, method: str, hp: dict[str, Any]) -> None:
        need = job_memory(self.config, self.tp, method, hp)
        total = need.per_rank * self.ranks
        budget, source = self.budget()
        if total <= budget:
            return
        if need.state > need.activations:
            field = "method" if method == "full" else "hyperparameters.lora_rank"
        else:
            field = "hyperparameters.batch_size" if int(hp["batch_size"]) > 1 else "hyperparameters.max_seq_len"
        raise TooLarge(f"the job needs about {total / MiB:.0f} MiB ({need.state * self.ranks / MiB:.0f} trainable "
                       f"state, {need.activations * self.ranks / MiB:.0f} activations over {self.ranks} ranks), "
                       f"more than the {budget / MiB:.0f} MiB of {source}; lower it", field)
