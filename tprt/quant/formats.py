"""Quantization math shared by the converter and the runtime: symmetric, one float32 scale per
output row and group of `group` input columns (per channel: one group spanning the row).

A weight W [out, in] is stored as Q [out, in] (int8 or float8_e4m3fn) and S float32
[out, in // group], with W ~= Q * S broadcast over each group. Groups run along the input dim, so
a column-parallel split (rows) keeps every group whole and a row-parallel split (columns) does
when each rank's columns are a whole number of groups (`check_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tprt.errors import ConfigError

if TYPE_CHECKING:
    import torch  # imported where needed: the converter plans without loading torch

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT_FORMATS = ("int8", "fp8")  # manifest `extra.weight_format` names


@dataclass(frozen=True)
class QuantSpec:
    """A quantized weight format: its name in the manifest, storage dtype and group size (None:
    per output channel)."""

    name: str  # "int8" or "fp8"
    group_size: int | None = None

    @property
    def storage(self) -> torch.dtype:
        import torch

        return torch.int8 if self.name == "int8" else torch.float8_e4m3fn

    @property
    def safetensors_dtype(self) -> str:
        return "I8" if self.name == "int8" else "F8_E4M3"

    def groups(self, in_features: int) -> int:
        """Scale columns of a weight with `in_features` input columns."""
        return 1 if self.group_size is None else in_features // self.group_size

    def to_extra(self) -> dict[str, object]:
        """The manifest's `extra` fields that record this format."""
        return {"weight_format": self.name, "group_size": self.group_size}


def parse_spec(quantize: str | None, group_size: int | None) -> QuantSpec | None:
    """--quantize / --group-size -> a spec (None: dense); bad values are one-line errors."""
    if quantize is None:
        if group_size is not None:
            raise ConfigError("--group-size applies with --quantize int8 only")
        return None
    if quantize not in ("int8", "fp8"):
        raise ConfigError(f"--quantize {quantize!r} is not supported; expected int8 or fp8")
    if group_size is not None:
        if quantize == "fp8":
            raise ConfigError("--group-size: fp8 weights have one scale per output channel; use it with --quantize int8")
        if group_size < 1 or group_size % 16:
            raise ConfigError(f"--group-size {group_size}: expected a positive multiple of 16")
    return QuantSpec(quantize, group_size)


def spec_from_extra(extra: dict[str, object], where: str) -> QuantSpec | None:
    """The spec a manifest's `extra` records (None: dense)."""
    name = extra.get("weight_format", "dense")
    if name == "dense":
        return None
    group = extra.get("group_size")
    if name not in ("int8", "fp8") or not (group is None or (isinstance(group, int) and group > 0)):
        raise ConfigError(f"{where}: weight_format {name!r} with group_size {group!r} is not supported "
                          "(expected dense, int8 or fp8, and a positive group_size or none)")
    return QuantSpec(str(name), group if isinstance(group, int) else None)


def check_groups(spec: QuantSpec, layer: str, in_features: int, tp_split: int) -> None:
    """A weight with `in_features` input columns split over `tp_split` ranks along them (1: not
    split) must keep every group whole; else a one-line error naming `layer`."""
    g = spec.group_size
    if g is None:
        return
    if in_features % g:
        raise ConfigError(f"{layer}: {in_features} input columns are not a whole number of groups of "
                          f"--group-size {g}")
    if tp_split > 1 and (in_features // tp_split) % g:
        raise ConfigError(f"{layer}: TP={tp_split} gives each rank {in_features // tp_split} input columns, "
                          f"which splits a group of --group-size {g}; choose a TP size or group size that "
                          "keeps groups whole")


def quantize(w: torch.Tensor, spec: QuantSpec, native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """W [rows, in] (any float dtype) -> (Q [rows, in] in spec.storage, S float32 [rows, groups]).
    int8 of float32/bf16 runs in tprt's compiled kernels when they are there (`native`; the same
    results as the torch code below, which is the reference)."""
    import torch

    rows, cols = w.shape
    if spec.group_size is not None and cols % spec.group_size:
        raise ValueError(f"{cols} columns are not a whole number of groups of {spec.group_size}")
    g = spec.groups(cols)
    if spec.name == "int8" and native:
        from tprt.cpu.native import quantize_q8

        done = quantize_q8(w, cols // g)  # the same numbers, 10-20x faster (the converter's hot loop)
        if done is not None:
            return done
    wf = w.float().reshape(rows, g, cols // g)  # [rows, groups, group]
    amax = wf.abs().amax(dim=-1)  # [rows, groups]
    top = INT8_MAX if spec.name == "int8" else FP8_MAX
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))  # an all-zero group stays zero
    scaled = wf / scale.unsqueeze(-1)
    if spec.name == "int8":
        q = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Q [rows, in] and S [rows, groups] -> W [rows, in] in `dtype` (products taken in float32)."""
    import torch

    rows, cols = q.shape
    g = scale.shape[1]
    w = q.to(torch.float32).reshape(rows, g, cols // g) * scale.to(torch.float32).unsqueeze(-1)  # [rows, groups, group]
    return w.reshape(rows, cols).to(dtype or torch.float32)
