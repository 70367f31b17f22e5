"""tprt's own compiled CPU kernels (`kernels.c`), built at first use and loaded with ctypes.

- `gemv_kernel(weight)`: x @ W^T for one-row inputs (batch-1 decode), reading W as one
  sequential stream: 19-24 GB/s on one core where oneDNN's and torch's one-row kernels reach
  10-15 (docs/PERF.md). `tprt.cpu.fast_linear` times it against torch's variants per weight shape.
- `set_threads(n)`: the GEMVs and the fused layer halves below split each weight's rows over n
  threads of the kernels' own persistent pool (pthreads that spin briefly, then sleep, between
  calls; a spinning barrier between a fused kernel's sections): one decode row streams the
  weights on every core given. Every output is computed by one thread with the one-thread code,
  so results equal one thread's bit for bit.
- `gemv_rows_kernel(weight)`: the same for a few rows (decode of 2-8 sequences), each weight row
  read once for all of them: 2-2.5x oneDNN at 2 rows, even with it from about 4.
- `rms_norm_kernel(weight, eps)`: RMSNorm with transformers' rounding in bf16, one call instead
  of torch's five or six ops (2 us instead of 15-35 us per call at decode sizes).
- `rope_cache_kernel(dtype)`: a decode step's RoPE on q and k, the k/v write into the (float32 or int8)
  paged KV cache (tprt.model.kv_cache) and q's conversion to float32, in one call instead of
  about ten ops per layer.
- `decode_attention_kernel(dtype)`: a decode step's attention over the paged KV cache (float32 or int8),
  each row up to its own position through its block table, every kv head's keys and values read
  once for its group of q heads (SDPA's CPU kernel spends ~2 us per (row, head) pair around
  ~0.1 us of arithmetic).
- `mlp_decode_kernel(...)`: a decoder layer's MLP half for one row (RMSNorm, gate/up GEMV,
  SwiGLU, down GEMV) in one call instead of about ten ops and six module calls;
  `attention_decode_kernel(...)` the same for its attention half (RMSNorm, q/k/v GEMV, RoPE and
  cache write, attention, o GEMV).
- `decode_stack_kernel(...)`: every decoder layer of a decode step of 1-8 rows in one call (both
  halves of each layer, the residual adds and, where TP > 1, the all-reduces through a compiled
  all-reduce such as tprt.distributed.shm_allreduce's), run as one job of the thread pool.

The C source is compiled with the system's C compiler (`$CC`, else `cc`) and `-march=native`
into a per-user cache (`$TPRT_CACHE_DIR`, else `~/.cache/tprt`), keyed by the source, the flags
and this CPU's model and feature flags, so a home directory shared between different machines
gets one build per kind of CPU. The build takes about a second, once; it is written under a
temporary name and renamed, so ranks building at the same time never load a half-written file.

Everything here is optional: without a compiler, on a build error, or with `TPRT_NATIVE=0`,
`gemv_kernel()` returns None (saying why once, at warning level) and callers keep torch's
kernels. No torch headers are involved, so the build does not depend on the torch version.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")
_DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {"tprt_gemv": [_P, _P, _P, _I, _I], "tprt_gemv_rows": [_P, _P, _P, _I, _I, _I],
               "tprt_rms_norm": [_P, _P, _P, _I, _I, _F], "tprt_rms_norm_unit": [_P, _P, _P, _I, _I, _F],
               "tprt_rope_cache": [_P] * 9 + [_I] * 8,
               "tprt_paged_decode_attention": [_P] * 8 + [_I] * 10 + [_F, _I, _F],
               "tprt_mlp_decode": [_P] * 7 + [_I, _I, _F, _I], "tprt_gelu_glu": [_P, _P, _I, _I],
               "tprt_paged_attention_decode": [_P] * 17 + [_I] * 9 + [_F, _F, _P, _I, _F, _I]}

Kernel = Callable[[torch.Tensor], torch.Tensor]


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(wanted))  # first occurrence of each (one per core otherwise)


def cache_dir() -> Path:
    root = os.environ.get("TPRT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tprt")
    return Path(root) / "native"


def _ours(directory: Path) -> bool:
    """Owned by this user and writable by no one else: we load code from it."""
    try:
        st = directory.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _sources(source_path: Path) -> bytes:
    """The source and the files it may include (every .c and .h beside it: kernels.c includes its
    families), names and contents, for the build's cache key."""
    files = sorted({source_path, *source_path.parent.glob("*.c"), *source_path.parent.glob("*.h")})
    return b"\0".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)


def _build(compiler: str, source_path: Path) -> Path:
    key = hashlib.sha256(b"\0".join([_sources(source_path), " ".join(FLAGS).encode(), compiler.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]
    name = f"{source_path.stem}-{key}.so"
    # A read-only home (some CI and container setups) falls back to a per-user temporary directory.
    for directory in (cache_dir(), Path(tempfile.gettempdir()) / f"tprt-{os.getuid()}" / "native"):
        if _ours(directory) and (directory / name).exists():
            return directory / name
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if _ours(directory) and os.access(directory, os.W_OK):
            break
    else:
        raise RuntimeError(f"no writable directory of this user for the compiled kernels (tried {cache_dir()})")
    target = directory / name
    fd, tmp = tempfile.mkstemp(prefix=f".{source_path.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *FLAGS, "-o", tmp, str(source_path), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            last = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
            raise RuntimeError(f"{compiler} failed on {source_path}: {last[0]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def compile_library(source: Path, what: str) -> ctypes.CDLL | None:
    """The C file `source` built (once per source, flags and CPU) and loaded, or None (saying why
    once, at warning level, as `what` unavailable) without a compiler, on a build error, off
    Linux or with TPRT_NATIVE=0."""
    if os.environ.get("TPRT_NATIVE", "1") == "0":
        log.info("%s disabled by TPRT_NATIVE=0", what)
        return None
    if platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("%s unavailable: no C compiler (set CC or install gcc); using torch's kernels", what)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable (%s); using torch's kernels", what, exc)
        return None


@cache
def _library() -> ctypes.CDLL | None:
    lib = compile_library(SOURCE, "tprt native kernels")
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        for suffix in _DTYPE_SUFFIX.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
    for suffix in _DTYPE_SUFFIX.values():
        fn = getattr(lib, f"tprt_decode_stack_{suffix}")
        fn.argtypes, fn.restype = [_P, _P, _I] + [_P] * 6 + [_I, _P, _P, _P], _I
    bind_q8(lib)
    lib.tprt_stream_sum_f32.argtypes, lib.tprt_stream_sum_f32.restype = [_P, _I], ctypes.c_double
    lib.tprt_pool_set_threads.argtypes, lib.tprt_pool_set_threads.restype = [_I], _I
    lib.tprt_pool_threads.argtypes, lib.tprt_pool_threads.restype = [], _I
    return lib


def available() -> bool:
    return _library() is not None


def set_threads(n: int) -> int:
    """Makes the kernels share their work among n threads (the caller and n - 1 workers of the
    kernels' own pool, which sleep when idle); returns the count in effect (1 without the kernels,
    fewer than n if the system refused threads). Results do not depend on it."""
    lib = _library()
    return 1 if lib is None else int(lib.tprt_pool_set_threads(max(1, n)))


def stream_sum(x: torch.Tensor) -> float | None:
    """The sum of a contiguous CPU float32 tensor, read by the pool's threads with the GEMVs'
    software prefetching: a plain read of memory at the rate the kernels can stream weights (the
    bandwidth floor of bench/generate_bench.py). None without the kernels."""
    lib = _library()
    if lib is None:
        return None
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"native stream_sum expects a contiguous CPU float32 tensor, got {x.dtype} on {x.device}")
    return float(lib.tprt_stream_sum_f32(x.data_ptr(), x.numel()))


def threads() -> int:
    """How many threads the kernels use (1 at start-up, or without the kernels)."""
    lib = _library()
    return 1 if lib is None else int(lib.tprt_pool_threads())


def _function(name: str, weight: torch.Tensor, dims: int) -> Any | None:
    """The compiled `name` for the weight's dtype, or None (unavailable, not CPU, another dtype)."""
    lib = _library()
    if lib is None or weight.device.type != "cpu" or weight.dtype not in _DTYPE_SUFFIX or weight.dim() != dims:
        return None
    return getattr(lib, f"{name}_{_DTYPE_SUFFIX[weight.dtype]}")


MAX_FEW_ROWS = 8  # gemv_rows_kernel's limit (its C loop keeps one accumulator per row in registers)
# q8_kernel's: 8 rows per pass over a cache-sized tile of the weight, so the weight is read from
# memory once for all of them (batched decode); more rows (prefill) are better off dequantized
MAX_Q8_ROWS = 32


def gemv_kernel(weight: torch.Tensor) -> Kernel | None:
    """A function computing `x @ weight^T` for a one-row x of the weight's dtype, or None when
    the native kernels are unavailable or do not cover this weight (CPU bf16/fp32 only)."""
    return _gemv(weight, "gemv", 1, 1)


def gemv_rows_kernel(weight: torch.Tensor) -> Kernel | None:
    """A function computing `x @ weight^T` for x [..., k] of 2 to MAX_FEW_ROWS rows in the
    weight's dtype, or None like `gemv_kernel`."""
    return _gemv(weight, "gemv_rows", 2, MAX_FEW_ROWS)


def _gemv(weight: torch.Tensor, label: str, min_rows: int, max_rows: int) -> Kernel | None:
    """x @ weight^T for min_rows..max_rows rows through tprt_gemv_rows (one row: tprt_gemv)."""
    fn = _function("tprt_gemv_rows", weight, 2)
    if fn is None:
        return None
    w = weight.detach().contiguous()
    n, k = w.shape

    def run(x: torch.Tensor) -> torch.Tensor:  # `w` in the closure keeps the weight alive
        rows = x.numel() // k if x.shape[-1] == k else 0
        if not min_rows <= rows <= max_rows or x.dtype != w.dtype:
            count = "one row" if max_rows == 1 else f"{min_rows}-{max_rows} rows"
            raise ValueError(f"native {label} expects {count} of {k} {w.dtype} values, got {tuple(x.shape)} {x.dtype}")
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], n, dtype=w.dtype)
        fn(w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, n, k)
        return y

    return run


def rms_norm_kernel(weight: torch.Tensor, eps: float, unit_offset: bool = False) -> Kernel | None:
    """A function computing RMSNorm(x) * weight over the last dimension for x of the weight's
    dtype (as `tprt.model.llama.RMSNorm`, to rounding; `unit_offset`: Gemma's, times 1 + weight in
    float32), or None like `gemv_kernel`."""
    fn = _function("tprt_rms_norm_unit" if unit_offset else "tprt_rms_norm", weight, 1)
    if fn is None:
        return None
    w = weight.detach().contiguous()
    n = w.shape[0]

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != n or x.dtype != w.dtype or x.device.type != "cpu":
            raise ValueError(f"native rms_norm expects [..., {n}] {w.dtype} on CPU, got {tuple(x.shape)} {x.dtype}")
        x = x.contiguous()
        y = torch.empty_like(x)
        fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
        return y

    return run


def gelu_glu_kernel(dtype: torch.dtype) -> Kernel | None:
    """A function gate_up [..., 2 inter] -> tanh-gelu(gate) * up [..., inter] (Gemma's GeGLU of the
    fused gate/up product, rounded as torch's ops round in `dtype`), or None like `gemv_kernel`."""
    lib = _library()
    if lib is None or dtype not in _DTYPE_SUFFIX:
        return None
    fn = getattr(lib, f"tprt_gelu_glu_{_DTYPE_SUFFIX[dtype]}")

    def run(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != dtype or gate_up.device.type != "cpu" or gate_up.shape[-1] % 2:
            raise ValueError(f"native gelu_glu expects [..., 2 inter] {dtype} on CPU, got {tuple(gate_up.shape)} "
                             f"{gate_up.dtype}")
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=dtype)
        fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
        return out

    return run


def _decode_indices(kernel: str, cache_step: Any, rows: int) -> tuple[int, int]:
    """Pointers to each row's write block and offset (int64) of a decode step, after checking
    that it has exactly `rows` rows of one token each: the kernels index both per row. The
    values were range-checked by `KVCache.prepare`."""
    blocks, offsets = cache_step.flat_write_blocks, cache_step.flat_write_offsets
    if blocks.numel() != rows or offsets.numel() != rows:
        raise ValueError(f"native {kernel}: {rows} rows, but the cache step has {blocks.numel()} blocks "
                         f"and {offsets.numel()} offsets to write")
    return blocks.data_ptr(), offsets.data_ptr()


def _block_tables(kernel: str, cache_step: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table [rows, blocks] (int64, unit stride along a row) and position
    [rows] (int64, contiguous) of a decode step."""
    tables, positions = cache_step.tables, cache_step.flat_positions
    if tables.shape[0] != rows or positions.numel() != rows or tables.stride(-1) != 1 or tables.dtype != torch.int64:
        raise ValueError(f"native {kernel}: {rows} rows, but the cache step has {tables.shape[0]} block tables "
                         f"and {positions.numel()} positions")
    return tables, positions


def _cache_store(kernel: str, cache: Any, layer: int | None) -> tuple[torch.Tensor, int | None, int | None]:
    """The cache's storage (one layer's, or every layer's when `layer` is None), its scales'
    address and its static scales' address (None where it has none): what the kernels read and
    write. They take float32, or int8 with a bfloat16 scale per head vector
    (tprt.model.kv_cache.quantize), contiguous so a vector's scale is at its element offset /
    head_dim, or int8 with static float32 scales [layer, k/v, kv_head] (`fixed_scales`)."""
    store = cache.kv if layer is None else cache.kv[layer]
    scales = cache.scales if layer is None or cache.scales is None else cache.scales[layer]
    fixed = cache.fixed_scales if layer is None or cache.fixed_scales is None else cache.fixed_scales[layer]
    if store.dtype == torch.float32 and scales is None and fixed is None and store.stride(-1) == 1:
        return store, None, None
    if store.dtype == torch.int8 and store.is_contiguous():
        if scales is not None and scales.dtype == torch.bfloat16 and scales.is_contiguous():
            return store, scales.data_ptr(), None
        if fixed is not None and fixed.dtype == torch.float32 and fixed.is_contiguous():
            return store, None, fixed.data_ptr()
    raise ValueError(f"native {kernel}: the cache must be float32, or int8 with bfloat16 scales or static float32 "
                     f"ones, contiguous; got {store.dtype}")


def supports_cache(cache: Any) -> bool:
    """Whether the decode kernels read and write this KV cache (float32, or int8 with scales)."""
    return cache.kv.dtype == torch.float32 or cache.kv.dtype == torch.int8


def rope_cache_kernel(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """A function (qkv, cos, sin, cache, cache_step, layer) -> q for one decode token per row, or
    None like `gemv_kernel`. qkv [batch, 1, nh + 2 nkv, d] is the fused projection in `dtype`,
    cos/sin [batch, 1, 1, d] from `tprt.model.rope.rope_angles`; k and v are rotated (k) and written
    into the `cache` (a `tprt.model.kv_cache.KVCache`, float32 or int8: `supports_cache`) at the
    step's write blocks and offsets (checked in range by `KVCache.prepare`); returns q rotated,
    float32, [batch, nh, 1, d]."""
    lib = _library()
    if lib is None or dtype not in _DTYPE_SUFFIX:
        return None
    fn = getattr(lib, f"tprt_rope_cache_{_DTYPE_SUFFIX[dtype]}")

    def run(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, cache_step: Any,
            layer: int) -> torch.Tensor:
        store, scales, fixed = _cache_store("rope_cache", cache, layer)  # [block, k/v, kv_head, offset, d]
        batch, seq, heads, d = qkv.shape
        nkv = store.shape[2]
        nh = heads - 2 * nkv
        if (seq != 1 or qkv.dtype != dtype or cos.dtype != dtype or sin.dtype != dtype or store.shape[-1] != d
                or qkv.device.type != "cpu" or nh <= 0 or cos.shape[-1] != d):
            raise ValueError(f"native rope_cache: unsupported qkv {tuple(qkv.shape)} {qkv.dtype} / cache {store.dtype}")
        blocks, offsets = _decode_indices("rope_cache", cache_step, batch)
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        q = torch.empty(batch, nh, 1, d, dtype=torch.float32)
        fn(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), store.data_ptr(), scales, fixed, blocks,
           offsets, batch, nh, nkv, d, *store.stride()[:4])
        return q

    return run


def decode_attention_kernel(dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """A function (q, cache, cache_step, layer) -> attention output for one decode token per
    row, or None like `gemv_kernel`. q [batch, nh, 1, d] float32 (from `rope_cache_kernel`);
    row b attends to its keys and values at positions 0..its own (the last `cache.windows[layer]`
    of them where the layer has a window; scores soft-capped where `cache.softcap`), read through
    its block table (the decode step's causal mask; blocks and positions checked in range by
    `KVCache.prepare`); returns [batch, 1, nh * d] in `dtype`."""
    lib = _library()
    if lib is None or dtype not in _DTYPE_SUFFIX:
        return None
    fn = getattr(lib, f"tprt_paged_decode_attention_{_DTYPE_SUFFIX[dtype]}")

    def run(q: torch.Tensor, cache: Any, cache_step: Any, layer: int) -> torch.Tensor:
        store, scales, fixed = _cache_store("decode_attention", cache, layer)  # [block, k/v, kv_head, offset, d]
        batch, nh, seq, d = q.shape
        nkv = store.shape[2]
        if seq != 1 or q.dtype != torch.float32 or store.shape[-1] != d or nh % nkv or q.device.type != "cpu":
            raise ValueError(f"native decode_attention: unsupported q {tuple(q.shape)} {q.dtype} / cache {store.dtype}")
        tables, positions = _block_tables("decode_attention", cache_step, batch)
        q = q.contiguous()
        out = torch.empty(batch, 1, nh * d, dtype=dtype)
        scratch = torch.empty(cache_step.kv_len * (nh // nkv), dtype=torch.float32)  # a group's scores
        fn(q.data_ptr(), store.data_ptr(), scales, fixed, tables.data_ptr(), positions.data_ptr(), out.data_ptr(),
           scratch.data_ptr(), batch, nh, nkv, d, store.shape[3], tables.stride(0), *store.stride()[:4], d ** -0.5,
           cache.windows[layer] or 0, cache.softcap or 0.0)
        return out

    return run


def mlp_decode_kernel(norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                      down_weight: torch.Tensor, gemma: bool = False) -> Kernel | None:
    """A function h -> down(silu(gate) * up) of RMSNorm(h) for one row h [..., hidden] (this rank's
    partial product, before the all-reduce and the residual add), or None like `gemv_kernel`.
    gate_up_weight [2 inter, hidden] holds the gate rows, then the up rows (tprt.model.llama.MLP).
    `gemma`: Gemma's norm (1 + w, in float32) and GeGLU (tanh) instead."""
    fn = _function("tprt_mlp_decode", gate_up_weight, 2)
    hidden = norm_weight.shape[0]
    inter = gate_up_weight.shape[0] // 2
    weights = [w.detach().contiguous() for w in (norm_weight, gate_up_weight, down_weight)]
    if (fn is None or any(w.dtype != gate_up_weight.dtype or w.device.type != "cpu" for w in weights)
            or gate_up_weight.shape != (2 * inter, hidden) or down_weight.shape != (hidden, inter)):
        return None
    norm, gate_up, down = weights
    dtype = gate_up.dtype

    def run(x: torch.Tensor) -> torch.Tensor:  # the closure keeps the weights alive
        if x.numel() != hidden or x.dtype != dtype:
            raise ValueError(f"native mlp_decode expects one row of {hidden} {dtype} values, got {tuple(x.shape)} {x.dtype}")
        x = x.contiguous()
        out = torch.empty_like(x)
        act, work = torch.empty(2 * inter, dtype=dtype), torch.empty(inter, dtype=torch.float32)
        fn(x.data_ptr(), norm.data_ptr(), gate_up.data_ptr(), down.data_ptr(), out.data_ptr(), act.data_ptr(),
           work.data_ptr(), hidden, inter, eps, int(gemma))
        return out

    return run


Extras = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _extras(extras: list[Extras] | None, dtype: torch.dtype, shapes: tuple[tuple[int, ...], ...]
            ) -> tuple[list[torch.Tensor | None], Any] | None:
    """decode_stack's `extras` (stack.c): per layer the q/k/v bias, q norm, k norm and o bias in
    the model's dtype (None where absent) as one C array of pointers, and the tensors it points
    to; None when a tensor does not fit `shapes`, ([], None) when there are none at all."""
    if extras is None or all(x is None for layer in extras for x in layer):
        return [], None
    flat = [None if x is None else x.detach().contiguous() for layer in extras for x in layer]
    if any(x is not None and (x.dtype != dtype or x.device.type != "cpu" or tuple(x.shape) != shapes[i % 4])
           for i, x in enumerate(flat)):
        return None
    return flat, (ctypes.c_void_p * len(flat))(*(None if x is None else x.data_ptr() for x in flat))


def attention_decode_kernel(norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor, o_weight: torch.Tensor,
                            n_heads: int, n_kv_heads: int, extras: Extras | None = None,
                            shape: AttentionShape | None = None) -> Callable[..., torch.Tensor] | None:
    """A function (x, cos, sin, cache, cache_step, layer) -> o_proj(attention(RMSNorm(x))) for one
    decode row x [1, 1, hidden] (this rank's partial product, before the all-reduce and the
    residual add), writing the row's k and v into the paged `cache` (float32 or int8) like
    `rope_cache_kernel` and attending through its block table like `decode_attention_kernel`;
    or None like `gemv_kernel`. qkv_weight rows are [q; k; v] of this rank's heads (tprt.model.llama).
    `extras`: the layer's (q/k/v bias, q norm, k norm, o bias), as `decode_stack_kernel` takes
    them; the o bias is the caller's to add after its all-reduce. `shape`: the layer's window,
    the scores' scale and soft-cap, Gemma's norms (its angles are the caller's to pick)."""
    shape = shape or AttentionShape()
    fn = _function("tprt_paged_attention_decode", qkv_weight, 2)
    hidden = norm_weight.shape[0]
    d = qkv_weight.shape[0] // (n_heads + 2 * n_kv_heads)
    weights = [w.detach().contiguous() for w in (norm_weight, qkv_weight, o_weight)]
    if (fn is None or any(w.dtype != qkv_weight.dtype or w.device.type != "cpu" for w in weights) or n_heads % n_kv_heads
            or qkv_weight.shape != ((n_heads + 2 * n_kv_heads) * d, hidden) or o_weight.shape != (hidden, n_heads * d)):
        return None
    found = _extras(None if extras is None else [extras], qkv_weight.dtype,
                    (((n_heads + 2 * n_kv_heads) * d,), (d,), (d,), (hidden,)))
    if found is None:
        return None
    extra_tensors, extra_ptrs = found
    norm, qkv_w, o_w = weights
    dtype = qkv_w.dtype

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, cache_step: Any,
            layer: int) -> torch.Tensor:  # the closure keeps the weights (and the extras) alive
        assert extra_tensors is not None
        store, scales, fixed = _cache_store("attention_decode", cache, layer)  # [block, k/v, kv_head, offset, d]
        if (x.numel() != hidden or x.dtype != dtype or cos.dtype != dtype or sin.dtype != dtype or cos.shape[-1] != d
                or tuple(store.shape[2:3]) != (n_kv_heads,) or store.shape[-1] != d):
            raise ValueError(f"native attention_decode: unsupported x {tuple(x.shape)} {x.dtype} / cache {store.dtype}")
        block, offset = _decode_indices("attention_decode", cache_step, 1)
        table, position = _block_tables("attention_decode", cache_step, 1)
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(x)
        qkv, attn = torch.empty((n_heads + 2 * n_kv_heads) * d, dtype=dtype), torch.empty(n_heads * d, dtype=dtype)
        q = torch.empty(n_heads * d, dtype=torch.float32)
        fn(x.data_ptr(), norm.data_ptr(), qkv_w.data_ptr(), o_w.data_ptr(), cos.data_ptr(), sin.data_ptr(),
           store.data_ptr(), scales, fixed, block, offset, table.data_ptr(), position.data_ptr(), out.data_ptr(),
           qkv.data_ptr(), attn.data_ptr(), q.data_ptr(), hidden, n_heads, n_kv_heads, d, store.shape[3],
           *store.stride()[:4], eps, shape.scale_for(d), None if extra_ptrs is None else ctypes.addressof(extra_ptrs),
           shape.window or 0, shape.softcap or 0.0, int(shape.gemma))
        return out

    return run


@dataclass(frozen=True)
class AttentionShape:
    """How a layer's attention departs from Llama's, as the kernels take it: its sliding window
    (None: none), the scores' scale (None: 1 / sqrt(head_dim)), their soft-cap (None: none), and
    Gemma's block (norms scaling by 1 + w in float32, GeGLU, norms of each half's output)."""

    window: int | None = None
    scale: float | None = None
    softcap: float | None = None
    gemma: bool = False

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else head_dim ** -0.5


class _DecodeStack(ctypes.Structure):
    """kernels.c's decode_stack: the model, for tprt_decode_stack."""
    _fields_ = [("layers", _I), ("hidden", _I), ("inter", _I), ("nh", _I), ("nkv", _I), ("d", _I),
                ("eps", _F), ("scale", _F), ("weights", _P), ("all_reduce", _P), ("all_reduce_ctx", _P),
                ("scales", _P), ("groups", _P), ("max_rows", _I), ("extras", _P), ("windows", _P),
                ("softcap", _F), ("gemma", _I), ("sandwich", _P)]


class _DecodeCache(ctypes.Structure):
    """kernels.c's decode_cache: where a step's keys and values go, layer 0's and the stride to the next."""
    _fields_ = [("cache", _P), ("s_layer", _I), ("block_size", _I), ("s_block", _I), ("s_kv", _I),
                ("s_head", _I), ("s_pos", _I), ("scales", _P), ("fixed", _P)]


STACK_MAX_ROWS = 8  # decode_stack_kernel's most rows (the dense few-row kernels: gemv_rows_*)
STACK_MAX_Q8_ROWS = 32  # with every projection in int8 (their batched products: q8_matmul_rows)


def decode_stack_kernel(layers: list[tuple[torch.Tensor, ...]], eps: float, n_heads: int, n_kv_heads: int,
                        all_reduce: tuple[int, int, Callable[[int], None]] | None = None,
                        scales: list[tuple[torch.Tensor | None, ...]] | None = None,
                        extras: list[Extras] | None = None, attention: list[AttentionShape] | None = None,
                        sandwich: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                        ) -> Callable[..., torch.Tensor] | None:
    """A function (h, cos, sin, cache, cache_step) -> h after every decoder layer (before the
    final norm) for a decode step of 1 to `stack_max_rows(scales)` rows of one token, h [rows, 1, hidden],
    writing each layer's k and v into the paged `cache` (float32 or int8) and each row attending through its
    block table up to its own position, as `attention_decode_kernel` does for one row; or None
    like `gemv_kernel`. One row gives the bits of the per-half kernels. `layers`: per decoder
    layer, its (input norm, q/k/v, o, post-attention norm, gate/up, down) weights as the halves'
    kernels take them. `all_reduce` (where TP > 1): (address of a C function `int64_t f(void *ctx,
    void *data, int64_t n, int64_t dtype)` summing a partial product over the TP group in place,
    its ctx, a function raising for its non-zero returns), e.g.
    `tprt.distributed.shm_allreduce.ShmAllReduce.c_function`. `scales`: per layer, 6 entries
    like `layers`: the float32 scales [out, groups] of a weight given in int8 (tprt.quant), None
    for a weight in the model's dtype; its products then run as `q8_kernel`'s. `extras`: per
    layer, its (q/k/v bias, q norm, k norm, o bias) in the model's dtype, None where absent (the
    blocks of Qwen2 and Qwen3). `attention`: per layer, its `AttentionShape` (the scale, soft-cap and
    Gemma flag the same for every layer); `sandwich` (Gemma): per layer, the norms of its
    attention's and its MLP's outputs. The function then takes the windowed layers' own angles
    too (`local`: (cos, sin), Gemma 3)."""
    if not layers:
        return None
    norm0, qkv0, o0, _, gate_up0, _ = layers[0]
    fn = _function("tprt_decode_stack", norm0, 1)
    hidden, inter = norm0.shape[0], gate_up0.shape[0] // 2
    d = qkv0.shape[0] // (n_heads + 2 * n_kv_heads)
    shapes = [(hidden,), ((n_heads + 2 * n_kv_heads) * d, hidden), (hidden, n_heads * d), (hidden,),
              (2 * inter, hidden), (hidden, inter)]
    weights = [w.detach().contiguous() for layer in layers for w in layer]
    dtype = norm0.dtype
    flat_scales = ([None] * len(weights) if scales is None
                   else [None if x is None else x.detach().to(torch.float32).contiguous() for lay in scales for x in lay])
    if (fn is None or n_heads % n_kv_heads or any(len(layer) != 6 for layer in layers)
            or len(flat_scales) != len(weights)
            or any(w.dtype != (dtype if sc is None else torch.int8) or w.device.type != "cpu"
                   or (sc is not None and (sc.shape[0] != w.shape[0] or w.shape[1] % sc.shape[1]))
                   for w, sc in zip(weights, flat_scales))
            or any(tuple(w.shape) != shape for layer in layers for w, shape in zip(layer, shapes))):
        return None
    pointers = (ctypes.c_void_p * len(weights))(*(w.data_ptr() for w in weights))
    scale_ptrs = (ctypes.c_void_p * len(weights))(*(None if sc is None else sc.data_ptr() for sc in flat_scales))
    groups = (ctypes.c_int64 * len(weights))(*(0 if sc is None else w.shape[1] // sc.shape[1]
                                               for w, sc in zip(weights, flat_scales)))
    function, ctx, check = all_reduce if all_reduce is not None else (None, None, None)
    max_rows = stack_max_rows(scales)
    found = _extras(extras, dtype, (((n_heads + 2 * n_kv_heads) * d,), (d,), (d,), (hidden,)))
    if found is None or (extras is not None and len(extras) != len(layers)):
        return None
    extra_tensors, extra_ptrs = found
    attention = attention or [AttentionShape()] * len(layers)
    first = attention[0]
    if len(attention) != len(layers) or any((a.scale, a.softcap, a.gemma) != (first.scale, first.softcap, first.gemma)
                                            for a in attention):
        return None
    windows = (ctypes.c_int64 * len(layers))(*(a.window or 0 for a in attention))
    sandwich_tensors = [w.detach().contiguous() for pair in sandwich or [] for w in pair]
    if (sandwich is not None) != first.gemma or any(w.dtype != dtype or tuple(w.shape) != (hidden,)
                                                    for w in sandwich_tensors) or len(sandwich_tensors) not in (0, 2 * len(layers)):
        return None
    sandwich_ptrs = (ctypes.c_void_p * len(sandwich_tensors))(*(w.data_ptr() for w in sandwich_tensors))
    model = _DecodeStack(len(layers), hidden, inter, n_heads, n_kv_heads, d, eps, first.scale_for(d),
                         ctypes.addressof(pointers), function, ctx,
                         ctypes.addressof(scale_ptrs) if scales is not None else None, ctypes.addressof(groups),
                         max_rows, None if extra_ptrs is None else ctypes.addressof(extra_ptrs),
                         ctypes.addressof(windows), first.softcap or 0.0, int(first.gemma),
                         ctypes.addressof(sandwich_ptrs) if sandwich_tensors else None)
    # what `model` points to, kept alive by the closure
    alive = (weights, pointers, flat_scales, scale_ptrs, groups, extra_tensors, extra_ptrs, windows, sandwich_tensors,
             sandwich_ptrs)

    def run(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, cache_step: Any,
            local: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        assert alive
        kv, scales, fixed = _cache_store("decode_stack", cache, None)  # [layer, block, k/v, kv_head, offset, d]
        rows = h.shape[0]
        if (h.dim() != 3 or h.shape[1:] != (1, hidden) or not 1 <= rows <= max_rows or h.dtype != dtype
                or cos.dtype != dtype or sin.dtype != dtype or cos.shape[-1] != d or cos.numel() != rows * d
                or kv.shape[0] != len(layers)
                or kv.shape[3] != n_kv_heads or kv.shape[-1] != d):
            raise ValueError(f"native decode_stack: unsupported h {tuple(h.shape)} {h.dtype} (1 to {max_rows} "
                             f"rows of one token) / cache {tuple(kv.shape)} {kv.dtype}")
        blocks, offsets = _decode_indices("decode_stack", cache_step, rows)
        tables, positions = _block_tables("decode_stack", cache_step, rows)
        out, cos, sin = h.contiguous().clone(), cos.contiguous(), sin.contiguous()
        local_cos, local_sin = (None, None) if local is None else (x.contiguous() for x in local)
        if local_cos is not None and (local_cos.shape != cos.shape or local_cos.dtype != dtype
                                      or local_sin is None or local_sin.shape != sin.shape or local_sin.dtype != dtype):
            raise ValueError(f"native decode_stack: local angles {tuple(local_cos.shape)} do not match {tuple(cos.shape)}")
        where = _DecodeCache(kv.data_ptr(), kv.stride(0), kv.shape[4], *kv.stride()[1:5], scales, fixed)
        status = fn(ctypes.addressof(model), out.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
                    ctypes.addressof(where), blocks, offsets, tables.data_ptr(), tables.stride(0), positions.data_ptr(),
                    None if local_cos is None else local_cos.data_ptr(),
                    None if local_sin is None else local_sin.data_ptr())
        if status:
            assert check is not None, status
            check(status)
        return out

    return run


def stack_max_rows(scales: list[tuple[torch.Tensor | None, ...]] | None) -> int:
    """The most rows `decode_stack_kernel` takes for these weights' `scales`: STACK_MAX_Q8_ROWS
    where every layer's four projections are int8 (their batched products take any row count),
    else STACK_MAX_ROWS (the dense few-row kernels are compiled for up to 8)."""
    int8 = scales is not None and all(all(x is not None for x in (s[1], s[2], s[4], s[5])) for s in scales)
    return STACK_MAX_Q8_ROWS if int8 else STACK_MAX_ROWS


def bind_q8(lib: ctypes.CDLL) -> None:
    """Declares the int8 product's C signature on a loaded build of kernels.c."""
    lib.tprt_gemv_q8.argtypes, lib.tprt_gemv_q8.restype = [_P] * 4 + [_I] * 7, None
    lib.tprt_q8_path.argtypes, lib.tprt_q8_path.restype = [], _I
    lib.tprt_quantize_q8.argtypes, lib.tprt_quantize_q8.restype = [_P, _I, _P, _P, _I, _I, _I], None


def quantize_q8(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """tprt.quant.formats.quantize for int8, bit for bit, in one compiled pass over `w` [rows,
    cols] (float32 or bf16, contiguous) on the kernels' thread pool: (int8 [rows, cols], float32
    scales [rows, cols / group]); None without the kernels or for another dtype."""
    lib = _library()
    if lib is None or w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu" or w.dim() != 2:
        return None
    w = w.contiguous()
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.int8)
    s = torch.empty(rows, cols // group, dtype=torch.float32)
    lib.tprt_quantize_q8(w.data_ptr(), int(w.dtype == torch.bfloat16), q.data_ptr(), s.data_ptr(), rows, cols, group)
    return q, s


Q8_PATHS = {"best": 0, "scalar": 1, "float": 2}  # tprt_gemv_q8's path argument


def q8_path(lib: ctypes.CDLL | None = None) -> str:
    """The path this build's int8 products take: "vnni" (x quantized per block of 32, integer
    dot products), "avx512" or "avx2" (float32 on the exactly converted weights), "scalar"."""
    lib = lib or _library()
    return "none" if lib is None else {4: "vnni", 3: "avx512", 2: "avx2", 1: "scalar"}[int(lib.tprt_q8_path())]


def q8_kernel(weight: torch.Tensor, scale: torch.Tensor, lib: ctypes.CDLL | None = None,
              path: str = "best") -> Kernel | None:
    """A function computing x @ (weight * scale)^T for x [..., k] of 1 to MAX_Q8_ROWS rows in
    float32 or bf16 (the output in x's dtype), from int8 `weight` [n, k] and float32 `scale`
    [n, k / group] (tprt.quant.formats), or None without the kernels or off CPU. `lib`: another
    build of kernels.c (tests compare builds); `path` (Q8_PATHS): "best" is the build's fastest
    (`q8_path`), "float" its float32 vector loop, "scalar" the plain C loop."""
    lib = lib or _library()
    if lib is None or weight.device.type != "cpu" or weight.dtype != torch.int8 or weight.dim() != 2:
        return None
    w, s = weight.detach().contiguous(), scale.detach().to(torch.float32).contiguous()
    n, k = w.shape
    group = k // s.shape[1]
    if s.shape[0] != n or group * s.shape[1] != k:
        raise ValueError(f"int8 weight {list(w.shape)} and scales {list(s.shape)} do not match")
    fn, which = lib.tprt_gemv_q8, Q8_PATHS[path]

    def run(x: torch.Tensor) -> torch.Tensor:  # the closure keeps the weight and scales alive
        rows = x.numel() // k if x.shape[-1] == k else 0
        if not 1 <= rows <= MAX_Q8_ROWS or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"native int8 product expects 1-{MAX_Q8_ROWS} rows of {k} float32/bf16 values, "
                             f"got {tuple(x.shape)} {x.dtype}")
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        bf16 = int(x.dtype == torch.bfloat16)
        fn(w.data_ptr(), s.data_ptr(), x.data_ptr(), y.data_ptr(), rows, n, k, group, bf16, bf16, which)
        return y

    return run
