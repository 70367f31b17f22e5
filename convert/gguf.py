"""A GGUF file (llama.cpp) as a converter source: HF names, HF layout, dequantised row blocks.
Architectures: `llama`, `qwen2`, `qwen3`, `gemma2` and `gemma3` (`GGUF_ARCHITECTURES`).

GGUF lists dimensions innermost first, so a GGUF tensor of dims [in, out] is HF's [out, in], and
ggml's quantisation blocks run along HF dim 1: a range of HF rows is one contiguous byte range of
the file, which is all `read_rows` reads and dequantises. llama.cpp's converter reorders the rows
of q_proj/k_proj inside each head from HF's rotate-half RoPE order to the interleaved order
(`w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)`); `read_rows` undoes that per whole
head. Qwen2 and Qwen3 files keep HF's order (llama.cpp rotates them NEOX-style, HF's
rotate-half) and add q/k/v biases (`blk.N.attn_q.bias`) or q/k norms (`blk.N.attn_q_norm`).
Gemma files keep HF's order too, store every norm weight plus 1 (taken back out here) and name
Gemma's extra norms their own way (`GEMMA_LAYER_NAMES`); what their metadata leaves out is
filled in as llama.cpp fills it in (`gemma_fields`).
Metadata is parsed with the `gguf` package's GGUFReader; config.json and the tokenizer files are
rebuilt from it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from convert.gguf_quants import check_supported, dequantize_rows, output_dtype, row_nbytes
from convert.gguf_tokenizer import tokenizer_files
from convert.rules import check_tensor_set
from tprt.model.config import ModelConfig
from tprt.errors import CheckpointError

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# general.architecture -> (HF architecture, model_type, whether q/k rows are in llama.cpp's interleaved order)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama", True), "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
                      "qwen3": ("Qwen3ForCausalLM", "qwen3", False), "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
                      "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False)}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma: ffn_norm is the MLP's input norm, and its post_attention_layernorm the attention output's.
GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Derived tables some exporters store (RoPE frequency factors, old rotary caches): never weights.
_DERIVED = re.compile(r"^(rope_freqs|rope_factors_(long|short))\.weight$|^blk\.\d+\.attn_rot_embd$")


def hf_name(gguf_name: str, source: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of `arch`; None for derived tensors; an error for anything else
    (a name that maps but that the config does not imply is left to `check_tensor_set`)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    names = GEMMA_LAYER_NAMES if arch.startswith("gemma") else _LAYER_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    if _DERIVED.match(gguf_name):
        return None
    raise CheckpointError(f"{source}: GGUF tensor {gguf_name!r} is not part of a Llama model")


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor's data lies in the file, and how to turn it into HF layout."""

    gguf_name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # HF layout: GGUF dims reversed
    offset: int  # absolute byte offset of the data in the file
    row_bytes: int  # bytes of one HF row (1-D tensors: of the whole tensor)
    rope_heads: int = 0  # >0: q/k in llama.cpp's interleaved order, this many heads
    value_offset: float = 0.0  # stored as the HF value plus this (Gemma's norms: 1)


class GGUFSource:
    """A GGUF llama, qwen2, qwen3, gemma2 or gemma3 file presented as an HF checkpoint (`TensorSource`)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
        self._data: np.ndarray | None = reader.data  # [file bytes] uint8 memmap
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise CheckpointError(f"{self.path}: general.architecture is {arch!r}; GGUF files of "
                                  f"{', '.join(map(repr, GGUF_ARCHITECTURES))} can be imported")
        self._permuted = GGUF_ARCHITECTURES[arch][2]
        self._arch = arch
        raw_tensors = {t.name: t for t in reader.tensors}
        self.config_json = config_from_metadata(self.metadata, _hf_shapes(raw_tensors), str(self.path))
        self._add_rope_scaling(raw_tensors)
        self.config = ModelConfig.from_dict(self.config_json, source=str(self.path))
        self.weight_map: dict[str, str] | None = None
        self._tensors = self._index(raw_tensors)
        check_tensor_set(self.shapes(), self.config, str(self.path))

    def _index(self, raw_tensors: dict[str, Any]) -> dict[str, GGUFTensor]:
        cfg, out = self.config_json, {}
        for name, t in raw_tensors.items():
            hf = hf_name(name, str(self.path), self._arch)
            if hf is None:
                continue
            qtype = GGMLQuantizationType(int(t.tensor_type))
            check_supported(qtype, name, str(self.path))
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            heads = 0
            if self._permuted and hf.endswith("self_attn.q_proj.weight"):
                heads = cfg["num_attention_heads"]
            elif self._permuted and hf.endswith("self_attn.k_proj.weight"):
                heads = cfg["num_key_value_heads"]
            n_bytes = row_nbytes(qtype, shape[-1], name, str(self.path))
            row_bytes = n_bytes * (1 if len(shape) == 1 else int(np.prod(shape[1:-1], dtype=np.int64)))
            plus = 1.0 if self._arch.startswith("gemma") and hf.endswith("norm.weight") else 0.0
            out[hf] = GGUFTensor(name, qtype, shape, int(t.data_offset), row_bytes, heads, plus)
        return out

    def _add_rope_scaling(self, raw_tensors: dict[str, Any]) -> None:
        freqs = raw_tensors.get("rope_freqs.weight")
        factors = None if freqs is None else np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        scaling = rope_scaling(self.metadata, factors, self.config_json, str(self.path))
        if scaling is not None:
            self.config_json["rope_scaling"] = scaling

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: t.shape for name, t in self._tensors.items()}

    def dtype(self, name: str) -> str:
        return output_dtype(self._tensor(name).qtype)

    @staticmethod
    def _dtype_of(t: GGUFTensor) -> torch.dtype:
        return {"F16": torch.float16, "BF16": torch.bfloat16}.get(output_dtype(t.qtype), torch.float32)

    def info(self, name: str) -> GGUFTensor:
        """The GGUF-side record of an HF tensor name (type, offset, permutation)."""
        return self._tensor(name)

    def _tensor(self, name: str) -> GGUFTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found in the GGUF file") from None

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the HF-layout tensor (1-D: elements), dequantised, contiguous."""
        t = self._tensor(name)
        if not 0 <= start <= stop <= t.shape[0]:
            raise CheckpointError(f"{self.path}: rows [{start}, {stop}) out of range for {name!r} {list(t.shape)}")
        if start == stop:
            return torch.empty((0, *t.shape[1:]), dtype=self._dtype_of(t))
        if len(t.shape) == 1:  # a whole norm vector is a few KiB; blocks need not align to `start`
            return (self._dequant(t, 0, 1)[0, start:stop] - t.value_offset).contiguous()
        return self._hf_rows(t, start, stop, lambda a, b: self._dequant(t, a, b)).reshape(stop - start, *t.shape[1:])

    def q8_0_rows(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows [start, stop) of a Q8_0 matrix as stored, without a float round trip: (int8
        [rows, in], float32 scales [rows, in / 32], each the block's fp16 scale); None for
        another type."""
        t = self._tensor(name)
        if t.qtype != GGMLQuantizationType.Q8_0 or len(t.shape) != 2:
            return None
        blocks_per_row = t.shape[1] // 32

        def fetch(a: int, b: int) -> torch.Tensor:  # [rows, in + 4 * blocks]: int8 values then scale bytes
            assert self._data is not None, f"{self.path}: read after close()"
            raw = np.asarray(self._data[t.offset + a * t.row_bytes : t.offset + b * t.row_bytes])
            blocks = raw.reshape(-1, 34)  # [rows * blocks, 34]: f16 d | int8 q[32]
            q = np.ascontiguousarray(blocks[:, 2:]).reshape(b - a, t.shape[1])
            d = np.ascontiguousarray(blocks[:, :2]).view("<f2").astype(np.float32).reshape(b - a, blocks_per_row)
            return torch.cat([torch.from_numpy(q.view(np.uint8)), torch.from_numpy(d).view(torch.uint8)], dim=1)

        both = self._hf_rows(t, start, stop, fetch)
        q = both[:, : t.shape[1]].contiguous().view(torch.int8)
        return q, both[:, t.shape[1] :].contiguous().view(torch.float32)

    def _hf_rows(self, t: GGUFTensor, start: int, stop: int,
                 fetch: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """Rows [start, stop) in HF order of a matrix whose stored rows [a, b) `fetch` returns
        (q/k: the whole heads covering the range, un-permuted)."""
        if not t.rope_heads:
            return fetch(start, stop)
        head_dim = t.shape[0] // t.rope_heads
        h0, h1 = start // head_dim, -(-stop // head_dim)  # whole heads covering the range
        rows = fetch(h0 * head_dim, h1 * head_dim)  # [heads * head_dim, in], interleaved
        rows = unpermute_rope_rows(rows, h1 - h0)
        return rows[start - h0 * head_dim : stop - h0 * head_dim].contiguous()

    def _dequant(self, t: GGUFTensor, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as [rows, elements per row], in the stored row order."""
        if self._data is None:
            raise CheckpointError(f"{self.path}: read after close()")
        raw = self._data[t.offset + start * t.row_bytes : t.offset + stop * t.row_bytes]
        per_row = int(np.prod(t.shape[1:], dtype=np.int64)) if len(t.shape) > 1 else t.shape[0]
        return dequantize_rows(raw, t.qtype, t.shape[-1]).reshape(stop - start, per_row)

    def aux_files(self) -> dict[str, bytes]:
        """Tokenizer files rebuilt from the GGUF vocabulary, and generation_config.json."""
        files = tokenizer_files(self.metadata, self.config_json["max_position_embeddings"], str(self.path))
        gen = {k: self.config_json[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in self.config_json}
        files["generation_config.json"] = (json.dumps(gen, indent=2) + "\n").encode()
        return files

    def close(self) -> None:
        self._data = None  # the memmap closes when the last view is gone

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unpermute_rope_rows(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation: interleaved (pairs) -> HF rotate-half row order."""
    n, cols = rows.shape
    head_dim = n // n_heads
    # [heads, head_dim/2, 2, in] -> [heads, 2, head_dim/2, in]
    return rows.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(n, cols)


def _open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    if reader.byte_order != "I":
        raise CheckpointError(f"{path}: byte-swapped (big-endian) GGUF files are not supported")
    return reader


def _hf_shapes(raw_tensors: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape in HF layout, for the tensors that config inference looks at."""
    return {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in raw_tensors.items()}


def _get_int(meta: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if isinstance(value, (list, tuple)):
        raise CheckpointError(f"{source}: GGUF key {key!r} varies per layer ({value[:4]}...); not supported")
    if value is None or isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise CheckpointError(f"{source}: GGUF key {key!r} must be a positive integer, got {value!r}")
    return int(value)


def _f32(value: Any) -> float:
    """A GGUF float32 back to the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def config_from_metadata(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """An HF config.json dict (Llama, Qwen2 or Qwen3: `GGUF_ARCHITECTURES`) from GGUF metadata (and
    the tensors' shapes)."""
    arch = str(meta.get("general.architecture"))
    p = f"{arch}."
    hidden = _get_int(meta, p + "embedding_length", source)
    heads = _get_int(meta, p + "attention.head_count", source)
    kv_heads = _get_int(meta, p + "attention.head_count_kv", source, heads)
    head_dim = meta.get(p + "attention.key_length") or meta.get(p + "rope.dimension_count") or hidden // heads
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{source}: GGUF tensor 'token_embd.weight' missing")
    vocab = shapes["token_embd.weight"][0]
    declared = meta.get(p + "vocab_size")
    if declared is not None and int(declared) != vocab:
        raise CheckpointError(f"{source}: GGUF key {p}vocab_size={declared} but token_embd has {vocab} rows")
    hf_arch, model_type, _ = GGUF_ARCHITECTURES.get(arch, GGUF_ARCHITECTURES["llama"])
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _get_int(meta, p + "feed_forward_length", source),
        "num_hidden_layers": _get_int(meta, p + "block_count", source),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": _f32(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": _get_int(meta, p + "context_length", source, 2048),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in shapes,
        "torch_dtype": "float32",
    }
    if arch == "qwen3":  # Qwen3 carries biases only where attention_bias says
        cfg["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if arch.startswith("gemma"):
        del cfg["hidden_act"]
        cfg.update(gemma_fields(meta, cfg, source))
    if model_type.startswith("qwen"):
        cfg["use_sliding_window"] = False
    cfg.update(_special_ids(meta))
    return cfg


def gemma_fields(meta: dict[str, Any], cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """A Gemma config's own fields from GGUF metadata, and what llama.cpp infers where the file
    says nothing: queries scaled by head_dim's -1/2 power except in the 27B models (46 layers of
    Gemma 2, 62 of Gemma 3: hidden / heads), every 2nd (Gemma 2) or 6th (Gemma 3) layer global
    unless `attention.sliding_window_pattern` lists them, Gemma 3's windowed layers on a rope base
    of 10,000."""
    arch = str(meta.get("general.architecture"))
    p = f"{arch}."
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    big = layers == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg["hidden_size"] // heads if big else cfg["head_dim"],
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if meta.get(p + key) is not None:
            out[key] = _f32(meta[p + key])
    window = meta.get(p + "attention.sliding_window")
    out["sliding_window"] = None if window is None else _get_int(meta, p + "attention.sliding_window", source)
    pattern = meta.get(p + "attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise CheckpointError(f"{source}: GGUF key {p}attention.sliding_window_pattern lists {len(pattern)} "
                                  f"layers, expected {layers}")
        sliding = [bool(x) for x in pattern]
    else:
        every = int(pattern) if pattern else 2 if arch == "gemma2" else 6
        sliding = [(i + 1) % every != 0 for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in sliding]
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
    return out


def _special_ids(meta: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids; end-of-turn ids (eot, eom) join eos so generation stops on them too."""
    out: dict[str, Any] = {}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        out["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
    if eos_ids:
        out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        out["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return out


def rope_scaling(meta: dict[str, Any], rope_freqs: np.ndarray | None, cfg: dict[str, Any], source: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from the GGUF rope keys, or inferred from a llama3 `rope_freqs` table."""
    p = f"{meta.get('general.architecture')}.rope.scaling."
    kind = meta.get(p + "type")
    factor = meta.get(p + "factor") or meta.get(f"{meta.get('general.architecture')}.rope.scale_linear")
    if kind in (None, "none") and factor and rope_freqs is None:
        kind = "linear"
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor or 1.0)}
    if kind == "llama3":
        return {
            "rope_type": "llama3",
            "factor": _f32(factor or 1.0),
            "low_freq_factor": _f32(meta.get(p + "low_freq_factor", 1.0)),
            "high_freq_factor": _f32(meta.get(p + "high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(meta.get(p + "original_context_length", 8192)),
        }
    if kind not in (None, "none"):
        raise CheckpointError(f"{source}: GGUF key {p}type={kind!r} is not supported (expected linear or none)")
    if rope_freqs is not None:
        return llama3_from_rope_freqs(rope_freqs, cfg["rope_theta"], cfg["head_dim"], source)
    return None


def llama3_factors(params: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of llama3 RoPE scaling (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old, lo, hi = params["original_max_position_embeddings"], params["low_freq_factor"], params["high_freq_factor"]
    smooth = np.clip((old / wavelen - lo) / (hi - lo), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / params["factor"] + smooth)


def llama3_from_rope_freqs(factors: np.ndarray, theta: float, head_dim: int, source: str) -> dict[str, Any] | None:
    """Recovers llama3 rope_scaling from llama.cpp's rope_freqs table. Only the ratios of
    (original context, low, high freq factor) shape the table, so low_freq_factor is taken as 1
    (every Meta release); the result is checked by recomputing the table."""
    factors = factors.astype(np.float64)
    if factors.shape != (head_dim // 2,):
        raise CheckpointError(f"{source}: GGUF tensor 'rope_freqs.weight' has {factors.size} entries, expected {head_dim // 2}")
    factor = _f32(factors.max())
    if abs(factor - 1.0) < 1e-6 and float(factors.min()) > 1 - 1e-6:
        return None
    medium = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    bad = f"{source}: GGUF tensor 'rope_freqs.weight' does not match llama3 RoPE scaling; cannot import it"
    if medium.sum() < 2:
        raise CheckpointError(bad + " (too few smoothed frequencies to infer the parameters)")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)  # linear in 1 / wavelength
    slope, intercept = np.polyfit(inv_freq[medium] / (2 * math.pi), smooth, 1)
    high = 1 - 1 / intercept
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(round(high, 4)),
        "original_max_position_embeddings": int(round(slope * (high - 1))),
    }
    if not np.allclose(llama3_factors(params, theta, head_dim), factors, rtol=1e-3, atol=0):
        raise CheckpointError(bad)
    return params
