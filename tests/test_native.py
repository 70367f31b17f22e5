"""tprt.cpu.native: the compiled CPU kernels against torch, their build cache and their fallback;
tprt.cpu.hugepages: the huge-page buffers that weights and the KV cache live in."""

from __future__ import annotations

import ctypes

import itertools

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tprt.cpu import native
from tprt.cpu.native_layers import NativeRMSNorm
from tprt.model.llama import RMSNorm


def test_kernels_build_where_a_compiler_is() -> None:
    # No skip: where a C compiler exists the kernels must build; elsewhere the fallback is tested below.
    has_compiler = shutil.which(os.environ.get("CC", "cc")) is not None
    assert native.available() == (has_compiler and sys.platform.startswith("linux"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_linear(dtype: torch.dtype) -> None:
    if not native.available():
        assert native.gemv_kernel(torch.zeros(2, 2, dtype=dtype)) is None
        return
    torch.manual_seed(0)
    for n in (1, 3, 7, 33, 200):
        for k in (1, 5, 31, 32, 33, 63, 64, 65, 100, 576):
            w, x = torch.randn(n, k).to(dtype), torch.randn(1, k).to(dtype)
            gemv = native.gemv_kernel(w)
            assert gemv is not None
            got, want = gemv(x), F.linear(x.float(), w.float())
            assert got.shape == (1, n) and got.dtype == dtype
            # float32 sums in another order; bf16 adds one rounding of the output (2^-8 relative)
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            assert (got.float() - want).abs().max() <= tol * (want.abs().max() + 1), (n, k)
    with pytest.raises(ValueError, match="one row of 576"):
        gemv(torch.randn(2, 576).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_matches_linear(dtype: torch.dtype) -> None:
    """The few-row kernel for 2-8 rows (each count has its own C loop), in 2-d and 3-d inputs, on
    row lengths off the vector widths."""
    if not native.available():
        assert native.gemv_rows_kernel(torch.zeros(2, 2, dtype=dtype)) is None
        return
    torch.manual_seed(0)
    for n, k in ((7, 31), (33, 33), (200, 576), (5, 100), (3, 1536)):
        w = torch.randn(n, k).to(dtype)
        rows_gemv = native.gemv_rows_kernel(w)
        assert rows_gemv is not None
        for rows in range(2, native.MAX_FEW_ROWS + 1):
            for x in (torch.randn(rows, k).to(dtype), torch.randn(rows, 1, k).to(dtype)):
                got, want = rows_gemv(x), F.linear(x.float(), w.float())
                assert got.shape == want.shape and got.dtype == dtype
                tol = 1e-5 if dtype == torch.float32 else 8e-3
                assert (got.float() - want).abs().max() <= tol * (want.abs().max() + 1), (n, k, rows)
    for bad in (torch.randn(1, 1536), torch.randn(native.MAX_FEW_ROWS + 1, 1536)):
        with pytest.raises(ValueError, match="gemv_rows"):
            rows_gemv(bad.to(dtype))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """Each row of the bf16 few-row kernel has the one-row GEMV's bits (the same sums in the same
    order): a decode row of drafted tokens verifies them with the logits one-token steps give.
    (fp32 rows match to rounding only: test_gemv_rows_matches_linear; see kernels.c.)"""
    if not native.available():
        return
    torch.manual_seed(1)
    dtype = torch.bfloat16
    for n, k in ((7, 31), (33, 72), (200, 576), (5, 100), (3, 1536), (9, 96)):
        w = torch.randn(n, k).to(dtype)
        one, rows_gemv = native.gemv_kernel(w), native.gemv_rows_kernel(w)
        assert one is not None and rows_gemv is not None
        for rows in range(2, native.MAX_FEW_ROWS + 1):
            x = torch.randn(rows, k).to(dtype)
            alone = torch.stack([one(x[i]) for i in range(rows)])
            assert torch.equal(rows_gemv(x), alone), (dtype, n, k, rows)


def test_fast_linear_routes_by_row_count() -> None:
    """One row to `one`, the counts in `few_rows` to `few`, everything else to `many`."""
    from tprt.cpu.fast_linear import FastLinear

    calls: list[str] = []

    def tag(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: (calls.append(name), x)[1]

    fast = FastLinear(tag("many"), tag("one"), "native", tag("few"), frozenset({2, 3}))
    for rows in (1, 2, 3, 4, 16):
        fast(torch.zeros(rows, 1, 8))
    assert calls == ["one", "few", "few", "many", "many"]
    assert FastLinear(tag("many"), tag("one"), "native", None, frozenset({2})).few_rows == frozenset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_module(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(100, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(4, 3, 100) * 3).to(dtype)
    with torch.no_grad():
        want = norm(x)
    fast = native.rms_norm_kernel(norm.weight, norm.eps)
    if not native.available():
        assert fast is None
        return
    assert fast is not None
    got = fast(x)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.bfloat16:  # transformers' two roundings, reproduced: equal but for rare ties
        assert (got != want).float().mean() < 1e-3
    assert (got.float() - want.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 2e-2) * want.abs().max().float()
    swapped = NativeRMSNorm(100, norm.eps, dtype, False, fast)
    swapped.weight = norm.weight
    with torch.no_grad():
        assert torch.equal(swapped(x), got)  # used with autograd off
    assert torch.equal(swapped(x).detach(), want)  # not under autograd: the differentiable torch path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa(dtype: torch.dtype) -> None:
    """The decode-attention kernel against SDPA with the engine's causal mask: head_dim 64 and
    128 (the vectorised paths) and 24 (the generic one), groups of 1 and 3 q heads per kv head,
    blocks of 1, 5 and 16 positions, rows in scattered blocks at positions from 0 to past a
    16-key block."""
    from tprt.model.kv_cache import KVCache

    attend = native.decode_attention_kernel(dtype)
    if not native.available():
        assert attend is None
        return
    assert attend is not None
    torch.manual_seed(0)
    for d, (nh, nkv), size in itertools.product((24, 64, 128), ((6, 2), (4, 4)), (1, 5, 16)):
        width = -(-34 // size)
        cache = KVCache(2, 4 * width + 1, nkv, size, d, torch.float32)
        cache.kv.normal_()
        positions = torch.tensor([[0], [16], [33], [5]])
        tables = (torch.randperm(4 * width, generator=torch.Generator().manual_seed(d + size)) + 1).view(4, width)
        step = cache.prepare(positions, tables)
        q = torch.randn(4, nh, 1, d) * 3  # sharper softmaxes than unit scale
        k, v = cache.read(1, step)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=step.masks[None], enable_gqa=nh != nkv)
        got = attend(q, cache, step, 1)
        assert got.shape == (4, 1, nh * d) and got.dtype == dtype
        tol = 2e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the output
        assert (got.float() - want.transpose(1, 2).reshape(4, 1, nh * d)).abs().max() <= tol * want.abs().max(), (d, nh, size)
    with pytest.raises(ValueError, match="decode_attention"):
        attend(q.to(torch.bfloat16), cache, step, 1)
    with pytest.raises(ValueError, match="decode_attention"):  # more rows than the step has positions
        attend(torch.randn(5, nh, 1, d), cache, step, 1)


@pytest.mark.parametrize("storage", ["fp32", "int8"])
def test_decode_attention_with_windows_and_soft_caps(storage: str) -> None:
    """Sliding windows (Mistral's, Gemma's windowed layers) and soft-capped scores (Gemma 2) in the
    decode kernel, against the reference's masked, capped attention over the same cache: windows
    starting inside a block, on a block edge, and longer than the row; the vectorised head_dims
    and the generic one; float32 and int8 caches."""
    from tprt.model.kv_cache import KVCache, kv_cache_dtype
    from tprt.model.sdpa import attention_math

    attend = native.decode_attention_kernel(torch.float32)
    if not native.available():
        assert attend is None
        return
    assert attend is not None
    torch.manual_seed(1)
    for d, size, (window, cap) in itertools.product((24, 64, 128), (5, 16), ((7, None), (16, 2.0), (None, 1.5),
                                                                            (64, 3.0))):
        width = -(-40 // size)
        cache = KVCache(2, 4 * width + 1, 2, size, d, kv_cache_dtype(storage) or torch.float32, windows=(None, window),
                        softcap=cap)
        positions = torch.tensor([[3], [16], [39], [21]])
        tables = (torch.randperm(4 * width, generator=torch.Generator().manual_seed(d + size)) + 1).view(4, width)
        step = cache.prepare(torch.arange(40).expand(4, 40), tables)  # every position of every row written
        cache.write(1, torch.randn(4, 40, 2, 2, d), step)
        step = cache.prepare(positions, tables)
        q = torch.randn(4, 6, 1, d) * 3
        k, v = cache.read(1, step)
        want = attention_math(q, k, v, step.masks[window], gqa=True, softcap=cap)
        got = attend(q, cache, step, 1)
        assert (got - want.transpose(1, 2).reshape(4, 1, 6 * d)).abs().max() <= 2e-5 * want.abs().max(), (d, size, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_glu_matches_torch(dtype: torch.dtype) -> None:
    """Gemma's GeGLU in one call against torch's tanh-gelu times up, rounded the same way: off the
    vector width, both signs, large and tiny gates (tanh saturating both ways)."""
    kernel = native.gelu_glu_kernel(dtype)
    if not native.available():
        assert kernel is None
        return
    assert kernel is not None
    x = (torch.randn(5, 2 * 101, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    x[0, :4] = torch.tensor([30.0, -30.0, 1e-4, -1e-4])
    gate, up = x.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = kernel(x)
    assert got.shape == want.shape and got.dtype == dtype
    # Against the operands' scale: where gelu is near 0 (gate far below 0) 1 + tanh cancels, and
    # the kernel's exp (relative error 2e-7) shows there as it would in any float32 formula.
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: a rounding flipped here and there
    scale = 1 + (gate.float() * up.float()).abs()
    assert ((got.float() - want.float()).abs() <= tol * scale).all()
    with pytest.raises(ValueError, match="gelu_glu"):
        kernel(x[:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_decode_matches_modules(dtype: torch.dtype) -> None:
    """The one-call MLP half against RMSNorm + the fused gate/up linear + SwiGLU + the down linear,
    on shapes off the vector widths and activations of both signs."""
    from tprt.model.config import ModelConfig
    from tprt.distributed.context import TPContext
    from tprt.model.llama import MLP

    torch.manual_seed(0)
    for hidden, inter in ((100, 37), (64, 256), (576, 1536)):
        cfg = ModelConfig.from_dict({"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": 4,
                                     "num_hidden_layers": 1, "vocab_size": 10, "rms_norm_eps": 1e-5})
        norm, mlp = RMSNorm(hidden, 1e-5, dtype), MLP(cfg, TPContext.single(), dtype)
        with torch.no_grad():
            for w in (norm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight):
                w.normal_(0, 3 / w.shape[-1] ** 0.5)
        fast = native.mlp_decode_kernel(norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        if not native.available():
            assert fast is None
            return
        assert fast is not None
        x = (torch.randn(1, 1, hidden) * 2).to(dtype)
        with torch.no_grad():
            want = mlp(norm(x)).float()
        got = fast(x)
        assert got.shape == x.shape and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: roundings of the intermediate values
        assert (got.float() - want).abs().max() <= tol * want.abs().max(), (hidden, inter)
    with pytest.raises(ValueError, match="one row of 576"):
        fast(torch.randn(2, 576).to(dtype))
    assert native.mlp_decode_kernel(norm.weight, 1e-5, mlp.down_proj.weight, mlp.down_proj.weight) is None  # shapes


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from tprt.cpu import native; print(native.available())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_build_cache_and_fallbacks(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    if shutil.which(os.environ.get("CC", "cc")) is not None:
        first = _probe({"TPRT_CACHE_DIR": str(cache)})
        assert first.stdout.strip() == "True", first.stderr
        built = sorted(p.name for p in (cache / "native").iterdir())
        assert len(built) == 1 and built[0].startswith("kernels-") and built[0].endswith(".so")  # no temporary left
        assert _probe({"TPRT_CACHE_DIR": str(cache)}).stdout.strip() == "True"  # reused
        blocked, tmp = tmp_path / "a-file", tmp_path / "tmp"  # a cache dir that cannot be created
        blocked.write_text("")
        tmp.mkdir()
        fallback = _probe({"TPRT_CACHE_DIR": str(blocked / "cache"), "TMPDIR": str(tmp)})
        assert fallback.stdout.strip() == "True", fallback.stderr
        assert len(list((tmp / f"tprt-{os.getuid()}" / "native").glob("kernels-*.so"))) == 1
    no_compiler = _probe({"TPRT_CACHE_DIR": str(tmp_path / "other"), "CC": str(tmp_path / "no-such-cc")})
    assert no_compiler.stdout.strip() == "False"
    assert "no C compiler" in no_compiler.stderr and "using torch's kernels" in no_compiler.stderr
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    failed = _probe({"TPRT_CACHE_DIR": str(tmp_path / "third"), "CC": str(broken)})
    assert failed.stdout.strip() == "False" and "broken compiler" in failed.stderr
    assert not any((tmp_path / "third" / "native").iterdir())  # nothing half-written left behind
    assert _probe({"TPRT_NATIVE": "0"}).stdout.strip() == "False"


def test_huge_tensors_are_aligned_disjoint_views() -> None:
    from tprt.cpu.hugepages import HUGE_PAGE, huge_empty, huge_tensors

    shapes = [(3, 5), (7,), (2000, 600), (2, 3, 4)]  # 2.4 MB in all: a huge-page block
    ts = huge_tensors(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in ts] == shapes and all(t.dtype == torch.bfloat16 for t in ts)
    assert ts[0].data_ptr() % HUGE_PAGE == 0 and all(t.data_ptr() % 64 == 0 for t in ts)
    for i, t in enumerate(ts):  # writing one leaves the others alone
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(ts))
    assert huge_empty(100).numel() == 100  # small: ordinary memory


def test_frozen_weights_share_one_block_and_trainable_ones_do_not(tmp_path: Path) -> None:
    from convert.api import hf_to_tp
    from train_fixtures import make_tiny_model
    from tprt.distributed.context import TPContext
    from tprt.checkpoint.loading import load_model

    hf, _ = make_tiny_model(tmp_path, tp=1)
    tp1 = tmp_path / "tp1"
    hf_to_tp(hf, tp1, 1)
    frozen = load_model(tp1, TPContext.single(), "fp32")
    trainable = load_model(tp1, TPContext.single(), "fp32", requires_grad=True)
    storages = {p.untyped_storage().data_ptr() for p in frozen.parameters()}
    assert len(storages) == 1
    assert len({p.untyped_storage().data_ptr() for p in trainable.parameters()}) == len(list(trainable.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(frozen.parameters(), trainable.parameters()))
    cache = frozen.new_cache(3, 16)
    assert not cache.kv.any()  # zeroed (masked entries still enter attention's weighted sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_kernels_equal_one_thread(dtype: torch.dtype) -> None:
    """The pool's kernels at 2 and 3 threads give one thread's results bit for bit: the GEMV and
    the few-row GEMV (row counts that split unevenly, large enough to be shared), the fused MLP
    half (intermediate sizes off the 16-wide blocks), the fused attention half over a paged
    cache (its output and the k/v it writes), on heads that split unevenly, and a stack of
    three layers in one call (tprt.cpu.native.decode_stack_kernel)."""
    from tprt.model.kv_cache import KVCache

    if not native.available():
        assert native.set_threads(3) == 1 and native.threads() == 1
        return
    torch.manual_seed(0)
    hidden, d, nh, nkv = 200, 64, 6, 2
    gemvs = [(native.gemv_kernel(w), native.gemv_rows_kernel(w), w.shape[1])
             for w in (torch.randn(1001, 333).to(dtype), torch.randn(7, 31).to(dtype), torch.randn(333, 200).to(dtype))]
    mlps = [native.mlp_decode_kernel(torch.rand(hidden).to(dtype), 1e-5, (torch.randn(2 * inter, hidden) / 8).to(dtype),
                                     (torch.randn(hidden, inter) / 8).to(dtype)) for inter in (37, 333)]
    attention = native.attention_decode_kernel(torch.rand(hidden).to(dtype), 1e-5,
                                               (torch.randn((nh + 2 * nkv) * d, hidden) / 8).to(dtype),
                                               (torch.randn(hidden, nh * d) / 8).to(dtype), nh, nkv)
    assert attention is not None and all(m is not None for m in mlps)
    layers = [(torch.rand(hidden).to(dtype), (torch.randn((nh + 2 * nkv) * d, hidden) / 8).to(dtype),
               (torch.randn(hidden, nh * d) / 8).to(dtype), torch.rand(hidden).to(dtype),
               (torch.randn(2 * 333, hidden) / 8).to(dtype), (torch.randn(hidden, 333) / 8).to(dtype)) for _ in range(3)]
    stack = native.decode_stack_kernel(layers, 1e-5, nh, nkv)
    assert stack is not None
    cos, sin = torch.rand(1, 1, 1, d).to(dtype), torch.rand(1, 1, 1, d).to(dtype)
    x = torch.randn(1, 1, hidden).to(dtype)

    def everything() -> list[torch.Tensor]:
        outs = []
        for one, few, k in gemvs:
            assert one is not None and few is not None
            outs.append(one(torch.linspace(-1, 1, k).to(dtype).view(1, k)))
            outs += [few(torch.linspace(-1, 1, rows * k).to(dtype).view(rows, k)) for rows in (2, 5, 8)]
        outs += [mlp(x) for mlp in mlps if mlp is not None]
        cache = KVCache(1, 9, nkv, 5, d, torch.float32)  # 40 positions in scattered blocks of 5
        table = (torch.randperm(8, generator=torch.Generator().manual_seed(2)) + 1).view(1, 8)
        step = cache.prepare(torch.tensor([[37]]), table)
        cache.kv.normal_(generator=torch.Generator().manual_seed(1))
        outs += [attention(x, cos, sin, cache, step, 0), cache.kv.clone()]
        cache = KVCache(3, 9, nkv, 5, d, torch.float32)  # the stack of 3 layers, same blocks
        cache.kv.normal_(generator=torch.Generator().manual_seed(3))
        outs += [stack(x, cos, sin, cache, step), cache.kv.clone()]
        return outs

    try:
        assert native.set_threads(1) == 1
        want = everything()
        for threads in (2, 3):
            assert native.set_threads(threads) == threads == native.threads()
            got = everything()
            assert all(torch.equal(a, b) for a, b in zip(got, want)), threads
    finally:
        native.set_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_stack_equals_its_layers_half_by_half(dtype: torch.dtype) -> None:
    """Every layer of a one-row step in one call (tprt.cpu.native.decode_stack_kernel) gives the
    bits of the same layers run half by half from Python (each half's kernel, the residual adds in
    torch), and writes the same keys and values, at 1 and 2 threads; bad inputs are refused."""
    from tprt.model.kv_cache import KVCache

    if not native.available():
        return
    torch.manual_seed(1)
    hidden, d, nh, nkv, inter = 128, 32, 4, 2, 96
    layers = [(torch.rand(hidden).to(dtype), (torch.randn((nh + 2 * nkv) * d, hidden) / 8).to(dtype),
               (torch.randn(hidden, nh * d) / 8).to(dtype), torch.rand(hidden).to(dtype),
               (torch.randn(2 * inter, hidden) / 8).to(dtype), (torch.randn(hidden, inter) / 8).to(dtype))
              for _ in range(4)]
    stack = native.decode_stack_kernel(layers, 1e-6, nh, nkv)
    halves = [(native.attention_decode_kernel(a, 1e-6, qkv, o, nh, nkv), native.mlp_decode_kernel(m, 1e-6, gu, down))
              for a, qkv, o, m, gu, down in layers]
    assert stack is not None
    cos, sin = torch.rand(1, 1, 1, d).to(dtype), torch.rand(1, 1, 1, d).to(dtype)
    x = torch.randn(1, 1, hidden).to(dtype)
    table = torch.tensor([[3, 1, 4, 2]])
    step = KVCache(4, 5, nkv, 4, d, torch.float32).prepare(torch.tensor([[13]]), table)

    def by_halves(cache: KVCache) -> torch.Tensor:
        h = x
        for i, (attention, mlp) in enumerate(halves):
            assert attention is not None and mlp is not None
            h = h + attention(h, cos, sin, cache, step, i)
            h = h + mlp(h)
        return h

    try:
        for threads in (1, 2):
            native.set_threads(threads)
            caches = [KVCache(4, 5, nkv, 4, d, torch.float32) for _ in range(2)]
            for c in caches:
                c.kv.normal_(generator=torch.Generator().manual_seed(5))
            want, got = by_halves(caches[0]), stack(x, cos, sin, caches[1], step)
            assert torch.equal(got, want) and torch.equal(caches[1].kv, caches[0].kv), threads
            assert not torch.equal(got, x)
    finally:
        native.set_threads(1)
    with pytest.raises(ValueError, match="decode_stack"):
        stack(torch.randn(1, 2, hidden).to(dtype), cos, sin, caches[1], step)  # two tokens in a row

    # Where TP > 1, each half's partial product goes through the all-reduce given, in place: a C
    # callable doubling it stands for two ranks with equal partials (doubling rounds exactly).
    calls: list[int] = []
    fail_at = [0]

    def double(ctx: int, data: int, n: int, code: int) -> int:
        calls.append(code)
        if len(calls) == fail_at[0]:
            return 2  # "rank 1 exited"
        elem = torch.empty(0, dtype=dtype).element_size()
        buf = (ctypes.c_char * (n * elem)).from_address(data)
        t = torch.frombuffer(buf, dtype=dtype)
        t.mul_(2)
        return 0

    c_double = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(double)
    errors: list[int] = []

    def check(status: int) -> None:
        errors.append(status)
        raise RuntimeError(f"all-reduce failed: {status}")

    reduced = native.decode_stack_kernel(layers, 1e-6, nh, nkv, (ctypes.cast(c_double, ctypes.c_void_p).value, 0, check))
    assert reduced is not None
    caches = [KVCache(4, 5, nkv, 4, d, torch.float32) for _ in range(2)]
    h = x
    for i, (attention, mlp) in enumerate(halves):
        assert attention is not None and mlp is not None
        h = h + 2 * attention(h, cos, sin, caches[0], step, i)
        h = h + 2 * mlp(h)
    assert torch.equal(reduced(x, cos, sin, caches[1], step), h) and torch.equal(caches[1].kv, caches[0].kv)
    assert calls == [{torch.float32: 0, torch.bfloat16: 1}[dtype]] * 8 and not errors  # two per layer
    calls.clear()
    fail_at[0] = 3
    with pytest.raises(RuntimeError, match="all-reduce failed: 2"):
        reduced(x, cos, sin, caches[1], step)
    assert len(calls) == 3 and errors == [2]  # none after the failure
    assert native.decode_stack_kernel(layers[:1] + [layers[1][:5]], 1e-6, nh, nkv) is None  # a layer short of a weight
    mismatched = list(layers[1])
    mismatched[4] = torch.randn(2 * inter + 2, hidden).to(dtype)  # another intermediate size
    assert native.decode_stack_kernel([layers[0], tuple(mismatched)], 1e-6, nh, nkv) is None


def test_stream_sum_reads_every_value_the_same_at_any_thread_count() -> None:
    """The benchmarks' prefetching read (native.stream_sum) sums every value, odd lengths and
    chunk edges included, with the same bits at 1, 2 and 3 threads; other tensors are refused."""
    if not native.available():
        assert native.stream_sum(torch.ones(3)) is None
        return
    x = torch.rand(3_000_001, generator=torch.Generator().manual_seed(0))  # several chunks, an odd tail
    try:
        sums = []
        for threads in (1, 2, 3):
            native.set_threads(threads)
            sums.append(native.stream_sum(x))
    finally:
        native.set_threads(1)
    assert sums[0] == sums[1] == sums[2]
    assert abs(sums[0] - x.double().sum().item()) <= 1e-4 * x.numel()
    assert native.stream_sum(torch.ones(5)) == 5.0
    with pytest.raises(ValueError, match="stream_sum"):
        native.stream_sum(torch.ones(4, 4)[:, 0])
