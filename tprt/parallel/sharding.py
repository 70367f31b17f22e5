"""The tensor-parallel rule of every Llama-family weight (Qwen's biases, q/k norms and Gemma's extra norms too), and how the runtime's fused parameters are
made of Hugging Face tensors: the one table the converter, the loader, the exporter and LoRA read.

HF stores linear weights as [out, in]. Column-parallel weights (q/k/v/gate/up) split dim 0, so
each rank holds whole output features (whole heads for attention: HF groups q/k/v rows by head);
k/v are "kv": split like a column, or replicated per kv head when TP > n_kv_heads (TPLayout).
Row-parallel weights (o/down) split dim 1. The embedding and the LM head split the (padded)
vocabulary. Norms are replicated.

The runtime fuses per rank: `qkv_proj` holds [q_r; k_r; v_r] and `gate_up_proj` [gate_r; up_r]
(each rank's own rows of each part, never a chunk of the concatenation). Its parameter names are
the HF names without the leading "model." (lm_head.weight has none in either).

Pure data and string functions, no torch: the converter imports this without loading torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tprt.errors import CheckpointError

REPLICATED, COLUMN, KV, ROW, VOCAB = "replicated", "column", "kv", "row", "vocab"


@dataclass(frozen=True)
class ShardRule:
    kind: str  # REPLICATED, COLUMN, KV, ROW or VOCAB
    split_dim: int | None  # the dimension split over the ranks; None when replicated


_REPLICATED = ShardRule(REPLICATED, None)

# HF weights outside the decoder layers.
MODEL_RULES: dict[str, ShardRule] = {
    "model.embed_tokens.weight": ShardRule(VOCAB, 0),
    "model.norm.weight": _REPLICATED,
    "lm_head.weight": ShardRule(VOCAB, 0),
}
# HF weights of each decoder layer, under `model.layers.N.`.
LAYER_RULES: dict[str, ShardRule] = {
    "input_layernorm.weight": _REPLICATED,
    "post_attention_layernorm.weight": _REPLICATED,
    "self_attn.q_proj.weight": ShardRule(COLUMN, 0),
    "self_attn.k_proj.weight": ShardRule(KV, 0),
    "self_attn.v_proj.weight": ShardRule(KV, 0),
    "self_attn.o_proj.weight": ShardRule(ROW, 1),
    "mlp.gate_proj.weight": ShardRule(COLUMN, 0),
    "mlp.up_proj.weight": ShardRule(COLUMN, 0),
    "mlp.down_proj.weight": ShardRule(ROW, 1),
    # Qwen2 (and attention_bias) biases split like their weights' rows; o_proj's is added after
    # the all-reduce, so replicated. Qwen3's q/k norms weigh head_dim, the same for every head.
    "self_attn.q_proj.bias": ShardRule(COLUMN, 0),
    "self_attn.k_proj.bias": ShardRule(KV, 0),
    "self_attn.v_proj.bias": ShardRule(KV, 0),
    "self_attn.o_proj.bias": _REPLICATED,
    "self_attn.q_norm.weight": _REPLICATED,
    "self_attn.k_norm.weight": _REPLICATED,
    # Gemma: norms of the MLP's input and output (its post_attention_layernorm is the attention's output's).
    "pre_feedforward_layernorm.weight": _REPLICATED,
    "post_feedforward_layernorm.weight": _REPLICATED,
}
# The runtime's linear layers of a decoder layer -> the HF linear modules whose rows they hold, in
# row order (the same for the weight and for LoRA's column targets).
LAYER_LINEARS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
VOCAB_TENSORS = tuple(name for name, rule in MODEL_RULES.items() if rule.kind == VOCAB)

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_RUNTIME_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|weight_scale|bias)$")
# A quantized linear weight's scales (tprt.quant): [out, groups], split like the weight's rows, or
# like its columns by whole groups (replicated when one group spans the row: per channel).
SCALE_SUFFIX = ".weight_scale"


def rule_for(name: str) -> ShardRule:
    """The TP rule of an HF Llama-family tensor name; unknown names are an error."""
    if name in MODEL_RULES:
        return MODEL_RULES[name]
    if name.endswith(SCALE_SUFFIX):
        rule = rule_for(name.removesuffix("_scale"))
        if rule.kind in (COLUMN, KV, ROW):
            return rule
        raise CheckpointError(f"tensor {name!r}: only the decoder's linear weights are quantized")
    m = _HF_LAYER.match(name)
    if m and m.group(2) in LAYER_RULES:
        return LAYER_RULES[m.group(2)]
    raise CheckpointError(f"tensor {name!r} is not part of a Llama model; expected HF LlamaForCausalLM names")


def module_rule(module: str) -> ShardRule:
    """The rule of an HF linear module of a decoder layer (e.g. "self_attn.k_proj")."""
    return LAYER_RULES[module + ".weight"]


def hf_sources(name: str) -> list[str]:
    """The HF tensor names, in row order, that make up the runtime parameter `name` on every rank."""
    m = _RUNTIME_LAYER.match(name)
    if m and m.group(2) in LAYER_LINEARS:
        return [f"model.layers.{m.group(1)}.{part}.{m.group(3)}" for part in LAYER_LINEARS[m.group(2)]]
    return [name if name in MODEL_RULES else "model." + name]
