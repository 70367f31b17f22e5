"""Every parameter one TP rank holds, with its local shape, computed from the config alone.

The shapes follow the runtime's modules (tprt.model.llama, tprt.parallel.layers) and the TP rules
of tprt.parallel.sharding: q/k/v fused per rank into `qkv_proj` ([q_r; k_r; v_r], a replicated kv
head counted on every rank that holds it), gate/up into `gate_up_proj`, o/down split on their
input, the embedding and an untied LM head split over the padded vocabulary (`TPLayout`), norms
replicated. LoRA factors follow tprt.lora.sites: a column target's B holds this rank's rows and
its A is replicated; a row target's A holds this rank's input columns and its B is replicated.
No torch: a plan for a 405B model is arithmetic on shapes.
"""

from __future__ import annotations

import math

from tprt.errors import ConfigError
from tprt.lora.config import normalize_targets
from tprt.model.config import ModelConfig, TPLayout
from tprt.parallel.sharding import LAYER_LINEARS, ROW, module_rule
from tprt.parallel.stages import Stage, stages

Shapes = dict[str, tuple[int, ...]]


def layout_for(cfg: ModelConfig, tp: int, vocab_align: int = 64) -> TPLayout:
    """`TPLayout.for_model` plus the check the model makes at construction (intermediate_size)."""
    layout = TPLayout.for_model(cfg, tp, vocab_align)
    if cfg.intermediate_size % tp:
        raise ConfigError(f"--tp {tp} does not divide intermediate_size={cfg.intermediate_size}")
    return layout


def allowed_tp(cfg: ModelConfig, up_to: int = 1024) -> list[int]:
    """Every TP degree the model can be split over (heads, kv heads and intermediate size)."""
    out = []
    for tp in range(1, min(up_to, cfg.num_attention_heads) + 1):
        try:
            layout_for(cfg, tp)
        except ConfigError:
            continue
        out.append(tp)
    return out


def _local_rows(cfg: ModelConfig, layout: TPLayout) -> dict[str, int]:
    """This rank's output rows of each column target."""
    q = layout.local_heads * cfg.head_dim
    kv = layout.local_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size // layout.tp
    return {"q": q, "k": kv, "v": kv, "gate": inter, "up": inter}


def rank_parameters(cfg: ModelConfig, layout: TPLayout, stage: Stage | None = None) -> Shapes:
    """Runtime parameter name -> local shape on one rank (the same on every rank), in the order
    of `TPLlamaForCausalLM.named_parameters()`; with `stage`, what one pipeline stage holds."""
    h, rows = cfg.hidden_size, _local_rows(cfg, layout)
    first, last = stage is None or stage.first, stage is None or stage.last
    out: Shapes = {}
    if first or (last and cfg.tie_word_embeddings):
        out["embed_tokens.weight"] = (layout.local_vocab, h)
    for i in range(cfg.num_hidden_layers) if stage is None else stage.layers:
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.qkv_proj.weight"] = (rows["q"] + rows["k"] + rows["v"], h)
        if cfg.qkv_bias:
            out[p + "self_attn.qkv_proj.bias"] = (rows["q"] + rows["k"] + rows["v"],)
        out[p + "self_attn.o_proj.weight"] = (h, rows["q"])
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_up_proj.weight"] = (rows["gate"] + rows["up"], h)
        out[p + "mlp.down_proj.weight"] = (h, rows["gate"])
        if cfg.gemma_block:
            out[p + "pre_feedforward_layernorm.weight"] = out[p + "post_feedforward_layernorm.weight"] = (h,)
    if last:
        out["norm.weight"] = (h,)
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (layout.local_vocab, h)
    return out


def lora_parameters(cfg: ModelConfig, layout: TPLayout, targets: tuple[str, ...] | list[str], rank: int,
                    stage: Stage | None = None) -> Shapes:
    """LoRA factor name -> local shape on one rank, as `tprt.lora.attach.apply_lora` builds them
    (with `stage`: on that pipeline stage's layers)."""
    if rank < 1:
        raise ConfigError(f"--lora-rank must be at least 1, got {rank}")
    chosen = normalize_targets(targets)
    h, rows = cfg.hidden_size, _local_rows(cfg, layout)
    out: Shapes = {}
    for i in range(cfg.num_hidden_layers) if stage is None else stage.layers:
        for linear, parts in LAYER_LINEARS.items():
            for module in parts:
                target = module.rsplit(".", 1)[1].removesuffix("_proj")
                if target not in chosen:
                    continue
                name = f"layers.{i}.{linear}.adapter.lora_{{}}.{target}"
                if module_rule(module).kind == ROW:  # o, down: input split over the ranks
                    local_in = rows["q"] if target == "o" else rows["gate"]
                    out[name.format("A")], out[name.format("B")] = (rank, local_in), (h, rank)
                else:
                    out[name.format("A")], out[name.format("B")] = (rank, h), (rows[target], rank)
    return out


def numel(shapes: Shapes) -> int:
    return sum(math.prod(s) for s in shapes.values())


def linear_weight_names(cfg: ModelConfig, shapes: Shapes) -> list[str]:
    """The weights that go through a linear layer (what CPU prepacking copies): every projection
    and the LM head, which is the embedding when tied."""
    names = [n for n in shapes if n.endswith("_proj.weight")]
    names.append("embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    return names
