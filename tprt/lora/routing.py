"""Several LoRA adapters in one batch: each row of a forward call uses its own adapter (or none).

A server keeps every loaded adapter on the model at once, in an `AdapterPool` (the engine's
runner holds one). Each targeted base layer gets one `AdapterSet` as its `adapter`, holding that
layer's module of every installed adapter by a small integer index (0 is reserved for the base
model). Before each forward call the pool's owner routes the batch's rows (`route`: which index
each row uses); every AdapterSet then applies each adapter to its rows only: the whole batch at
once when all rows share one adapter, otherwise per group of rows (gathered, adapted, scattered
back). Rows of the base model pass through untouched, so a batch without adapter rows costs
nothing beyond a Python check per layer.

Routing is decided on the host from the plan, identically on every TP rank, and involves no
communication: a LoRA module's own TP rules (row-parallel deltas added before the base
all-reduce) are unchanged.

Tiers: an installed adapter is on the model's device and can be routed to; `offload` takes it off
the layers and keeps its modules in host memory (`host`), `restore` puts them back under the same
index, `drop` forgets it. Which adapters sit in which tier is rank 0's decision (serve/adapter_pool.py);
every rank applies the same moves, so the tiers agree across the TP group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tprt.lora.attach import LoRAAdapter
from tprt.model.llama import TPLlamaForCausalLM

BASE = 0  # the index of "no adapter"


class AdapterPool:
    """The adapters installed side by side on one model, and the rows routed to each."""

    def __init__(self, model: TPLlamaForCausalLM) -> None:
        self.model = model
        self.installed: set[int] = set()  # the indices adapters are installed under
        self.host: dict[int, LoRAAdapter] = {}  # offloaded adapters (host memory), by index
        self._device_copies: dict[int, LoRAAdapter] = {}  # what is installed, to offload it again
        # [(adapter index, rows or None for every row)]; empty: every row is the base model
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def sets(self) -> list[AdapterSet]:
        return [linear.adapter for linear in self.model.linears() if isinstance(linear.adapter, AdapterSet)]

    def install(self, index: int, adapter: LoRAAdapter) -> None:
        """Installs `adapter` (built for this pool's model) for inference under `index` (> 0),
        replacing whatever was installed there."""
        if index == BASE:
            raise ValueError(f"adapter index {BASE} is reserved for the base model")
        linears = {id(linear) for linear in self.model.linears()}
        if any(id(site.linear) not in linears for site, _ in adapter.pieces):
            raise ValueError("the adapter was built for another model")
        for adapter_set in self.sets():  # a previous version's modules
            if str(index) in adapter_set.members:
                del adapter_set.members[str(index)]
        for site, module in adapter.pieces:
            linear = site.linear
            if linear.adapter is None:
                linear.adapter = AdapterSet(self)
            elif not isinstance(linear.adapter, AdapterSet):
                raise ValueError("a base layer already has an adapter that is not an AdapterSet")
            linear.adapter.members[str(index)] = module.eval().requires_grad_(False)
        self.installed.add(index)
        self._device_copies[index] = adapter
        self.host.pop(index, None)

    def _uninstall(self, index: int) -> LoRAAdapter | None:
        """Takes adapter `index`'s modules off every layer; returns the adapter (None: not installed)."""
        for adapter_set in self.sets():
            if str(index) in adapter_set.members:
                del adapter_set.members[str(index)]
        self.installed.discard(index)
        return self._device_copies.pop(index, None)

    def offload(self, index: int) -> None:
        """Moves an installed adapter to host memory; rows can no longer be routed to it."""
        adapter = self._uninstall(index)
        if adapter is None:
            raise KeyError(f"adapter index {index} is not installed")
        for _, module in adapter.pieces:
            module.to("cpu")
        self.host[index] = adapter

    def restore(self, index: int) -> None:
        """Installs an offloaded adapter again, on the model's device, under the same index."""
        adapter = self.host.pop(index, None)
        if adapter is None:
            raise KeyError(f"adapter index {index} is not in host memory")
        device = self.model.tp.device
        for _, module in adapter.pieces:
            module.to(device)
        self.install(index, adapter)

    def drop(self, index: int) -> None:
        """Forgets adapter `index`, installed or offloaded (no-op when unknown)."""
        self._uninstall(index)
        self.host.pop(index, None)

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

    def __init__(self, pool: AdapterPool) -> None:
        super().__init__()
        self.pool = pool
        self.members = nn.ModuleDict()  # str(adapter index) -> that adapter's module for this layer

    def applies(self) -> bool:
        """Whether the current routing sends rows to a member of this set (tprt.parallel.layers.adapted)."""
        return any(str(index) in self.members for index, _ in self.pool.groups)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [rows, ...] the layer's input, y [rows, ...] its base output."""
        for index, rows in self.pool.groups:
            if str(index) not in self.members:  # this adapter does not target this layer
                continue
            member = self.members[str(index)]
            if rows is None:
                y = member(x, y)
            else:
                y = y.index_copy(0, rows, member(x.index_select(0, rows), y.index_select(0, rows)))
        return y
