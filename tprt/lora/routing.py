"""Several LoRA adapters in one batch: each row of a forward call uses its own adapter (or none).

A server keeps every loaded adapter on the model at once, in numbered `AdapterSlots` (the
engine's runner holds them). Each targeted base layer gets one `AdapterSet` wrapped around its
linear method (tprt.lora.method), holding that layer's module of every installed adapter by its
slot, a small integer index (0 is reserved for the base model). Before each forward call the
slots' owner routes the batch's rows (`route`: which index
each row uses); every AdapterSet then applies each adapter to its rows only. When all rows share
one adapter, its module runs on the whole batch. Otherwise (Punica's grouped idea) the rows are
grouped by adapter once per routing, each group padded to the largest group's size, and each
target of a set costs the same few operations however many adapters the batch mixes: one gather
of the adapter rows' inputs, each group's A and B picked from the set's stacks of every member's
factors (zero-padded to the largest rank, B pre-scaled by alpha / r; position 0 is all zeros for
adapters that do not target this layer), two batched matmuls over the groups, and one
index_add_ of the deltas into the base output (padding rows masked to zero). Rows of the base
model are in no group: they pay nothing, and a batch without adapter rows costs only a Python
check per layer.

Routing is decided on the host from the plan, identically on every TP rank, and involves no
communication: a LoRA module's own TP rules (row-parallel deltas added before the base
all-reduce) are unchanged.

Tiers: an installed adapter is on the model's device and can be routed to; `offload` takes it off
the layers and keeps its modules in host memory (`host`), `restore` puts them back under the same
index, `drop` forgets it. Which adapters sit in which tier is rank 0's decision (serve's AdapterPool);
every rank applies the same moves, so the tiers agree across the TP group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from tprt.lora.attach import LoRAAdapter
from tprt.lora.method import wrap
from tprt.lora.modules import LoRAModule
from tprt.model.llama import TPLlamaForCausalLM

BASE = 0  # the index of "no adapter"


class AdapterSlots:
    """The adapters installed side by side on one model, each under its slot index, and the rows
    routed to each."""

    def __init__(self, model: TPLlamaForCausalLM) -> None:
        self.model = model
        self.installed: set[int] = set()  # the indices adapters are installed under
        self.version = 0  # bumped whenever the installed set changes (AdapterSet stacks are rebuilt)
        self.grouped: Grouped | None = None  # the current mixed routing (None: one adapter or none)
        self.host: dict[int, LoRAAdapter] = {}  # offloaded adapters (host memory), by index
        self._device_copies: dict[int, LoRAAdapter] = {}  # what is installed, to offload it again
        # [(adapter index, rows or None for every row)]; empty: every row is the base model
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        # A static step's routing (`route_static`): its adapters in group order, padded with BASE
        # (empty otherwise), and each token's group as a one-hot, [max tokens, max groups].
        self.static_adapters: tuple[int, ...] = ()
        self.token_groups: torch.Tensor | None = None
        self.max_static_groups = 0

    def sets(self) -> list[AdapterSet]:
        return [linear.adapter for linear in self.model.linears() if isinstance(linear.adapter, AdapterSet)]

    def install(self, index: int, adapter: LoRAAdapter) -> None:
        """Installs `adapter` (built for these slots' model) for inference under `index` (> 0),
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
                wrap(linear, AdapterSet(self))
            members = linear.adapter
            if not isinstance(members, AdapterSet) or members.slots is not self:
                raise ValueError("a base layer already has an adapter that is not these slots' AdapterSet")
            members.members[str(index)] = module.eval().requires_grad_(False)
        self.installed.add(index)
        self.version += 1
        self._device_copies[index] = adapter
        self.host.pop(index, None)

    def _uninstall(self, index: int) -> LoRAAdapter | None:
        """Takes adapter `index`'s modules off every layer; returns the adapter (None: not installed)."""
        for adapter_set in self.sets():
            if str(index) in adapter_set.members:
                del adapter_set.members[str(index)]
        self.installed.discard(index)
        self.version += 1
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
        self.grouped, self.static_adapters = None, ()
        if not indices:
            self.groups = []
        elif len(set(row_adapters)) == 1:
            self.groups = [(row_adapters[0], None)]
        else:
            rows = {i: [b for b, a in enumerate(row_adapters) if a == i] for i in sorted(indices)}
            self.groups = [(i, torch.tensor(r, device=device)) for i, r in rows.items()]
            self.grouped = Grouped.of(rows, len(row_adapters), device)


    def reserve_static(self, max_tokens: int, max_groups: int) -> None:
        """Sizes static steps' routing (`route_static`): up to `max_tokens` tokens and
        `max_groups` adapters in one step (the one-hot buffer is allocated once, so captured
        graphs keep reading it)."""
        self.max_static_groups = max_groups
        self.token_groups = torch.zeros(max_tokens, max_groups, dtype=self.model.dtype, device=self.model.tp.device)

    def route_static(self, token_adapters: Sequence[int], tokens: int, groups: int) -> None:
        """Routes a static step (tprt.engine.step_graphs) of `tokens` token slots over `groups`
        adapter groups (0: every token on the base model); token_adapters[t] is token t's adapter,
        the slots past them padding on the base model. Every AdapterSet stages the factors of the
        step's adapters in fixed buffers and adds each token's delta through its group's one-hot,
        so one captured graph of `groups` groups serves any routing of at most that many adapters
        (the same kernels, whatever adapters and rows)."""
        self.groups, self.grouped = [], None
        adapters = sorted(set(token_adapters) - {BASE})
        if len(adapters) > groups or groups > self.max_static_groups or self.token_groups is None:
            raise ValueError(f"a static step routes {len(adapters)} adapters in {groups} groups; "
                             f"{self.max_static_groups} reserved (reserve_static)")
        self.static_adapters = tuple(adapters) + (BASE,) * (groups - len(adapters))
        if not groups:
            return
        where = {a: g for g, a in enumerate(adapters)}
        one_hot = torch.zeros(tokens, groups, dtype=self.token_groups.dtype)
        for t, a in enumerate(token_adapters):
            if a != BASE:
                one_hot[t, where[a]] = 1
        self.token_groups[:tokens, :groups].copy_(one_hot, non_blocking=True)
        for adapter_set in self.sets():
            adapter_set.stage(self.static_adapters)


class Grouped:
    """A mixed routing's rows grouped by adapter: `perm` [groups * size] the rows of each group in
    turn, each group padded to `size` by repeating its first row; `mask` [groups * size, 1] zero
    on padding (None without padding); `indices` each group's adapter index; `inverse` where each
    row is in `perm` when every row is there once (no padding, no base rows: the deltas are then
    put back in row order with a gather, cheaper than a scatter-add), else None."""

    def __init__(self, indices: tuple[int, ...], perm: torch.Tensor, mask: torch.Tensor | None, size: int,
                 inverse: torch.Tensor | None) -> None:
        self.indices = indices
        self.perm = perm
        self.mask = mask
        self.size = size
        self.inverse = inverse

    @classmethod
    def of(cls, rows: dict[int, list[int]], n_rows: int, device: torch.device) -> Grouped:
        """`rows`: each adapter's rows of a batch of `n_rows` (base rows are in none)."""
        size = max(len(r) for r in rows.values())
        perm = [b for r in rows.values() for b in r + [r[0]] * (size - len(r))]
        real = [1.0 * (j < len(r)) for r in rows.values() for j in range(size)]
        mask = None if all(real) else torch.tensor(real, device=device)[:, None]
        inverse = None
        if mask is None and sorted(perm) == list(range(n_rows)):  # every row, once
            where = {b: j for j, b in enumerate(perm)}
            inverse = torch.tensor([where[b] for b in range(len(perm))], device=device)
        return cls(tuple(rows), torch.tensor(perm, device=device), mask, size, inverse)


class AdapterSet(nn.Module):
    """A base layer's modules of several adapters (`adapter(x, y) -> y'` each), applied per row."""

    def __init__(self, slots: AdapterSlots) -> None:
        super().__init__()
        self.slots = slots
        self.members = nn.ModuleDict()  # str(adapter index) -> that adapter's module for this layer
        # Per target: (A [1 + members, r_max, in], B * scale [1 + members, out, r_max], (start, stop) or
        # None for every output column), built for slots version `_version`; `_slots` adapter index -> position.
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]] = {}
        self._slots: dict[int, int] = {}
        self._version = -1
        # The groups' factors picked from the stacks for the last routing's adapters, per target:
        # a decode step routes like the one before it, so the gathers are reused until it changes.
        self._picked: tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]]] = ((), [])
        # Static steps, per target: the staged adapters' A^T side by side [in, max groups * r_max],
        # their scaled B^T stacked [max groups * r_max, out], r_max, the output columns; and what
        # is staged in them (slots version, adapters).
        self._static: dict[str, tuple[torch.Tensor, torch.Tensor, int, tuple[int, int] | None]] = {}
        self._staged: tuple[int, ...] = ()

    def applies(self) -> bool:
        """Whether the current routing sends rows to a member of this set (tprt.lora.method.Adapter)."""
        if self.slots.static_adapters:  # a static step: every set with members adds (zeros where unrouted)
            return bool(self.members)
        return any(str(index) in self.members for index, _ in self.slots.groups)

    def stage(self, adapters: tuple[int, ...]) -> None:
        """Copies the factors of `adapters` (a static step's groups, in order; BASE: zeros) into
        this set's static buffers. The buffers are allocated once per installed set (slots
        version): graphs captured over them stay valid until that changes."""
        stacks = self._current_stacks()
        key = (self.slots.version, *adapters)
        if self._staged == key or not stacks:
            return
        capacity, n = self.slots.max_static_groups, len(adapters)
        if self._staged[:1] != key[:1]:
            self._static = {}
        device = next(iter(stacks.values()))[0].device
        positions = torch.tensor([self._slots.get(i, 0) for i in adapters], device=device)
        for t, (a, b, cols) in stacks.items():
            r = a.shape[1]
            if t not in self._static:
                self._static[t] = (a.new_zeros(a.shape[2], capacity * r), b.new_zeros(capacity * r, b.shape[1]),
                                   r, cols)
            a_cat, b_cat, _, _ = self._static[t]
            a_cat[:, : n * r] = a.index_select(0, positions).permute(2, 0, 1).reshape(a.shape[2], n * r)
            b_cat[: n * r] = b.index_select(0, positions).permute(0, 2, 1).reshape(n * r, b.shape[1])
        self._staged = key

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [rows, ...] the layer's input, y [rows, ...] its base output."""
        if self.slots.static_adapters:
            return self._static_step(x, y)
        grouped = self.slots.grouped
        if grouped is not None and not torch.is_grad_enabled():
            return self._grouped(grouped, x, y)
        for index, rows in self.slots.groups:
            if str(index) not in self.members:  # this adapter does not target this layer
                continue
            member = self.members[str(index)]
            if rows is None:
                y = member(x, y)
            else:
                y = y.index_copy(0, rows, member(x.index_select(0, rows), y.index_select(0, rows)))
        return y

    def _grouped(self, g: Grouped, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The grouped path (see the module docstring); y is updated in place."""
        n = len(g.indices)
        xs = x.index_select(0, g.perm)  # [groups * size, ..., in]
        xg = xs.reshape(n, -1, xs.shape[-1])  # [groups, size * tokens, in]
        for a_t, b_t, cols in self._factors(g.indices, x.device):
            z = torch.bmm(xg, a_t)  # [groups, size * tokens, r]
            d = torch.bmm(z, b_t)  # [groups, size * tokens, out]
            d = d.reshape(*xs.shape[:-1], d.shape[-1])
            if g.mask is not None:
                d = d * g.mask.view(-1, *([1] * (d.dim() - 1)))
            dest = y if cols is None else y[..., cols[0] : cols[1]]
            if g.inverse is not None:
                dest.add_(d.index_select(0, g.inverse))
            else:
                dest.index_add_(0, g.perm, d)
        return y

    def _static_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A static step's deltas (`AdapterSlots.route_static`): every token through the staged
        adapters' A side by side, each token's ranks masked to its group, then the stacked B;
        y is updated in place. Fixed shapes for a group count: what a CUDA graph replays."""
        groups = len(self.slots.static_adapters)
        assert self.slots.token_groups is not None
        xs = x.reshape(-1, x.shape[-1])  # [tokens, in]
        mask = self.slots.token_groups[: xs.shape[0], :groups, None]  # [tokens, groups, 1]
        for a_cat, b_cat, r, cols in self._static.values():
            z = (xs @ a_cat[:, : groups * r]).view(-1, groups, r) * mask  # [tokens, groups, r]
            d = z.view(-1, groups * r) @ b_cat[: groups * r]  # [tokens, out]
            dest = y if cols is None else y[..., cols[0] : cols[1]]
            dest.add_(d.view(dest.shape))
        return y

    def _factors(self, indices: tuple[int, ...], device: torch.device
                 ) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]]:
        """Per target: A^T [groups, in, r] and (scale B)^T [groups, r, out] of the groups' adapters
        (zeros for one that does not target this layer), and the output columns they add to."""
        stacks = self._current_stacks()
        key = (self.slots.version, *indices)
        if self._picked[0] != key:
            positions = torch.tensor([self._slots.get(i, 0) for i in indices], device=device)
            picked = [(a.index_select(0, positions).transpose(1, 2).contiguous(),
                       b.index_select(0, positions).transpose(1, 2).contiguous(), cols) for a, b, cols in stacks.values()]
            self._picked = (key, picked)
        return self._picked[1]

    def _current_stacks(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]]:
        """Every member's factors stacked per target (rebuilt when the installed adapters change)."""
        if self._version == self.slots.version:
            return self._stacks
        members = sorted((int(k), cast(LoRAModule, m)) for k, m in self.members.items())
        self._slots = {index: pos for pos, (index, _) in enumerate(members, start=1)}
        self._stacks = {}
        targets = dict.fromkeys(t for _, m in members for t in m.lora_A)
        for t in targets:
            having = [(pos, m) for pos, (_, m) in enumerate(members, start=1) if t in m.lora_A]
            first = having[0][1]
            a0, b0 = first.lora_A[t], first.lora_B[t]
            r_max = max(m.lora_A[t].shape[0] for _, m in having)
            a_stack = a0.new_zeros(len(members) + 1, r_max, a0.shape[1])
            b_stack = b0.new_zeros(len(members) + 1, b0.shape[0], r_max)
            for pos, m in having:
                r = m.lora_A[t].shape[0]
                a_stack[pos, :r] = m.lora_A[t].detach()
                b_stack[pos, :, :r] = m.lora_B[t].detach() * m.scale
            segments = getattr(first, "segments", None)
            cols = None if segments is None else (segments[t].start, segments[t].stop)
            self._stacks[t] = (a_stack, b_stack, cols)
        self._version = self.slots.version
        return self._stacks
