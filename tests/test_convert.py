"""The converter against independent references: TP slices computed here with torch.chunk from
the tensors transformers saved, round trips compared bit for bit, outputs loaded by transformers."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert import api, copy, sink
from convert.cli import main
from helpers import FAMILY_CONFIGS, TINY_CONFIGS, make_hf_llama, make_hf_model
from tprt.checkpoint.format import MANIFEST_NAME, TPCheckpoint, rank_file_name


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {name: make_hf_llama(root / name, name) for name in TINY_CONFIGS}
    out["gqa_sharded"] = make_hf_llama(root / "gqa_sharded", "gqa", max_shard_size="100KB")
    out["gqa_bf16"] = make_hf_llama(root / "gqa_bf16", "gqa", dtype=torch.bfloat16, seed=1)
    out.update({name: make_hf_model(root / name, name) for name in FAMILY_CONFIGS})
    return out


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def reference_slice(name: str, t: torch.Tensor, cfg: dict, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice by the TP rules, computed independently of the converter."""
    if t.dim() == 1 and not name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return t  # norms, o_proj's bias: replicated
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        multiple = 64 * tp
        padded = -(-cfg["vocab_size"] // multiple) * multiple
        t = torch.cat([t, torch.zeros(padded - t.shape[0], t.shape[1], dtype=t.dtype)])
        return torch.chunk(t, tp, dim=0)[rank]
    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
        n_kv = cfg["num_key_value_heads"]
        if tp > n_kv:
            return torch.chunk(t, n_kv, dim=0)[rank // (tp // n_kv)]
        return torch.chunk(t, tp, dim=0)[rank]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.chunk(t, tp, dim=1)[rank]
    return torch.chunk(t, tp, dim=0)[rank]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("config", [*TINY_CONFIGS, *FAMILY_CONFIGS])
def test_hf_to_tp_slices(models: dict[str, Path], tmp_path: Path, config: str, tp: int) -> None:
    src, dst = models[config], tmp_path / "tp"
    manifest = api.hf_to_tp(src, dst, tp=tp)
    cfg, ref = config_of(src), hf_tensors(src)
    if cfg.get("tie_word_embeddings"):
        ref.pop("lm_head.weight", None)
    multiple = 64 * tp
    assert manifest.tp_size == tp
    assert manifest.vocab_size == cfg["vocab_size"]
    assert manifest.padded_vocab_size == -(-cfg["vocab_size"] // multiple) * multiple
    assert set(manifest.tensors) == set(ref)
    for rank in range(tp):
        got = load_file(dst / rank_file_name(rank, tp))
        assert set(got) == set(ref)
        for name, t in ref.items():
            want = reference_slice(name, t, cfg, tp, rank)
            assert torch.equal(got[name], want), (name, rank)
    n_kv = cfg["num_key_value_heads"]
    k = manifest.tensors["model.layers.0.self_attn.k_proj.weight"]
    assert (k.split_dim, k.kv_replication) == (0, max(1, tp // n_kv))
    assert manifest.tensors["model.layers.1.mlp.down_proj.weight"].split_dim == 1
    assert manifest.tensors["model.norm.weight"].split_dim is None
    assert manifest.tensors["model.embed_tokens.weight"].shape[0] == manifest.padded_vocab_size
    for fname, entry in manifest.files.items():
        data = (dst / fname).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry.size, entry.sha256)
    assert json.loads((dst / MANIFEST_NAME).read_text())["tp_size"] == tp
    assert config_of(dst) == cfg
    assert api.verify(dst) == []


def test_padding_rows_are_zero(models: dict[str, Path], tmp_path: Path) -> None:
    api.hf_to_tp(models["rope_pad"], tmp_path / "tp", tp=4)  # vocab 250 -> 256
    last = load_file(tmp_path / "tp" / rank_file_name(3, 4))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert last[name].shape[0] == 64
        assert torch.count_nonzero(last[name][250 - 192 :]) == 0
        assert torch.count_nonzero(last[name][: 250 - 192]) > 0


def test_runtime_loader_accepts_output(models: dict[str, Path], tmp_path: Path) -> None:
    api.hf_to_tp(models["gqa"], tmp_path / "tp", tp=8)
    ckpt = TPCheckpoint(tmp_path / "tp")
    rank = ckpt.open_rank(5)
    k = rank.tensor("model.layers.0.self_attn.k_proj.weight")
    ref = hf_tensors(models["gqa"])["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(k, ref[16:24])  # head 5 // 2 = 2, head_dim 8
    rank.close()


def assert_same_hf(a: Path, b: Path) -> None:
    ta, tb = hf_tensors(a), hf_tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("source", ["gqa_sharded", "gqa_bf16", "tied", "rope_pad", *FAMILY_CONFIGS])
def test_round_trip_hf_tp8_tp2_hf(models: dict[str, Path], tmp_path: Path, source: str) -> None:
    src = models[source]
    tp = 8 if source != "rope_pad" else 4
    assert main(["hf-to-tp", str(src), str(tmp_path / "a"), "--tp", str(tp), "--no-progress"]) == 0
    assert main(["reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--tp", "2", "--no-progress"]) == 0
    assert main(["tp-to-hf", str(tmp_path / "b"), str(tmp_path / "hf"), "--no-progress"]) == 0
    assert_same_hf(src, tmp_path / "hf")
    if (src / "model.safetensors.index.json").exists():  # the shard grouping is reproduced
        index = lambda d: json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
        assert index(tmp_path / "hf") == index(src)
    else:
        assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == ["model.safetensors"]
    assert config_of(tmp_path / "hf") == config_of(src)


def test_tp_to_hf_loads_in_transformers(models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    api.hf_to_tp(models["rope_pad"], tmp_path / "tp", tp=8)
    api.tp_to_hf(tmp_path / "tp", tmp_path / "hf")
    got = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    want = LlamaForCausalLM.from_pretrained(models["rope_pad"]).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_family_exports_load_in_transformers(models: dict[str, Path], tmp_path: Path, family: str) -> None:
    """Qwen2 / Qwen3 at TP 4 and back: transformers loads the export as the same architecture,
    every tensor (biases, q/k norms) bit-identical."""
    from transformers import AutoModelForCausalLM

    api.hf_to_tp(models[family], tmp_path / "tp", tp=4)
    api.tp_to_hf(tmp_path / "tp", tmp_path / "hf")
    got, want = (AutoModelForCausalLM.from_pretrained(d) for d in (tmp_path / "hf", models[family]))
    assert type(got) is type(want) and type(got).__name__.startswith(FAMILY_CONFIGS[family][0].removesuffix("Text"))
    assert got.state_dict().keys() == want.state_dict().keys()
    assert all(torch.equal(got.state_dict()[n], t) for n, t in want.state_dict().items())


def test_tied_export_loads_in_transformers(models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    api.hf_to_tp(models["tied"], tmp_path / "tp", tp=2)
    api.tp_to_hf(tmp_path / "tp", tmp_path / "hf")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    ref = LlamaForCausalLM.from_pretrained(models["tied"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)


def test_max_shard_size_regroups(models: dict[str, Path], tmp_path: Path) -> None:
    api.hf_to_tp(models["gqa"], tmp_path / "tp", tp=2)
    files = api.tp_to_hf(tmp_path / "tp", tmp_path / "hf", max_shard_size="150KB")
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert_same_hf(models["gqa"], tmp_path / "hf")


def test_dtype_conversion_matches_torch(models: dict[str, Path], tmp_path: Path) -> None:
    manifest = api.hf_to_tp(models["gqa"], tmp_path / "tp", tp=2, dtype="bf16")
    assert manifest.dtype == "BF16"
    assert config_of(tmp_path / "tp")["dtype"] == "bfloat16"
    api.tp_to_hf(tmp_path / "tp", tmp_path / "hf")
    ref = hf_tensors(models["gqa"])
    got = hf_tensors(tmp_path / "hf")
    for name, t in ref.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name
    api.tp_to_hf(tmp_path / "tp", tmp_path / "hf32", dtype="float32")
    for name, t in hf_tensors(tmp_path / "hf32").items():
        assert torch.equal(t, ref[name].to(torch.bfloat16).float()), name


def test_pytorch_bin_source(models: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "bin"
    src.mkdir()
    shutil.copy(models["gqa"] / "config.json", src / "config.json")
    ref = hf_tensors(models["gqa"])
    torch.save(ref, src / "pytorch_model.bin")
    api.hf_to_tp(src, tmp_path / "tp", tp=4)
    api.tp_to_hf(tmp_path / "tp", tmp_path / "hf")
    assert_same_hf(models["gqa"], tmp_path / "hf")


def test_sharded_pytorch_bin_source(models: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "bin"
    src.mkdir()
    shutil.copy(models["gqa"] / "config.json", src / "config.json")
    ref = hf_tensors(models["gqa"])
    names = sorted(ref)
    weight_map = {}
    for k, part in enumerate((names[:7], names[7:])):
        fname = f"pytorch_model-{k + 1:05d}-of-00002.bin"
        torch.save({n: ref[n] for n in part}, src / fname)
        weight_map.update({n: fname for n in part})
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    api.hf_to_tp(src, tmp_path / "tp", tp=2)
    files = api.tp_to_hf(tmp_path / "tp", tmp_path / "hf")
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert_same_hf(models["gqa"], tmp_path / "hf")


@pytest.mark.parametrize("chunk", [800, 3000])
def test_tiny_chunks_give_identical_files(models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    src = models["rope_pad"]
    api.hf_to_tp(src, tmp_path / "whole", tp=4)
    api.hf_to_tp(src, tmp_path / "whole_bf16", tp=4, dtype="bf16")
    monkeypatch.setattr(copy, "CHUNK_BYTES", chunk)  # rows straddle rank, head and padding boundaries
    a = api.hf_to_tp(src, tmp_path / "chunked", tp=4)
    b = api.hf_to_tp(src, tmp_path / "chunked_bf16", tp=4, dtype="bf16")
    assert a.files == api.hf_to_tp(src, tmp_path / "again", tp=4).files
    for name in a.files:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "chunked" / name).read_bytes()
    for name in b.files:
        assert (tmp_path / "whole_bf16" / name).read_bytes() == (tmp_path / "chunked_bf16" / name).read_bytes()
    api.reshard(tmp_path / "chunked", tmp_path / "tp8", tp=8)
    api.tp_to_hf(tmp_path / "tp8", tmp_path / "hf")
    assert_same_hf(src, tmp_path / "hf")


def test_without_kernel_copies(models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_file_range refused (EXDEV, as across filesystems on old kernels): buffered fallback."""
    import errno

    api.hf_to_tp(models["gqa_sharded"], tmp_path / "kernel", tp=8)
    calls = []

    def refuse(*args: object) -> int:
        calls.append(1)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(sink, "_copy_file_range_ok", True)
    monkeypatch.setattr(sink.os, "copy_file_range", refuse)
    monkeypatch.setattr(copy, "CHUNK_BYTES", 1000)
    m = api.hf_to_tp(models["gqa_sharded"], tmp_path / "buffered", tp=8)
    assert calls and not sink._copy_file_range_ok
    for name in m.files:
        assert (tmp_path / "kernel" / name).read_bytes() == (tmp_path / "buffered" / name).read_bytes()
    api.tp_to_hf(tmp_path / "buffered", tmp_path / "hf")
    assert_same_hf(models["gqa_sharded"], tmp_path / "hf")


def test_hash_without_mappings(models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Source ranges that cannot be mapped are hashed through reads; the manifest stays right."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no mmap here")

    monkeypatch.setattr(sink.mmap, "mmap", refuse)
    monkeypatch.setattr(sink, "HASH_READ_BYTES", 1000)
    api.hf_to_tp(models["rope_pad"], tmp_path / "tp", tp=4)
    assert api.verify(tmp_path / "tp") == []


def test_tokenizer_files_travel(models: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(models["gqa"], src)
    (src / "tokenizer.json").write_text('{"model": {}}')
    (src / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    m = api.hf_to_tp(src, tmp_path / "tp", tp=2)
    assert m.files["tokenizer.json"].rank == -1
    api.tp_to_hf(tmp_path / "tp", tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes()


def test_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "hf-to-tp" in out and "reshard" in out


def test_progress_bar_on_stderr(models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hf-to-tp", str(models["gqa"]), str(tmp_path / "tp"), "--tp", "2", "--progress"]) == 0
    assert "B/s" in capsys.readouterr().err


@pytest.mark.parametrize("config,tp", [("gqa", 2), ("tied", 2), ("rope_pad", 4)])
def test_sharding_table_describes_the_output(models: dict[str, Path], tmp_path: Path, config: str, tp: int) -> None:
    """tprt.parallel.sharding's table is what the converter writes (each tensor's split dimension
    and per-rank shape, kv heads replicated only for KV weights), and its fused parameters fill
    the runtime's own parameter shapes at this TP degree (hf_sources covers the manifest exactly)."""
    from tprt.distributed.context import TPContext
    from tprt.model.config import ModelConfig, TPLayout
    from tprt.model.llama import TPLlamaForCausalLM
    from tprt.parallel.sharding import KV, REPLICATED, hf_sources, rule_for

    manifest = api.hf_to_tp(models[config], tmp_path / "tp", tp=tp)
    cfg = ModelConfig.from_file(models[config] / "config.json")
    replication = TPLayout.for_model(cfg, tp).kv_replication
    files = [load_file(tmp_path / "tp" / rank_file_name(r, tp)) for r in range(tp)]
    for name, entry in manifest.tensors.items():
        rule = rule_for(name)
        assert entry.split_dim == rule.split_dim and (rule.kind == REPLICATED) == (rule.split_dim is None), name
        assert entry.kv_replication == (replication if rule.kind == KV else 1), name
        want = list(entry.shape)
        if rule.split_dim is not None:
            want[rule.split_dim] = want[rule.split_dim] * entry.kv_replication // tp
        assert all(list(f[name].shape) == want for f in files), name
    ctx = TPContext(group=None, rank=0, world_size=tp, device=torch.device("cpu"), backend=None)
    with torch.device("meta"):  # rank 0's shapes as the model builds them, without the table
        params = TPLlamaForCausalLM(cfg, TPLayout.for_model(cfg, tp), ctx).state_dict()
    for name, param in params.items():
        rows = [files[0][src].shape for src in hf_sources(name)]
        assert sum(r[0] for r in rows) == param.shape[0] and all(r[1:] == param.shape[1:] for r in rows), name
    assert sorted(src for name in params for src in hf_sources(name)) == sorted(manifest.tensors)
