"""The quantized KV cache (tprt.model.kv_cache: int8 and FP8 e4m3 with a bfloat16 scale per head
vector, or int8 with static scales per layer, k/v and head: tprt.model.kv_scales): the quantizers,
the paged cache's writes and reads, the C decode kernels reading int8 directly (native build, and
the AVX2 and scalar builds of the same source) against the torch reference, the
`--kv-cache-dtype` names, the static scales' file, and garbage detection (wrong scales must show).
Model-level checks (logits near the float cache's at TP 1/2/4/8, greedy agreement, prefix sharing
through the engine) live in the existing worlds: tests/test_model_tp.py and tests/test_engine.py."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tprt.cpu import native
from tprt.errors import ConfigError
from tprt.model.kv_cache import (QUANTIZED, SCALE_DTYPE, KVCache, key_rotation, kv_bytes_per_position, kv_cache_dtype,
                                  quantize, quantize_fixed)
from tprt.model.kv_scales import kv_cache_flags, load_kv_scales, save_kv_scales, scales_from_amax

HAS_FP8 = hasattr(torch, "float8_e4m3fn")
QDTYPES = [torch.int8] + ([torch.float8_e4m3fn] if HAS_FP8 else [])
# Worst relative error of one dequantized element against its vector's amax: half a step of 1/127
# for int8 (the step, amax / 127 rounded up to a bfloat16, is at most 2^-7 larger); e4m3 has 3
# mantissa bits, so half an ulp is 1/16 of the value.
ELEMENT_TOL = {torch.int8: 0.5 / 127 * (1 + 2 ** -7) + 1e-6, torch.float8_e4m3fn: 1 / 16 + 1e-6}

# Max |attention output error| over its max, unit-scale keys/values and queries (measured: int8
# 1.0e-2, e4m3 3.3e-2; wrong scales give 0.66 to 140).
ATTENTION_TOL = {torch.int8: 0.02, torch.float8_e4m3fn: 0.06}
# The same with static scales, 1.25 x each head's amax over all 40 tokens (measured 2.2e-2: a
# head's step is its largest value's, not each token's).
STATIC_ATTENTION_TOL = 0.04


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
    cache = KVCache(1, 6, 2, 8, 64, dtype)
    err = _attention_error(cache, torch.randn(1, 40, 2, 2, 64) * (0.5 + torch.rand(1, 40, 1, 1, 1)))  # per token
    assert err() < ATTENTION_TOL[dtype]
    assert cache.scales is not None
    good = cache.scales.clone()
    cache.scales.fill_(1.0)
    assert err() > 10 * ATTENTION_TOL[dtype]
    cache.scales.copy_(good.roll(1, dims=-1))  # each position read with its neighbour's scale
    assert err() > 5 * ATTENTION_TOL[dtype]


def _attention_error(cache: KVCache, kv: torch.Tensor) -> Callable[[], float]:
    """Writes kv [1, 40, 2, 2, 64] into layer 0 of `cache` and of a float32 reference cache;
    returns a function giving the max |error| over the max of attention read through `cache`
    (as its scales then stand) against the reference's, for one set of random queries."""
    ref = KVCache(1, cache.n_blocks, 2, cache.block_size, 64, torch.float32)
    positions, tables = torch.arange(40)[None], torch.tensor([[1, 2, 3, 4, 5]])
    q = torch.randn(1, 2, 40, 64)

    def attention(c: KVCache) -> torch.Tensor:
        step = c.prepare(positions, tables)
        k, v = c.read(0, step)
        return step.attend(q, k, v, enable_gqa=False)

    for c in (cache, ref):
        c.update(0, kv, c.prepare(positions, tables))
    want = attention(ref)
    return lambda: ((attention(cache) - want).abs().max() / want.abs().max()).item()


def test_static_scales_store_int8_alone_and_read_back_within_half_a_step() -> None:
    """An int8 cache with static scales (one per layer, k/v and kv head): exactly half a bf16
    cache's bytes per position (nothing stored per token); round(x / scale) written at each
    token's block and offset, values beyond +-127 steps clipped; reads within half a step; and
    the cache refuses scales of the wrong shape or for another dtype."""
    n_layers, nkv, bs, d = 2, 3, 4, 64
    fixed = torch.tensor([[[0.01, 0.02, 0.04], [0.03, 0.05, 0.02]], [[0.02, 0.01, 0.03], [0.04, 0.02, 0.01]]])
    cache = KVCache(n_layers, 12, nkv, bs, d, torch.int8, fixed_scales=fixed)
    assert cache.quantized and cache.scales is None and torch.equal(cache.fixed_scales, fixed)
    assert cache.format_name == "int8-static" and cache.positions == 11 * bs  # block 0 is scratch
    assert [KVCache(1, 2, 1, 4, 8, dt).format_name for dt in (torch.float32, torch.bfloat16, *QDTYPES)] == [
        "fp32", "bf16", "int8", "fp8"][: 2 + len(QDTYPES)]
    assert kv_bytes_per_position(torch.int8, d, static_scales=True) * 2 == kv_bytes_per_position(torch.bfloat16, d)
    assert KVCache(n_layers, 12, nkv, bs, d, torch.bfloat16).kv.nbytes == 2 * cache.kv.nbytes
    assert cache.nbytes() == cache.kv.nbytes + fixed.nbytes
    positions, tables = torch.arange(6)[None], torch.tensor([[7, 3]])
    kv = torch.randn(1, 6, 2, nkv, d)
    kv[0, 2, 1, 0, 5] = 1e3  # far beyond head 0's values range (127 x 0.03): clipped
    k, v = cache.update(1, kv, cache.prepare(positions, tables))
    want = quantize_fixed(kv[0], fixed[1])  # [6, 2, nkv, d]
    assert torch.equal(cache.kv[1, 7, :, :, 1], want[1]) and torch.equal(cache.kv[1, 3, :, :, 1], want[5])
    assert want[2, 1, 0, 5] == 127 and not cache.kv[0].any()
    back = torch.stack((k[0], v[0]), dim=1).permute(2, 1, 0, 3)  # [6, 2, nkv, d]
    inside = kv[0].abs() <= 127 * fixed[1][:, :, None]
    step = fixed[1][:, :, None].expand_as(kv[0])
    assert ((back - kv[0]).abs()[inside] <= 0.5 * step[inside] + 1e-6).all()
    assert back[2, 1, 0, 5] == 127 * fixed[1, 1, 0]
    with pytest.raises(ValueError, match=r"static KV scales need an int8 cache and the shape \[2, 2, 3\]"):
        KVCache(n_layers, 12, nkv, bs, d, torch.int8, fixed_scales=fixed[:, :, :2])
    with pytest.raises(ValueError, match="static KV scales need an int8 cache"):
        KVCache(n_layers, 12, nkv, bs, d, torch.float32, fixed_scales=fixed)


def test_wrong_static_scales_are_detected() -> None:
    """Garbage detection for static scales: attention close to the float cache's with the right
    scales, far from it with all ones (a path that forgot them) or each head's scales swapped with another's."""
    torch.manual_seed(1)
    kv = torch.randn(1, 40, 2, 2, 64) * torch.tensor([1.0, 3.0])[None, None, None, :, None]  # heads differ
    amax = kv.abs().amax(dim=(0, 1, 4))[None]  # [1 layer, k/v, head]
    cache = KVCache(1, 6, 2, 8, 64, torch.int8, fixed_scales=scales_from_amax(amax))
    err = _attention_error(cache, kv)
    assert err() < STATIC_ATTENTION_TOL
    assert cache.fixed_scales is not None
    good = cache.fixed_scales.clone()
    cache.fixed_scales.fill_(1.0)
    assert err() > 10 * STATIC_ATTENTION_TOL
    cache.fixed_scales.copy_(good.flip(-1))  # each head read with the other's scales
    assert err() > 5 * STATIC_ATTENTION_TOL


def test_static_scales_file_round_trip_and_refusals(tmp_path: Path) -> None:
    """The calibrate-kv file: written atomically and read back for the model it fits; each rank
    takes its kv heads (split, or replicated when TP exceeds them); any other file, tensor, shape
    or value is refused in one line naming --kv-scales and the file, and so is another cache dtype."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tprt.model.config import ModelConfig, TPLayout

    cfg = ModelConfig.from_dict({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8,
                                 "num_key_value_heads": 4, "num_hidden_layers": 3, "vocab_size": 300})
    scales = scales_from_amax(torch.rand(3, 2, 4) + 0.1, margin=1.5)
    path = tmp_path / "kv.safetensors"
    save_kv_scales(path, scales, 1.5, 1234)
    assert torch.equal(load_kv_scales(path, cfg), scales) and [p.name for p in tmp_path.iterdir()] == ["kv.safetensors"]
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "tprt-kv-scales", "margin": "1.5", "tokens": "1234"}
    assert kv_cache_flags("auto", path, cfg) == "int8" and kv_cache_flags(None, path, cfg) == "int8"
    assert kv_cache_flags("int8", path, cfg) == "int8" and kv_cache_flags("fp8", None, cfg) == "fp8"
    for tp, rank, heads in ((1, 0, [0, 1, 2, 3]), (2, 1, [2, 3]), (4, 1, [1]), (8, 1, [0]), (8, 7, [3])):
        assert list(TPLayout.for_model(cfg, tp).kv_heads_of(rank)) == heads, (tp, rank)  # split, then replicated
    with pytest.raises(ConfigError, match=r"--kv-scales .*nope: no such file \(make one with `tprt calibrate-kv`\)"):
        load_kv_scales(tmp_path / "nope", cfg)
    (tmp_path / "junk").write_text("not safetensors")
    with pytest.raises(ConfigError, match=r"--kv-scales .*junk: not a safetensors file of KV scales"):
        load_kv_scales(tmp_path / "junk", cfg)
    save_file({"scales": scales}, tmp_path / "other.st")
    with pytest.raises(ConfigError, match=r"other.st: no tensor 'kv_scales' \(found \['scales'\]\)"):
        load_kv_scales(tmp_path / "other.st", cfg)
    save_file({"kv_scales": scales[:2]}, tmp_path / "short.st")
    with pytest.raises(ConfigError, match=r"short.st: tensor 'kv_scales' is \[2, 2, 4\], this model needs \[3, 2, 4\]"):
        load_kv_scales(tmp_path / "short.st", cfg)
    for bad in (0.0, float("nan"), -1.0):
        save_file({"kv_scales": scales.clone().index_fill_(0, torch.tensor([1]), bad)}, tmp_path / "bad.st")
        with pytest.raises(ConfigError, match=r"bad.st: tensor 'kv_scales' must hold finite positive scales"):
            load_kv_scales(tmp_path / "bad.st", cfg)
    for bad, shown in ((1e-40, "1e-40"), (3e38, "3e\\+38"), (5e-7, "5e-07"), (2e3, "2e\\+03")):  # R10: accepted, then noise
        save_file({"kv_scales": scales.clone().index_fill_(0, torch.tensor([1]), bad)}, tmp_path / "bad.st")
        with pytest.raises(ConfigError, match=rf"bad.st: tensor 'kv_scales' holds a scale of {shown}, outside "
                                              r"\[1e-06, 1000\]"):
            load_kv_scales(tmp_path / "bad.st", cfg)
    with pytest.raises(ConfigError, match=r"^--kv-scales holds static int8 scales: use it with --kv-cache-dtype int8, "
                                          r"not bf16$"):
        kv_cache_flags("bf16", path, cfg)
    with pytest.raises(ConfigError, match=r"--margin must be a number of at least 1"):
        scales_from_amax(torch.ones(1), 0.9)


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


def _int8_case(d: int, nh: int, nkv: int, size: int, seed: int,
               static: bool = False) -> tuple[KVCache, object, torch.Tensor, torch.Tensor]:
    """An int8 cache of 2 layers holding random keys/values of both magnitudes in scattered
    blocks (`static`: under static scales, different per layer, k/v and head), a step of 4 rows
    at positions 0..33 and its q; with the torch reference output."""
    g = torch.Generator().manual_seed(seed)
    width = -(-34 // size)
    fixed = torch.rand(2, 2, nkv, generator=g) * 0.1 + 0.01 if static else None
    cache = KVCache(2, 4 * width + 1, nkv, size, d, torch.int8, fixed_scales=fixed)
    values, scales = quantize(torch.randn(*cache.kv.shape, generator=g) * 3, torch.int8)
    cache.kv.copy_(values)
    if not static:
        assert cache.scales is not None
        cache.scales.copy_(scales * torch.rand(scales.shape, generator=g) * 2)  # per-vector magnitudes differ
    positions = torch.tensor([[0], [16], [33], [5]])
    tables = (torch.randperm(4 * width, generator=g) + 1).view(4, width)
    step = cache.prepare(positions, tables)
    q = torch.randn(4, nh, 1, d, generator=g) * 3
    k, v = cache.read(1, step)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=step.masks[None], enable_gqa=nh != nkv)
    return cache, step, q, want.transpose(1, 2).reshape(4, 1, nh * d)


SHAPES = list(itertools.product((24, 64, 128), ((6, 2), (4, 4)), (1, 5, 16)))


@pytest.mark.parametrize("static", [False, True], ids=["per_vector", "static"])
def test_native_attention_reads_int8_like_the_reference(static: bool) -> None:
    """tprt_paged_decode_attention over an int8 cache (the vectorised paths at head_dim 64/128,
    the generic one at 24; a scale per vector, or static ones) against dequantize-then-SDPA."""
    attend = native.decode_attention_kernel(torch.float32)
    if not native.available():
        pytest.skip("no C compiler: the torch reference is the only path")
    assert attend is not None
    for d, (nh, nkv), size in SHAPES:
        cache, step, q, want = _int8_case(d, nh, nkv, size, d + size, static)
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
    fn.argtypes, fn.restype = [P] * 8 + [I] * 10 + [ctypes.c_float, I, ctypes.c_float], None
    for (d, (nh, nkv), size), static in itertools.product(SHAPES, (False, True)):
        cache, step, q, want = _int8_case(d, nh, nkv, size, d * size, static)
        store = cache.kv[1]
        scales = None if cache.scales is None else cache.scales[1].data_ptr()
        fixed = None if cache.fixed_scales is None else cache.fixed_scales[1].data_ptr()
        out, scratch = torch.empty(4, 1, nh * d), torch.empty(step.kv_len * (nh // nkv))
        tables, positions = step.tables.contiguous(), step.flat_positions
        fn(q.contiguous().data_ptr(), store.data_ptr(), scales, fixed, tables.data_ptr(), positions.data_ptr(),
           out.data_ptr(), scratch.data_ptr(), 4, nh, nkv, d, size, tables.stride(0), *store.stride()[:4], d ** -0.5,
           0, 0.0)  # no window, no soft-cap
        assert (out - want).abs().max() <= 1e-5 * want.abs().max(), (march, d, nh, size, static)  # another order


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
    fixed = torch.rand(2, 2, nkv, generator=g) * 0.02 + 0.005  # small enough that some values clip
    static = KVCache(2, 10, nkv, 4, d, torch.int8, fixed_scales=fixed)
    assert torch.equal(rope_cache(qkv, cos, sin, static, static.prepare(positions, tables), 1), q_f)
    stored = flt.kv[1].permute(0, 3, 1, 2, 4)  # [block, offset, k/v, kv_head, d]
    want = quantize_fixed(stored, fixed[1]).permute(0, 2, 3, 1, 4)
    assert torch.equal(static.kv[1], want) and not static.kv[0].any()
    assert (want.abs() == 127).any() and (stored.abs() > 127.5 * fixed[1][:, :, None]).any()  # clipped ones too


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
    from tprt.engine.settings import CacheSettings

    hf_to_tp(make_hf_llama(tmp_path / "hf"), tmp_path / "tp1", 1)
    cfg = ServeConfig(model=tmp_path / "tp1", data_dir=tmp_path / "data", cache=CacheSettings(dtype="int8"))
    check_config(cfg)
    assert engine_config(cfg).cache_dtype == torch.int8
    assert engine_config(ServeConfig(model=tmp_path / "tp1")).cache_dtype is None  # auto
    with pytest.raises(ConfigError, match=r"^--kv-cache-dtype must be one of .* got 'fp4'$"):
        check_config(ServeConfig(model=tmp_path / "tp1", data_dir=tmp_path / "data", cache=CacheSettings(dtype="fp4")))
    # --kv-scales: an int8 cache with the file's static scales (auto becomes int8); another dtype refused
    scales = scales_from_amax(torch.rand(2, 2, 4) + 0.1)
    save_kv_scales(tmp_path / "kv.st", scales, 1.25, 10)
    cfg = ServeConfig(model=tmp_path / "tp1", data_dir=tmp_path / "data", cache=CacheSettings(scales=tmp_path / "kv.st"))
    check_config(cfg)
    engine = engine_config(cfg)
    assert engine.cache_dtype == torch.int8 and engine.kv_scales is not None and torch.equal(engine.kv_scales, scales)
    with pytest.raises(ConfigError, match=r"^--kv-scales holds static int8 scales: .* not fp8$"):
        check_config(ServeConfig(model=tmp_path / "tp1", data_dir=tmp_path / "data",
                                 cache=CacheSettings(dtype="fp8", scales=tmp_path / "kv.st")))


@pytest.mark.parametrize("static", [False, True], ids=["per_vector", "static"])
def test_fused_decode_kernels_over_int8(static: bool) -> None:
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
        fixed = torch.rand(layers, 2, nkv, generator=g) * 0.05 + 0.05 if static else None
        q8 = KVCache(layers, 17, nkv, 5, d, torch.int8, fixed_scales=fixed)
        f32 = KVCache(layers, 17, nkv, 5, d, torch.float32)
        values, scales = quantize(torch.randn(f32.kv.shape, generator=g), torch.int8)
        q8.kv.copy_(values)
        if fixed is None:
            assert q8.scales is not None
            q8.scales.copy_(scales)
            f32.kv.copy_(values.float() * scales.unsqueeze(-1))
        else:
            f32.kv.copy_(values.float() * fixed[:, None, :, :, None, None])
        return q8, f32

    for layers, rows, run in ((1, 1, lambda c, s: half(x[:1], cos[:1], sin[:1], c, s, 0)),
                              (3, 2, lambda c, s: stack(x, cos, sin, c, s))):
        q8, f32 = caches(layers)
        before = q8.kv.clone()
        positions = torch.tensor([[37], [21]])[:rows]
        outs = [run(c, c.prepare(positions, tables[:rows])) for c in (q8, f32)]
        assert (outs[0] - outs[1]).abs().max() <= 0.03 * outs[1].abs().max(), layers
        written = torch.zeros(q8.kv.shape[:-1], dtype=torch.bool)
        for r, p in enumerate(positions[:, 0].tolist()):
            written[:, tables[r, p // 5], :, :, p % 5] = True
        first = written.clone()
        first[1:] = False  # layer 0's input is the same in both runs; later layers' differ a little
        if q8.fixed_scales is None:
            assert q8.scales is not None
            values, scales = quantize(f32.kv[first], torch.int8)
            assert torch.equal(q8.kv[first], values) and torch.equal(q8.scales[first], scales), layers
        else:  # [k/v, kv_head] of layer 0, spread over the written (block, offset)s
            step_scales = q8.fixed_scales[:, None, :, :, None].expand(first.shape)[first]
            want = (f32.kv[first] / step_scales[:, None]).round().clamp(-127, 127).to(torch.int8)
            assert torch.equal(q8.kv[first], want), layers
        assert torch.equal(q8.kv[~written], before[~written]), layers
