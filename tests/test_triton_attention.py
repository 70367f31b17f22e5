"""tprt's paged Triton attention kernel (tprt.gpu) against the torch reference backend, run on the
CPU through Triton's interpreter: ragged steps mixing prompt chunks over cached prefix blocks,
plain decode rows and verifying rows; rows crossing block edges and sharing a prefix block; GQA
ratios 1, 3, 4 and 8; head_dim 64 and 128; float32, bfloat16, int8 (per-vector and static scales)
and FP8 caches; the split-context (flash-decoding) path; static steps (what CUDA graphs replay)."""

from __future__ import annotations

import os

# CPU: the kernels through Triton's interpreter (set before they are defined); on the GPU check
# (bench/gpu_check.sh, TPRT_TEST_DEVICE=cuda) the same tests run the compiled kernels on the GPU.
DEVICE = "cuda" if os.environ.get("TPRT_TEST_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tprt.gpu.attention import TritonAttention, splits_for
from tprt.model.attention import TorchAttention
from tprt.model.batch import BatchRow, TokenBatch
from tprt.model.kv_cache import KVCache, kv_cache_dtype

BLOCK = 16
A, B, C, D = (1, 2, 3), (1, 4, 5), (6, 7, 8), (9, 10, 11)  # B shares A's first block


def _cache(heads_kv: int, head_dim: int, kv: str, dtype: torch.dtype, window: int | None = None,
           softcap: float | None = None) -> KVCache:
    storage = kv_cache_dtype(kv) if kv != "int8-static" else torch.int8
    fixed = None
    if kv == "int8-static":
        fixed = torch.rand(1, 2, heads_kv, generator=torch.Generator().manual_seed(1)) * 0.03 + 0.02
    return KVCache(1, 12, heads_kv, BLOCK, head_dim, storage or dtype, DEVICE, compute_dtype=dtype, fixed_scales=fixed,
                   windows=(window,), softcap=softcap)


def _run(steps: list[list[BatchRow]], heads: int, heads_kv: int, head_dim: int, kv: str,
         dtype: torch.dtype = torch.float32, splits: int | None = None, window: int | None = None,
         softcap: float | None = None) -> None:
    """Each step: the reference writes the step's keys and values and attends; the Triton step then
    attends over the same cache (attend_cached) and must agree."""
    cache = _cache(heads_kv, head_dim, kv, dtype, window, softcap)
    gen = torch.Generator().manual_seed(0)
    tol = {"fp32": 2e-5, "bf16": 2e-2}["fp32" if dtype == torch.float32 else "bf16"]
    for i, rows in enumerate(steps):
        batch = TokenBatch.of(rows)
        q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
        k, v = (torch.randn(batch.num_tokens, heads_kv, head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
        want = TorchAttention().prepare(batch, cache).attend(0, q, k, v).float()
        step = TritonAttention().prepare(batch, cache)
        if splits is not None:
            object.__setattr__(step.rows, "splits", splits)
        got = step.attend_cached(0, q).float()
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (i, kv, err)


MIXED = [
    # two prompts, one crossing a block edge
    [BatchRow(A, 0, (0,) * 20, 1), BatchRow(C, 0, (0,) * 5, 1)],
    # B's prompt after A's shared first block, A decodes, C verifies 3 tokens, D's first chunk
    [BatchRow(A, 20, (0,), 1), BatchRow(B, 16, (0,) * 9, 1), BatchRow(C, 5, (0,) * 3, 3),
     BatchRow(D, 0, (0,) * 17, 0)],
    # plain decode rows only
    [BatchRow(A, 21, (0,), 1), BatchRow(B, 25, (0,), 1), BatchRow(C, 8, (0,), 1), BatchRow(D, 17, (0,), 1)],
]


@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (12, 4), (8, 2), (16, 2)])
def test_gqa_ratios_on_a_mixed_ragged_batch(heads: int, heads_kv: int) -> None:
    _run(MIXED, heads, heads_kv, 64, "fp32")


@pytest.mark.parametrize("kv", ["int8", "int8-static", "fp8"])
def test_quantized_caches_are_dequantized_in_the_kernel(kv: str) -> None:
    _run(MIXED, 8, 2, 64, kv, dtype=torch.bfloat16)


def test_head_dim_128_in_bfloat16() -> None:
    _run(MIXED, 8, 1, 128, "bf16", dtype=torch.bfloat16)


def test_split_contexts_merge_to_the_same_attention() -> None:
    _run(MIXED, 8, 2, 64, "fp32", splits=2)
    _run(MIXED, 8, 2, 64, "fp32", splits=3)  # more shares than some rows have blocks: empty shares


@pytest.mark.parametrize("name", ["triton", "torch"])
def test_a_static_step_reads_its_buffers_only(name: str) -> None:
    """`static` (what a CUDA graph captures) over the buffers a graph replays
    (tprt.engine.step_graphs.StaticInputs), a step of decode and verifying rows padded from 6 to
    8 token slots: the reference's attention for the real tokens, and the cache as the
    reference leaves it outside the scratch block (padding writes only there)."""
    from tprt.engine.step_graphs import GraphKey, StaticInputs

    backend = TritonAttention() if name == "triton" else TorchAttention()
    caches = [_cache(2, 64, "fp32", torch.float32) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    prompt = TokenBatch.of([BatchRow(A, 0, (0,) * 20, 1), BatchRow(C, 0, (0,) * 3, 1), BatchRow(D, 0, (0,) * 9, 1)])
    q, k, v = (torch.randn(32, n, 64, generator=gen).to(DEVICE) for n in (8, 2, 2))
    for cache in caches:
        TorchAttention().prepare(prompt, cache).attend(0, q, k, v)
    rows = TokenBatch.of([BatchRow(A, 20, (0,), 1), BatchRow(C, 3, (0,) * 4, 4), BatchRow(D, 9, (0,), 1)])
    q, k, v = (torch.randn(6, n, 64, generator=gen).to(DEVICE) for n in (8, 2, 2))
    want = TorchAttention().prepare(rows, caches[0]).attend(0, q, k, v)
    inputs = StaticInputs(8, 4, torch.device(DEVICE))
    inputs.fill(rows, 8, BLOCK)
    key = GraphKey(8, 5, 0, 32 if backend.static_needs_kv_len else 0)
    pad = lambda x: torch.cat((x, torch.randn(2, *x.shape[1:], generator=gen).to(DEVICE)))  # noqa: E731
    got = backend.static(caches[1], inputs.rows(key)).attend(0, pad(q), pad(k), pad(v))
    assert torch.allclose(got[:6], want, atol=2e-5)
    assert torch.equal(caches[1].kv[:, 1:], caches[0].kv[:, 1:])


def test_splits_fill_the_gpu_only_when_rows_do_not() -> None:
    assert splits_for(64, 8, 256) == 1  # 512 programs: enough
    assert splits_for(1, 8, 256) == 16 and splits_for(1, 8, 24) == 3  # few rows, long or short contexts
    assert splits_for(2, 8, 4) == 1  # too few blocks to share


def test_the_model_gives_the_reference_logits_through_the_triton_backend(tmp_path: pytest.TempPathFactory) -> None:
    """A whole forward (TP 1, GQA 8/4, head_dim 16) over steps mixing prompt chunks, decode rows and
    a verifying row: the same logits through the Triton backend as through the torch reference."""
    from pathlib import Path

    from convert.api import hf_to_tp
    from helpers import forward_rows, make_hf_llama
    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import TPContext
    from tprt.model.attention import backend

    root = Path(str(tmp_path))
    hf_to_tp(make_hf_llama(root / "hf", "gqa", head_dim=16), root / "tp1", 1)
    model = load_model(root / "tp1", TPContext.single(torch.device(DEVICE)), dtype="fp32")
    caches = [model.new_cache(24, 4) for _ in range(2)]
    triton = backend("triton", torch.device(DEVICE), caches[1])
    assert triton.name == "triton"
    tables = [list(range(1, 9)), list(range(9, 17)), list(range(17, 24))]
    steps = [([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], [0, 0], tables[:2]),
             ([[20], [21, 22, 23], [30, 31, 32, 33, 34]], [7, 3, 0], tables),
             ([[40], [41], [42]], [8, 6, 5], tables)]
    with torch.inference_mode():
        for rows, starts, table in steps:
            want = torch.cat(forward_rows(model, caches[0], rows, starts, table))
            got = torch.cat(forward_rows(model, caches[1], rows, starts, table, triton))
            assert (got - want).abs().max() <= 1e-4 * want.abs().max(), starts


def test_triton_is_refused_clearly_where_it_cannot_run() -> None:
    from tprt.errors import ConfigError
    from tprt.model.attention import backend

    head_dim = 8 if DEVICE == "cuda" else 24  # compiled: below tl.dot's 16; any device: not a power of 2
    odd = KVCache(1, 4, 2, BLOCK, head_dim, torch.float32, DEVICE)
    with pytest.raises(ConfigError, match=f"attention backend triton.*head_dim {head_dim}"):
        backend("triton", torch.device(DEVICE), odd)
    if DEVICE == "cpu":  # never auto on a CPU, even with the interpreter on
        assert backend("auto", torch.device("cpu"), _cache(2, 64, "fp32", torch.float32)).name != "triton"


def test_the_flag_offers_every_backend() -> None:
    from tprt.engine.settings import ATTENTION_BACKEND_NAMES
    from tprt.model.attention import ATTENTION_BACKENDS

    assert ATTENTION_BACKEND_NAMES == ATTENTION_BACKENDS


@pytest.mark.parametrize("splits", [None, 3])
def test_a_sliding_window_skips_the_blocks_before_it(splits: int | None) -> None:
    """Mistral's window (tprt.model.kv_cache: `window`): each token sees its row's last 5 positions,
    through the kernel as through the reference, split or not."""
    _run(MIXED, 8, 2, 64, "fp32", splits=splits, window=5)


@pytest.mark.parametrize("splits", [None, 3])
def test_soft_capped_scores_with_a_window(splits: int | None) -> None:
    """Gemma 2's soft-capping (scores through cap * tanh(score / cap); a cap of 2 bends these
    unit-scale scores) under a window, as the reference computes it, split or not."""
    _run(MIXED, 8, 2, 64, "fp32", splits=splits, window=7, softcap=2.0)
