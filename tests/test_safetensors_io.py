"""tprt.checkpoint.safetensors_io against the reference safetensors library, and its error messages."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tprt.errors import CheckpointError
from tprt.checkpoint.safetensors_io import SafetensorsFile, StreamingSafetensorsWriter, read_header, sha256_file, st_dtype


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(5, 7, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "c": torch.arange(12, dtype=torch.int64).reshape(2, 2, 3),
        "d": torch.randn(4, 2, generator=g).half(),
    }


def test_reads_reference_files(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    infos, metadata = read_header(tmp_path / "x.safetensors")
    assert metadata == {"format": "pt"}
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        for name, t in tensors.items():
            assert infos[name].shape == tuple(t.shape) and infos[name].dtype == st_dtype(t.dtype)
            assert torch.equal(f.tensor(name), t)
            assert f.raw(name).shape == tuple(t.shape)
            assert f.raw(name).tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_streaming_writer_matches_reference(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    entries = [(n, st_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "y.safetensors"
    w = StreamingSafetensorsWriter(path, entries, {"format": "pt"}, max_queued=1)
    for t in tensors.values():
        raw = t.contiguous().view(torch.uint8).numpy().reshape(-1)
        for s in range(0, raw.size, 5):  # many small, unaligned chunks
            w.write(np.ascontiguousarray(raw[s : s + 5]))
    size, digest = w.close()
    assert size == path.stat().st_size == w.size
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() == sha256_file(path)
    got = load_file(path)
    for name, t in tensors.items():
        assert torch.equal(got[name], t)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % 8 == 0  # data 8-byte aligned


def test_streaming_writer_refuses_short_data(tmp_path: Path) -> None:
    w = StreamingSafetensorsWriter(tmp_path / "z.safetensors", [("a", "F32", (4,))])
    w.write(b"\0" * 12)
    with pytest.raises(CheckpointError, match="header promises"):
        w.close()


def _corrupt(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "bad.safetensors"
    p.write_bytes(data)
    return p


def test_header_errors(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with pytest.raises(CheckpointError, match="no header length"):
        read_header(_corrupt(tmp_path, b"abc"))
    with pytest.raises(CheckpointError, match="declares"):
        read_header(_corrupt(tmp_path, struct.pack("<Q", 10**6) + b"{}"))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_header(_corrupt(tmp_path, struct.pack("<Q", 4) + b"{{{{"))
    bad_span = json.dumps({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    with pytest.raises(CheckpointError, match="'a' spans 8 bytes"):
        read_header(_corrupt(tmp_path, struct.pack("<Q", len(bad_span)) + bad_span + b"\0" * 12))
    save_file(tensors, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(_corrupt(tmp_path, data[:-3]))
    with pytest.raises(CheckpointError, match="file not found"):
        read_header(tmp_path / "nope.safetensors")
