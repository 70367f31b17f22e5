"""Converting straight from the Hugging Face Hub, against a fake Hub on loopback (tests/fake_hub.py)
reached through huggingface_hub itself, with HF_ENDPOINT and HF_HUB_CACHE pointing at it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants

from convert import api
from convert.cli import main
from fake_hub import FakeHub, load_dir
from helpers import make_hf_llama
from tprt.checkpoint.format import MANIFEST_NAME, rank_file_name
from tprt.errors import ConfigError

REPO = "tiny-org/tiny-llama"
EXTRA = {  # what a real repo has besides the safetensors: never fetched
    "original/consolidated.00.pth": b"pth" * 1000,
    "original/params.json": b"{}",
    "pytorch_model.bin": b"bin" * 1000,
    "tokenizer_config.json": b'{"model_max_length": 256}',
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "README.md": b"# tiny",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_hf_llama(tmp_path_factory.mktemp("hub") / "tiny", "gqa", max_shard_size="100KB")
    for name, data in EXTRA.items():
        if not name.startswith("original/") and not name.endswith(".bin"):
            (path / name).write_bytes(data)
    return path


@pytest.fixture
def hub(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add(REPO, load_dir(model, EXTRA))
    server, url = fake.start()
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    fake.watch_cache = cache / f"models--{REPO.replace('/', '--')}"
    fake.url = url  # type: ignore[attr-defined]
    yield fake
    server.shutdown()
    server.server_close()


def shard_names(model: Path) -> list[str]:
    return sorted(p.name for p in model.glob("model-*.safetensors"))


def same_output(a: Path, b: Path) -> None:
    """Every rank file, config and tokenizer file identical; manifests equal but for the source."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name != MANIFEST_NAME:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (json.loads((d / MANIFEST_NAME).read_text()) for d in (a, b))
    for m in (ma, mb):
        m["extra"].pop("source")
        m["extra"].pop("source_commit", None)
    assert ma == mb


def test_hub_convert_bit_exact_and_only_needed_files(hub: FakeHub, model: Path, tmp_path: Path) -> None:
    assert len(shard_names(model)) >= 4
    api.hf_to_tp(model, tmp_path / "local", tp=2)
    manifest = api.hf_to_tp(REPO, tmp_path / "hub", tp=2)
    same_output(tmp_path / "local", tmp_path / "hub")
    assert (tmp_path / "hub" / "chat_template.jinja").read_bytes() == EXTRA["chat_template.jinja"]
    assert manifest.extra["source"] == REPO and len(manifest.extra["source_commit"]) == 40
    fetched = {p.rsplit("/", 1)[-1] for p in hub.fetched()}
    assert fetched == {"config.json", "generation_config.json", "model.safetensors.index.json",
                       "tokenizer_config.json", "chat_template.jinja", *shard_names(model)}
    assert not any("original/" in k or k.endswith((".bin", ".pth", "README.md")) for k in hub.requests)
    assert all(hub.count(f"/{s}") <= 4 for s in shard_names(model))  # 2 header ranges + HEAD + GET
    assert all(n == 1 for n in hub.full_gets.values())
    # without --stream the shards stay in the standard cache: a second run downloads nothing
    before = sum(hub.full_gets.values())
    api.hf_to_tp(REPO, tmp_path / "again", tp=2)
    assert sum(hub.full_gets.values()) == before
    assert len(list((hub.watch_cache / "blobs").iterdir())) >= len(shard_names(model))  # type: ignore[operator]


def test_stream_keeps_at_most_two_raw_shards(hub: FakeHub, model: Path, tmp_path: Path) -> None:
    api.hf_to_tp(model, tmp_path / "local", tp=4)
    api.hf_to_tp(REPO, tmp_path / "hub", tp=4, stream=True)
    same_output(tmp_path / "local", tmp_path / "hub")
    assert 1 <= hub.peak_shards <= 2
    snapshot = next((hub.watch_cache / "snapshots").iterdir())  # type: ignore[operator]
    assert not list(snapshot.glob("*.safetensors"))  # deleted once converted
    blob_sizes = [p.stat().st_size for p in (hub.watch_cache / "blobs").iterdir()]  # type: ignore[operator]
    assert max(blob_sizes) < 10_000  # only the small files remain


def test_stream_keeps_shards_that_were_cached_before(hub: FakeHub, model: Path, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download

    first = shard_names(model)[0]
    hf_hub_download(REPO, first)  # as transformers would have
    api.hf_to_tp(REPO, tmp_path / "hub", tp=2, stream=True)
    snapshot = next((hub.watch_cache / "snapshots").iterdir())  # type: ignore[operator]
    assert [p.name for p in snapshot.glob("*.safetensors")] == [first]


def test_revision(hub: FakeHub, model: Path, tmp_path: Path) -> None:
    other = make_hf_llama(tmp_path / "v2", "gqa", seed=7)
    sha = hub.add(REPO, load_dir(model, EXTRA), v2=load_dir(other))
    v2 = hub.repos[REPO].revisions["v2"]
    api.hf_to_tp(other, tmp_path / "local", tp=2)
    for rev in ("v2", v2):
        m = api.hf_to_tp(REPO, tmp_path / f"hub-{rev}", tp=2, revision=rev)
        assert m.extra["source_commit"] == v2 != sha
        same_output(tmp_path / "local", tmp_path / f"hub-{rev}")
    with pytest.raises(ConfigError, match=r"revision 'nope' not found"):
        api.hf_to_tp(REPO, tmp_path / "bad", tp=2, revision="nope")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("token,status", [(None, 401), ("hf_wrong", 403)])
def test_gated_repo(hub: FakeHub, model: Path, tmp_path: Path, token: str | None, status: int) -> None:
    hub.add("meta/gated", load_dir(model), gated=True)
    with pytest.raises(ConfigError, match=r"^meta/gated: gated repository; accept its license"):
        api.hf_to_tp("meta/gated", tmp_path / "out", tp=2, token=token)
    assert not (tmp_path / "out").exists()
    api.hf_to_tp("meta/gated", tmp_path / "ok", tp=2, token="hf_good")
    assert (tmp_path / "ok" / rank_file_name(1, 2)).is_file()


def test_missing_repo_file_and_weights(hub: FakeHub, model: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^nobody/nothing: repository not found on the Hub"):
        api.hf_to_tp("nobody/nothing", tmp_path / "out", tp=2)
    files = load_dir(model)
    del files[shard_names(model)[1]]
    hub.add("org/broken", files)
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json lists model-00002-of-\d+.safetensors, "
                                          r"which the repository does not have"):
        api.hf_to_tp("org/broken", tmp_path / "out", tp=2)
    bins = {k: v for k, v in load_dir(model, EXTRA).items() if not k.startswith("model")}
    hub.add("org/bin-only", bins)
    with pytest.raises(ConfigError, match=r"no safetensors weights .*it has original/consolidated.00.pth, "
                                          r"pytorch_model.bin"):
        api.hf_to_tp("org/bin-only", tmp_path / "out", tp=2)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    hub.add("org/gpt2", {**load_dir(model), "config.json": json.dumps(cfg).encode()})
    with pytest.raises(ConfigError, match=r"^org/gpt2: unsupported architecture 'GPT2LMHeadModel'"):
        api.hf_to_tp("org/gpt2", tmp_path / "out", tp=2)
    assert not (tmp_path / "out").exists()
    assert not any(k.endswith(".safetensors") and k.startswith("GET /org/gpt2") for k in hub.requests)


def test_missing_file_404(hub: FakeHub, model: Path, tmp_path: Path) -> None:
    """A file the repo listing promised but the resolve endpoint does not have: 404 EntryNotFound."""
    from tprt.checkpoint.hub import HubRepo

    repo = HubRepo(REPO).resolve()
    with pytest.raises(ConfigError, match=r"^tiny-org/tiny-llama: tokenizer.json: file not found in the repository"):
        repo.download("tokenizer.json")
    assert hub.count("/resolve/" + repo.commit + "/tokenizer.json") == 1


def test_connection_dropped_mid_shard_resumes(hub: FakeHub, model: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub resumes from the last chunk it received; chunks made small to fit the shard."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    shard = shard_names(model)[2]
    hub.drop_once.add(shard)
    api.hf_to_tp(model, tmp_path / "local", tp=2)
    api.hf_to_tp(REPO, tmp_path / "hub", tp=2, stream=True)
    same_output(tmp_path / "local", tmp_path / "hub")
    size = (model / shard).stat().st_size
    starts = [int(r.rsplit("bytes=", 1)[1].rstrip("-")) for r in hub.ranges
              if r.split(" ")[0].endswith(shard) and r.endswith("-")]
    assert len(starts) == 1 and size // 2 - 4096 < starts[0] <= size // 2  # resumed, not restarted
    assert hub.full_gets[next(p for p in hub.full_gets if p.endswith(shard))] == 1


def test_interrupted_stream_resumes_without_refetching(hub: FakeHub, model: Path, tmp_path: Path) -> None:
    shards = shard_names(model)
    hub.failing.add(shards[3])
    dst = tmp_path / "hub"
    assert main(["hf-to-tp", REPO, str(dst), "--tp", "2", "--stream"]) == 2
    assert not dst.exists()  # still atomic
    partial = tmp_path / ".hub.tprt-partial"
    assert (partial / ".tprt-resume.json").is_file()
    fetched = {p.rsplit("/", 1)[-1] for p, n in hub.full_gets.items() if n}
    assert set(shards[:3]) <= fetched and shards[4] not in fetched
    hub.failing.clear()
    hub.full_gets.clear()
    assert main(["hf-to-tp", REPO, str(dst), "--tp", "2", "--stream"]) == 0
    assert {p.rsplit("/", 1)[-1] for p in hub.full_gets if p.endswith(".safetensors")} == set(shards[3:])
    assert not partial.exists()
    api.hf_to_tp(model, tmp_path / "local", tp=2)
    same_output(tmp_path / "local", dst)
    assert api.verify(dst) == []


def test_closing_stops_a_running_download(hub: FakeHub, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failure or Ctrl-C the prefetched download stops at its next chunk, and leaves no
    partial file in the cache, instead of running to the end of a multi-GB shard."""
    import time

    from convert.hub_source import HubSource
    from tprt.checkpoint.hub import HubRepo

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.chunk_delay = 0.05  # the ~80 KB shard takes about a second
    source = HubSource(HubRepo(REPO).resolve(), stream=True)
    source.byte_ranges(source.order()[0], 0, 1)  # opens shard 1 (downloaded), starts shard 2
    blobs = hub.watch_cache / "blobs"  # type: ignore[operator]

    def downloading() -> bool:  # shard 2's partial file is there: its download is under way
        return blobs.is_dir() and any(p.name.endswith(".incomplete") for p in blobs.iterdir())

    deadline = time.monotonic() + 30
    while not downloading():
        assert time.monotonic() < deadline, "shard 2's download never started"
        time.sleep(0.01)
    source.close()  # returns once the download has stopped
    assert not [p.name for p in blobs.iterdir() if p.name.endswith(".incomplete")]
    assert len([p for p in blobs.iterdir() if p.stat().st_size > 10_000]) == 1  # shard 2 never completed


def test_offline_with_warm_cache(hub: FakeHub, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api.hf_to_tp(REPO, tmp_path / "warm", tp=2)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    seen = sum(hub.requests.values())
    api.hf_to_tp(REPO, tmp_path / "offline", tp=2)
    assert sum(hub.requests.values()) == seen  # not one request
    same_output(tmp_path / "warm", tmp_path / "offline")
    with pytest.raises(ConfigError, match=r"^other/model: not in the Hugging Face cache and HF_HUB_OFFLINE is set"):
        api.hf_to_tp("other/model", tmp_path / "x", tp=2)


def test_cli_with_hf_endpoint_env(hub: FakeHub, model: Path, tmp_path: Path) -> None:
    """The real environment variables, in a fresh process: HF_ENDPOINT, HF_HUB_CACHE, HF_TOKEN."""
    hub.add("meta/gated", load_dir(model), gated=True)
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "c"),  # type: ignore[attr-defined]
           "HF_TOKEN": "hf_good", "PYTHONPATH": str(Path(__file__).parent)}
    out = subprocess.run([sys.executable, "-m", "convert", "hf-to-tp", "meta/gated", str(tmp_path / "o"),
                          "--tp", "2", "--stream", "--progress"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "download+convert" in out.stderr and "B/s" in out.stderr
    assert (tmp_path / "o" / rank_file_name(0, 2)).is_file()
    env.pop("HF_TOKEN")
    out = subprocess.run([sys.executable, "-m", "convert", "hf-to-tp", "meta/gated", str(tmp_path / "p"),
                          "--tp", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("tprt-convert: error: meta/gated: gated repository")


def test_verify_download(hub: FakeHub, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", REPO]) == 0
    blobs = hub.watch_cache / "blobs"  # type: ignore[operator]
    shard = next(p for p in blobs.iterdir() if p.stat().st_size > 10_000)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # a flipped bit in the cached copy: headers still parse
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", REPO]) == 1
    assert "differs from the Hub's (sha256 mismatch)" in capsys.readouterr().out


def test_gguf_from_hub(hub: FakeHub, tmp_path: Path) -> None:
    from gguf_helpers import Q, write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.Q8_0.gguf", types={"blk.0.ffn_up.weight": Q.Q8_0})
    write_tiny_gguf(tmp_path / "m.F32.gguf", seed=1)
    files = {n: (tmp_path / n).read_bytes() for n in ("m.Q8_0.gguf", "m.F32.gguf")}
    hub.add("org/m-GGUF", {**files, "README.md": b"# gguf"})
    with pytest.raises(ConfigError, match=r"^org/m-GGUF: pick one .gguf file with --gguf-file "
                                          r"\(found: m.F32.gguf, m.Q8_0.gguf\)"):
        api.gguf_to_hf("org/m-GGUF", tmp_path / "x")
    api.gguf_to_hf(tmp_path / "m.Q8_0.gguf", tmp_path / "local")
    assert main(["gguf-to-hf", "org/m-GGUF", str(tmp_path / "hub"), "--gguf-file", "m.Q8_0.gguf"]) == 0
    for f in (tmp_path / "local").iterdir():
        assert f.read_bytes() == (tmp_path / "hub" / f.name).read_bytes(), f.name
    assert {p.rsplit("/", 1)[-1] for p in hub.fetched() if "m-GGUF" in p} == {"m.Q8_0.gguf"}


def test_plan_fetches_only_config(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    from tprt.cli.main import main as tprt_main

    assert tprt_main(["plan", "--model", REPO, "--tp", "2", "--device", "cpu", "--json", "serve"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tp"] == 2
    about_repo = [k for k in hub.requests if REPO in k]  # (huggingface_hub also asks /api/agent-harnesses)
    assert about_repo and all(k.endswith("/config.json") for k in about_repo)
    assert tprt_main(["plan", "--model", "nobody/nothing", "--tp", "2", "--device", "cpu", "serve"]) == 2


def test_local_flags_rejected_for_local_path(model: Path, tmp_path: Path) -> None:
    assert main(["hf-to-tp", str(model), str(tmp_path / "o"), "--tp", "2", "--stream"]) == 2
