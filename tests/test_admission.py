"""serve/jobs/admission.py: a job's memory by the planner's arithmetic, and the refusal it leads to."""

from __future__ import annotations

import pytest

import math

from serve.errors import InvalidArgument, Status
from serve.jobs.admission import JobAdmission, TooLarge, job_memory
from tprt.model.config import ModelConfig
from tprt.plan import layout_for, lora_parameters, rank_parameters

# SmolLM2-135M's shape.
CONFIG = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True)
LORA = {"batch_size": 4, "max_seq_len": 512, "lora_rank": 8}


def params(tp: int) -> int:
    return sum(math.prod(shape) for shape in rank_parameters(CONFIG, layout_for(CONFIG, tp)).values())


def test_the_job_counts_its_own_state_and_grows_with_each_field() -> None:
    assert 134e6 < params(1) < 136e6  # SmolLM2-135M
    lora, full = job_memory(CONFIG, 1, "lora", LORA), job_memory(CONFIG, 1, "full", LORA)
    # full, fp32: its own weights, gradients and AdamW's two moments; LoRA: the same for its factors only
    assert full.state == 16 * params(1) > 100 * lora.state
    adapter = sum(math.prod(s) for s in lora_parameters(CONFIG, layout_for(CONFIG, 1), ("q", "k", "v", "o"), 8).values())
    assert lora.state == 16 * adapter
    assert job_memory(CONFIG, 3, "full", LORA).state == 16 * params(3) < full.state / 2.5
    bf16 = job_memory(CONFIG, 1, "lora", LORA, served_dtype="bf16")  # trains on the served bf16 weights
    assert bf16.state == adapter * (2 + 2 + 4 + 8 + 4)  # weights, gradients + their fp32 copy, moments, masters
    double = job_memory(CONFIG, 1, "lora", {**LORA, "batch_size": 8})
    assert double.activations == 2 * lora.activations
    longer = job_memory(CONFIG, 1, "lora", {**LORA, "max_seq_len": 1024})
    assert longer.activations > 1.9 * lora.activations


@pytest.mark.parametrize("method, hp, field", [
    ("lora", {**LORA, "batch_size": 512}, "hyperparameters.batch_size"),
    ("lora", {**LORA, "batch_size": 1, "max_seq_len": 2048 * 32}, "hyperparameters.max_seq_len"),
    ("full", {**LORA, "batch_size": 1, "max_seq_len": 16}, "method"),
])
def test_a_job_over_the_limit_is_refused_naming_the_field(method: str, hp: dict[str, int], field: str) -> None:
    admit = JobAdmission(CONFIG, tp=1, ranks=1, device=None, limit=1 << 30)
    admit("lora", {**LORA, "batch_size": 1, "max_seq_len": 16})  # fits
    with pytest.raises(TooLarge) as info:
        admit(method, hp)
    assert info.value.field == field and info.value.status == Status.RESOURCE_EXHAUSTED
    assert "1024 MiB of --job-memory-limit" in str(info.value)


def test_a_lora_rank_over_the_servers_limit_is_refused() -> None:
    """The pool would refuse to serve the adapter (--max-lora-rank): the job is refused first."""

    admit = JobAdmission(CONFIG, tp=1, ranks=1, device=None, limit=1 << 40, max_lora_rank=16)
    admit("lora", {**LORA, "lora_rank": 16, "batch_size": 1, "max_seq_len": 16})
    with pytest.raises(InvalidArgument, match="256 is over this server's limit of 16") as info:
        admit("lora", {**LORA, "lora_rank": 256, "batch_size": 1, "max_seq_len": 16})
    assert info.value.field == "hyperparameters.lora_rank"
    admit("full", {**LORA, "batch_size": 1, "max_seq_len": 16})  # no adapter: no rank
