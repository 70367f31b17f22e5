"""Bad inputs and failing outputs: one line on stderr naming the culprit, a non-zero exit, and
no DST (nor any temporary directory) left behind."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

import convert.engine
from convert import api, copy, sink
from convert.cli import main
from convert.sink import FileSink
from helpers import make_hf_llama


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine")
    return {
        "single": make_hf_llama(root / "single", "gqa"),
        "sharded": make_hf_llama(root / "sharded", "gqa", max_shard_size="100KB"),
    }


@pytest.fixture
def model(pristine: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the single-file model, free to damage."""
    return Path(shutil.copytree(pristine["single"], tmp_path / "src"))


@pytest.fixture
def sharded(pristine: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine["sharded"], tmp_path / "src_sharded"))


def fails(capsys: pytest.CaptureFixture[str], argv: list[str], code: int, *needles: str) -> str:
    """Runs the CLI, expects exit `code`, one error line containing every needle, and no DST."""
    assert main([*argv, "--no-progress"] if argv[0] != "verify" else argv) == code
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tprt-convert: error: "), err
    for needle in needles:
        assert needle in err, err
    dst = Path(argv[2])
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]  # no temp dirs
    return err


def to_tp(src: Path, dst: Path, tp: int = 2) -> list[str]:
    return ["hf-to-tp", str(src), str(dst), "--tp", str(tp)]


def test_missing_shard(sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (sharded / "model-00003-of-00005.safetensors").unlink()
    fails(capsys, to_tp(sharded, tmp_path / "out"), 2, "model-00003-of-00005.safetensors", "missing", "index")


def test_truncated_safetensors(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = model / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    fails(capsys, to_tp(model, tmp_path / "out"), 2, "model.safetensors", "truncated")


def test_corrupted_header(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = model / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:24] = b"\xff" * 16
    f.write_bytes(bytes(data))
    fails(capsys, to_tp(model, tmp_path / "out"), 2, "model.safetensors", "corrupt safetensors header")


def test_shape_disagrees_with_config(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 120
    (model / "config.json").write_text(json.dumps(cfg))
    fails(capsys, to_tp(model, tmp_path / "out"), 2, "model.layers.0.mlp.gate_proj.weight", "[128, 64]", "[120, 64]")


def _rewrite(model: Path, edit: Any) -> None:
    tensors = load_file(model / "model.safetensors")
    edit(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _rewrite(model, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    fails(capsys, to_tp(model, tmp_path / "out"), 2, "model.layers.1.self_attn.v_proj.weight", "missing")


def test_unexpected_tensor(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _rewrite(model, lambda t: t.update({"model.layers.2.input_layernorm.weight": t["model.norm.weight"].clone()}))
    fails(capsys, to_tp(model, tmp_path / "out"), 2, "model.layers.2.input_layernorm.weight", "unexpected")


def test_foreign_tensor(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _rewrite(model, lambda t: t.update({"transformer.wte.weight": t["model.norm.weight"].clone()}))
    fails(capsys, to_tp(model, tmp_path / "out"), 2, "transformer.wte.weight")


def test_unsupported_architecture(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model / "config.json").write_text(json.dumps(cfg))
    fails(capsys, to_tp(model, tmp_path / "out"), 2, "config.json", "GPT2LMHeadModel")


@pytest.mark.parametrize("tp", [3, 16])
def test_tp_not_allowed_by_heads(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], tp: int) -> None:
    fails(capsys, to_tp(model, tmp_path / "out", tp), 2, f"--tp {tp}", "[1, 2, 4, 8]")


def test_not_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    fails(capsys, to_tp(tmp_path / "empty", tmp_path / "out"), 2, "empty", "config.json")
    fails(capsys, to_tp(tmp_path / "nowhere", tmp_path / "out"), 2, "nowhere", "not found")


def test_bad_dtype_and_shard_size(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, [*to_tp(model, tmp_path / "out"), "--dtype", "int4"], 2, "--dtype", "int4")
    fails(capsys, ["tp-to-hf", str(model), str(tmp_path / "out"), "--max-shard-size", "lots"], 2, "--max-shard-size")


def test_existing_dst_needs_force(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert main([*to_tp(model, dst), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(dst) in err and "--force" in err
    assert (dst / "keep.txt").read_text() == "mine"
    assert main([*to_tp(model, dst), "--force", "--no-progress"]) == 0
    assert not (dst / "keep.txt").exists() and (dst / "tprt_manifest.json").is_file()
    assert api.verify(dst) == []


def test_missing_parent_of_dst(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*to_tp(model, tmp_path / "absent" / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parent directory of DST does not exist" in err and "absent" in err, err
    assert not (tmp_path / "absent").exists()


def test_not_enough_space_up_front(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert.engine.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))  # type: ignore[attr-defined]
    fails(capsys, to_tp(model, tmp_path / "out"), 1, "not enough free space", "out")


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_disk_full_mid_stream(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, kernel_copy: bool) -> None:
    """Writes (and kernel copies) fail with ENOSPC once 150 kB have gone through."""
    budget = [150_000]
    real_write, real_copy = FileSink._os_write, FileSink._os_copy

    def spend(n: int) -> None:
        if budget[0] < n:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget[0] -= n

    def write(self: FileSink, mv: memoryview) -> int:
        spend(len(mv))
        return real_write(self, mv)

    def copy_range(self: FileSink, fd: int, count: int, pos: int) -> int:
        spend(count)
        return real_copy(self, fd, count, pos)

    monkeypatch.setattr(copy, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(sink, "_copy_file_range_ok", kernel_copy)
    monkeypatch.setattr(FileSink, "_os_write", write)
    monkeypatch.setattr(FileSink, "_os_copy", copy_range)
    fails(capsys, to_tp(model, tmp_path / "out"), 1, "No space left on device", "out")


def test_interrupt_leaves_nothing(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls = []
    real = copy.copy_tensor

    def interrupted(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(copy, "copy_tensor", interrupted)
    fails(capsys, to_tp(model, tmp_path / "out"), 130, "interrupted")


def test_verify_flipped_byte(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "tp"
    api.hf_to_tp(model, dst, tp=2)
    assert main(["verify", str(dst)]) == 0
    capsys.readouterr()
    f = dst / "rank-00001-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01
    f.write_bytes(bytes(data))
    assert main(["verify", str(dst)]) == 1
    out = capsys.readouterr().out
    assert "rank-00001-of-00002.safetensors" in out and "sha256" in out
    assert "rank-00000" not in out


def test_verify_missing_rank_file(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "tp"
    api.hf_to_tp(model, dst, tp=4)
    (dst / "rank-00002-of-00004.safetensors").unlink()
    assert main(["verify", str(dst)]) == 1
    out = capsys.readouterr().out
    assert "rank-00002-of-00004.safetensors" in out and "missing" in out


def test_verify_tampered_manifest_shape(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "tp"
    api.hf_to_tp(model, dst, tp=2)
    m = json.loads((dst / "tprt_manifest.json").read_text())
    m["tensors"]["model.layers.0.mlp.up_proj.weight"]["shape"] = [64, 64]
    (dst / "tprt_manifest.json").write_text(json.dumps(m))
    assert main(["verify", str(dst)]) == 1
    assert "model.layers.0.mlp.up_proj.weight" in capsys.readouterr().out


def test_reshard_from_damaged_checkpoint(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    api.hf_to_tp(model, tmp_path / "tp", tp=2)
    (tmp_path / "tp" / "rank-00001-of-00002.safetensors").unlink()
    fails(capsys, ["reshard", str(tmp_path / "tp"), str(tmp_path / "out"), "--tp", "4"], 2,
          "rank-00001-of-00002.safetensors", "missing")
