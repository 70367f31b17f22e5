"""The quantized KV cache (tprt.model.kv_cache: int8 and FP8 e4m3 with a float32 scale per head
vector): the quantizer, the paged cache's writes and reads, the C decode kernels reading int8
directly (native build, and the AVX2 and scalar builds of the same source) against the torch
reference, the `--kv-cache-dtype` names, and garbage detection (wrong scales must show).
Model-level checks (logits near the float cache's at TP 1/2/4/8, greedy agreement, prefix sharing
through the engine) live in the existing worlds: tests/test_model_tp.py and tests/test_engine.py."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tprt.cpu import native
from tprt.errors import ConfigError
from tprt.model.kv_cache import QUANTIZED, SCALE_DTYPE, KVCache, key_rotation, kv_bytes_per_position, kv_cache_dtype, quantize

HAS_FP8 = hasattr(torch, "float8_e4m3fn")
QDTYPES = [torch.int8] + ([torch.float8_e4m3fn] if HAS_FP8 else [])
# Worst relative error of one dequantized element against its vector's amax: half a step of 1/127
# for int8 (the step, amax / 127 rounded up to a bfloat16, is at most 2^-7 larger); e4m3 has 3
# mantissa bits, so half an ulp is 1/16 of the value.
ELEMENT_TOL = {torch.int8: 0.5 / 127 * (1 + 2 ** -7) + 1e-6, torch.float8_e4m3fn: 1 / 16 + 1e-6}

# Max |attention output error| over its max, unit-scale keys/values and queries (measured: int8
# 1.0e-2, e4m3 3.3e-2; wrong scales give 0.66 to 140).
ATTENTION_TOL = {torch.int8: 0.02, torch.float8_e4m3fn: 0.06}


@pytest.mark.parametrize("dtype", QDTYPES, ids=str)
def test_quantize_round_trip_is_within_half_a_step(dtype: torch.dtype) -> None:
    """Each vector's own scale, the smallest bfloat16 at or above amax / the format's largest:
    error per element within half a quantization step of its amax (int8) or half an ulp of the
    value (e4m3); zero vectors stay zero; magnitudes spanning 1e-3 to 1e3 across vectors lose
    nothing to each other."""
    x = torch.randn(4, 7, 2, 3, 64) * torch.logspace(-3, 3, 7).view(1, 7, 1, 1, 1)
    x[0, 0, 0, 0] = 0
    values, scales = quantize(x, dtype)
    assert values.dtype == dtype and scales.shape == x.shape[:-1] and scales.dtype == SCALE_DTYPE == torch.bfloat16
    ratio = x.abs().amax(-1) / QUANTIZED[dtype]
    nonzero = ratio > 0
    up = scales.float()[nonzero]  # rounded up, never to nearest: the largest value stays in range
    assert (up >= ratio[nonzero]).all() and (up < ratio[nonzero] * (1 + 2 ** -7)).all()
    assert scales[0, 0, 0, 0] == 1
    back = values.float() * scales.float().unsqueeze(-1)
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        assert ((back - x).abs() <= ELEMENT_TOL[dtype] * amax).all()
        assert (values.abs().amax(-1)[nonzero] >= 126).all()
    else:  # relative to the value, or to the smallest normal's step for tiny ones
        assert ((back - x).abs() <= ELEMENT_TOL[dtype] * x.abs() + amax * 2.0 ** -9 / QUANTIZED[dtype]).all()
    assert torch.equal(back[0, 0, 0, 0], torch.zeros(64))


@pytest.mark.parametrize("dtype", QDTYPES, ids=str)
def test_paged_cache_writes_quantize_and_reads_dequantize(dtype: torch.dtype) -> None:
    """Through block tables: a token's keys/values read back near what was written, at its block
    and offset, with its scale stored beside it; storage is the quantized dtype and bytes per
    position shrink as kv_bytes_per_position says."""
    n_layers, nkv, bs, d = 2, 2, 4, 32
    cache = KVCache(n_layers, 12, nkv, bs, d, dtype)
    ref = KVCache(n_layers, 12, nkv, bs, d, torch.float32)
    assert cache.quantized and cache.storage_dtype == dtype and cache.dtype == torch.float32
    assert cache.nbytes() == 12 * bs * n_layers * 2 * nkv * kv_bytes_per_position(dtype, d)
    assert ref.nbytes() / cache.nbytes() == 4 * d / (d + 2)  # a two-byte scale per head vector
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    tables = torch.tensor([[3, 7, 0], [9, 2, 5]])
    kv = torch.randn(2, 6, 2, nkv, d) * 4
    for c in (cache, ref):
        step = c.prepare(positions, tables)
        k, v = c.update(1, kv, step)
    k_ref, v_ref = ref.read(1, ref.prepare(positions, tables))
    amax = kv.abs().amax(-1).max()
    rotation = cache.key_rotation  # FP8 keys are stored rotated, int8's as given
    assert (rotation is None) == (dtype == torch.int8)
    for got, want in ((k, k_ref), (v, v_ref)):
        real = torch.cat([got[0, :, :6], got[1, :, 6:12]]) - torch.cat([want[0, :, :6], want[1, :, 6:12]])
        if rotation is None or got is v:
            assert real.abs().max() <= ELEMENT_TOL[dtype] * amax
        else:  # the rotation keeps each error vector's length: within half an ulp of the key's
            assert (real.norm(dim=-1) <= ELEMENT_TOL[dtype] * torch.cat([want[0, :, :6], want[1, :, 6:12]]).norm(dim=-1)).all()
    written = kv[1, 3].clone()  # row 1's position 9: block 5 (its table's third), offset 1
    if rotation is not None:
        assert torch.allclose(rotation @ rotation.T, torch.eye(d), atol=1e-6)
        written[0] = written[0] @ rotation
    values, scales = quantize(written, dtype)
    assert cache.scales is not None
    assert torch.equal(cache.kv[1, 5, :, :, 1].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(cache.scales[1, 5, :, :, 1], scales)
    assert not cache.kv[0].view(torch.uint8).any() and not cache.scales[0].any(), "layer 0 was written"


def test_key_rotation_is_a_hadamard_matrix_where_head_dim_allows() -> None:
    """FP8 keys' rotation: orthogonal, every entry +-1/sqrt(d), the same matrix each time; none
    for a head_dim that is not a power of 2 (keys then stored as given, and still read back)."""
    for d in (2, 64, 128):
        h = key_rotation(d)
        assert h is not None and torch.allclose(h @ h.T, torch.eye(d), atol=1e-6)
        assert torch.equal(h.abs(), torch.full((d, d), d ** -0.5)) and torch.equal(h, key_rotation(d))
    assert key_rotation(48) is None and key_rotation(1) is None
    if HAS_FP8:  # attention reads FP8 keys as stored and rotates its queries instead: the same scores
        cache = KVCache(1, 3, 2, 4, 64, torch.float8_e4m3fn)
        step = cache.prepare(torch.arange(6)[None], torch.tensor([[1, 2]]))
        k, _ = cache.update(0, torch.randn(1, 6, 2, 2, 64), step)
        k_stored, _ = cache.read(0, step, rotated_keys=True)
        q = torch.randn(1, 2, 6, 64)
        assert not torch.allclose(k_stored, k, atol=1e-2)
        assert torch.allclose(cache.rotate_queries(q) @ k_stored.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4)
    if HAS_FP8:
        cache = KVCache(1, 3, 1, 4, 48, torch.float8_e4m3fn)
        assert cache.key_rotation is None
        kv = torch.randn(1, 4, 2, 1, 48)
        k, _ = cache.update(0, kv, cache.prepare(torch.arange(4)[None], torch.tensor([[1]])))
        assert ((k[0, 0] - kv[0, :, 0, 0]).abs() <= ELEMENT_TOL[torch.float8_e4m3fn] * kv[0, :, 0, 0].abs() + 1e-3).all()


@pytest.mark.parametrize("dtype", QDTYPES, ids=str)
def test_wrong_scales_are_detected(dtype: torch.dtype) -> None:
    """Garbage detection: attention over the quantized cache agrees with the float cache's, and
    the same check fails when the scales are wrong (all 1, as a path that forgot them would read;
    or another token's), so a quantized path producing garbage cannot pass as close."""
    torch.manual_seed(0)
    cache, ref = KVCache(1, 6, 2, 8, 64, dtype), KVCache(1, 6, 2, 8, 64, torch.float32)
    positions, tables = torch.arange(40)[None], torch.tensor([[1, 2, 3, 4, 5]])
    kv = torch.randn(1, 40, 2, 2, 64) * (0.5 + torch.rand(1, 40, 1, 1, 1))  # magnitudes differ per token
    q = torch.randn(1, 2, 40, 64)

    def attention(c: KVCache) -> torch.Tensor:
        step = c.prepare(positions, tables)
        k, v = c.read(0, step)
        return step.attend(q, k, v, enable_gqa=False)

    for c in (cache, ref):
        c.update(0, kv, c.prepare(positions, tables))
    want = attention(ref)
    err = lambda got: ((got - want).abs().max() / want.abs().max()).item()  # noqa: E731
    assert err(attention(cache)) < ATTENTION_TOL[dtype]
    assert cache.scales is not None
    good = cache.scales.clone()
    cache.scales.fill_(1.0)
    assert err(attention(cache)) > 10 * ATTENTION_TOL[dtype]
    cache.scales.copy_(good.roll(1, dims=-1))  # each position read with its neighbour's scale
    assert err(attention(cache)) > 5 * ATTENTION_TOL[dtype]


def test_kv_cache_dtype_names_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_cache_dtype("auto") is None
    assert kv_cache_dtype("int8") == torch.int8 and kv_cache_dtype("bf16") == torch.bfloat16
    assert kv_cache_dtype("fp32") == torch.float32
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype must be one of auto, bf16, fp32, int8, fp8, got 'int4'"):
        kv_cache_dtype("int4")
    if HAS_FP8:
        assert kv_cache_dtype("fp8") == torch.float8_e4m3fn
    monkeypatch.delattr(torch, "float8_e4m3fn", raising=False)
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype fp8: this torch .* has no torch.float8_e4m3fn"):
        kv_cache_dtype("fp8")


# ----------------------------------------------------------------------------- the C kernels


def _int8_case(d: int, nh: int, nkv: int, size: int, seed: int) -> tuple[KVCache, object, torch.Tensor, torch.Tensor]:
    """An int8 cache of 2 layers holding random keys/values of both magnitudes in scattered
    blocks, a step of 4 rows at positions 0..33 and its q; with the torch reference output."""
    g = torch.Generator().manual_seed(seed)
    width = -(-34 // size)
    cache = KVCache(2, 4 * width + 1, nkv, size, d, torch.int8)
    assert cache.scales is not None
    values, scales = quantize(torch.randn(*cache.kv.shape, generator=g) * 3, torch.int8)
    cache.kv.copy_(values)
    cache.scales.copy_(scales * torch.rand(scales.shape, generator=g) * 2)  # per-vector magnitudes differ
    positions = torch.tensor([[0], [16], [33], [5]])
    tables = (torch.randperm(4 * width, generator=g) + 1).view(4, width)
    step = cache.prepare(positions, tables)
    q = torch.randn(4, nh, 1, d, generator=g) * 3
    k, v = cache.read(1, step)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, enable_gqa=nh != nkv)
    return cache, step, q, want.transpose(1, 2).reshape(4, 1, nh * d)


SHAPES = list(itertools.product((24, 64, 128), ((6, 2), (4, 4)), (1, 5, 16)))


def test_native_attention_reads_int8_like_the_reference() -> None:
    """tprt_paged_decode_attention over an int8 cache (the vectorised paths at head_dim 64/128,
    the generic one at 24) against dequantize-then-SDPA."""
    attend = native.decode_attention_kernel(torch.float32)
    if not native.available():
        pytest.skip("no C compiler: the torch reference is the only path")
    assert attend is not None
    for d, (nh, nkv), size in SHAPES:
        cache, step, q, want = _int8_case(d, nh, nkv, size, d + size)
        got = attend(q, cache, step, 1)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (d, nh, size)  # sums in another order


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_avx2_and_scalar_builds_read_int8_like_the_reference(march: str, tmp_path: Path) -> None:
    """The same source built for AVX2 only and for no vector extension (the paths other CPUs
    take), called through ctypes like the native build."""
    compiler = shutil.which("cc")
    if compiler is None or not native.available():
        pytest.skip("no C compiler")
    lib_path = tmp_path / f"kernels-{march}.so"
    subprocess.run([compiler, "-O2", f"-march={march}", "-shared", "-fPIC", "-std=gnu11", "-o", str(lib_path),
                    str(native.SOURCE), "-lm"], check=True, capture_output=True, timeout=300)
    fn = ctypes.CDLL(str(lib_path)).tprt_paged_decode_attention_f32
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = [P] * 7 + [I] * 10 + [ctypes.c_float], None
    for d, (nh, nkv), size in SHAPES:
        cache, step, q, want = _int8_case(d, nh, nkv, size, d * size)
        assert cache.scales is not None
        store, scales = cache.kv[1], cache.scales[1]
        out, scratch = torch.empty(4, 1, nh * d), torch.empty(step.kv_len)
        tables, positions = step.tables.contiguous(), step.flat_positions
        fn(q.contiguous().data_ptr(), store.data_ptr(), scales.data_ptr(), tables.data_ptr(), positions.data_ptr(),
           out.data_ptr(), scratch.data_ptr(), 4, nh, nkv, d, size, tables.stride(0), *store.stride()[:4], d ** -0.5)
        assert (out - want).abs().max() <= 1e-5 * want.abs().max(), (march, d, nh, size)  # sums in another order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_cache_write_quantizes_like_the_reference(dtype: torch.dtype) -> None:
    """tprt_rope_cache into an int8 cache stores exactly what the float32 cache holds after the
    same write, quantized by the torch reference (the same scale bits, the same int8 values)."""
    rope_cache = native.rope_cache_kernel(dtype)
    if rope_cache is None:
        pytest.skip("no C compiler")
    nh, nkv, d = 4, 2, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, 1, nh + 2 * nkv, d, generator=g).to(dtype) * 2
    cos, sin = torch.rand(3, 1, 1, d, generator=g).to(dtype), torch.rand(3, 1, 1, d, generator=g).to(dtype)
    positions, tables = torch.tensor([[3], [9], [0]]), torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    flt, q8 = KVCache(2, 10, nkv, 4, d, torch.float32), KVCache(2, 10, nkv, 4, d, torch.int8)
    q_f = rope_cache(qkv, cos, sin, flt, flt.prepare(positions, tables), 1)
    q_8 = rope_cache(qkv, cos, sin, q8, q8.prepare(positions, tables), 1)
    assert torch.equal(q_f, q_8)
    values, scales = quantize(flt.kv, torch.int8)
    assert q8.scales is not None
    assert torch.equal(q8.kv, values) and torch.equal(q8.scales, torch.where(flt.kv.any(-1), scales, 0))


def test_native_layers_take_int8_and_leave_fp8_to_torch() -> None:
    """Which caches the decode kernels take: float32 and int8 (with scales), not FP8 or bf16."""
    assert native.supports_cache(KVCache(1, 2, 1, 4, 8, torch.float32))
    assert native.supports_cache(KVCache(1, 2, 1, 4, 8, torch.int8))
    assert not native.supports_cache(KVCache(1, 2, 1, 4, 8, torch.bfloat16))
    if HAS_FP8:
        assert not native.supports_cache(KVCache(1, 2, 1, 4, 8, torch.float8_e4m3fn))


def test_serve_flag_is_checked_and_reaches_the_engine(tmp_path: Path) -> None:
    """`tprt serve --kv-cache-dtype`: refused at start-up in one line naming the flag; a valid
    one becomes the engine's cache dtype."""
    from convert.api import hf_to_tp
    from helpers import make_hf_llama
    from serve.server import ServeConfig, check_config, engine_config

    hf_to_tp(make_hf_llama(tmp_path / "hf"), tmp_path / "tp1", 1)
    cfg = ServeConfig(model=tmp_path / "tp1", data_dir=tmp_path / "data", kv_cache_dtype="int8")
    check_config(cfg)
    assert engine_config(cfg).cache_dtype == torch.int8
    assert engine_config(ServeConfig(model=tmp_path / "tp1")).cache_dtype is None  # auto
    with pytest.raises(ConfigError, match=r"^--kv-cache-dtype must be one of .* got 'fp4'$"):
        check_config(ServeConfig(model=tmp_path / "tp1", data_dir=tmp_path / "data", kv_cache_dtype="fp4"))


def test_fused_decode_kernels_over_int8() -> None:
    """The one-row attention half and the decode stack (3 layers, 2 rows) over an int8 cache
    holding the same values as a float32 one: each new token's keys and values stored as the
    reference quantizes the float32 kernel's (layer 0's: later layers' inputs differ), every other
    entry untouched, and outputs near the
    float32 cache's (they differ by the new token's quantization only)."""
    if not native.available():
        pytest.skip("no C compiler")
    nh, nkv, d, hidden = 4, 2, 64, 96
    g = torch.Generator().manual_seed(4)
    w = [(torch.rand(hidden, generator=g) + 0.5, torch.randn((nh + 2 * nkv) * d, hidden, generator=g) / 8,
          torch.randn(hidden, nh * d, generator=g) / 8, torch.rand(hidden, generator=g) + 0.5,
          torch.randn(2 * 80, hidden, generator=g) / 8, torch.randn(hidden, 80, generator=g) / 8) for _ in range(3)]
    half = native.attention_decode_kernel(w[0][0], 1e-5, w[0][1], w[0][2], nh, nkv)
    stack = native.decode_stack_kernel(w, 1e-5, nh, nkv)
    assert half is not None and stack is not None
    cos, sin = torch.rand(2, 1, 1, d, generator=g), torch.rand(2, 1, 1, d, generator=g)
    x = torch.randn(2, 1, hidden, generator=g)
    tables = (torch.randperm(16, generator=g) + 1).view(2, 8)

    def caches(layers: int) -> tuple[KVCache, KVCache]:
        q8, f32 = KVCache(layers, 17, nkv, 5, d, torch.int8), KVCache(layers, 17, nkv, 5, d, torch.float32)
        assert q8.scales is not None
        values, scales = quantize(torch.randn(f32.kv.shape, generator=g), torch.int8)
        q8.kv.copy_(values)
        q8.scales.copy_(scales)
        f32.kv.copy_(values.float() * scales.unsqueeze(-1))
        return q8, f32

    for layers, rows, run in ((1, 1, lambda c, s: half(x[:1], cos[:1], sin[:1], c, s, 0)),
                              (3, 2, lambda c, s: stack(x, cos, sin, c, s))):
        q8, f32 = caches(layers)
        before = q8.kv.clone()
        positions = torch.tensor([[37], [21]])[:rows]
        outs = [run(c, c.prepare(positions, tables[:rows])) for c in (q8, f32)]
        assert (outs[0] - outs[1]).abs().max() <= 0.03 * outs[1].abs().max(), layers
        assert q8.scales is not None
        written = torch.zeros(q8.kv.shape[:-1], dtype=torch.bool)
        for r, p in enumerate(positions[:, 0].tolist()):
            written[:, tables[r, p // 5], :, :, p % 5] = True
        first = written.clone()
        first[1:] = False  # layer 0's input is the same in both runs; later layers' differ a little
        values, scales = quantize(f32.kv[first], torch.int8)
        assert torch.equal(q8.kv[first], values) and torch.equal(q8.scales[first], scales), layers
        assert torch.equal(q8.kv[~written], before[~written]), layers
