"""The adapter pool's policy (serve/adapter_pool.py) against fake ranks: tiers, LRU eviction,
pinning, on-demand registration, unloading after the requests in flight, a new index per load,
the checks of an adapter directory, and the adapter metrics. The ranks' side (installing,
offloading, restoring, routing) is tested in test_lora.py, test_engine.py and test_server.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from serve.adapter_pool import ADAPTERS_DIR, AdapterPool
from serve.adapters import DEVICE, DISK, HOST, AdapterRegistry
from serve.errors import FailedPrecondition, InvalidArgument, NotFound, QueueFull
from serve.metrics import Metrics
from tprt.distributed.protocol import AdapterLoaded, LoadAdapter, MoveAdapter
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
