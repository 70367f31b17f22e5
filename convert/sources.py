"""Where the converter reads weights from: one protocol, three kinds of source.

Every source presents the model under Hugging Face names in HF layout ([out, in]), with the
true (unpadded) vocabulary and without kv replication, whatever the storage looks like. The
engine only ever asks for row ranges, so no source has to materialise a whole tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from tprt.config import ModelConfig


@runtime_checkable
class TensorSource(Protocol):
    """A model to convert, read row range by row range."""

    path: Path
    config: ModelConfig  # parsed
    config_json: dict[str, Any]  # written as DST/config.json (HF form)
    weight_map: dict[str, str] | None  # tensor name -> HF shard file name, if the source had shards

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF names -> HF global shapes ([out, in]; true vocabulary, no kv replication)."""
        ...

    def dtype(self, name: str) -> str:
        """safetensors dtype name of the stored (or dequantised) data: "F32", "BF16", ..."""
        ...

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0 (for 1-D tensors: elements), contiguous, HF layout."""
        ...

    def aux_files(self) -> dict[str, bytes]:
        """tokenizer.json, tokenizer_config.json, generation_config.json, ... to write into DST."""
        ...

    def close(self) -> None: ...


def open_source(path: Path) -> TensorSource:
    """A TP checkpoint (has tprt_manifest.json), an HF directory, or a .gguf file."""
    raise NotImplementedError  # filled in with the HF and TP sources
