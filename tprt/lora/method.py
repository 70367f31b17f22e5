"""LoRA as a linear method: an adapter module wrapped around a layer's weight method.

`wrap(layer, adapter)` makes the layer's method a `LoRAMethod` over the one it had (dense,
packed, ...): the product is the inner method's, then `adapter(x, y) -> y'` adds its delta (a
ColumnLoRA/RowLoRA of tprt.lora.modules, or a routed set of them, tprt.lora.routing.AdapterSet).
The module is registered on the layer as `adapter`, so its parameters keep their checkpoint and
PEFT names (`layers.N.self_attn.qkv_proj.adapter.lora_A.q`). `unwrap` undoes both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from tprt.parallel.layers import LinearMethod, ParallelLinear


class Adapter(Protocol):
    """An adapter module as a LoRAMethod applies it."""

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x the layer's input as this rank sees it, y the inner method's product; returns y plus the delta."""
        ...

    def applies(self) -> bool:
        """Whether it adds anything in the coming forward call (a routed set: rows routed to a member)."""
        ...


class LoRAMethod(LinearMethod):
    """The inner method's product plus `adapter`'s delta; the weights stay the inner method's."""

    def __init__(self, inner: LinearMethod, adapter: Adapter) -> None:
        self.inner: LinearMethod = inner
        self.adapter = adapter

    def create_weights(self, layer: ParallelLinear, out_features: int, in_features: int,
                       dtype: torch.dtype | None) -> None:
        self.inner.create_weights(layer, out_features, in_features, dtype)

    def load_weight(self, layer: ParallelLinear, name: str, dest: torch.Tensor,
                    pieces: Sequence[torch.Tensor]) -> None:
        self.inner.load_weight(layer, name, dest, pieces)

    def process_after_loading(self, layer: ParallelLinear) -> None:
        self.inner.process_after_loading(layer)

    def apply(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(x, self.inner.apply(layer, x))

    def adapts(self) -> bool:
        return self.adapter.applies()


def wrap(layer: ParallelLinear, adapter: nn.Module) -> None:
    """Puts `adapter` (an `Adapter` module) on top of `layer`'s method and registers it as
    `layer.adapter`; the layer must have none."""
    if layer.adapter is not None:
        raise ValueError("the layer already has an adapter; unwrap it first")
    layer.method = LoRAMethod(layer.method, adapter)  # type: ignore[arg-type]  # an nn.Module is callable
    layer.adapter = adapter


def unwrap(layer: ParallelLinear) -> nn.Module | None:
    """Takes the adapter off `layer` (its method goes back to the one it wrapped); returns it,
    or None when the layer had none."""
    adapter = layer.adapter
    if adapter is None:
        return None
    assert isinstance(layer.method, LoRAMethod), "the layer's adapter is registered but its method does not wrap it"
    layer.method = layer.method.inner
    layer.adapter = None
    return adapter
