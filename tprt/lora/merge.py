"""Folding attached LoRA adapters into the base weights (`tprt merge-lora`)."""

from __future__ import annotations

import torch

from tprt.errors import ConfigError
from tprt.lora.attach import detach
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.layers import DENSE, set_base_method


@torch.no_grad()
def merge_lora(model: TPLlamaForCausalLM) -> int:
    """Folds every attached adapter into its base weight (W += scale * B A on this rank's rows or
    columns, computed in float32) and detaches it, so the model computes the same outputs
    without it. Returns the number of base layers changed; they go back to the dense method
    (packed copies would be stale: `tprt.cpu.fast_linear.prepack` again to speed them up). No
    communication. A quantized base (tprt.quant) is refused: folding would requantize it."""
    frozen = [linear for linear in model.linears() if linear.method.base.frozen]
    if frozen:
        fmt = frozen[0].method.base.name
        raise ConfigError(f"merge-lora: the base model's weights are {fmt}; merging an adapter into them would "
                          "quantize it away: serve the adapter unmerged (--adapter), or merge into the float model")
    adapter = detach(model)
    for site, module in adapter.pieces:
        module.merge_into(site.linear.weight)
        set_base_method(site.linear, DENSE)
    return len(adapter.pieces)
