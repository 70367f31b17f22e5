"""Several LoRA adapters in one batch: each row of a forward call uses its own adapter (or none).

A server keeps every loaded adapter on the model at once. Each targeted base layer gets one
`AdapterSet` as its `adapter`, holding that layer's module of every adapter by a small integer
index (0 is reserved for the base model). Before a forward call the runner tells the model's
`AdapterRouting` which index each row uses (`route`); every AdapterSet then applies each adapter
to its rows only: the whole batch at once when all rows share one adapter, otherwise per group
of rows (gathered, adapted, scattered back). Rows of the base model pass through untouched, so a
batch without adapter rows costs nothing beyond a Python check per layer.

Routing is decided on the host from the plan, identically on every TP rank, and involves no
communication: a LoRA module's own TP rules (row-parallel deltas added before the base
all-reduce) are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.layers import ColumnParallelLinear, RowParallelLinear

BASE = 0  # the index of "no adapter"

Linear = ColumnParallelLinear | RowParallelLinear


class AdapterRouting:
    """Which adapter each row of the current forward call uses; shared by a model's AdapterSets."""

    def __init__(self) -> None:
        # [(adapter index, rows or None for every row)]; empty: every row is the base model
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def route(self, row_adapters: Sequence[int], device: torch.device) -> None:
        """Sets the rows of the next forward call: row_adapters[b] is row b's adapter index."""
        indices = set(row_adapters) - {BASE}
        if not indices:
            self.groups = []
        elif len(set(row_adapters)) == 1:
            self.groups = [(row_adapters[0], None)]
        else:
            self.groups = [(i, torch.tensor([b for b, a in enumerate(row_adapters) if a == i], device=device))
                           for i in sorted(indices)]


class AdapterSet(nn.Module):
    """A base layer's modules of several adapters (`adapter(x, y) -> y'` each), applied per row."""

    def __init__(self, routing: AdapterRouting) -> None:
        super().__init__()
        self.routing = routing
        self.members = nn.ModuleDict()  # str(adapter index) -> that adapter's module for this layer

    def applies(self) -> bool:
        """Whether the current routing sends rows to a member of this set (tprt.parallel.layers.adapted)."""
        return any(str(index) in self.members for index, _ in self.routing.groups)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [rows, ...] the layer's input, y [rows, ...] its base output."""
        for index, rows in self.routing.groups:
            if str(index) not in self.members:  # this adapter does not target this layer
                continue
            member = self.members[str(index)]
            if rows is None:
                y = member(x, y)
            else:
                y = y.index_copy(0, rows, member(x.index_select(0, rows), y.index_select(0, rows)))
        return y


def routing_of(model: TPLlamaForCausalLM) -> AdapterRouting | None:
    """The model's routing, when adapters were installed with `install`."""
    routing = getattr(model, "adapter_routing", None)
    return routing if isinstance(routing, AdapterRouting) else None


def install(model: TPLlamaForCausalLM, index: int, modules: Sequence[tuple[Linear, nn.Module]]) -> None:
    """Adds one adapter's modules (base layer, module) under `index` (> 0) to the model's sets."""
    if index == BASE:
        raise ValueError(f"adapter index {BASE} is reserved for the base model")
    routing = routing_of(model)
    if routing is None:
        routing = AdapterRouting()
        model.adapter_routing = routing
    for linear, module in modules:
        if not isinstance(linear.adapter, AdapterSet):
            if linear.adapter is not None:
                raise ValueError("a base layer already has an adapter that is not an AdapterSet")
            linear.adapter = AdapterSet(routing)
        linear.adapter.members[str(index)] = module
