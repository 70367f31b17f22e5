"""How each parameter is laid out over the TP group: a `TPSpec` recorded on the parameter itself.

The base model's parameters are marked by `mark_tp_params`; adapter parameters by their creator
(`tprt.lora.attach.build_lora`). `tprt.train.grads` reads the specs to sum, average and count
gradients correctly under tensor parallelism.

Which HF weight is split how is `tprt.parallel.sharding`'s table (torch-free, for the converter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tprt.model.llama import Attention, RMSNorm, TPLlamaForCausalLM

SPEC_ATTR = "tprt_tp_spec"


@dataclass(frozen=True)
class TPSpec:
    """How one parameter is laid out over the TP group."""

    replicated: bool = False  # every TP rank holds the whole tensor
    partial_grad: bool = False  # replicated, but each rank's gradient is a share: sum over TP
    kv_rows: tuple[int, int] | None = None  # [start, stop) rows of a kv head held by several ranks
    kv_replication: int = 1  # how many consecutive TP ranks hold the same kv head


def set_spec(param: nn.Parameter, spec: TPSpec) -> None:
    setattr(param, SPEC_ATTR, spec)


def get_spec(param: torch.Tensor) -> TPSpec | None:
    spec = getattr(param, SPEC_ATTR, None)
    return spec if isinstance(spec, TPSpec) else None


def mark_tp_params(model: TPLlamaForCausalLM) -> None:
    """Records a `TPSpec` on every parameter of the base model that has none yet.

    Norm weights are replicated; `qkv_proj`'s k/v rows (weight and bias) are kv-replicated when
    TP > n_kv_heads; o_proj's bias is replicated (added after the all-reduce); the q/k norms are
    replicated but see only this rank's heads, so each rank's gradient is a share; everything else
    is sharded. Adapter parameters are marked by their creator (`apply_lora`).
    """
    rep = model.layout.kv_replication
    for module in model.modules():  # an Attention before the norms inside it
        if isinstance(module, RMSNorm) and get_spec(module.weight) is None:
            set_spec(module.weight, TPSpec(replicated=True))
        elif isinstance(module, Attention) and get_spec(module.qkv_proj.weight) is None:
            qkv = [module.qkv_proj.weight] + ([] if module.qkv_proj.bias is None else [module.qkv_proj.bias])
            for p in qkv:
                set_spec(p, TPSpec(kv_rows=kv_rows(module), kv_replication=rep))
            if module.o_proj.bias is not None:
                set_spec(module.o_proj.bias, TPSpec(replicated=True))
            for norm in (module.q_norm, module.k_norm):
                if norm is not None:
                    set_spec(norm.weight, TPSpec(replicated=True, partial_grad=True))
    for p in model.parameters():
        if get_spec(p) is None:
            set_spec(p, TPSpec())


def kv_rows(attn: Attention) -> tuple[int, int]:
    """[start, stop) of the k and v rows in this rank's fused `qkv_proj` output ([q_r; k_r; v_r])."""
    q_rows = attn.n_heads * attn.head_dim
    return q_rows, q_rows + 2 * attn.n_kv * attn.head_dim
