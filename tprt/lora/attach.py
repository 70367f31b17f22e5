"""A LoRA adapter for a model: built on its own, then attached to (or detached from) the model.

`build_lora` makes one adapter module per targeted base layer, initialised as PEFT does (A
Kaiming-uniform, B zero) and marked with its TP layout (tprt.parallel.spec), without touching
the model. The initialisation is drawn for each whole unsharded matrix from a seeded generator
on every rank and sliced, so every rank agrees and the result does not depend on the TP degree.

`attach` wraps each module around its base layer's linear method (tprt.lora.method), `detach`
takes them off again; `apply_lora` is training's step: build, freeze the base model, attach. Serving installs
adapters side by side instead (tprt.lora.routing).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tprt.distributed.context import TPContext
from tprt.errors import ConfigError
from tprt.lora.config import TARGETS, check_hparams, normalize_targets
from tprt.lora.method import unwrap, wrap
from tprt.lora.modules import ColumnLoRA, LoRAModule, RowLoRA, Segment
from tprt.lora.sites import Site, full_shape, local_factor, sites
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.spec import TPSpec, mark_tp_params, set_spec


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's modules, each with the site (base layer) it belongs on, in layer order."""

    pieces: tuple[tuple[Site, LoRAModule], ...]

    @property
    def rank(self) -> int:
        return self.pieces[0][1].rank

    @property
    def alpha(self) -> float:
        return self.pieces[0][1].alpha

    @property
    def targets(self) -> tuple[str, ...]:
        """The targets it adapts, in canonical order."""
        found = {t for _, module in self.pieces for t in module.targets}
        return tuple(t for t in TARGETS if t in found)

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, module in self.pieces for p in module.parameters()]


def _kaiming_a(gen: torch.Generator, rank: int, full_in: int) -> torch.Tensor:
    """PEFT's A init, kaiming_uniform_(a=sqrt(5)): uniform in +-1/sqrt(fan_in), [rank, full_in]."""
    bound = 1.0 / math.sqrt(full_in)
    return (torch.rand(rank, full_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound


def _new_module(
    site: Site, chosen: Sequence[Segment], rank: int, alpha: float, dropout: float,
    gen: torch.Generator, ctx: TPContext, dtype: torch.dtype,
) -> LoRAModule:
    """The module for `chosen` targets of one base layer, initialised as PEFT and marked with TPSpecs,
    in `dtype` (the model's compute dtype: a quantized base's int8/FP8 weight is not a float type
    to train in)."""
    weight = site.linear.weight
    module: LoRAModule = ColumnLoRA(rank, alpha, dropout, chosen) if site.column else RowLoRA(rank, alpha, dropout)
    for seg in chosen:
        a_full = _kaiming_a(gen, rank, site.full_in)
        b_shape = full_shape(site, seg, "B", rank, ctx.world_size)
        a = nn.Parameter(local_factor(a_full, site, seg.target, "A", ctx).to(weight.device, dtype))
        b_local = local_factor(torch.zeros(b_shape), site, seg.target, "B", ctx)
        b = nn.Parameter(b_local.to(weight.device, dtype))
        rep = site.replication(seg.target)
        if site.column:
            set_spec(a, TPSpec(replicated=True, partial_grad=True))
            set_spec(b, TPSpec(kv_rows=(0, b.shape[0]), kv_replication=rep) if rep > 1 else TPSpec())
        else:
            set_spec(a, TPSpec())
            set_spec(b, TPSpec(replicated=True, partial_grad=True))
        module.lora_A[seg.target] = a
        module.lora_B[seg.target] = b
    return module


def build_lora(
    model: TPLlamaForCausalLM, targets: Sequence[str], rank: int, alpha: float, dropout: float = 0.0, seed: int = 0,
) -> LoRAAdapter:
    """A new adapter for every targeted projection of every layer of `model`, not attached.

    targets: a subset of q, k, v, o, gate, up, down (or q_proj, ...); anything else is a
    ValidationError naming it and listing the allowed ones. The same `seed` on every rank gives
    every rank its slice of the same unsharded initialisation. On a pipeline stage
    (tprt.model.stage) the draws of the layers other stages hold are made and dropped, so the
    stage's layers start as the whole model's do.
    """
    names = normalize_targets(targets)
    check_hparams(rank, alpha, dropout)
    gen = torch.Generator().manual_seed(seed)
    by_layer: dict[int, list[Site]] = {}
    for site in sites(model):
        by_layer.setdefault(site.layer, []).append(site)
    template = next(iter(by_layer.values()), [])  # every layer has the same sites
    pieces = []
    for layer in range(model.config.num_hidden_layers):
        for site in by_layer.get(layer, template):
            chosen = [s for s in site.segments if s.target in names]
            if not chosen:
                continue
            if layer in by_layer:
                pieces.append((site, _new_module(site, chosen, rank, alpha, dropout, gen, model.tp, model.dtype)))
            else:  # another stage's layer: its A factors' draws
                for _ in chosen:
                    _kaiming_a(gen, rank, site.full_in)
    return LoRAAdapter(tuple(pieces))


def attach(model: TPLlamaForCausalLM, adapter: LoRAAdapter) -> None:
    """Puts the adapter's modules on their base layers of `model` (which it was built for)."""
    linears = {id(linear) for linear in model.linears()}
    if any(id(site.linear) not in linears for site, _ in adapter.pieces):
        raise ValueError("the adapter was built for another model")
    if any(site.linear.adapter is not None for site, _ in adapter.pieces):
        raise ConfigError("a targeted layer already has an adapter; detach it first")
    for site, module in adapter.pieces:
        wrap(site.linear, module)


def attached(model: TPLlamaForCausalLM) -> LoRAAdapter:
    """The LoRA modules attached to `model` (none: no pieces)."""
    return LoRAAdapter(tuple((site, site.linear.adapter) for site in sites(model)
                             if isinstance(site.linear.adapter, (ColumnLoRA, RowLoRA))))


def detach(model: TPLlamaForCausalLM) -> LoRAAdapter:
    """Takes every attached LoRA module off `model`; returns them (they can be attached again)."""
    adapter = attached(model)
    for site, _ in adapter.pieces:
        unwrap(site.linear)
    return adapter


@contextmanager
def adapter_off(model: TPLlamaForCausalLM) -> Iterator[None]:
    """`model` without its attached LoRA modules for the body of the `with`, then with them again:
    the base model's output from the same weights (DPO's reference), no copy."""
    adapter = detach(model)
    try:
        yield
    finally:
        attach(model, adapter)


def apply_lora(
    model: TPLlamaForCausalLM, targets: Sequence[str], rank: int, alpha: float, dropout: float = 0.0, seed: int = 0,
) -> list[nn.Parameter]:
    """Training's step: builds an adapter (`build_lora`), freezes the base model, marks its TP
    layout and attaches the adapter; returns the adapter's (trainable) parameters. On CPU a
    trainer may then give the frozen base packed matmuls: `tprt.cpu.fast_linear.prepack`."""
    adapter = build_lora(model, targets, rank, alpha, dropout, seed)
    if attached(model).pieces:
        raise ConfigError("LoRA adapters are already applied to this model")
    model.requires_grad_(False)
    mark_tp_params(model)
    attach(model, adapter)
    return adapter.parameters()
