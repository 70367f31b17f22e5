"""Quantization in the stream: a source wrapper that presents the decoder's linear weights
quantized (tprt.quant.formats), each `X.weight` in the format's storage dtype followed by its
`X.weight_scale` float32 [out, groups]. The copy engine reads it like any source, row range by
row range, so memory stays bounded: a weight's rows are quantized as they are read, and their
scales are kept until the scale tensor (planned right after the weight) is written, at most
4 / group_size bytes per weight element (per channel: 4 bytes per row).

A GGUF Q8_0 weight converted to int8 with group size 32 is taken as stored (its int8 blocks and
their fp16 scales): no float round trip, the values llama.cpp computes with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from convert.rules import is_quantized
from tprt.checkpoint.safetensors_io import DTYPE_SIZES
from tprt.parallel.sharding import SCALE_SUFFIX
from tprt.quant.formats import QuantSpec, quantize

if TYPE_CHECKING:
    import torch

    from convert.sources import ByteRange, TensorSource


class QuantizingSource:
    """`inner` (a float model) with its decoder linear weights quantized as `spec` says."""

    def __init__(self, inner: TensorSource, spec: QuantSpec) -> None:
        self.inner, self.spec = inner, spec
        self.path, self.config, self.config_json = inner.path, inner.config, inner.config_json
        self.weight_map = inner.weight_map
        self._scales: dict[str, torch.Tensor] = {}  # weight -> its scales, filled as its rows are read

    def names(self, names: list[str]) -> list[str]:
        """`names` with each quantized weight's scale tensor right after it."""
        return [x for n in names for x in ((n, n + "_scale") if is_quantized(n) else (n,))]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = dict(self.inner.shapes())
        for name, shape in list(shapes.items()):
            if is_quantized(name):
                shapes[name + "_scale"] = (shape[0], self.spec.groups(shape[1]))
        return shapes

    def dtype(self, name: str) -> str:
        if name.endswith(SCALE_SUFFIX):
            return "F32"
        return self.spec.safetensors_dtype if is_quantized(name) else self.inner.dtype(name)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name.endswith(SCALE_SUFFIX):
            return self._scale_rows(name.removesuffix("_scale"), start, stop)
        if not is_quantized(name):
            return self.inner.read_rows(name, start, stop)
        q, scale = self._quantized(name, start, stop)
        self._keep_scales(name, start, scale)
        return q

    def _quantized(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        as_stored = getattr(self.inner, "q8_0_rows", None)
        if self.spec.name == "int8" and self.spec.group_size == 32 and as_stored is not None:
            got = as_stored(name, start, stop)
            if got is not None:
                return got  # type: ignore[no-any-return]
        return quantize(self.inner.read_rows(name, start, stop), self.spec)

    def _keep_scales(self, name: str, start: int, scale: torch.Tensor) -> None:
        import torch

        if name not in self._scales:
            rows = self.inner.shapes()[name][0]
            self._scales[name] = torch.empty(rows, scale.shape[1], dtype=torch.float32)
        self._scales[name][start : start + scale.shape[0]] = scale

    def _scale_rows(self, weight: str, start: int, stop: int) -> torch.Tensor:
        kept = self._scales.get(weight)
        if kept is None:  # not read through this source (e.g. the weight was copied elsewhere)
            return self._quantized(weight, start, stop)[1]
        rows = kept[start:stop].clone()
        if stop == kept.shape[0]:
            del self._scales[weight]  # written in order: the last rows end the tensor
        return rows

    # RawSource: byte-level paths for what passes through unchanged, bytes of the rest.
    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        raw = getattr(self.inner, "raw_rows", None)
        if raw is not None and not is_quantized(name) and not name.endswith(SCALE_SUFFIX):
            return raw(name, start, stop)  # type: ignore[no-any-return]
        t = self.read_rows(name, start, stop).contiguous()
        row = int(np.prod(t.shape[1:], dtype=np.int64)) * DTYPE_SIZES[self.dtype(name)]
        return t.reshape(-1).view(_u8()).numpy().reshape(stop - start, row)

    def byte_ranges(self, name: str, start: int, stop: int) -> list[ByteRange] | None:
        ranges = getattr(self.inner, "byte_ranges", None)
        if ranges is None or is_quantized(name) or name.endswith(SCALE_SUFFIX):
            return None
        return ranges(name, start, stop)  # type: ignore[no-any-return]

    def release_after(self, names: list[str]) -> dict[str, Callable[[], None]]:
        """The inner source's releases (a Hub shard), each after the last tensor read from it."""
        release = getattr(self.inner, "release_after", None)
        if release is None:
            return {}
        inner_names = [n for n in names if not n.endswith(SCALE_SUFFIX)]
        out: dict[str, Callable[[], None]] = release(inner_names)
        # a weight's scales come from rows already read: its release may wait until they are written
        return {(n + "_scale" if is_quantized(n) else n): fn for n, fn in out.items()}

    def order(self) -> list[str]:
        order: Any = getattr(self.inner, "order", None)
        return self.names(order() if callable(order) else sorted(self.inner.shapes()))

    def aux_files(self) -> dict[str, bytes]:
        return self.inner.aux_files()

    def close(self) -> None:
        self.inner.close()


def _u8() -> torch.dtype:
    import torch

    return torch.uint8
