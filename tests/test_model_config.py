"""Which config.json files tprt takes (tprt.model.config): the Llama family's architectures and
their deltas, and one-line refusals of everything else, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from tprt.errors import ConfigError
from tprt.model.config import SUPPORTED_ARCHITECTURES, ModelConfig

BASE: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)


def config(arch: str, model_type: str, **fields: Any) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "architectures": [arch], "model_type": model_type, **fields}, "c.json")


def test_each_family_gets_its_deltas() -> None:
    llama = config("LlamaForCausalLM", "llama")
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm, llama.llama_block) == (False, False, False, True)
    biased = config("LlamaForCausalLM", "llama", attention_bias=True)
    assert (biased.qkv_bias, biased.o_bias) == (True, True) and not biased.llama_block
    qwen2 = config("Qwen2ForCausalLM", "qwen2", use_sliding_window=False, sliding_window=131072)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)  # Qwen2's biases need no flag
    qwen3 = config("Qwen3ForCausalLM", "qwen3", head_dim=32, use_sliding_window=False, sliding_window=None,
                   layer_types=["full_attention"] * 2)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim, qwen3.q_size) == (False, True, 32, 256)
    assert config("Qwen3ForCausalLM", "qwen3", attention_bias=True).o_bias
    assert ModelConfig.from_dict({**BASE, "model_type": "qwen3"}).architecture == "Qwen3ForCausalLM"
    mistral = config("MistralForCausalLM", "mistral", sliding_window=128)
    assert mistral.sliding_window == 128 and not mistral.llama_block
    for unwindowed in (dict(sliding_window=None), dict(sliding_window=512), dict(sliding_window=4096),
                       dict(sliding_window=128, use_sliding_window=False)):
        assert config("MistralForCausalLM", "mistral", **unwindowed).sliding_window is None, unwindowed
    assert config("MistralForCausalLM", "mistral", sliding_window=8,
                  layer_types=["sliding_attention"] * 2).sliding_window == 8


def test_gemma_configs_as_transformers_reads_them() -> None:
    """Gemma 2's defaults where the fields are absent (soft-caps 50 and 30, query_pre_attn_scalar
    256, every other layer windowed), Gemma 3's older field names (rope_local_base_freq,
    sliding_window_pattern, a rope_scaling of the global layers) and its newer per-kind rope
    parameters."""
    gemma2 = config("Gemma2ForCausalLM", "gemma2", head_dim=16, sliding_window=64, num_hidden_layers=4)
    assert gemma2.gemma_block and not gemma2.llama_block and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.windows == (64, None, 64, None) and gemma2.query_scale == (16 / 256) ** 0.5
    assert not gemma2.qk_norm and gemma2.local_rope_theta is None
    uncapped = config("Gemma2ForCausalLM", "gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (uncapped.attn_logit_softcapping, uncapped.final_logit_softcapping) == (None, None)
    old = config("Gemma3ForCausalLM", "gemma3_text", num_hidden_layers=7, sliding_window=32, rope_theta=1e6,
                 rope_local_base_freq=1e4, sliding_window_pattern=3, query_pre_attn_scalar=8,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert old.windows == (32, 32, None, 32, 32, None, 32) and old.qk_norm and old.query_scale == 1.0
    assert (old.rope_theta, old.local_rope_theta, old.rope_scaling and old.rope_scaling.factor) == (1e6, 1e4, 8.0)
    new = config("Gemma3ForCausalLM", "gemma3_text", sliding_window=32, layer_types=["full_attention"] * 2,
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 5e5}})
    assert new.windows == (None, None) and (new.rope_theta, new.local_rope_theta, new.rope_scaling) == (5e5, 100.0, None)
    assert (new.attn_logit_softcapping, new.final_logit_softcapping) == (None, None)
    unwindowed = config("Gemma3ForCausalLM", "gemma3_text", sliding_window=None)
    assert unwindowed.windows == (None, None)


@pytest.mark.parametrize("arch,model_type,fields,match", [
    ("Gemma3ForConditionalGeneration", "gemma3", {}, "unsupported architecture 'Gemma3ForConditionalGeneration'"),
    ("GemmaForCausalLM", "gemma", {}, "unsupported architecture 'GemmaForCausalLM'"),
    ("Gemma2ForCausalLM", "gemma2", {"hidden_activation": "gelu"}, "field 'hidden_activation' must be "
     "'gelu_pytorch_tanh' for Gemma2ForCausalLM"),
    ("Gemma2ForCausalLM", "gemma2", {"layer_types": ["sliding_attention"]}, "field 'layer_types' must list"),
    ("Gemma3ForCausalLM", "gemma3_text", {"use_bidirectional_attention": True}, "field 'use_bidirectional_attention'"),
    ("Gemma2ForCausalLM", "gemma2", {"attn_logit_softcapping": -1}, "field 'attn_logit_softcapping' must be a "
     "positive number or null"),
    ("Gemma3ForCausalLM", "gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2},
                                                              "full_attention": {"rope_type": "default"}}},
     "field 'rope_parameters.sliding_attention': rope type 'linear' is not supported there"),
    ("LlamaForCausalLM", "llama", {"query_pre_attn_scalar": 256}, "field 'query_pre_attn_scalar'=256 is not supported"),
    ("Qwen2ForCausalLM", "llama", {}, "unsupported architecture 'Qwen2ForCausalLM' \\(model_type 'llama'\\)"),
    ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": True, "sliding_window": 128}, "field 'sliding_window'=128"),
    ("Qwen3ForCausalLM", "qwen3", {"layer_types": ["full_attention", "sliding_attention"]},
     "field 'layer_types' lists \\['sliding_attention'\\]"),
    ("LlamaForCausalLM", "llama", {"sliding_window": 128}, "field 'sliding_window'=128 is not supported for Llama"),
    ("MistralForCausalLM", "mistral", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
     "field 'layer_types' lists \\['full_attention'\\]"),
    ("LlamaForCausalLM", "llama", {"mlp_bias": True}, "field 'mlp_bias'=true"),
    ("MistralForCausalLM", "mistral", {"attention_bias": True}, "field 'attention_bias'=true is not supported for Mistral"),
    ("LlamaForCausalLM", "llama", {"final_logit_softcapping": 30.0}, "field 'final_logit_softcapping'"),
])
def test_what_would_change_the_math_is_refused_by_name(arch: str, model_type: str, fields: dict[str, Any],
                                                         match: str) -> None:
    with pytest.raises(ConfigError, match=f"^c.json: {match}") as e:
        config(arch, model_type, **fields)
    assert "\n" not in str(e.value)
    if "unsupported architecture" in match:
        assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)
