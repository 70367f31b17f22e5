"""The tensor-parallel rule for every Llama weight, as pure functions of (name, config, layout).

HF stores linear weights as [out, in]. Column-parallel layers (q/k/v/gate/up) split dim 0, so each
rank holds whole output features (whole heads for attention, since HF groups q/k/v rows by head).
Row-parallel layers (o/down) split dim 1. Embedding and LM head split the (padded) vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tprt.checkpoint.format import TensorEntry
from tprt.model.config import ModelConfig, TPLayout
from tprt.errors import CheckpointError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Tensors that some checkpoints carry but that are derived, never learned: skipped on read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# kind: "replicated" | "column" | "kv" | "row" | "vocab"
_LAYER_RULES: dict[str, tuple[str, int | None]] = {
    "input_layernorm.weight": ("replicated", None),
    "post_attention_layernorm.weight": ("replicated", None),
    "self_attn.q_proj.weight": ("column", 0),
    "self_attn.k_proj.weight": ("kv", 0),
    "self_attn.v_proj.weight": ("kv", 0),
    "self_attn.o_proj.weight": ("row", 1),
    "mlp.gate_proj.weight": ("column", 0),
    "mlp.up_proj.weight": ("column", 0),
    "mlp.down_proj.weight": ("row", 1),
}
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ShardRule:
    kind: str
    split_dim: int | None


def is_ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES)


def rule_for(name: str) -> ShardRule:
    """The TP rule of an HF Llama tensor name; unknown names are an error."""
    if name in VOCAB_TENSORS:
        return ShardRule("vocab", 0)
    if name == "model.norm.weight":
        return ShardRule("replicated", None)
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_RULES:
        kind, dim = _LAYER_RULES[m.group(2)]
        return ShardRule(kind, dim)
    raise CheckpointError(f"tensor {name!r} is not part of a Llama model; expected HF LlamaForCausalLM names")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Llama checkpoint of `cfg` must hold, with its unpadded global shape."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    return shapes


def check_tensor_set(found: dict[str, tuple[int, ...]], cfg: ModelConfig, source: str) -> None:
    """Missing, unexpected or mis-shaped tensors, each named with `source` and what was expected.
    A tied model may still carry lm_head.weight (some exporters write it); it is then dropped."""
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"{source}: tensor {name!r} missing (config.json implies {list(shape)})")
        if tuple(found[name]) != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(found[name])}, config.json implies {list(shape)}"
            )
    for name in found:
        if name in expected or is_ignored(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        rule_for(name)  # raises for names that are not Llama at all
        raise CheckpointError(f"{source}: unexpected tensor {name!r} (not implied by config.json)")


def tp_entry(name: str, shape: tuple[int, ...], dtype: str, layout: TPLayout) -> TensorEntry:
    """The manifest entry of `name` at this layout: padded vocabulary, kv replication."""
    rule = rule_for(name)
    if rule.kind == "vocab":
        return TensorEntry((layout.padded_vocab_size, *shape[1:]), dtype, 0)
    if rule.kind == "kv":
        return TensorEntry(shape, dtype, 0, layout.kv_replication)
    return TensorEntry(shape, dtype, rule.split_dim)
