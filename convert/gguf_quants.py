"""Dequantisation of GGUF (ggml) tensor data, row block by row block.

ggml quantises along the innermost dimension (HF dim 1) in fixed-size blocks, so every row of an
HF-layout tensor is a whole number of blocks and a range of rows is one contiguous byte range.
Each function below turns `[n_blocks, block_bytes]` raw bytes into `[n_blocks, block_size]`
float32 values. Layouts (little-endian; "f16" is an IEEE half scale):

    Q8_0  32 values, 34 bytes:  f16 d | int8 q[32]                     x = d * q
    Q4_0  32 values, 18 bytes:  f16 d | u8 qs[16]                      x = d * (nibble - 8)
    Q4_1  32 values, 20 bytes:  f16 d | f16 m | u8 qs[16]              x = d * nibble + m
          (low nibbles of qs are values 0..15, high nibbles values 16..31)
    Q4_K 256 values, 144 bytes: f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
          eight sub-blocks of 32, each with a 6-bit scale and a 6-bit min packed in `scales`;
          qs holds four 32-byte chunks, chunk c's low nibbles are sub-block 2c, high nibbles 2c+1;
          x = (d * scale) * q - (dmin * min)
    Q6_K 256 values, 210 bytes: u8 ql[128] | u8 qh[64] | int8 scales[16] | f16 d
          two halves of 128; each value is 4 low bits (ql) + 2 high bits (qh) - 32, and every
          16 values share an int8 scale; x = (d * scale) * q
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tprt.errors import CheckpointError

Q = GGMLQuantizationType

# ggml types whose data is stored as plain floats: returned in their own dtype.
FLOAT_TYPES: dict[Q, str] = {Q.F32: "F32", Q.F16: "F16", Q.BF16: "BF16"}
QUANT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANT_TYPES)


def _where(source: str, tensor: str) -> str:
    return f"{source}: GGUF tensor {tensor!r}" if source else f"GGUF tensor {tensor!r}"


def check_supported(qtype: Q, tensor: str, source: str = "") -> None:
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise CheckpointError(f"{_where(source, tensor)} has type {qtype.name}, not supported (supported: {names})")


def output_dtype(qtype: Q) -> str:
    """safetensors dtype of what `dequantize_rows` returns for this ggml type."""
    return FLOAT_TYPES.get(qtype, "F32")


def row_nbytes(qtype: Q, n_cols: int, tensor: str, source: str = "") -> int:
    """Bytes of one row of `n_cols` values; the row must be a whole number of blocks."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise CheckpointError(
            f"{_where(source, tensor)}: innermost dimension {n_cols} is not a multiple of the {qtype.name} block {block}"
        )
    return n_cols // block * nbytes


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n, 1] float32 from little-endian IEEE half."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])  # [n, 1]
    q = np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32)  # [n, 32]
    return d * q


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] values 0..15: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])  # [n, 1]
    q = _nibbles32(b[:, 2:18]).astype(np.int8) - np.int8(8)  # [n, 32]
    return d * q.astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # [n, 1] each
    q = _nibbles32(b[:, 4:20]).astype(np.float32)  # [n, 32]
    return d * q + m


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 12] packed bytes -> (scales [n, 8], mins [n, 8]) as float32, 6 bits each.
    Sub-blocks 0..3 keep theirs in the low 6 bits of bytes 0..3 (scale) and 4..7 (min);
    sub-blocks 4..7 take 4 low bits from bytes 8..11 and their top 2 bits from the spare
    high bits of bytes 0..3 (scale) and 4..7 (min)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]  # [n, 4] each
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # [n, 1] each
    sc, mn = _k4_scales(b[:, 4:16])  # [n, 8] each
    qs = b[:, 16:144].reshape(n, 4, 1, 32)  # [n, chunk, 1, 32]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)  # [n, sub, 32]
    scale = (d * sc)[:, :, None]  # [n, 8, 1]
    offset = (dmin * mn)[:, :, None]
    return (scale * q - offset).reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)  # [n, half, 1, chunk, 32]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)  # [n, half, 1, 32]
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(b[:, 208:210])  # [n, 1]
    # quarter k of a half: (low nibbles, chunk 0), (low, chunk 1), (high, chunk 0), (high, chunk 1)
    low4 = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # [n, half, quarter, 32]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high2 = (qh >> shifts) & 0x03  # [n, half, quarter, 32]
    q = ((low4 | (high2 << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    ds = (d * scales).reshape(n, 2, 4, 2, 1)  # [n, half, quarter, 16-group, 1]
    return (ds * q.reshape(n, 2, 4, 2, 16)).reshape(n, 256)


_BLOCK_FNS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}


def dequantize_blocks(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """[n_blocks, block_bytes] uint8 -> [n_blocks, block_size] float32."""
    return _BLOCK_FNS[qtype](blocks)


def dequantize_rows(raw: np.ndarray, qtype: Q, n_cols: int) -> torch.Tensor:
    """`raw`: the bytes of whole rows (any shape, uint8) -> a new contiguous [rows, n_cols] tensor,
    float32 for quantised types and the stored dtype for F32/F16/BF16."""
    flat = np.ascontiguousarray(raw).reshape(-1)
    if qtype in FLOAT_TYPES:
        np_dtype = {Q.F32: "<f4", Q.F16: "<f2", Q.BF16: "<i2"}[qtype]
        t = torch.from_numpy(flat.view(np_dtype).copy()).reshape(-1, n_cols)
        return t.view(torch.bfloat16) if qtype == Q.BF16 else t
    block, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = flat.reshape(-1, nbytes)  # [rows * n_cols / block, block_bytes]
    return torch.from_numpy(dequantize_blocks(blocks, qtype).reshape(-1, n_cols))
