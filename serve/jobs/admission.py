"""Admission of fine-tuning jobs by memory: the memory planner's arithmetic against what the server can spare.

A job's bytes per rank are `tprt.plan`'s for that fine-tune (the same numbers `tprt plan ...
finetune` prints), less what the server already holds: a LoRA job trains over the served
weights (and their CPU-packed copies), so it adds its adapter's weights, gradients, optimizer
state and master weights, and the activations of one micro-batch; a full fine-tune loads its own
float32 copy of the shard, so its weights count too. The framework's reserve is already spent.

The job needs `ranks` times that (local ranks share the host's memory) and is refused with
RESOURCE_EXHAUSTED when that exceeds the budget: --job-memory-limit, or else the memory the
machine has available at the time of the request (MemAvailable; free device memory on CUDA),
which already leaves out what the server holds. The message names the field that made the job
too large and the limit.

A LoRA job's rank is also held to --max-lora-rank (INVALID_ARGUMENT naming
`hyperparameters.lora_rank`): the adapter pool would refuse to serve a higher-rank adapter.

Generation requests need no such check: the paged KV pool is allocated whole at start-up (its
blocks hold --kv-cache-tokens, by default --max-batch-size x --max-seq-len) and a step's prefill is
bounded by --token-budget, so a request that passes the context and queue checks fits by
construction (when the pool runs short, the engine preempts, it does not allocate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve.errors import InvalidArgument, ServeError, Status
from tprt.model.config import ModelConfig
from tprt.plan import FinetuneWorkload, device as plan_device, plan_memory
from tprt.plan.memory import DTYPE_BYTES

MiB = 1 << 20
# Dtypes a LoRA job trains in directly, on the served weights (serve/ranks/executor.py: SHAREABLE_DTYPES);
# otherwise, and for full fine-tuning, the job trains in float32.
_SHARED_DTYPES = ("fp32", "bf16")


class TooLarge(ServeError):
    status = Status.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class JobMemory:
    """A job's planned bytes per rank beyond what the server holds, by term."""

    state: int  # its own weights, gradients, optimizer state, master weights
    activations: int

    @property
    def per_rank(self) -> int:
        return self.state + self.activations


def job_memory(c: ModelConfig, tp: int, method: str, hp: dict[str, Any], served_dtype: str = "fp32",
               device_kind: str = "cpu") -> JobMemory:
    """The planner's bytes for a stored job's hyper-parameters (see the module docstring)."""
    full = method == "full"
    dtype = served_dtype if not full and served_dtype in _SHARED_DTYPES else "fp32"
    workload = FinetuneWorkload(full=full, lora_rank=int(hp.get("lora_rank", 8)), dtype=dtype,
                                batch_size=int(hp["batch_size"]), seq_len=int(hp["max_seq_len"]),
                                dpo="beta" in hp)  # a DPO job's (serve.jobs.preference.dpo_hyperparameters)
    plan = plan_memory(c, tp, workload, plan_device("cpu" if device_kind == "cpu" else "h100-80gb"))
    parts = plan.per_rank_bytes
    weights = parts["weights"] if full else parts["weights"] - plan.params_per_rank * DTYPE_BYTES[dtype]
    state = weights + parts["gradients"] + parts["optimizer_states"] + parts["master_weights"]
    return JobMemory(state, parts["activations"])


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

    def __init__(self, config: ModelConfig, tp: int, ranks: int, device: Any, limit: int | None,
                 served_dtype: str = "fp32", max_lora_rank: int | None = None) -> None:
        self.config, self.tp, self.ranks, self.device, self.limit = config, tp, ranks, device, limit
        self.served_dtype = served_dtype  # "fp32", "bf16" or "fp16"
        self.max_lora_rank = max_lora_rank  # --max-lora-rank: the pool would refuse a job's adapter above it

    def budget(self) -> tuple[int, str]:
        if self.limit is not None:
            return self.limit, "--job-memory-limit"
        return available_bytes(self.device), "the memory available now"

    def __call__(self, method: str, hp: dict[str, Any]) -> None:
        rank = hp.get("lora_rank")
        if method == "lora" and self.max_lora_rank is not None and rank is not None and rank > self.max_lora_rank:
            raise InvalidArgument(f"{rank} is over this server's limit of {self.max_lora_rank} (--max-lora-rank): "
                                  "it could not serve the adapter", "hyperparameters.lora_rank")
        need = job_memory(self.config, self.tp, method, hp, self.served_dtype, getattr(self.device, "type", "cpu"))
        total = need.per_rank * self.ranks
        budget, source = self.budget()
        if total <= budget:
            return
        if need.state > need.activations:
            field = "method" if method == "full" else "hyperparameters.lora_rank"
        else:
            field = "hyperparameters.batch_size" if int(hp["batch_size"]) > 1 else "hyperparameters.max_seq_len"
        raise TooLarge(f"the job needs about {total / MiB:.0f} MiB by tprt plan's arithmetic ({need.state * self.ranks / MiB:.0f} trainable "
                       f"state, {need.activations * self.ranks / MiB:.0f} activations over {self.ranks} ranks), "
                       f"more than the {budget / MiB:.0f} MiB of {source}; lower it", field)
