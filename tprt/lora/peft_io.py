"""LoRA adapters in Hugging Face PEFT's format: the state dict, adapter_config.json, a directory.

A PEFT state dict holds each factor whole (unsharded) under PEFT's names
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, ...); each rank keeps its
slice (tprt.lora.sites). `read_adapter` builds an adapter from a directory as PEFT's
save_pretrained writes it, without attaching it to the model.
"""

from __future__ import annotations

import re

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tprt.distributed.context import TPContext
from tprt.checkpoint.safetensors_io import SafetensorsFile
from tprt.errors import CheckpointError, ConfigError, ValidationError
from tprt.lora.attach import LoRAAdapter, build_lora
from tprt.lora.config import HF_MODULES, TARGETS, check_hparams, hf_names, normalize_targets
from tprt.lora.sites import full_factor, full_shape, local_factor
from tprt.model.config import read_json_object
from tprt.model.llama import TPLlamaForCausalLM

PEFT_PREFIX = "base_model.model.model.layers"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_key(layer: int, target: str, factor: str) -> str:
    return f"{PEFT_PREFIX}.{layer}.{HF_MODULES[target]}.lora_{factor}.weight"


@torch.no_grad()
def lora_state_dict(adapter: LoRAAdapter, ctx: TPContext) -> dict[str, torch.Tensor]:
    """The adapter's full (unsharded) A and B under PEFT's names, on the CPU, on TP rank 0; the
    other ranks get {}. Collective over the TP group (all-gathers the sharded factors)."""
    out: dict[str, torch.Tensor] = {}
    for site, module in adapter.pieces:
        for t in module.targets:
            for factor, param in (("A", module.lora_A[t]), ("B", module.lora_B[t])):
                full = full_factor(param.detach(), site, t, factor, ctx)
                if ctx.rank == 0:
                    out[peft_key(site.layer, t, factor)] = full.to("cpu", copy=True).contiguous()
    return out


def _peft_name(key: str) -> str:
    """PEFT's saved name of a key that may carry the adapter name (`lora_A.default.weight`)."""
    for factor in ("lora_A", "lora_B"):
        key = key.replace(f".{factor}.default.weight", f".{factor}.weight")
    return key


@torch.no_grad()
def load_lora_state_dict(adapter: LoRAAdapter, state: dict[str, torch.Tensor], ctx: TPContext) -> None:
    """Fills the adapter with this rank's slices of full PEFT-named factors (every rank passes
    the whole state, e.g. adapter_model.safetensors). Each factor must be there with its
    unsharded shape; tensors for projections the adapter does not target are an error. No
    communication."""
    state = {_peft_name(k): v for k, v in state.items()}
    if not adapter.pieces:
        raise ConfigError("no LoRA adapters to fill; build one with the adapter's targets first")
    expected: set[str] = set()
    for site, module in adapter.pieces:
        for seg in (s for s in site.segments if s.target in module.targets):
            for factor, param in (("A", module.lora_A[seg.target]), ("B", module.lora_B[seg.target])):
                key = peft_key(site.layer, seg.target, factor)
                expected.add(key)
                if key not in state:
                    raise CheckpointError(f"LoRA state: tensor {key!r} missing")
                want = full_shape(site, seg, factor, module.rank, ctx.world_size)
                if tuple(state[key].shape) != want:
                    raise CheckpointError(f"LoRA state: tensor {key!r} has shape {list(state[key].shape)}; expected {list(want)}")
                param.copy_(local_factor(state[key], site, seg.target, factor, ctx))
    extra = sorted(set(state) - expected)
    if extra:
        raise CheckpointError(
            f"LoRA state: {len(extra)} tensor(s) for projections without an adapter, e.g. {extra[0]!r}; "
            "build the adapter with its targets"
        )


def adapter_config(
    targets: Sequence[str], rank: int, alpha: float, dropout: float, base_model_path: str | Path | None
) -> dict[str, Any]:
    """PEFT's adapter_config.json for these settings (target_modules as HF module names)."""
    names = normalize_targets(targets)
    check_hparams(rank, alpha, dropout)
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
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"{source}: field 'target_modules' must be a list of module names, got {_short(modules)}")
    targets = normalize_targets(modules)
    rank, alpha, dropout = cfg.get("r"), cfg.get("lora_alpha", 8), cfg.get("lora_dropout", 0.0)
    try:
        check_hparams(rank, alpha, dropout)  # type: ignore[arg-type]
    except ValidationError as e:
        field = {"lora_rank": "r"}.get(e.field, e.field)
        raise ConfigError(f"{source}: field {field!r}: {e}") from None
    return targets, int(rank), float(alpha), float(dropout)  # type: ignore[arg-type]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_config_file(path: Path, shown: str, error: type[ConfigError] | type[CheckpointError]) -> dict[str, Any]:
    """The adapter directory `path`'s adapter_config.json as a dict; `error` naming it as `shown`
    (a path, or just a name where the full path is not to be shown) when it is missing, not
    JSON or not an object."""
    return read_json_object(path / ADAPTER_CONFIG, shown, "a PEFT LoRA adapter directory", error)


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # the dtypes a LoRA factor may be stored in


def check_factor_dtype(name: str, dtype: str, shown: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{shown}: tensor {_short(name, 120)} is {dtype}; a LoRA factor is floating point")


def read_adapter_weights(path: Path, shown: str) -> dict[str, torch.Tensor]:
    """The tensors of the adapter directory `path`'s adapter_model.safetensors, copied out of the
    file; CheckpointError naming the file as `shown` (a path, or just a name) when it is missing
    or corrupt (its header is validated before any tensor is read: tprt.checkpoint.safetensors_io)
    and naming the tensor when one is not floating point or holds NaN or infinity."""
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{shown}: not found; expected the adapter's weights")
    out: dict[str, torch.Tensor] = {}
    with SafetensorsFile(weights, shown) as f:
        for name, info in f.tensors.items():
            check_factor_dtype(name, info.dtype, shown)
            t = f.tensor(name).clone()
            if not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"{shown}: tensor {_short(name, 120)} holds NaN or infinite values")
            out[name] = t
    return out


def read_adapter(model: TPLlamaForCausalLM, path: str | Path, ctx: TPContext) -> LoRAAdapter:
    """The PEFT LoRA adapter in directory `path` (adapter_config.json and adapter_model.safetensors,
    as PEFT's save_pretrained writes them), built for `model` and filled; not attached."""
    path = Path(path)
    cfg = read_config_file(path, str(path / ADAPTER_CONFIG), CheckpointError)
    targets, rank, alpha, dropout = read_adapter_config(cfg, str(path / ADAPTER_CONFIG))
    state = read_adapter_weights(path, str(path / ADAPTER_WEIGHTS))
    if len(model.decoder_layers) < model.config.num_hidden_layers:  # a pipeline stage: its layers' factors
        held = set(model.held_layers)
        state = {k: v for k, v in state.items()
                 if (m := re.search(r"\.layers\.(\d+)\.", k)) is None or int(m.group(1)) in held}
    adapter = build_lora(model, targets, rank, alpha, dropout)
    load_lora_state_dict(adapter, state, ctx)
    return adapter
