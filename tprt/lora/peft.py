"""Tensor-parallel LoRA: adapters on the fused, sharded projections that compute exactly what
Hugging Face PEFT computes on the unsharded model, and PEFT-format state dicts.

A LoRA on a weight W [out, in] adds `scale * B (A x)` with A [r, in], B [out, r], scale = alpha / r.

- **Column-parallel base** (q, k, v, gate, up; fused per rank as [q_r; k_r; v_r], [gate_r; up_r]):
  A is replicated, B holds this rank's rows of the target, and the delta is added to the target's
  rows of the fused output only (a q-only LoRA leaves k/v rows alone). The adapter reads the
  input after the base layer's copy-to-region, so the input gradient is summed by the base's own
  all-reduce; each rank's A gradient is then a share of the whole (only its rows of B
  contribute) and `sync_gradients` sums it over the TP group. B rows of a replicated kv head
  (TP > n_kv_heads) are summed over the ranks holding that head, like the base k/v rows.
- **Row-parallel base** (o, down): A holds this rank's input columns, B is replicated. The
  delta `scale * B (A_r x_r)` is added to the rank's partial output *before* the base's
  all-reduce, which sums the shares into `scale * B (A x)`: no extra collective. B's gradient is
  a share (x_r only) and is summed over the TP group by `sync_gradients`.

Initialisation is PEFT's (A Kaiming-uniform, B zero), drawn for the whole unsharded matrix from a
seeded generator on every rank and sliced, so every rank agrees and the result does not depend
on the TP degree. With dropout > 0 the masks come from each rank's RNG: seed the TP ranks alike
for the column adapters' masks to agree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tprt.distributed.context import TPContext
from tprt.errors import CheckpointError, ConfigError, ValidationError
from tprt.cpu.fast_linear import prepack
from tprt.model.llama import DecoderLayer, TPLlamaForCausalLM
from tprt.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tprt.parallel.sharding import KV, LAYER_LINEARS, ROW, module_rule
from tprt.parallel.spec import TPSpec, mark_tp_params, set_spec


def _target(module: str) -> str:
    """The short target name of an HF linear module: self_attn.q_proj -> q."""
    return module.split(".")[1].removesuffix("_proj")


# Short target name -> HF module, in canonical order (the runtime's row order, tprt.parallel.sharding).
HF_MODULES = {_target(m): m for parts in LAYER_LINEARS.values() for m in parts}
TARGETS = tuple(HF_MODULES)
PEFT_PREFIX = "base_model.model.model.layers"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def normalize_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """Short target names (q, ..., down) in canonical order; HF names (q_proj, ...) are accepted."""
    if isinstance(targets, str):
        targets = [t for t in targets.replace(",", " ").split() if t]
    if not targets:
        raise ValidationError("lora_targets", f"no LoRA target given; allowed: {', '.join(TARGETS)}")
    out = set()
    for t in targets:
        short = t.removesuffix("_proj")
        if short not in TARGETS:
            raise ValidationError(
                "lora_targets",
                f"unknown LoRA target {t!r}; allowed: {', '.join(TARGETS)} (or {', '.join(hf_names(TARGETS))})",
            )
        out.add(short)
    return tuple(t for t in TARGETS if t in out)


def hf_names(targets: Sequence[str]) -> list[str]:
    """HF module names (q_proj, ...) of short targets, as PEFT's `target_modules`."""
    return [HF_MODULES[t].split(".")[1] for t in targets]


def _check_hparams(rank: int, alpha: float, dropout: float) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise ValidationError("lora_rank", f"LoRA rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise ValidationError("lora_alpha", f"LoRA alpha must be positive, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValidationError("lora_dropout", f"LoRA dropout must be in [0, 1), got {dropout!r}")


# ----------------------------------------------------------------------------- adapter modules


@dataclass(frozen=True)
class Segment:
    """One target's rows [start, stop) in this rank's (fused) column-parallel output."""

    target: str
    start: int
    stop: int


class _LoRA(nn.Module):
    """Common state: per-target A and B (ParameterDicts keyed by short target name)."""

    def __init__(self, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()

    @property
    def targets(self) -> list[str]:
        return list(self.lora_A.keys())

    def delta(self, target: str, x: torch.Tensor) -> torch.Tensor:
        """scale * B (A dropout(x)) for one target: [..., in] -> [..., rows of B]."""
        z = F.linear(self.dropout(x), self.lora_A[target])  # [..., rank]
        return F.linear(z, self.lora_B[target]) * self.scale


class ColumnLoRA(_LoRA):
    """LoRA on a column-parallel layer: A [rank, in] replicated, B [rows, rank] this rank's rows of
    its target; the delta goes to the target's rows of the fused output."""

    def __init__(self, rank: int, alpha: float, dropout: float, segments: Sequence[Segment]) -> None:
        super().__init__(rank, alpha, dropout)
        self.segments = {s.target: s for s in segments}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [..., in] as copied to this rank; y [..., local_out] the base output (updated in place
        when autograd is off)."""
        if not torch.is_grad_enabled():
            for t, seg in self.segments.items():
                y[..., seg.start : seg.stop] += self.delta(t, x)
            return y
        # Under autograd one out-of-place add of the concatenated deltas: in-place adds into row
        # slices would each cost a CopySlices and a zero-filled gradient of all of y.
        pieces, at = [], 0
        for t, seg in sorted(self.segments.items(), key=lambda item: item[1].start):
            if seg.start > at:
                pieces.append(y.new_zeros(*y.shape[:-1], seg.start - at))
            pieces.append(self.delta(t, x))
            at = seg.stop
        if at < y.shape[-1]:
            pieces.append(y.new_zeros(*y.shape[:-1], y.shape[-1] - at))
        return y + torch.cat(pieces, dim=-1)

    @torch.no_grad()
    def merge_into(self, weight: torch.Tensor) -> None:
        for t, seg in self.segments.items():
            w = weight[seg.start : seg.stop]
            w.copy_(w.float() + self.scale * (self.lora_B[t].float() @ self.lora_A[t].float()))


class RowLoRA(_LoRA):
    """LoRA on a row-parallel layer: A [rank, in_local] this rank's input columns, B [out, rank]
    replicated; the delta joins the rank's partial output before the base's all-reduce."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [..., in_local]; y [..., out] this rank's partial base output (before the all-reduce)."""
        for t in self.lora_A:
            y = y + self.delta(t, x)
        return y

    @torch.no_grad()
    def merge_into(self, weight: torch.Tensor) -> None:
        for t in self.lora_A:
            weight.copy_(weight.float() + self.scale * (self.lora_B[t].float() @ self.lora_A[t].float()))


# ----------------------------------------------------------------------------- where adapters go


@dataclass(frozen=True)
class _Site:
    """One base layer of one decoder layer that LoRA may target."""

    layer: int
    linear: ColumnParallelLinear | RowParallelLinear
    segments: tuple[Segment, ...]  # every target this layer can take, with its local rows
    full_in: int  # the unsharded weight's input size
    kv_replication: int  # >1: k/v segments are held by that many ranks each


def _sites(model: TPLlamaForCausalLM) -> Iterator[_Site]:
    """Every linear layer of every decoder layer, its targets laid out as tprt.parallel.sharding says."""
    cfg, tp, rep = model.config, model.tp.world_size, model.layout.kv_replication
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.n_heads * attn.head_dim, attn.n_kv * attn.head_dim
        inter = mlp.down_proj.weight.shape[1]
        rows = {"q": q, "k": kv, "v": kv, "gate": inter, "up": inter}  # this rank's rows of each column target
        for name, parts in LAYER_LINEARS.items():
            linear = layer.get_submodule(name)
            assert isinstance(linear, (ColumnParallelLinear, RowParallelLinear))
            targets = [_target(m) for m in parts]
            if module_rule(parts[0]).kind == ROW:  # one target: every output row; input split over ranks
                yield _Site(i, linear, (Segment(targets[0], 0, cfg.hidden_size),), linear.weight.shape[1] * tp, 1)
                continue
            starts = [sum(rows[t] for t in targets[:j]) for j in range(len(targets) + 1)]
            segments = tuple(Segment(t, starts[j], starts[j + 1]) for j, t in enumerate(targets))
            kv_rep = rep if any(module_rule(m).kind == KV for m in parts) else 1
            yield _Site(i, linear, segments, cfg.hidden_size, kv_rep)


def _peft_key(layer: int, target: str, factor: str) -> str:
    return f"{PEFT_PREFIX}.{layer}.{HF_MODULES[target]}.lora_{factor}.weight"


def lora_modules(model: TPLlamaForCausalLM) -> list[tuple[_Site, ColumnLoRA | RowLoRA]]:
    """Every applied adapter with the base layer it sits on, in layer order."""
    out = []
    for site in _sites(model):
        adapter = site.linear.adapter
        if isinstance(adapter, (ColumnLoRA, RowLoRA)):
            out.append((site, adapter))
    return out


def _block(full: torch.Tensor, dim: int, blocks: int, index: int) -> torch.Tensor:
    """Block `index` of `blocks` equal blocks of `full` along `dim`."""
    n = full.shape[dim] // blocks
    return full.narrow(dim, index * n, n)


def _replication(site: _Site, target: str) -> int:
    return site.kv_replication if target in ("k", "v") else 1


def _local_factor(full: torch.Tensor, site: _Site, target: str, factor: str, ctx: TPContext) -> torch.Tensor:
    """This rank's part of a full (unsharded) factor: B rows of a column target (a kv head is
    held by `kv_replication` ranks), A columns of a row target; the rest is replicated."""
    column = isinstance(site.linear, ColumnParallelLinear)
    if column and factor == "B":
        rep = _replication(site, target)
        return _block(full, 0, ctx.world_size // rep, ctx.rank // rep)
    if not column and factor == "A":
        return _block(full, 1, ctx.world_size, ctx.rank)
    return full


def _full_shape(site: _Site, seg: Segment, factor: str, rank: int, tp: int) -> tuple[int, int]:
    if factor == "A":
        return rank, site.full_in
    if isinstance(site.linear, RowParallelLinear):
        return site.linear.weight.shape[0], rank
    return (seg.stop - seg.start) * tp // _replication(site, seg.target), rank


def _kaiming_a(gen: torch.Generator, rank: int, full_in: int) -> torch.Tensor:
    """PEFT's A init, kaiming_uniform_(a=sqrt(5)): uniform in +-1/sqrt(fan_in), [rank, full_in]."""
    bound = 1.0 / math.sqrt(full_in)
    return (torch.rand(rank, full_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound


def _new_adapter(
    site: _Site, chosen: Sequence[Segment], rank: int, alpha: float, dropout: float,
    gen: torch.Generator, ctx: TPContext,
) -> ColumnLoRA | RowLoRA:
    """Adapter for `chosen` targets of one base layer, initialised as PEFT and marked with TPSpecs."""
    weight = site.linear.weight
    column = isinstance(site.linear, ColumnParallelLinear)
    adapter: ColumnLoRA | RowLoRA = ColumnLoRA(rank, alpha, dropout, chosen) if column else RowLoRA(rank, alpha, dropout)
    for seg in chosen:
        a_full = _kaiming_a(gen, rank, site.full_in)
        b_shape = _full_shape(site, seg, "B", rank, ctx.world_size)
        a = nn.Parameter(_local_factor(a_full, site, seg.target, "A", ctx).to(weight.device, weight.dtype))
        b_local = _local_factor(torch.zeros(b_shape), site, seg.target, "B", ctx)
        b = nn.Parameter(b_local.to(weight.device, weight.dtype))
        rep = _replication(site, seg.target)
        if column:
            set_spec(a, TPSpec(replicated=True, partial_grad=True))
            set_spec(b, TPSpec(kv_rows=(0, b.shape[0]), kv_replication=rep) if rep > 1 else TPSpec())
        else:
            set_spec(a, TPSpec())
            set_spec(b, TPSpec(replicated=True, partial_grad=True))
        adapter.lora_A[seg.target] = a
        adapter.lora_B[seg.target] = b
    return adapter


def apply_lora(
    model: TPLlamaForCausalLM,
    targets: Sequence[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    seed: int = 0,
    pack_base: bool = True,
) -> list[nn.Parameter]:
    """Freezes the base model and puts a LoRA adapter on every targeted projection of every layer.

    With `pack_base`, on CPU the frozen base linears then run forward and input-gradient from
    oneDNN-packed copies (`tprt.cpu.fast_linear.prepack`; a no-op on GPU): faster steps for one more
    copy of the base weights in memory (docs/PERF.md).

    targets: a subset of q, k, v, o, gate, up, down (or q_proj, ...); anything else is a
    ValidationError naming it and listing the allowed ones. Returns the new (trainable)
    parameters, each marked with its TP layout. The same `seed` on every rank gives every rank
    its slice of the same unsharded initialisation (PEFT's: A Kaiming-uniform, B zero).
    """
    names = normalize_targets(targets)
    _check_hparams(rank, alpha, dropout)
    if lora_modules(model):
        raise ConfigError("LoRA adapters are already applied to this model")
    model.requires_grad_(False)
    mark_tp_params(model)
    gen = torch.Generator().manual_seed(seed)
    params: list[nn.Parameter] = []
    for site in _sites(model):
        chosen = [s for s in site.segments if s.target in names]
        if chosen:
            adapter = _new_adapter(site, chosen, rank, alpha, dropout, gen, model.tp)
            site.linear.adapter = adapter
            params.extend(adapter.parameters())
    if pack_base:
        prepack(model, tune=False, norms=False)
    return params


# ----------------------------------------------------------------------------- state, merge, config


def _all_gather(t: torch.Tensor, ctx: TPContext) -> list[torch.Tensor]:
    if ctx.world_size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group)
    return parts


def _full_factor(param: torch.Tensor, site: _Site, target: str, factor: str, ctx: TPContext) -> torch.Tensor:
    """The unsharded factor from every rank's part (collective when the factor is sharded)."""
    column = isinstance(site.linear, ColumnParallelLinear)
    if column and factor == "B":
        return torch.cat(_all_gather(param, ctx)[:: _replication(site, target)], dim=0)
    if not column and factor == "A":
        return torch.cat(_all_gather(param, ctx), dim=1)
    return param


@torch.no_grad()
def lora_state_dict(model: TPLlamaForCausalLM, ctx: TPContext) -> dict[str, torch.Tensor]:
    """Every adapter's full (unsharded) A and B under PEFT's names
    (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, ...), on the CPU, on TP
    rank 0; the other ranks get {}. Collective over the TP group (all-gathers the sharded factors)."""
    out: dict[str, torch.Tensor] = {}
    for site, adapter in lora_modules(model):
        for t in adapter.targets:
            for factor, param in (("A", adapter.lora_A[t]), ("B", adapter.lora_B[t])):
                full = _full_factor(param.detach(), site, t, factor, ctx)
                if ctx.rank == 0:
                    out[_peft_key(site.layer, t, factor)] = full.to("cpu", copy=True).contiguous()
    return out


def _peft_name(key: str) -> str:
    """PEFT's saved name of a key that may carry the adapter name (`lora_A.default.weight`)."""
    for factor in ("lora_A", "lora_B"):
        key = key.replace(f".{factor}.default.weight", f".{factor}.weight")
    return key


@torch.no_grad()
def load_lora_state_dict(model: TPLlamaForCausalLM, state: dict[str, torch.Tensor], ctx: TPContext) -> None:
    """Fills the applied adapters with this rank's slices of full PEFT-named factors (every rank
    passes the whole state, e.g. adapter_model.safetensors). Each factor must be there with its
    unsharded shape; tensors for projections without an adapter are an error. No communication."""
    state = {_peft_name(k): v for k, v in state.items()}
    adapters = lora_modules(model)
    if not adapters:
        raise ConfigError("the model has no LoRA adapters; apply_lora with the adapter's targets first")
    expected: set[str] = set()
    for site, adapter in adapters:
        for seg in (s for s in site.segments if s.target in adapter.targets):
            for factor, param in (("A", adapter.lora_A[seg.target]), ("B", adapter.lora_B[seg.target])):
                key = _peft_key(site.layer, seg.target, factor)
                expected.add(key)
                if key not in state:
                    raise CheckpointError(f"LoRA state: tensor {key!r} missing")
                want = _full_shape(site, seg, factor, adapter.rank, ctx.world_size)
                if tuple(state[key].shape) != want:
                    raise CheckpointError(f"LoRA state: tensor {key!r} has shape {list(state[key].shape)}; expected {list(want)}")
                param.copy_(_local_factor(state[key], site, seg.target, factor, ctx))
    extra = sorted(set(state) - expected)
    if extra:
        raise CheckpointError(
            f"LoRA state: {len(extra)} tensor(s) for projections without an adapter, e.g. {extra[0]!r}; "
            "apply_lora with the adapter's targets"
        )


@torch.no_grad()
def merge_lora(model: TPLlamaForCausalLM) -> int:
    """Folds every adapter into its base weight (W += scale * B A on this rank's rows or columns,
    computed in float32) and removes the adapters, so the model computes the same outputs without
    them. Returns the number of base layers changed (their packed copies, if any, are dropped:
    `tprt.cpu.fast_linear.prepack` again to speed them up). No communication."""
    adapters = lora_modules(model)
    for site, adapter in adapters:
        adapter.merge_into(site.linear.weight)
        site.linear.adapter = None
        site.linear.fast_linear = None
    return len(adapters)


def adapter_config(
    targets: Sequence[str], rank: int, alpha: float, dropout: float, base_model_path: str | Path | None
) -> dict[str, Any]:
    """PEFT's adapter_config.json for these settings (target_modules as HF module names)."""
    names = normalize_targets(targets)
    _check_hparams(rank, alpha, dropout)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_model_path is None else str(base_model_path),
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": hf_names(names),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }


_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
                "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def read_adapter_config(cfg: dict[str, Any], source: str = ADAPTER_CONFIG) -> tuple[tuple[str, ...], int, float, float]:
    """(targets, rank, alpha, dropout) of a PEFT LoRA adapter_config.json; options tprt's LoRA
    does not implement are refused with the field named."""
    if cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{source}: field 'peft_type' must be 'LORA', got {cfg.get('peft_type')!r}")
    for key, default in _UNSUPPORTED.items():
        if cfg.get(key, default) not in (default, None, {}, []) and cfg.get(key) != default:
            raise ConfigError(f"{source}: field {key!r}={cfg[key]!r} is not supported (expected {default!r})")
    modules = cfg.get("target_modules")
    if modules == "all-linear":
        modules = list(TARGETS)
    if not isinstance(modules, list):
        raise ConfigError(f"{source}: field 'target_modules' must be a list of module names, got {modules!r}")
    targets = normalize_targets(modules)
    rank, alpha, dropout = cfg.get("r"), cfg.get("lora_alpha", 8), float(cfg.get("lora_dropout", 0.0))
    _check_hparams(rank, alpha, dropout)  # type: ignore[arg-type]
    return targets, int(rank), float(alpha), dropout  # type: ignore[arg-type]


def load_adapter(model: TPLlamaForCausalLM, path: str | Path, ctx: TPContext) -> list[nn.Parameter]:
    """Applies and fills the PEFT LoRA adapter in directory `path` (adapter_config.json and
    adapter_model.safetensors, as PEFT's save_pretrained writes them); returns its parameters."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: not found; expected a PEFT LoRA adapter directory") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: not valid JSON ({e.msg} at line {e.lineno})") from None
    targets, rank, alpha, dropout = read_adapter_config(cfg, str(path / ADAPTER_CONFIG))
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{weights}: not found; expected the adapter's weights")
    # For inference: the caller's runner packs (and tunes) the base weights once, if at all.
    params = apply_lora(model, targets, rank, alpha, dropout, pack_base=False)
    load_lora_state_dict(model, load_file(str(weights)), ctx)
    return params
