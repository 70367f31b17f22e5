"""Faster inference matmuls on CPU: each linear layer's weight in the layout its kernel wants.

On CPU, `F.linear` on a few rows of input (decode) streams the weight well below the memory
bandwidth, and how far below depends on dtype and shape. `FastLinear` is the linear method
(tprt.parallel.layers.LinearMethod) for that: the dense format's weights, plus copies derived from
them after loading (`process_after_loading`: the packed copy), chosen per input row count.
`prepack(model)`, called after loading by whoever builds an inference model (the engine's runner),
gives every Column/RowParallelLinear and the LM head one, under any LoRA wrapping the layer, and
times which copy serves one and a few rows over all layers of a weight shape:

- inputs of more than one row (prefill, batched decode) use oneDNN's linear on a copy of the
  weight reordered once ("packed"): the CPU's bf16 dot-product instructions for bf16, better
  blocking for fp32; except 2-4 rows (decode of a few sequences), where tprt's few-row kernel
  is used for the row counts at which it was faster when timed;
- one-row inputs (batch-1 decode) use whichever of tprt's own compiled kernel ("native",
  `tprt.cpu.native`: reads the weight itself as one sequential stream, when a C compiler is there),
  packed, `x @ W^T` with W^T stored contiguous ("transposed": an axpy-style stream) and plain
  `F.linear` ("dense") was fastest when timed at prepack time, per weight shape, over all
  layers of that shape (so the timing streams from memory like decode does, not from cache).

With autograd on, a FastLinear gives F.linear's product for a trainable weight, and for a frozen
one (the base of a LoRA run) its own product, the input's gradient coming from the weight: a
LoRA trainer asks for that explicitly (`prepack(model, tune=False)`), or shares the served
model's methods (`tprt.checkpoint.loading.shared_twin`).

The compiled one-row decode layers that build on the native GEMV's choice are installed
separately, after this (`tprt.cpu.native_layers.install_native_layers`).

Measured effects are in docs/PERF.md. Results differ from F.linear's in rounding only (another
summation order). Cost: one or two extra copies of the weights in memory; the copies are taken
at prepack time, so weights changed in place afterwards need `prepack(model)` again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F

from tprt.cpu import native
from tprt.cpu.threads import decode_threads
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.layers import DenseLinear, LinearMethod, ParallelLinear, set_base_method

PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VARIANTS = ("native", "packed", "transposed", "dense")
Kernel = Callable[[torch.Tensor], torch.Tensor]


# oneDNN picks the packed layout for an expected number of input rows. A hint of 1 made fp32
# products of 2-512 rows 10-40% slower than any larger hint (16 rows: 31 vs 22 ms for SmolLM2's
# linears), and one-row products gain nothing from it (docs/PERF.md), so one layout serves all.
PACK_ROWS_HINT = 64

# Row counts for which tprt's few-row kernel (tprt.cpu.native.gemv_rows_kernel) is timed against the
# packed weights: it reads each weight once for all rows, 2-2.5x faster at 2 rows, even by ~4.
FEW_ROWS = (2, 3, 4)


def _packed(weight: torch.Tensor) -> Kernel:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)

    def run(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out

    return run


def _transposed(weight: torch.Tensor) -> Kernel:
    wt = weight.detach().t().contiguous()  # [in, out]

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.reshape(-1, x.shape[-1]), wt).view(*x.shape[:-1], wt.shape[1])

    return run


def _dense(weight: torch.Tensor) -> Kernel:
    w = weight.detach()
    return lambda x: F.linear(x, w)


_MAKERS: dict[str, Callable[[torch.Tensor], Kernel | None]] = {
    "native": native.gemv_kernel, "packed": _packed, "transposed": _transposed, "dense": _dense}


class FastLinear(DenseLinear):
    """A layer's `LinearMethod` (tprt.parallel.layers) over the dense format's weight and copies
    of it in faster layouts: y = x @ W^T by `one` for a single row, `few` for the row counts in
    `few_rows`, `many` for the rest (see the module docstring). Built empty, it makes the packed
    copy in `process_after_loading` and serves every row count from it until `prepack`'s timing
    chooses (`choose`). Not a module: the copies stay out of state_dict."""

    def __init__(self, many: Kernel | None = None, one: Kernel | None = None, one_variant: str = "packed",
                 few: Kernel | None = None, few_rows: frozenset[int] = frozenset()) -> None:
        self.many, self.one = many, one
        self.one_variant = one_variant
        self.few, self.few_rows = few, few_rows if few is not None else frozenset()

    def process_after_loading(self, layer: ParallelLinear) -> None:
        """(Re)makes the packed copy from the layer's weight; every row count uses it."""
        self.many = self.one = _packed(layer.weight_matrix())
        self.one_variant, self.few, self.few_rows = "packed", None, frozenset()

    tunable = True

    def cpu_method(self) -> LinearMethod | None:
        return None  # already

    @property
    def one_row_native(self) -> bool:
        return self.one_variant == "native"

    def choose(self, one: Kernel, one_variant: str, few: Kernel | None, few_rows: frozenset[int]) -> None:
        """The kernels `prepack`'s timing picked for one row and for `few_rows` rows."""
        self.one, self.one_variant = one, one_variant
        self.few, self.few_rows = few, few_rows if few is not None else frozenset()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert self.many is not None and self.one is not None, "FastLinear used before process_after_loading"
        rows = x.numel() // x.shape[-1]
        if rows == 1:
            return self.one(x)
        if rows in self.few_rows:
            assert self.few is not None
            return self.few(x)
        return self.many(x)

    def apply(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        """The copies' product with autograd off; under autograd F.linear for a trainable weight,
        and for a frozen one (a LoRA base) the copies' product with the input's gradient taken
        from the weight itself."""
        if not torch.is_grad_enabled():
            return self(x)
        weight = layer.weight_matrix()
        if weight.requires_grad:
            return F.linear(x, weight)
        out: torch.Tensor = _FrozenLinear.apply(x, weight, self)
        return out


class _FrozenLinear(torch.autograd.Function):
    """y = fast(x) = x @ W^T for a weight that gets no gradient; backward: dx = dy @ W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, fast: FastLinear) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return fast(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (weight,) = ctx.saved_tensors
        return (grad.matmul(weight) if ctx.needs_input_grad[0] else None), None, None


def supported(model: TPLlamaForCausalLM) -> bool:
    """CPU weights in a dtype oneDNN handles on this CPU."""
    if model.tp.device.type != "cpu" or model.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if model.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if model.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def _time_group(fns: list[Kernel], x: torch.Tensor, repeats: int = 3) -> float:
    """Best time of one pass of x through every layer of a group (streams their weights): CPU
    time when torch and the native pool run on one thread (steadier under other processes'
    load), wall time otherwise (CPU time would count a multi-threaded kernel's work on every core
    against it)."""
    single = torch.get_num_threads() == 1 and native.threads() == 1
    clock = time.process_time if single else time.perf_counter
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        t0 = clock()
        for fn in fns:
            fn(x)
        best = min(best, clock() - t0)
    return best


def _tune_one_row(weights: list[torch.Tensor], torch_threads: int | None
                  ) -> tuple[str, list[Kernel]]:
    """The fastest variant for one-row inputs over a group of same-shape weights, and its
    callables; torch's variants timed on `torch_threads` (None: the current count), the threads
    one-row steps will give them (the native one runs on its own pool)."""
    x = torch.ones(1, weights[0].shape[1], dtype=weights[0].dtype)  # not randn: leave the global RNG alone
    best: tuple[float, str, list[Kernel]] | None = None
    for name in VARIANTS:
        made = [_MAKERS[name](w) for w in weights]
        fns = [fn for fn in made if fn is not None]
        if len(fns) < len(made):
            continue  # not available here (native: no compiler, or another dtype)
        with torch_thread_count(None if name == "native" else torch_threads):
            t = _time_group(fns, x)
        if best is None or t < best[0]:
            best = (t, name, fns)
        del fns, made  # drop this variant's copies before building the next
    assert best is not None
    return best[1], best[2]


def _tune_few_rows(weights: list[torch.Tensor], many: list[Kernel]
                   ) -> tuple[frozenset[int], list[Kernel] | None]:
    """The row counts (of FEW_ROWS) at which the native few-row kernel beat the packed weights
    over a group of same-shape weights, and its callables (None when it is unavailable)."""
    made = [native.gemv_rows_kernel(w) for w in weights]
    fns = [fn for fn in made if fn is not None]
    if len(fns) < len(made):
        return frozenset(), None
    won = set()
    for rows in FEW_ROWS:
        x = torch.ones(rows, weights[0].shape[1], dtype=weights[0].dtype)
        if _time_group(fns, x) < _time_group(many, x):
            won.add(rows)
    return frozenset(won), fns if won else None


def prepack(model: TPLlamaForCausalLM, tune: bool = True, one_row_threads: int | None = None) -> dict[str, str]:
    """Gives every dense linear layer and the LM head a `FastLinear` as its weight method (under
    any LoRA wrapping it), and int8 layers a `NativeInt8Linear` (and, with `tune`, the LM head an
    `Int8Head`), when `supported(model)`; returns, per weight shape, the variant chosen for one-row inputs (empty
    when nothing was done). Without `tune`, one-row inputs use the packed weight too (training:
    faster frozen-base products without the timing). `one_row_threads`: the torch threads
    one-row steps run on (tprt.engine.runner; None: the current count), which torch's one-row
    variants are timed with."""
    if not supported(model):
        return {}
    head_method = int8_head(model) if tune else None
    native.set_threads(decode_threads())  # before the timings, so the native GEMV is timed as it will run
    if one_row_threads is not None:  # one-row steps never raise the count (tprt.engine.runner)
        one_row_threads = min(one_row_threads, torch.get_num_threads())
    groups: dict[tuple[int, ...], list[tuple[ParallelLinear, FastLinear]]] = {}
    with torch.inference_mode():
        for layer in model.modules():
            if not isinstance(layer, ParallelLinear):
                continue
            method = head_method if layer is model.lm_head and head_method is not None else layer.method.base.cpu_method()
            if method is None:
                continue
            method.process_after_loading(layer)  # the packed copy, the compiled products
            set_base_method(layer, method)
            if method.tunable:
                groups.setdefault(tuple(layer.weight_matrix().shape), []).append((layer, cast(FastLinear, method)))
        chosen: dict[str, str] = {}
        for shape, group in groups.items():
            if tune:
                weights = [layer.weight_matrix() for layer, _ in group]
                many = [method.many for _, method in group]
                assert all(m is not None for m in many)
                name, ones = _tune_one_row(weights, one_row_threads)
                few_rows, fews = _tune_few_rows(weights, cast(list[Kernel], many))
                for i, (_, method) in enumerate(group):
                    one = method.many if name == "packed" else ones[i]  # packed: the same copy serves both
                    assert one is not None
                    method.choose(one, name, fews[i] if fews else None, few_rows)
            chosen["x".join(map(str, shape))] = group[0][1].one_variant
    return chosen


def int8_head(model: TPLlamaForCausalLM) -> LinearMethod | None:
    """The LM head's method at inference on the compiled kernels, as the decoder's format says
    (int8: the head quantized in the same format, tprt.cpu.quant_linear.Int8Head); None: dense."""
    return model.weight_method.cpu_head_method()


@contextmanager
def torch_thread_count(threads: int | None) -> Iterator[None]:
    """torch's thread count set to `threads` inside (None: unchanged), restored after."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_row_native(*linears: ParallelLinear) -> bool:
    """Whether `prepack` chose the native GEMV for one-row inputs of each of these layers."""
    return all(linear.method.base.one_row_native for linear in linears)
