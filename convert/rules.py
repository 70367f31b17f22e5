"""The converter's use of the TP rules (`tprt.parallel.sharding`): the manifest entry of each
tensor at a layout, and which tensors an HF Llama-family checkpoint of a config must hold."""

from __future__ import annotations

from tprt.checkpoint.format import TensorEntry
from tprt.errors import CheckpointError
from tprt.model.config import ModelConfig, TPLayout
from tprt.quant.formats import QuantSpec
from tprt.parallel.sharding import KV, ROW, SCALE_SUFFIX, VOCAB, rule_for

# Tensors that some checkpoints carry but that are derived, never learned: skipped on read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES)


def expected_shapes(cfg: ModelConfig, spec: QuantSpec | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF Llama checkpoint of `cfg` must hold, with its unpadded global shape;
    with a quantized `spec`, each decoder linear weight's scales too."""
    shapes = _dense_shapes(cfg)
    if spec is not None:
        for name, shape in list(shapes.items()):
            if is_quantized(name):
                shapes[name + "_scale"] = (shape[0], spec.groups(shape[1]))
    return shapes


def is_quantized(name: str) -> bool:
    """Whether a quantized format stores HF tensor `name` quantized (the decoder's linear weights)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _dense_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        if cfg.gemma_block:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    return shapes


def check_tensor_set(found: dict[str, tuple[int, ...]], cfg: ModelConfig, source: str,
                     spec: QuantSpec | None = None) -> None:
    """Missing, unexpected or mis-shaped tensors, each named with `source` and what was expected.
    A tied model may still carry lm_head.weight (some exporters write it); it is then dropped."""
    expected = expected_shapes(cfg, spec)
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
    if name.endswith(SCALE_SUFFIX) and rule.kind == ROW and shape[1] == 1:
        return TensorEntry(shape, dtype, None)  # per channel: every rank's columns share the row's scale
    if rule.kind == VOCAB:
        return TensorEntry((layout.padded_vocab_size, *shape[1:]), dtype, rule.split_dim)
    if rule.kind == KV:
        return TensorEntry(shape, dtype, rule.split_dim, layout.kv_replication)
    return TensorEntry(shape, dtype, rule.split_dim)
