"""serve/admission.py: the conservative job-memory estimate and the refusal it leads to."""

from __future__ import annotations

import grpc
import pytest

from serve.admission import JobAdmission, TooLarge, job_memory, shard_parameters
from tprt.model.config import ModelConfig

# SmolLM2-135M's shape.
CONFIG = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True)
LORA = {"batch_size": 4, "max_seq_len": 512, "lora_rank": 8}


def test_the_estimate_counts_the_whole_model_and_grows_with_each_field() -> None:
    assert 134e6 < shard_parameters(CONFIG, 1) < 136e6  # SmolLM2-135M
    assert shard_parameters(CONFIG, 3) < shard_parameters(CONFIG, 1) / 2.9
    lora, full = job_memory(CONFIG, 1, "lora", LORA), job_memory(CONFIG, 1, "full", LORA)
    assert full.state == 16 * shard_parameters(CONFIG, 1) > 100 * lora.state
    assert full.activations == lora.activations
    double = job_memory(CONFIG, 1, "lora", {**LORA, "batch_size": 8})
    assert double.activations == 2 * lora.activations
    longer = job_memory(CONFIG, 1, "lora", {**LORA, "max_seq_len": 1024})
    assert longer.activations > 2 * lora.activations  # attention is quadratic in the length


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
    assert info.value.field == field and info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "1024 MiB of --job-memory-limit" in str(info.value)
