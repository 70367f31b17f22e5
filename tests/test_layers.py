"""Parallel layers, mappings, RoPE, RMSNorm, the KV cache and the launcher.

Multi-rank checks run in one gloo world of 2 ranks (tests/mp.py) and compare against the same
computation done whole in a single process.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp import Checks, WorldResults, names, run_world
from tprt.errors import ConfigError
from tprt.model.config import ModelConfig, RopeScaling
from tprt.distributed.context import TPContext, init_distributed
from tprt.model.kv_cache import SCRATCH_BLOCK, KVCache
from tprt.distributed.launcher import LaunchError, launch_local
from tprt.model.llama import RMSNorm
from tprt.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
from tprt.parallel.mappings import gather_from_region, scatter_to_region
from tprt.model.rope import apply_rope_, inv_frequencies, rope_angles


def _shard(t: torch.Tensor, dim: int, ctx: TPContext) -> torch.Tensor:
    """This rank's contiguous chunk of `t` along `dim`."""
    return t.chunk(ctx.world_size, dim=dim)[ctx.rank].contiguous()


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------- multi-rank checks


def check_mlp_grads(ctx: TPContext, workdir: Path) -> None:
    """Column -> SiLU -> row MLP: output and every gradient equal the single-process ones."""
    g = torch.Generator().manual_seed(0)  # same full weights and data on every rank
    w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 32, generator=g)
    x, target = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    xf, w1f, w2f = (t.clone().requires_grad_() for t in (x, w1, w2))
    ((F.linear(F.silu(F.linear(xf, w1f)), w2f) * target).sum()).backward()

    col, row = ColumnParallelLinear(16, 32 // ctx.world_size, ctx), RowParallelLinear(32 // ctx.world_size, 16, ctx)
    with torch.no_grad():
        col.weight.copy_(_shard(w1, 0, ctx))
        row.weight.copy_(_shard(w2, 1, ctx))
    xp = x.clone().requires_grad_()
    y = row(F.silu(col(xp)))
    (y * target).sum().backward()
    _close(y.detach(), F.linear(F.silu(F.linear(x, w1)), w2), "output")
    assert xp.grad is not None and col.weight.grad is not None and row.weight.grad is not None
    _close(xp.grad, xf.grad, "input grad (copy_to_region backward all-reduce)")  # type: ignore[arg-type]
    _close(col.weight.grad, _shard(w1f.grad, 0, ctx), "column weight grad")  # type: ignore[arg-type]
    _close(row.weight.grad, _shard(w2f.grad, 1, ctx), "row weight grad")  # type: ignore[arg-type]


def check_gather_scatter_grads(ctx: TPContext, workdir: Path) -> None:
    """scatter -> per-feature scale -> gather: forward and input gradient equal the whole computation."""
    g = torch.Generator().manual_seed(1)
    x, scale, target = torch.randn(4, 8, generator=g), torch.randn(8, generator=g), torch.randn(4, 8, generator=g)
    xf = x.clone().requires_grad_()
    ((xf * scale) ** 2 * target).sum().backward()
    xp = x.clone().requires_grad_()
    local = scatter_to_region(xp, ctx) * _shard(scale, 0, ctx)  # [4, 8 / tp]
    y = gather_from_region(local**2, ctx)  # [4, 8]
    (y * target).sum().backward()
    _close(y.detach(), (x * scale) ** 2, "gathered output")
    assert xp.grad is not None and xf.grad is not None
    _close(xp.grad, xf.grad, "input grad through scatter/gather")


def check_embedding(ctx: TPContext, workdir: Path) -> None:
    """Ids of every rank's range, padding ids included: rows and weight gradients equal F.embedding's."""
    g = torch.Generator().manual_seed(2)
    weight, ids = torch.randn(64, 8, generator=g), torch.randint(0, 64, (3, 7), generator=g)
    ids[0, :3] = torch.tensor([0, 31, 63])  # both ends of both ranks' ranges
    wf = weight.clone().requires_grad_()
    target = torch.randn(3, 7, 8, generator=g)
    (F.embedding(ids, wf) * target).sum().backward()
    emb = VocabParallelEmbedding(64, 8, ctx)
    with torch.no_grad():
        emb.weight.copy_(_shard(weight, 0, ctx))
    out = emb(ids)
    (out * target).sum().backward()
    _close(out.detach(), F.embedding(ids, weight), "embedding rows")
    assert emb.weight.grad is not None and wf.grad is not None
    _close(emb.weight.grad, _shard(wf.grad, 0, ctx), "embedding weight grad")


def check_lm_head(ctx: TPContext, workdir: Path, vocab: int) -> None:
    """Padded vocabulary (64 rows for `vocab` true ones): gathered logits equal the full matmul,
    padding is -inf locally and never appears after gather; the parallel argmax matches."""
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(64, 8, generator=g), torch.randn(5, 8, generator=g)
    weight[vocab:] = 0.0
    x[0] = 0.0  # every real logit 0: ties resolve to the lowest id, as torch.argmax does
    head = VocabParallelLMHead(8, 64, vocab, ctx)
    with torch.no_grad():
        assert head.weight is not None
        head.weight.copy_(_shard(weight, 0, ctx))
    local = head(x)  # [5, 64 / tp]
    start = ctx.rank * head.local_vocab
    n_pad_local = max(0, min(head.local_vocab, start + head.local_vocab - max(vocab, start)))
    assert bool(torch.isneginf(local[:, head.local_vocab - n_pad_local :]).all()), "padding logits are not -inf"
    assert not torch.isinf(local[:, : head.local_vocab - n_pad_local]).any(), "real logits are infinite"
    full = head.gather(local)
    assert full.shape == (5, vocab), f"gathered shape {tuple(full.shape)}, expected {(5, vocab)}"
    _close(full, x @ weight[:vocab].T, "gathered logits")
    assert torch.equal(head.argmax(local), full.argmax(-1)), "vocab-parallel argmax differs from full argmax"


def check_run_together(ctx: TPContext, workdir: Path) -> None:
    """A section that fails on the last rank alone raises on every rank (none is left waiting in
    the next collective); one that succeeds everywhere returns each rank's own value."""
    from tprt.distributed.together import PeerFailed, run_together

    assert run_together(lambda: ctx.rank * 10, "counting") == ctx.rank * 10

    def fail_on_last() -> None:
        if ctx.rank == ctx.world_size - 1:
            raise OSError("disk full")

    try:
        run_together(fail_on_last, "writing the checkpoint")
    except PeerFailed as e:
        assert ctx.rank != ctx.world_size - 1
        assert str(e) == f"writing the checkpoint failed on rank {ctx.world_size - 1}: OSError: disk full", str(e)
    except OSError as e:
        assert ctx.rank == ctx.world_size - 1 and str(e) == "disk full"
    else:
        raise AssertionError("the failure was not reported to this rank")
    assert run_together(lambda: "still in step", "a later section") == "still in step"


WORLD2: Checks = [
    ("run_together", check_run_together),
    ("mlp_grads", check_mlp_grads),
    ("gather_scatter_grads", check_gather_scatter_grads),
    ("embedding", check_embedding),
    ("lm_head_pad_last_rank", partial(check_lm_head, vocab=50)),
    ("lm_head_pad_whole_rank", partial(check_lm_head, vocab=20)),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> WorldResults:
    return run_world(2, WORLD2, tmp_path_factory.mktemp("layers"))


@pytest.mark.parametrize("name", names(WORLD2))
def test_tp2(world2: WorldResults, name: str) -> None:
    world2.assert_ok(name)


@pytest.mark.parametrize("name", names(WORLD2))
def test_tp1(tmp_path: Path, name: str) -> None:
    dict(WORLD2)[name](TPContext.single(), tmp_path)


# ----------------------------------------------------------------------------- single-process


def _cfg(rope_scaling: dict[str, object] | None) -> ModelConfig:
    d: dict[str, object] = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                rope_theta=500000.0)
    if rope_scaling is not None:
        d["rope_scaling"] = rope_scaling
    return ModelConfig.from_dict(d)


ROPES: dict[str, dict[str, object] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_matches_transformers(rope: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = _cfg(ROPES[rope])
    assert (cfg.rope_scaling is None) == (rope == "default")
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.raw.items()})
    positions = torch.tensor([[0, 1, 2, 3, 4], [1000, 1001, 3000, 7, 9]])  # [batch 2, seq 5], uneven
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)  # HF layout [batch, heads, seq, head_dim]
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(q, positions)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = rope_angles(positions, inv_frequencies(cfg), torch.float32)
    q_ours = apply_rope_(q.transpose(1, 2).clone(), c, s).transpose(1, 2)  # ours is [batch, seq, heads, head_dim]
    k_ours = apply_rope_(k.transpose(1, 2).clone(), c, s).transpose(1, 2)
    _close(q_ours, q_ref, "q", 1e-6)
    _close(k_ours, k_ref, "k", 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(64, eps=1e-5)
    ours = RMSNorm(64, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64))
        ours.weight.copy_(ref.weight)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = (torch.randn(3, 5, 64) * 3).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    _close(ours(x).float(), ref(x).float(), f"rmsnorm {dtype}", tol)


def test_kv_cache_bounds() -> None:
    """Block ids outside the pool and positions past kv_len are refused before any write."""
    cache = KVCache(n_layers=1, n_blocks=3, n_kv_heads=1, block_size=4, head_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 3\)"):
        cache.prepare(torch.tensor([[0, 1]]), torch.tensor([[3]]))
    with pytest.raises(ValueError, match="kv_len=2"):
        cache.prepare(torch.tensor([[0, 2]]), torch.tensor([[1]]), kv_len=2)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCache(1, 1, 1, 4, 4, torch.float32)


@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_kv_cache_write_and_read(block_size: int) -> None:
    """Tokens land at (table[p // block_size], p % block_size) and read back in position order
    through each row's table; positions past a row's table go to the scratch block; the mask is
    position-causal."""
    cache = KVCache(n_layers=2, n_blocks=12, n_kv_heads=2, block_size=block_size, head_dim=4, dtype=torch.float32)
    k, v = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)  # [batch, seq, kv_heads, head_dim]
    positions = torch.tensor([[0, 1], [3, 4]])
    tables = torch.tensor([[7, 3, 9, 1, 5], [2, 11, 4, 6, 10]])[:, : -(-5 // block_size)]
    step = cache.prepare(positions, tables)
    keys, values = cache.update(1, torch.stack((k, v), dim=2), step)  # [batch, kv_heads, kv_len 5, head_dim]
    assert keys.shape == (2, 2, 5, 4)
    at = lambda row, p: (int(tables[row, p // block_size]), p % block_size)  # noqa: E731
    assert torch.equal(cache.kv[1, at(0, 1)[0], 0, :, at(0, 1)[1]], k[0, 1])
    assert torch.equal(cache.kv[1, at(1, 4)[0], 1, :, at(1, 4)[1]], v[1, 1])
    assert torch.equal(keys[1, :, 3], k[1, 0]) and torch.equal(values[0, :, 0], v[0, 0])
    assert not cache.kv[0].any(), "layer 0 was written"
    assert step.starts == (0, 3)  # a chunk of consecutive positions: the mask is a staircase
    allowed = step.masks[None] == 0  # additive mask: 0 where allowed, -inf elsewhere
    assert allowed.tolist() == [[True, True, True, True, False, False, False, False],
                                [True, True, True, True, True, False, False, False]]
    assert bool(torch.isneginf(step.masks[None][~allowed]).all())
    # A table too short for the batch's positions (a padding token): the write goes to scratch.
    short = cache.prepare(torch.tensor([[block_size]]), torch.tensor([[8]]))
    assert short.write_blocks.tolist() == [[SCRATCH_BLOCK]] and short.tables.tolist() == [[8, SCRATCH_BLOCK]]


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SDPA under a mask per row [batch, 1, seq, kv_len] (what the cache built before the staircase)."""
    hidden = torch.arange(k.shape[2]) > positions[:, None, :, None]
    mask = torch.zeros(hidden.shape, dtype=q.dtype).masked_fill_(hidden, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("starts,seq", [((0,), 7), ((0, 0, 0), 40), ((5, 0, 5, 5, 17), 33), ((0, 700, 700), 200)])
def test_prefill_attention_under_the_staircase(starts: tuple[int, ...], seq: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk's attention under the staircase mask: bit for bit the per-row mask's while
    the chunk's mask fits MASK_ELEMENTS; beyond, in query blocks over truncated keys, equal up to
    rounding, and the mask never holds more than MASK_ELEMENTS."""
    torch.manual_seed(0)
    kv_len = max(starts) + seq
    positions = torch.tensor(starts)[:, None] + torch.arange(seq)
    q = torch.randn(len(starts), 6, seq, 32)
    k, v = torch.randn(len(starts), 2, kv_len, 32), torch.randn(len(starts), 2, kv_len, 32)
    want = _masked_attention(q, k, v, positions)
    cache = KVCache(1, 2, 2, kv_len, 32, torch.float32)  # the tables do not matter to the mask
    tables = torch.ones(len(starts), 1, dtype=torch.long)
    step = cache.prepare(positions, tables, kv_len, starts)
    assert torch.equal(step.attend(q, k, v, True), want)
    cap = seq * kv_len // 3  # too small for the chunk: queries in blocks
    monkeypatch.setattr("tprt.model.kv_cache.MASK_ELEMENTS", cap)
    step = cache.prepare(positions, tables, kv_len)  # the starts found from the positions
    assert step.starts == starts and step.masks[None].numel() <= cap and step.masks[None].shape[0] < seq
    torch.testing.assert_close(step.attend(q, k, v, True), want, rtol=1e-5, atol=1e-6)


def _ranks_fail(fail_rank: int) -> int:
    ctx = init_distributed()
    if ctx.rank == fail_rank:
        raise ValueError(f"boom on rank {ctx.rank}\nsecond line")
    dist.barrier()  # the others wait here for a rank that never comes
    return ctx.rank


def _ranks_ok(base: int) -> int:
    ctx = init_distributed()
    t = torch.tensor([ctx.rank + base])
    dist.all_reduce(t)
    return int(t.item()) * 10 + ctx.rank


def _mesh_sums() -> tuple[int, int, int, int]:
    """In a [2 dp, 2 tp] mesh: sums of global ranks over this rank's TP group and DP group."""
    ctx = init_distributed(tp_size=2)
    t, d = torch.tensor([ctx.global_rank]), torch.tensor([ctx.global_rank])
    dist.all_reduce(t, group=ctx.group)
    dist.all_reduce(d, group=ctx.dp_group)
    return ctx.rank, ctx.dp_rank, int(t.item()), int(d.item())


def test_mesh_groups() -> None:
    """TP ranks are consecutive global ranks; DP groups hold the same TP rank of every replica."""
    assert launch_local(4, _mesh_sums, timeout_s=120) == [(0, 0, 1, 2), (1, 0, 1, 4), (0, 1, 5, 2), (1, 1, 5, 4)]


def test_launch_local_returns_rank_results() -> None:
    assert launch_local(2, _ranks_ok, (1,), timeout_s=120) == [30, 31]  # (1 + 2) * 10 + rank


def test_launch_local_tears_down_on_failure() -> None:
    # Rank 0 waits in a collective for rank 1, which raises: unless the launcher tears rank 0
    # down, the call ends in the launcher's own timeout, whose message does not match.
    with pytest.raises(LaunchError, match=r"^rank 1 failed: ValueError: boom on rank 1$") as info:
        launch_local(2, _ranks_fail, (1,), timeout_s=120)
    assert info.value.rank == 1 and "Traceback" in info.value.details


@pytest.mark.parametrize("fields, message", [
    ({"sliding_window": 8, "max_position_embeddings": 256}, "'sliding_window'=8 is not supported for LlamaForCausalLM"),
    ({"sliding_window": "8"}, "'sliding_window'='8' is not supported"),
    ({"final_logit_softcapping": 30.0}, "'final_logit_softcapping'=30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping'=50.0 is not supported"),
    ({"partial_rotary_factor": 0.5}, "'partial_rotary_factor'=0.5 is not supported"),
])
def test_config_fields_that_change_the_math_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    """A Mistral config's sliding window was accepted and ignored (wrong log-probs past the window);
    Mistral's is implemented now (tests/test_model_tp.py), anyone else's is refused."""
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "max_position_embeddings": 256}
    with pytest.raises(ConfigError, match=rf"^cfg.json: field {message}"):
        ModelConfig.from_dict({**base, **fields}, source="cfg.json")
    for harmless in ({"sliding_window": None}, {"sliding_window": 256}, {"sliding_window": 8, "use_sliding_window": False},
                     {"final_logit_softcapping": None}, {"partial_rotary_factor": 1.0}):
        ModelConfig.from_dict({**base, **harmless})
