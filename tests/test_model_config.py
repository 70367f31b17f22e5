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


@pytest.mark.parametrize("arch,model_type,fields,match", [
    ("Gemma2ForCausalLM", "gemma2", {}, "unsupported architecture 'Gemma2ForCausalLM'"),
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
