"""Attention over the paged cache for one TokenBatch (tprt.model.attention): every backend
against a naive reference kept outside the cache (each sequence's keys and values as plain
tensors, each token attending to its own sequence's positions up to its own), on ragged
batches: prompt chunks, plain decode rows and verifying rows in one step, rows crossing block
edges, two sequences sharing a prefix block, and float32, int8 and FP8 caches."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on the CPU (set before they are defined)

import pytest
import torch

from tprt.cpu.native_attention import NativeCPUAttention
from tprt.errors import ConfigError
from tprt.gpu.attention import TritonAttentionStep
from tprt.model.attention import AttentionStep, TorchAttention, backend
from tprt.model.batch import BatchRow, TokenBatch
from tprt.model.kv_cache import KVCache, kv_cache_dtype

NH, NKV, D, BLOCK = 4, 2, 16, 4
TOL = {"fp32": 1e-5, "int8": 3e-2, "fp8": 8e-2}  # of the outputs' scale; quantized: the stored values' rounding


class Naive:
    """Each sequence's keys and values by position, and attention computed from them alone."""

    def __init__(self) -> None:
        self.k: dict[str, list[torch.Tensor]] = {}
        self.v: dict[str, list[torch.Tensor]] = {}

    def write(self, seq: str, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        ks, vs = self.k.setdefault(seq, []), self.v.setdefault(seq, [])
        del ks[start:], vs[start:]  # positions given back are written again
        ks.extend(k.unbind(0))
        vs.extend(v.unbind(0))

    def attend(self, seq: str, position: int, q: torch.Tensor) -> torch.Tensor:
        """q [heads, d] of the token at `position` -> [heads, d]."""
        k = torch.stack(self.k[seq][: position + 1])  # [keys, kv_heads, d]
        v = torch.stack(self.v[seq][: position + 1])
        group = NH // NKV
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [keys, heads, d]
        scores = torch.einsum("hd,khd->hk", q, k) / math.sqrt(D)
        return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


def _step(attention: AttentionStep, naive: Naive, rows: list[tuple[str, int, int]], gen: torch.Generator,
          cached: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random q/k/v for the batch's tokens: (the backend's output, the naive one), [tokens, heads, d]."""
    tokens = attention.tokens
    q, k, v = (torch.randn(tokens, n, D, generator=gen) for n in (NH, NKV, NKV))
    if cached:  # a fused kernel wrote them (a plain decode step: one group): written, then attended
        slots = attention.rows if isinstance(attention, TritonAttentionStep) else attention.groups[0].cache_step
        attention.cache.write(0, torch.stack((k, v), dim=1)[:, None], slots)
        got = attention.attend_cached(0, q)
    else:
        got = attention.attend(0, q, k, v)
    want, i = [], 0
    for seq, start, n in rows:
        naive.write(seq, start, k[i : i + n], v[i : i + n])
        i += n
    i = 0
    for seq, start, n in rows:
        for j in range(n):
            want.append(naive.attend(seq, start + j, q[i + j]))
        i += n
    return got.float(), torch.stack(want)


BACKENDS = ["torch", "native", "triton"]


@pytest.mark.parametrize("kv", ["fp32", "int8", "fp8"])
@pytest.mark.parametrize("name", BACKENDS)
def test_backends_agree_with_a_naive_reference_on_ragged_batches(name: str, kv: str) -> None:
    cache = KVCache(1, 40, NKV, BLOCK, D, kv_cache_dtype(kv) or torch.float32)
    if name == "native" and kv == "fp8":  # the compiled kernels read float32 and int8 caches only
        with pytest.raises(ConfigError, match="attention backend native"):
            backend(name, torch.device("cpu"), cache)
        assert backend("auto", torch.device("cpu"), cache).name == "torch"
        return
    attention = backend(name, torch.device("cpu"), cache)
    assert attention.name == name
    naive, gen = Naive(), torch.Generator().manual_seed(0)
    a, b, c, d = (1, 2, 3, 4), (1, 5, 6, 7), (8, 9, 10), (11, 12, 13, 14)  # b shares a's first block
    steps = [
        # two prompts, one crossing block edges (6 positions over blocks of 4)
        [BatchRow(a, 0, (0,) * 6, 1), BatchRow(c, 0, (0,) * 3, 1)],
        # b's prompt after the shared block (positions 0-3 are a's), a decodes, c verifies 3 tokens,
        # d's first chunk: every kind of row in one step
        [BatchRow(a, 6, (0,), 1), BatchRow(b, 4, (0,) * 5, 1), BatchRow(c, 3, (0,) * 3, 3),
         BatchRow(d, 0, (0,) * 2, 0)],
        # plain decode rows only (the compiled kernel's step), c back at a given-back position
        [BatchRow(a, 7, (0,), 1), BatchRow(b, 9, (0,), 1), BatchRow(c, 4, (0,), 1), BatchRow(d, 2, (0,), 1)],
        # two rows of the same start and length (one attention group), beside a decode row
        [BatchRow(a, 8, (0,) * 2, 2), BatchRow(b, 10, (0,), 1), BatchRow(d, 3, (0,) * 2, 2)],
    ]
    names = {a: "a", b: "b", c: "c", d: "d"}
    naive.k["b"], naive.v["b"] = [], []
    for i, rows in enumerate(steps):
        batch = TokenBatch.of(rows)
        layout = [(names[r.table], r.start, len(r.tokens)) for r in rows]
        if i == 1:  # b reads a's first block: its naive history starts with a's four positions
            naive.k["b"], naive.v["b"] = list(naive.k["a"][:4]), list(naive.v["a"][:4])
        step = attention.prepare(batch, cache)
        assert step.single_tokens == (batch.max_query_len == 1)
        got, want = _step(step, naive, layout, gen, cached=i == 2)
        scale = want.abs().max()
        assert (got - want).abs().max() <= TOL[kv] * scale, (name, kv, i)


def test_the_native_backend_gives_the_reference_bits_on_a_decode_step_and_the_same_steps_otherwise() -> None:
    """float32: the compiled kernel within rounding of the reference on plain decode; any step with
    a row of several tokens attends exactly as the reference does."""
    cache = KVCache(1, 20, NKV, BLOCK, D, torch.float32)
    assert NativeCPUAttention.available(torch.device("cpu"), cache), "tprt's CPU kernels did not build here"
    gen = torch.Generator().manual_seed(1)
    prefill = TokenBatch.of([BatchRow((1, 2), 0, (0,) * 5, 1), BatchRow((3, 4), 0, (0,) * 7, 1)])
    q, k, v = (torch.randn(12, n, D, generator=gen) for n in (NH, NKV, NKV))
    ref = TorchAttention().prepare(prefill, cache).attend(0, q, k, v)
    assert torch.equal(NativeCPUAttention().prepare(prefill, cache).attend(0, q, k, v), ref)
    decode = TokenBatch.of([BatchRow((1, 2), 5, (0,), 1), BatchRow((3, 4), 7, (0,), 1)])
    q, k, v = (torch.randn(2, n, D, generator=gen) for n in (NH, NKV, NKV))
    snapshot = cache.kv.clone()
    want = TorchAttention().prepare(decode, cache).attend(0, q, k, v)
    cache.kv.copy_(snapshot)
    got = NativeCPUAttention().prepare(decode, cache).attend(0, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-5)


def test_a_batch_whose_rows_leave_their_blocks_is_refused() -> None:
    cache = KVCache(1, 8, NKV, BLOCK, D, torch.float32)
    with pytest.raises(ValueError, match="row 0: positions up to 8 but 2 blocks"):
        TorchAttention().prepare(TokenBatch.of([BatchRow((1, 2), 6, (0,) * 3, 1)]), cache)
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 8\)"):
        TorchAttention().prepare(TokenBatch.of([BatchRow((1,), 0, (0,), 1), BatchRow((9,), 0, (0,), 1)]), cache)
