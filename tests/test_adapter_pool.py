"""The adapter pool's policy (serve/adapters/pool.py) against fake ranks: tiers, LRU eviction,
pinning, on-demand registration, unloading after the requests in flight, a new index per load,
the checks of an adapter directory, and the adapter metrics. The ranks' side (installing,
offloading, restoring, routing) is tested in test_lora.py, test_engine.py and test_server.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from serve.adapters.pool import ADAPTERS_DIR, AdapterPool
from serve.adapters.registry import DEVICE, DISK, HOST, AdapterRegistry
from serve.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, QueueFull
from serve.metrics import Metrics
from serve.ranks.commands import AdapterLoaded, LoadAdapter, MoveAdapter
from tprt.lora.peft_io import adapter_config, peft_key
from tprt.model.config import ModelConfig


class FakeRanks:
    """Records the adapter commands; a load answers with the index it was given."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, Any, ...]] = []

    def run(self, cmd: Any) -> Any:
        if isinstance(cmd, LoadAdapter):
            self.commands.append(("load", cmd.adapter_id, cmd.index))
            cfg = json.loads((Path(cmd.path) / "adapter_config.json").read_text())
            return AdapterLoaded(cfg["r"], cfg["lora_alpha"], cmd.index, ("q",))
        assert isinstance(cmd, MoveAdapter)
        self.commands.append((cmd.tier, cmd.index))
        return None


def _write_adapter(data_dir: Path, name: str, rank: int = 4) -> Path:
    path = data_dir / ADAPTERS_DIR / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(adapter_config(["q"], rank, 8.0, 0.0, None)))
    return path


@pytest.fixture
def pool(tmp_path: Path) -> AdapterPool:
    for name in "abcde":
        _write_adapter(tmp_path, name)
    return AdapterPool(AdapterRegistry(), tmp_path, Metrics(), max_loras=2, max_cpu_loras=1, max_rank=16)


def _tiers(pool: AdapterPool) -> dict[str, str]:
    return {a.id: a.tier for a in pool.registry.list()}


def _serve(pool: AdapterPool, ranks: FakeRanks, name: str) -> int | None:
    """A request for `name` arrives, joins the batch and finishes; its device index."""
    pool.acquire(name)
    index = pool.make_resident(ranks, name)
    pool.release(name, started=False)
    return index


def test_lru_eviction_moves_to_host_then_drops(pool: AdapterPool) -> None:
    ranks = FakeRanks()
    assert [_serve(pool, ranks, n) for n in "ab"] == [1, 2]
    assert _tiers(pool) == {"a": DEVICE, "b": DEVICE}  # the others are registered when a request names them
    assert _serve(pool, ranks, "c") == 3  # a is least recently used: to host memory
    assert ranks.commands[-2:] == [("host", 1), ("load", "c", 3)]
    assert _serve(pool, ranks, "a") == 1  # back from host memory under its index, b to host
    assert ranks.commands[-2:] == [("host", 2), ("device", 1)]
    assert _serve(pool, ranks, "d") == 4  # c to host; host holds one: b (least recent) is dropped
    assert ranks.commands[-3:] == [("host", 3), ("drop", 2), ("load", "d", 4)]
    assert _tiers(pool) == {"a": DEVICE, "b": DISK, "c": HOST, "d": DEVICE}
    assert _serve(pool, ranks, "b") == 5  # from disk again: a new index, so no cached KV of load 2 matches
    m = pool.metrics
    assert m is not None
    value = m.registry.get_sample_value
    assert value("tprt_adapter_loads_total") == 5
    assert value("tprt_adapter_evictions_total", {"tier": "device"}) == 4
    assert value("tprt_adapter_evictions_total", {"tier": "host"}) == 2
    assert [value("tprt_adapters", {"tier": t}) for t in (DEVICE, HOST, DISK)] == [2, 1, 1]
    assert value("tprt_adapter_requests_total", {"adapter": "a"}) == 2


def test_pinned_and_running_adapters_stay(pool: AdapterPool) -> None:
    ranks = FakeRanks()
    pool.load(ranks, "a", pool.data_dir / ADAPTERS_DIR / "a", pin=True)
    pool.acquire("b")
    assert pool.make_resident(ranks, "b") == 2
    pool.registry.start("b")  # b has a row in the batch
    pool.acquire("c")
    assert pool.make_resident(ranks, "c") is None  # a pinned, b running: c waits
    pool.release("b", started=True)
    assert pool.make_resident(ranks, "c") == 3 and _tiers(pool)["a"] == DEVICE and _tiers(pool)["b"] == HOST
    with pytest.raises(FailedPrecondition) as e:  # reloading an id with requests in flight
        pool.load(ranks, "c", pool.data_dir / ADAPTERS_DIR / "c")
    assert e.value.field == "id"
    pool.release("c", started=False)
    pool.load(ranks, "d", pool.data_dir / ADAPTERS_DIR / "d", pin=True)
    assert _tiers(pool)["c"] == HOST  # evicted for the pinned d
    with pytest.raises(FailedPrecondition):  # both device slots pinned
        pool.load(ranks, "e", pool.data_dir / ADAPTERS_DIR / "e", pin=True)
    with pytest.raises(QueueFull):  # and no unpinned one to evict
        pool.load(ranks, "e", pool.data_dir / ADAPTERS_DIR / "e")


def test_unload_waits_for_requests_in_flight(pool: AdapterPool) -> None:
    ranks = FakeRanks()
    assert _serve(pool, ranks, "a") == 1
    pool.acquire("a")  # a request in flight
    pool.begin_unload("a")
    with pytest.raises(NotFound):  # new requests are refused at once
        pool.acquire("a")
    pool.finish_unloads(ranks)
    assert pool.registry.has("a") and ranks.commands[-1] == ("load", "a", 1)  # still serving its request
    pool.release("a", started=True)
    pool.finish_unloads(ranks)
    assert not pool.registry.has("a") and ranks.commands[-1] == ("drop", 1)
    assert _serve(pool, ranks, "a") == 2  # its directory is still there: loaded on demand, a new index
    with pytest.raises(NotFound) as e:
        pool.begin_unload("zzz")
    assert e.value.field == "id"


def test_unknown_adapters_and_bad_directories(pool: AdapterPool, tmp_path: Path) -> None:
    for name in ("missing", "../adapters/a", "", "x" * 400, "a\0b"):
        with pytest.raises(NotFound) as e:
            pool.acquire(name)
        assert e.value.field == "adapter_id"
    _write_adapter(tmp_path, "big", rank=32)
    with pytest.raises(InvalidArgument, match="rank r=32 is over this server's limit of 16") as bad:
        pool.acquire("big")
    assert bad.value.field == "adapter_id"
    with pytest.raises(InvalidArgument) as outside:
        pool.resolve_path("../elsewhere")
    assert outside.value.field == "path"
    assert pool.resolve_path(f"{ADAPTERS_DIR}/a") == (tmp_path / ADAPTERS_DIR / "a").resolve()


def test_an_adapter_for_another_base_model_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config = ModelConfig.from_dict({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    path = _write_adapter(tmp_path, "a")
    tensors = {peft_key(layer, "q", f): torch.zeros(shape) for layer in range(2)
               for f, shape in (("A", (4, 32)), ("B", (32, 4)))}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    pool = AdapterPool(AdapterRegistry(), tmp_path, base=config)
    assert pool.describe(path, "path").rank == 4
    save_file({**tensors, peft_key(0, "q", "A"): torch.zeros(4, 64)}, str(path / "adapter_model.safetensors"))
    with pytest.raises(InvalidArgument, match="shape \\[4, 64\\]; this base model needs \\[4, 32\\]") as e:
        pool.describe(path, "path")
    assert e.value.field == "path"
    save_file({**tensors, peft_key(2, "q", "A"): torch.zeros(4, 32)}, str(path / "adapter_model.safetensors"))
    with pytest.raises(InvalidArgument, match="built for another base model"):
        pool.describe(path, "path")


# ----------------------------------------------------------------- hostile adapter directories (issue 30)

BASE = ModelConfig.from_dict({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})


def _sound_adapter(tmp_path: Path, name: str = "a") -> Path:
    """An adapter directory for BASE (q, rank 4) that describe() accepts."""
    from safetensors.torch import save_file

    path = _write_adapter(tmp_path, name)
    save_file({peft_key(layer, "q", f): torch.full(shape, 0.01) for layer in range(2)
               for f, shape in (("A", (4, 32)), ("B", (32, 4)))}, str(path / "adapter_model.safetensors"))
    return path


def _safetensors(header: dict[str, Any] | bytes, data: bytes, length: int | None = None) -> bytes:
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def test_corrupt_safetensors_files_are_invalid_argument_naming_the_file(tmp_path: Path) -> None:
    path = _sound_adapter(tmp_path)
    pool = AdapterPool(AdapterRegistry(), tmp_path, base=BASE)
    assert pool.describe(path, "path").rank == 4
    weights = path / "adapter_model.safetensors"
    good = weights.read_bytes()
    key = peft_key(0, "q", "A")
    entry = {"dtype": "F32", "shape": [4, 32], "data_offsets": [0, 512]}
    cases = {
        "empty file": b"",
        "truncated": good[: len(good) - 100],
        "huge header length": _safetensors({}, b"", length=2**63),
        "non-JSON header": _safetensors(b"{not json", b""),
        "header not an object": _safetensors(b"[1, 2]", b""),
        "deep header": _safetensors(b"[" * 100_000 + b"]" * 100_000, b""),
        "lying offsets": _safetensors({key: {**entry, "data_offsets": [0, 600]}}, b"\0" * 600),
        "reversed offsets": _safetensors({key: {**entry, "data_offsets": [512, 0]}}, b"\0" * 512),
        "offsets past the data": _safetensors({key: {**entry, "data_offsets": [512, 1024]}}, b"\0" * 512),
        "overlap": _safetensors({key: entry, peft_key(1, "q", "A"): {**entry, "data_offsets": [256, 768]}},
                                b"\0" * 768),
        "absurd shape": _safetensors({key: {**entry, "shape": [2**62, 2**62]}}, b"\0" * 512),
        "negative shape": _safetensors({key: {**entry, "shape": [-4, -32]}}, b"\0" * 512),
        "float shape": _safetensors({key: {**entry, "shape": [4.0, 32]}}, b"\0" * 512),
        "bad dtype": _safetensors({key: {**entry, "dtype": "F33"}}, b"\0" * 512),
        "integer dtype": _safetensors({key: {**entry, "dtype": "I32"}}, b"\0" * 512),
        "malformed entry": _safetensors({key: [1, 2, 3]}, b""),
        "bad metadata": _safetensors({"__metadata__": [1]}, b""),
    }
    for what, content in cases.items():
        weights.write_bytes(content)
        with pytest.raises(InvalidArgument) as e:
            pool.describe(path, "path")
        assert e.value.field == "path" and "a/adapter_model.safetensors" in str(e.value), (what, str(e.value))
        assert len(str(e.value)) < 300 and str(tmp_path) not in str(e.value), (what, str(e.value))
    weights.unlink()
    weights.mkdir()
    with pytest.raises(InvalidArgument, match="adapter_model.safetensors"):
        pool.describe(path, "path")


def test_adapters_with_nan_or_infinite_weights_or_absurd_alpha_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _sound_adapter(tmp_path)
    pool = AdapterPool(AdapterRegistry(), tmp_path, base=BASE)
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = peft_key(1, "q", "B")
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = dict(tensors)
        poisoned[key] = tensors[key].clone()
        poisoned[key][3, 1] = bad
        save_file(poisoned, str(weights))
        with pytest.raises(InvalidArgument, match=f"tensor '{key}' holds NaN or infinite values") as e:
            pool.describe(path, "adapter_id")
        assert e.value.field == "adapter_id"
    save_file(tensors, str(weights))
    config = path / "adapter_config.json"
    sound = json.loads(config.read_text())
    for alpha in ("Infinity", "NaN", "1e30", '"8"', "true", "-1"):
        config.write_text(json.dumps(sound).replace('"lora_alpha": 8.0', f'"lora_alpha": {alpha}'))
        with pytest.raises(InvalidArgument, match="field 'lora_alpha'"):
            pool.describe(path, "path")
    for field, value in (("r", "4"), ("r", True), ("lora_dropout", [0]), ("target_modules", [1, 2])):
        config.write_text(json.dumps({**sound, field: value}))
        with pytest.raises(InvalidArgument, match=f"field '{field}'"):
            pool.describe(path, "path")


def test_unreadable_adapter_configs_are_invalid_argument_naming_the_file(tmp_path: Path) -> None:
    path = _sound_adapter(tmp_path)
    pool = AdapterPool(AdapterRegistry(), tmp_path, base=BASE)
    config = path / "adapter_config.json"
    for what, content, why in (
        ("deep", b"[" * 200_000 + b"]" * 200_000, "nested more than"),
        ("deep object", b'{"a": ' * 200_000 + b"1" + b"}" * 200_000, "nested more than"),
        ("binary", bytes(range(256)) * 4, "not UTF-8"),
        ("not JSON", b"r = 4", "not valid JSON"),
        ("not an object", b"[4]", "expected a JSON object"),
    ):
        config.write_bytes(content)
        with pytest.raises(InvalidArgument, match=why) as e:
            pool.describe(path, "path")
        assert "a/adapter_config.json" in str(e.value) and e.value.field == "path", what
    config.unlink()
    config.mkdir()
    with pytest.raises(InvalidArgument, match="a/adapter_config.json: not a regular file"):
        pool.describe(path, "path")


def test_adapter_paths_and_on_demand_ids_share_one_resolver(pool: AdapterPool, tmp_path: Path) -> None:
    for given in ("adapters/a\0b", "a" * 5000, "/".join(["b" * 300] * 3), "x/" * 3000):
        with pytest.raises(InvalidArgument) as e:
            pool.resolve_path(given)
        assert e.value.field == "path" and len(str(e.value)) < 200, str(e.value)[:300]
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    _write_adapter(outside, "evil")
    (tmp_path / ADAPTERS_DIR / "evil").symlink_to(outside / ADAPTERS_DIR / "evil")
    with pytest.raises(InvalidArgument, match="outside the server's --data-dir") as e:
        pool.resolve_path(f"{ADAPTERS_DIR}/evil")
    with pytest.raises(InvalidArgument, match="outside the server's --data-dir") as e:
        pool.acquire("evil")  # on demand: refused as LoadAdapter refuses it
    assert e.value.field == "adapter_id" and not pool.registry.has("evil")
    (tmp_path / ADAPTERS_DIR / "loop").symlink_to(tmp_path / ADAPTERS_DIR / "loop")
    with pytest.raises(InvalidArgument, match="cannot be resolved") as e:
        pool.acquire("loop")
    (tmp_path / ADAPTERS_DIR / "inside").symlink_to(tmp_path / ADAPTERS_DIR / "a")  # a link inside is fine
    assert pool.acquire("inside").path == (tmp_path / ADAPTERS_DIR / "a").resolve()
    # R8: a directory inside whose files are links out of --data-dir (on demand and by path)
    leaky = tmp_path / ADAPTERS_DIR / "leaky"
    leaky.mkdir()
    (leaky / "adapter_config.json").symlink_to(outside / ADAPTERS_DIR / "evil" / "adapter_config.json")
    for call, field in ((lambda: pool.acquire("leaky"), "adapter_id"),
                        (lambda: pool.resolve_path(f"{ADAPTERS_DIR}/leaky"), "path")):
        with pytest.raises(InvalidArgument, match="adapter_config.json.* leads outside the server's --data-dir") as e:
            call()
        assert e.value.field == field and not pool.registry.has("leaky")


def test_a_request_that_can_never_be_placed_is_refused_at_once(pool: AdapterPool) -> None:
    ranks = FakeRanks()
    for name in "ab":  # both device slots pinned
        pool.load(ranks, name, pool.data_dir / ADAPTERS_DIR / name, pin=True)
    pool.acquire("c")
    with pytest.raises(QueueFull, match="hold pinned adapters") as e:
        pool.make_resident(ranks, "c")
    assert e.value.field == "adapter_id"
    pool.begin_unload("a")  # once a pinned one leaves, the request is placed
    pool.finish_unloads(ranks)
    assert pool.make_resident(ranks, "c") == 3


def test_new_adapter_ids_and_registration(tmp_path: Path) -> None:
    _write_adapter(tmp_path, "on-disk")
    pool = AdapterPool(AdapterRegistry(), tmp_path, max_rank=16, reserved=("base-model",))
    for taken in ("base-model", "on-disk"):
        with pytest.raises(AlreadyExists) as e:
            pool.check_new_id(taken)
        assert e.value.field == "adapter_id"
    pool.check_new_id("fresh")
    job_out = _write_adapter(tmp_path / "jobs" / "job-1", "adapter")
    info = pool.register("fresh", job_out, "job-1")  # on disk: no command, no device slot
    assert (info.tier, info.rank, info.source_job_id) == (DISK, 4, "job-1")
    with pytest.raises(AlreadyExists):
        pool.check_new_id("fresh")
    with pytest.raises(AlreadyExists):
        pool.register("fresh", job_out)
    with pytest.raises(AlreadyExists):
        pool.register("base-model", job_out)
    with pytest.raises(NotFound, match="base model"):
        pool.acquire("base-model")
    big = _write_adapter(tmp_path / "jobs" / "job-2", "adapter", rank=32)
    with pytest.raises(InvalidArgument, match="over this server's limit of 16"):
        pool.register("big", big)
    ranks = FakeRanks()
    pool.acquire("fresh")
    assert pool.make_resident(ranks, "fresh") == 1 and ranks.commands == [("load", "fresh", 1)]
