"""A LinearMethod owns its weights: create -> load this rank's slice -> post-process -> apply gives
the dense product of that slice, for the dense format, the CPU packed copies and LoRA wrapped
around either; and the loader refuses a weight format it has no method for."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tprt.checkpoint.loading import weight_format
from tprt.distributed.context import TPContext
from tprt.errors import CheckpointError
from tprt.lora.method import LoRAMethod, unwrap, wrap
from tprt.lora.modules import ColumnLoRA, RowLoRA, Segment
from tprt.parallel.layers import (DENSE, WEIGHT_FORMATS, ColumnParallelLinear, LinearMethod, ParallelLinear,
                                  RowParallelLinear, set_base_method)

TP, RANK = 2, 1  # this rank's slices: rank 1 of 2 (the method sees only its own rows or columns)
CTX = TPContext(group=None, rank=RANK, world_size=TP, device=torch.device("cpu"), backend=None)
HIDDEN, Q_ROWS, K_ROWS = 64, 64, 32  # a fused q/k layer: q [64, 64] and k [32, 64] before the split


def _full_weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(Q_ROWS, HIDDEN, generator=gen) / 8).to(dtype)
    k = (torch.randn(K_ROWS, HIDDEN, generator=gen) / 8).to(dtype)
    return q, k


def _rank_rows(w: torch.Tensor) -> torch.Tensor:
    n = w.shape[0] // TP
    return w[RANK * n : (RANK + 1) * n]


def _loaded_column(method: LinearMethod, dtype: torch.dtype) -> tuple[ColumnParallelLinear, torch.Tensor]:
    """The method's whole lifecycle on a fused column layer [q_r; k_r]; returns it and the dense
    weight it must compute with."""
    q, k = _full_weights(dtype)
    pieces = [_rank_rows(q), _rank_rows(k)]  # this rank's checkpoint tensors, in row order
    with torch.device("meta"):
        layer = ColumnParallelLinear(HIDDEN, (Q_ROWS + K_ROWS) // TP, CTX, dtype, method)
    assert layer.method is method
    assert {n: (tuple(p.shape), p.dtype) for n, p in layer.named_parameters()} == {
        "weight": (((Q_ROWS + K_ROWS) // TP, HIDDEN), dtype)}
    dest = torch.empty(layer.weight.shape, dtype=layer.weight.dtype)
    method.load_weight(layer, "weight", dest, pieces)
    layer.load_state_dict({"weight": dest}, assign=True)
    method.process_after_loading(layer)
    return layer, torch.cat(pieces)


def _x(dtype: torch.dtype, rows: int) -> torch.Tensor:
    return torch.randn(rows, 3, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)


def test_dense_method_lifecycle_equals_the_slice_product() -> None:
    layer, want_w = _loaded_column(DENSE, torch.float32)
    assert torch.equal(layer.weight, want_w)
    x = _x(torch.float32, 2)
    assert torch.equal(layer.method.apply(layer, x), F.linear(x, want_w))
    assert WEIGHT_FORMATS["dense"]({}, "manifest") is DENSE
    assert {"dense", "int8", "fp8"} <= set(WEIGHT_FORMATS)  # one registry: tprt.quant registers its formats


def _packed_or_skip(dtype: torch.dtype) -> None:
    if not torch.backends.mkldnn.is_available() or (
            dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip(f"no oneDNN {dtype} on this CPU")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_method_lifecycle_equals_the_dense_product(dtype: torch.dtype, tol: float) -> None:
    """FastLinear: the dense format's parameters (same names, shapes, dtypes), a packed copy made
    after loading, and the dense product to rounding for 1, 2 and many rows; under autograd the
    weight's gradient is F.linear's."""
    _packed_or_skip(dtype)
    from tprt.cpu.fast_linear import FastLinear

    method = FastLinear()
    layer, want_w = _loaded_column(method, dtype)
    assert method.many is not None and method.one_variant == "packed"  # made by process_after_loading
    for rows in (1, 2, 7):
        x = _x(dtype, rows)[:, :1] if rows == 1 else _x(dtype, rows)
        with torch.inference_mode():
            got, want = layer.method.apply(layer, x).float(), F.linear(x, want_w).float()
        assert (got - want).abs().max() <= tol * want.abs().max(), rows
    layer.weight.requires_grad_(True)
    x = _x(dtype, 2)
    layer.method.apply(layer, x).float().square().sum().backward()
    grad = layer.weight.grad
    weight = want_w.clone().requires_grad_(True)
    F.linear(x, weight).float().square().sum().backward()
    assert grad is not None and torch.equal(grad, weight.grad)


def _column_lora(dtype: torch.dtype) -> ColumnLoRA:
    """A LoRA on the k rows of the fused layer only (q rows untouched), rank 4."""
    gen = torch.Generator().manual_seed(5)
    module = ColumnLoRA(4, 8.0, 0.0, [Segment("k", Q_ROWS // TP, (Q_ROWS + K_ROWS) // TP)])
    module.lora_A["k"] = torch.nn.Parameter((torch.randn(4, HIDDEN, generator=gen) / 8).to(dtype))
    module.lora_B["k"] = torch.nn.Parameter((torch.randn(K_ROWS // TP, 4, generator=gen) / 8).to(dtype))
    return module


def _lora_reference(x: torch.Tensor, w: torch.Tensor, module: ColumnLoRA) -> torch.Tensor:
    y = F.linear(x, w)
    delta = module.scale * F.linear(F.linear(x, module.lora_A["k"]), module.lora_B["k"])
    return y + torch.cat((torch.zeros(*y.shape[:-1], Q_ROWS // TP), delta), dim=-1)


def test_lora_wraps_the_base_method_and_keeps_checkpoint_names() -> None:
    """LoRA is a method around the base one: the base product plus the delta on the target's
    rows, the adapter's parameters named `adapter.lora_X.<target>` beside the base `weight`, and
    unwrapping gives the base method back."""
    layer, w = _loaded_column(DENSE, torch.float32)
    module = _column_lora(torch.float32)
    wrap(layer, module)
    assert isinstance(layer.method, LoRAMethod) and layer.method.inner is DENSE and layer.method.base is DENSE
    assert layer.method.adapts()
    assert set(layer.state_dict()) == {"weight", "adapter.lora_A.k", "adapter.lora_B.k"}
    x = _x(torch.float32, 2)
    with torch.no_grad():  # both of the module's paths: in place without autograd, out of place with
        assert torch.allclose(layer(x), _lora_reference(x, w, module), atol=1e-6)
    assert torch.allclose(layer(x), _lora_reference(x, w, module), atol=1e-6)
    with pytest.raises(ValueError, match="already has an adapter"):
        wrap(layer, _column_lora(torch.float32))
    assert unwrap(layer) is module
    assert layer.method is DENSE and not layer.method.adapts() and set(layer.state_dict()) == {"weight"}
    assert unwrap(layer) is None


def test_a_new_base_method_goes_under_the_lora() -> None:
    """Packing a layer that has a LoRA (a LoRA trainer's frozen base) replaces the base only."""
    _packed_or_skip(torch.float32)
    from tprt.cpu.fast_linear import FastLinear

    layer, w = _loaded_column(DENSE, torch.float32)
    module = _column_lora(torch.float32)
    wrap(layer, module)
    packed = FastLinear()
    packed.process_after_loading(layer)
    set_base_method(layer, packed)
    assert isinstance(layer.method, LoRAMethod) and layer.method.inner is packed and layer.method.base is packed
    x = _x(torch.float32, 3)
    with torch.inference_mode():
        assert torch.allclose(layer(x), _lora_reference(x, w, module), atol=1e-5)
    assert unwrap(layer) is module and layer.method is packed


def test_row_lora_joins_the_partial_product() -> None:
    """A row-parallel layer's method gives this rank's partial product; a RowLoRA wrapped around
    it adds B (A_r x_r) to it, before the all-reduce."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) / 8
    cols = full[:, RANK * HIDDEN : (RANK + 1) * HIDDEN]  # this rank's input columns
    with torch.device("meta"):
        layer = RowParallelLinear(HIDDEN, HIDDEN, CTX, torch.float32)
    dest = torch.empty(layer.weight.shape)
    layer.method.load_weight(layer, "weight", dest, [cols])
    layer.load_state_dict({"weight": dest}, assign=True)
    layer.method.process_after_loading(layer)
    module = RowLoRA(2, 2.0, 0.0)
    module.lora_A["o"] = torch.nn.Parameter(torch.randn(2, HIDDEN, generator=gen))
    module.lora_B["o"] = torch.nn.Parameter(torch.randn(HIDDEN, 2, generator=gen))
    wrap(layer, module)
    x = torch.randn(4, HIDDEN, generator=gen)
    want = F.linear(x, cols) + F.linear(F.linear(x, module.lora_A["o"]), module.lora_B["o"])
    assert torch.allclose(layer.method.apply(layer, x), want, atol=1e-5)
    assert isinstance(layer, ParallelLinear)


def test_unknown_weight_format_is_a_one_line_error(tmp_path: Path) -> None:
    ckpt = SimpleNamespace(path=tmp_path, manifest=SimpleNamespace(extra={"weight_format": "int3"}))
    with pytest.raises(CheckpointError) as e:
        weight_format(ckpt)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "\n" not in msg and "tprt_manifest.json" in msg and "'int3'" in msg and "dense" in msg, msg
    ckpt.manifest.extra = {}
    assert weight_format(ckpt) is DENSE  # type: ignore[arg-type]
