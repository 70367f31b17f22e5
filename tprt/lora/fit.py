"""Whether a PEFT adapter directory fits a base model, read from its files alone (no weights loaded).

A server checks an adapter before every rank loads it, so a bad one is refused with a clear line
instead of failing on each rank: its adapter_config.json must be a LoRA tprt implements, its rank
within the server's limit, and every tensor of adapter_model.safetensors must have the shape this
base model's projection needs (an adapter built for another base model differs in hidden size,
widths or layer count).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tprt.checkpoint.safetensors_io import read_header
from tprt.errors import CheckpointError, ConfigError
from tprt.lora.peft_io import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_factor_dtype, peft_key, read_adapter_config,
                              read_adapter_weights, read_config_file)
from tprt.model.config import ModelConfig


@dataclass(frozen=True)
class AdapterFacts:
    """What an adapter directory says about itself."""

    targets: tuple[str, ...]
    rank: int
    alpha: float


def in_out(config: ModelConfig, target: str) -> tuple[int, int]:
    """The unsharded (in, out) features of a target projection."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h),
            "gate": (h, inter), "up": (h, inter), "down": (inter, h)}[target]


def read_facts(path: Path, max_rank: int | None = None) -> AdapterFacts:
    """The adapter's targets, rank and alpha; ConfigError for a missing or unsupported config or a
    rank over `max_rank`."""
    cfg = read_config_file(path, f"{path.name}/{ADAPTER_CONFIG}", ConfigError)
    targets, rank, alpha, _ = read_adapter_config(cfg, f"{path.name}/{ADAPTER_CONFIG}")
    if max_rank is not None and rank > max_rank:
        raise ConfigError(f"{path.name}: LoRA rank r={rank} is over this server's limit of {max_rank} (--max-lora-rank)")
    return AdapterFacts(targets, rank, alpha)


def check_fits(path: Path, config: ModelConfig, facts: AdapterFacts, values: bool = True) -> None:
    """CheckpointError unless adapter_model.safetensors is sound (a valid header, floating point
    tensors, and with `values` no NaN or infinity: peft_io.read_adapter_weights, which reads every
    tensor; the ranks check the values again when they load it) and holds exactly A and B of
    every targeted projection of every layer of `config`'s model, in the shapes rank `facts.rank`
    needs."""
    shown = f"{path.name}/{ADAPTER_WEIGHTS}"
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(f"{shown}: not found; expected the adapter's weights")
    want: dict[str, tuple[int, int]] = {}
    for layer in range(config.num_hidden_layers):
        for t in facts.targets:
            n_in, n_out = in_out(config, t)
            want[peft_key(layer, t, "A")] = (facts.rank, n_in)
            want[peft_key(layer, t, "B")] = (n_out, facts.rank)
    tensors, _ = read_header(path / ADAPTER_WEIGHTS, shown)  # shapes first: no tensor is read for a mismatch
    for name, info in tensors.items():
        check_factor_dtype(name, info.dtype, shown)
    have = {k.replace(".default.weight", ".weight"): info.shape for k, info in tensors.items()}
    for key, shape in have.items():
        if key not in want:
            raise CheckpointError(f"{path.name}: tensor {key!r} has no projection in this base model "
                                  f"({config.num_hidden_layers} layers; targets {', '.join(facts.targets)}): "
                                  "the adapter was built for another base model")
        if shape != want[key]:
            raise CheckpointError(f"{path.name}: tensor {key!r} has shape {list(shape)}; this base model needs "
                                  f"{list(want[key])}: the adapter was built for another base model")
    missing = sorted(set(want) - set(have))
    if missing:
        raise CheckpointError(f"{path.name}: {len(missing)} tensor(s) missing, e.g. {missing[0]!r} "
                              f"(this base model has {config.num_hidden_layers} layers)")
    if values:
        read_adapter_weights(path, shown)
