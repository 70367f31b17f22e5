"""The compiled int8 products (tprt.cpu.native.q8_kernel) against the torch path they replace:
the float32 vector loops (AVX-512F, AVX2) and the scalar loop equal F.linear on the dequantized
weight to float32 rounding; the VNNI path equals a torch emulation of its activation quantization
(x rounded to int8 per block of 32) to rounding, and the plain product to that quantization's
error. Results do not depend on the thread count. A CPU model's int8 layers use them after
`prepack`, and decode with them as the torch path does."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import forward_rows
from tprt.cpu import native
from tprt.quant.formats import QuantSpec, dequantize, quantize

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for tprt's native kernels")

SHAPES = [(96, 576), (40, 1536), (48, 96)]  # 96 columns: not a multiple of 64, the float32 path serves VNNI builds


def _weights(n: int, k: int, group: int | None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return quantize(w, QuantSpec("int8", group))


def _x(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)


def _plain(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), dequantize(q, s))


def _vnni_emulation(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What the VNNI path computes: x rounded to int8 per block of 32 columns (scale amax / 127)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)  # [rows, blocks, 32]
    amax = xb.abs().amax(-1, keepdim=True)
    xq = torch.where(amax > 0, torch.round(xb * (127 / amax)), torch.zeros_like(xb)) * (amax / 127)
    return F.linear(xq.reshape(m, k), dequantize(q, s))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _uses_vnni(k: int, group: int | None, lib: ctypes.CDLL | None = None) -> bool:
    return native.q8_path(lib) == "vnni" and k % 64 == 0 and (group or k) % 32 == 0


@pytest.mark.parametrize("group", [None, 16, 32])
@pytest.mark.parametrize("n, k", SHAPES)
def test_best_path_matches_torch(n: int, k: int, group: int | None) -> None:
    q, s = _weights(n, k, group)
    kernel = native.q8_kernel(q, s)
    assert kernel is not None
    for m in (*range(1, 9), 13, 16, native.MAX_Q8_ROWS):  # beyond 8: 8 rows at a time per weight tile
        x = _x(m, k, torch.float32)
        y = kernel(x)
        if _uses_vnni(k, group):
            assert _rel(y, _vnni_emulation(x, q, s)) < 2e-6, m
            assert _rel(y, _plain(x, q, s)) < 2e-2, m  # x's 8-bit rounding, nothing more
        else:
            assert _rel(y, _plain(x, q, s)) < 2e-6, m


@pytest.mark.parametrize("path", ["float", "scalar"])
def test_float_and_scalar_paths_match_torch(path: str) -> None:
    for n, k in SHAPES:
        for group in (None, 16):
            q, s = _weights(n, k, group)
            kernel = native.q8_kernel(q, s, path=path)
            assert kernel is not None
            for m in (1, 2, 5, 8, 11, native.MAX_Q8_ROWS):
                x = _x(m, k, torch.float32)
                assert _rel(kernel(x), _plain(x, q, s)) < 2e-6, (path, n, k, group, m)


def test_bf16_activations_and_outputs() -> None:
    q, s = _weights(64, 576, None)
    x = _x(3, 576, torch.bfloat16)
    y = native.q8_kernel(q, s, path="float")(x)  # type: ignore[misc]
    assert y.dtype == torch.bfloat16 and y.shape == (3, 64)
    assert torch.equal(y, _plain(x, q, s).to(torch.bfloat16)) or _rel(y, _plain(x, q, s)) < 8e-3


def test_results_do_not_depend_on_the_thread_count() -> None:
    q, s = _weights(4096, 576, 32)  # large enough to be split over the pool
    kernel = native.q8_kernel(q, s)
    assert kernel is not None
    before = native.threads()
    try:
        for m in (3, 20):  # 20: many weight tiles (28 rows of 576 each), each taken by 8 + 8 + 4 rows
            x = _x(m, 576, torch.float32)
            native.set_threads(1)
            one = kernel(x)
            native.set_threads(2)
            assert torch.equal(kernel(x), one)
            assert torch.equal(one, torch.cat([kernel(r[None]) for r in x])), m  # a row's result is its own
    finally:
        native.set_threads(before)


@pytest.mark.parametrize("group", [None, 32, 64])
def test_many_bf16_rows_take_the_weight_dequantized_to_bf16(group: int | None) -> None:
    """9-32 rows of bf16 activations (batched decode): the weight tile dequantized to bf16 once and
    taken by bf16 dot products; each row as close to the bf16-rounded dequantized product as a bf16
    model's GEMV is, and the same whatever rows come with it."""
    q, s = _weights(300, 576, group)  # 300 rows: several tiles of 28 rows
    kernel = native.q8_kernel(q, s)
    assert kernel is not None
    w = dequantize(q, s).to(torch.bfloat16).float()
    x = _x(native.MAX_Q8_ROWS, 576, torch.bfloat16)
    full = kernel(x)
    for m in (9, 16, 25, native.MAX_Q8_ROWS):
        got = kernel(x[:m])
        assert got.dtype == torch.bfloat16 and torch.equal(got, full[:m]), m
        assert _rel(got, F.linear(x[:m].float(), w)) < 2e-2, m  # (without AVX512-BF16: x rounded per 32)


def test_bad_inputs_are_refused() -> None:
    q, s = _weights(32, 64, None)
    kernel = native.q8_kernel(q, s)
    assert kernel is not None
    with pytest.raises(ValueError, match=f"1-{native.MAX_Q8_ROWS} rows of 64"):
        kernel(torch.zeros(native.MAX_Q8_ROWS + 1, 64))
    with pytest.raises(ValueError, match="do not match"):
        native.q8_kernel(q, s[:16])


def test_avx2_build_matches_torch(tmp_path: Path) -> None:
    """The same source built for AVX2 without AVX-512 (as on older CPUs): its vector loop too."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lib_path = tmp_path / "kernels-avx2.so"
    subprocess.run([cc, "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=gnu11", "-o", str(lib_path),
                    str(native.SOURCE), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    native.bind_q8(lib)
    assert native.q8_path(lib) == "avx2"
    for n, k in SHAPES:
        q, s = _weights(n, k, 16)
        kernel = native.q8_kernel(q, s, lib=lib)
        assert kernel is not None
        for m in (1, 2, 7):
            x = _x(m, k, torch.float32)
            assert _rel(kernel(x), _plain(x, q, s)) < 2e-6, (n, k, m)


def test_prepacked_int8_model_decodes_like_the_torch_path(tmp_path: Path) -> None:
    """After prepack every int8 layer holds a compiled product; a batch of 3 decode steps (the
    native path) gives the torch path's logits up to the activations' 8-bit rounding."""
    from convert.api import hf_to_tp
    from tests.helpers import make_hf_llama
    from tprt.checkpoint.loading import load_model
    from tprt.cpu.fast_linear import prepack
    from tprt.cpu.quant_linear import NativeInt8Linear
    from tprt.distributed.context import TPContext

    hf = make_hf_llama(tmp_path / "hf", "gqa", seed=5)
    hf_to_tp(hf, tmp_path / "q", 1, quantize="int8", group_size=32)
    plain = load_model(tmp_path / "q", TPContext.single())
    fast = load_model(tmp_path / "q", TPContext.single())
    prepack(fast, tune=False)
    assert all(isinstance(layer.method.base, NativeInt8Linear) for layer in fast.linears())
    calls = [0]
    for layer in fast.linears():
        method = layer.method.base
        assert isinstance(method, NativeInt8Linear) and method.kernel is not None
        inner = method.kernel

        def counted(x: torch.Tensor, inner: native.Kernel = inner) -> torch.Tensor:
            calls[0] += 1
            return inner(x)

        method.kernel = counted
    ids = torch.randint(3, 256, (3, 1), generator=torch.Generator().manual_seed(1))  # [batch, 1]: decode-sized
    with torch.inference_mode():
        want = plain.gather_logits(plain(ids))
        got = fast.gather_logits(fast(ids))
    assert calls[0] == 4 * 2  # every linear of both layers went through the compiled product
    tol = 2e-2 if native.q8_path() == "vnni" else 1e-5
    assert _rel(got, want) < tol
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [None, 16, 32, 24])
def test_compiled_quantize_equals_the_torch_reference(dtype: torch.dtype, group: int | None) -> None:
    """The converter's int8 quantization (tprt_quantize_q8) gives tprt.quant.formats' torch
    results bit for bit: scales, rounding half to even, zero groups (24: the scalar loop)."""
    w = torch.randn(300, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    w[4] = 0.0
    w[9, :48] = 0.0
    w[11, 5] = 0.5 * float(w[11].abs().max()) / 127 * 127  # values on rounding ties appear too
    spec = QuantSpec("int8", group)
    want = quantize(w, spec, native=False)
    got = native.quantize_q8(w, group or 96)
    assert got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(quantize(w, spec)[0], want[0])


def test_native_method_takes_batched_decode_in_one_call() -> None:
    """NativeInt8Linear: 1-32 rows through the compiled product in one call, equal to the kernel
    row by row; more rows, or a product that needs the input's gradient, take the torch path."""
    from tprt.cpu.quant_linear import NativeInt8Linear
    from tprt.distributed.context import TPContext
    from tprt.parallel.layers import ColumnParallelLinear

    spec = QuantSpec("int8", 32)
    q, s = _weights(48, 128, 32)
    method = NativeInt8Linear(spec)
    with torch.device("meta"):
        layer = ColumnParallelLinear(128, 48, TPContext.single(), torch.float32, method)
    layer.load_state_dict({"weight": q, "weight_scale": s}, assign=True)
    method.process_after_loading(layer)
    kernel = native.q8_kernel(q, s)
    assert kernel is not None
    x = _x(20, 128, torch.float32).view(4, 5, 128)  # [batch, seq, in]: 20 rows
    with torch.inference_mode():
        got = method.apply(layer, x)
    assert torch.equal(got.view(20, 48), torch.cat([kernel(r[None]) for r in x.view(20, 128)]))
    big = _x(native.MAX_Q8_ROWS + 1, 128, torch.float32)
    with torch.inference_mode():
        assert torch.equal(method.apply(layer, big), F.linear(big, dequantize(q, s)))
    xg = x.clone().requires_grad_()
    method.apply(layer, xg).sum().backward()
    assert xg.grad is not None and torch.allclose(xg.grad, dequantize(q, s).sum(0).expand_as(xg), atol=1e-4)


@pytest.mark.parametrize("dtype, batch", [("bf16", 3), ("bf16", 12), ("bf16", 32), ("bf16", 33), ("fp32", 3), ("fp32", 12)])
def test_int8_model_decodes_in_the_whole_stack_kernel(tmp_path: Path, dtype: str, batch: int) -> None:
    """An int8 model gets the one-call decode stack (tprt_decode_stack reading int8 weights and
    their scales) after prepack + install_native_layers; in bf16 its decode steps equal the layer
    by layer path bit for bit (the same products, the same roundings; in float32 to rounding),
    several rows at once too:
    up to STACK_MAX_Q8_ROWS (the batched int8 products, as the layer by layer path calls them),
    and more rows take the layer by layer path."""
    from convert.api import hf_to_tp
    from tests.helpers import make_hf_llama
    from tprt.checkpoint.loading import load_model
    from tprt.cpu.fast_linear import prepack
    from tprt.cpu.native import STACK_MAX_Q8_ROWS
    from tprt.cpu.native_layers import NativeDecodeStack, install_native_layers
    from tprt.distributed.context import TPContext
    from tprt.model.llama import LayerStack

    hf = make_hf_llama(tmp_path / "hf", "gqa", seed=8)
    hf_to_tp(hf, tmp_path / "q", 1, quantize="int8", group_size=32)
    model = load_model(tmp_path / "q", TPContext.single(), dtype=dtype)
    prepack(model, tune=False)
    install_native_layers(model)
    stack = model.stack
    assert isinstance(stack, NativeDecodeStack)
    calls = [0]
    kernel = stack.kernel

    def counted(*args: object) -> torch.Tensor:
        calls[0] += 1
        return kernel(*args)

    stack.kernel = counted
    ids = torch.randint(3, 256, (batch, 6), generator=torch.Generator().manual_seed(2))  # [batch, steps]

    def decode(with_stack: bool) -> torch.Tensor:
        model.stack = stack if with_stack else LayerStack()
        cache = model.new_cache(batch * 2 + 1, 4)
        tables = torch.arange(1, 2 * batch + 1).view(batch, 2).tolist()  # [batch, blocks]
        out = []
        with torch.inference_mode():
            for t in range(ids.shape[1]):
                out.append(torch.stack([row[0] for row in forward_rows(model, cache, ids[:, t : t + 1].tolist(),
                                                                       [t] * batch, tables)]))
        return torch.stack(out)

    got, want = decode(True), decode(False)
    assert calls[0] == (ids.shape[1] if batch <= STACK_MAX_Q8_ROWS else 0)
    if dtype == "bf16":
        assert torch.equal(got, want)
    else:  # float32's sums (the norms', the attention's) run in another order: rounding only (measured 1.5e-7)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
