"""Static int8 KV cache scales: calibrating them on text, and the file that holds them.

`tprt calibrate-kv` runs text through the model and records, per layer, k/v and kv head, the
largest magnitude the model writes to its KV cache (keys after RoPE, as they are stored). A head's
scale is `margin` times that over 127. Serving with `--kv-cache-dtype int8 --kv-scales FILE`
then stores every key and value as int8 under its head's fixed scale, with nothing per position
(tprt.model.kv_cache: exactly 2x bf16's positions, where a scale per vector gives 1.94x at
head_dim 64). Values beyond margin x the calibrated range are clipped, so the text should be like
what will be served; the margin leaves room (1.25 measured best on SmolLM2: docs/PERF.md).

The file: safetensors, one float32 tensor "kv_scales" [num_hidden_layers, 2 (k, v),
num_key_value_heads] over every kv head of the model, whatever the TP degree (each rank takes its
heads, `TPLayout.kv_heads_of`, in `TPLlamaForCausalLM.new_cache`), with metadata {"format":
"tprt-kv-scales", "margin", "tokens"}.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from tprt.checkpoint.fsutil import write_bytes_atomic
from tprt.errors import ConfigError
from tprt.model.config import ModelConfig
from tprt.model.attention import TorchAttention, backend
from tprt.model.batch import BatchRow, TokenBatch
from tprt.model.kv_cache import KVCache, WriteSlots, blocks_for, kv_cache_dtype

FORMAT = "tprt-kv-scales"
TENSOR = "kv_scales"
DEFAULT_MARGIN = 1.25
CHUNK = 512  # calibration prefill chunk (positions per forward)
# A scale is the largest |k| or |v| of a head over 127 (times the margin): outside this range the
# file was not calibrated on a model (1e-40 clips every value to nothing, 3e38 rounds all to zero).
MIN_SCALE, MAX_SCALE = 1e-6, 1e3
BLOCK = 16


class _AmaxCache(KVCache):
    """A float cache recording, per layer, the largest |value| written per k/v and kv head."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.amax = torch.zeros(self.kv.shape[0], 2, self.kv.shape[3], dtype=torch.float32, device=self.kv.device)

    def write(self, layer: int, kv: torch.Tensor, step: WriteSlots) -> None:
        # kv [rows, width, 2, n_kv_heads, head_dim]: one row, no padding (`calibrate`)
        torch.maximum(self.amax[layer], kv.detach().abs().amax(dim=(0, 1, 4)).float(), out=self.amax[layer])
        super().write(layer, kv, step)


@torch.inference_mode()
def calibrate(model: Any, documents: Sequence[Sequence[int]], chunk: int = CHUNK,
              progress: Callable[[int], object] | None = None) -> torch.Tensor:
    """The largest |key| and |value| the model writes per layer, k/v and kv head over `documents`
    (token ids, each within the model's context), model-wide [layers, 2, num_key_value_heads]
    float32 on every rank; collective over the TP group. Each document is one sequence, prefilled
    `chunk` positions at a time through a float cache, as the engine runs a prompt. `progress`
    is called with the positions of each chunk done."""
    cfg, layout, tp = model.config, model.layout, model.tp
    longest = max(len(d) for d in documents)
    n_blocks = blocks_for(longest, BLOCK) + 1
    dtype = model.default_cache_dtype()
    cache = _AmaxCache(cfg.num_hidden_layers, n_blocks, layout.local_kv_heads, BLOCK, cfg.head_dim, dtype,
                       tp.device, dtype)
    blocks = tuple(range(1, n_blocks))
    # Both backends write through the cache's `write`, where the maxima are taken; on CUDA the
    # paged kernel reads in place (the reference would gather every chunk's context).
    attention = backend("auto", tp.device, cache) if tp.device.type == "cuda" else TorchAttention()
    for document in documents:
        for a in range(0, len(document), chunk):
            tokens = tuple(document[a : a + chunk])
            step = attention.prepare(TokenBatch.of([BatchRow(blocks, a, tokens, 0)]), cache)
            model.forward_hidden(torch.tensor(tokens), attention=step)
            if progress is not None:
                progress(len(tokens))
    local = cache.amax
    if tp.world_size == 1:
        return local.cpu()
    parts = [torch.empty_like(local) for _ in range(tp.world_size)]
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    amax = torch.zeros(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, dtype=torch.float32)
    for rank, part in enumerate(parts):  # replicas of a head hold the same values
        heads = layout.kv_heads_of(rank)
        amax[:, :, heads.start : heads.stop] = part.cpu()
    return amax


def check_margin(margin: float) -> None:
    if not 1 <= margin < float("inf"):
        raise ConfigError(f"--margin must be a number of at least 1 (values beyond margin x the calibrated range "
                          f"are clipped), got {margin}")


def scales_from_amax(amax: torch.Tensor, margin: float = DEFAULT_MARGIN) -> torch.Tensor:
    """margin x amax / 127 per head (1 for a head that never held a non-zero value)."""
    check_margin(margin)
    return torch.where(amax > 0, amax * (margin / 127.0), torch.ones_like(amax))


def save_kv_scales(path: Path, scales: torch.Tensor, margin: float, tokens: int) -> None:
    """Writes the file atomically (a temporary name, fsync, rename)."""
    meta = {"format": FORMAT, "margin": repr(margin), "tokens": str(tokens)}
    write_bytes_atomic(Path(path), save({TENSOR: scales.float().contiguous()}, metadata=meta))


def load_kv_scales(path: Path | str, cfg: ModelConfig) -> torch.Tensor:
    """The model-wide scales [layers, 2, num_key_value_heads] float32 from a `tprt calibrate-kv`
    file, checked against the model; a ConfigError naming the file and what was expected."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise ConfigError(f"--kv-scales {path}: no such file (make one with `tprt calibrate-kv`)") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"--kv-scales {path}: not a safetensors file of KV scales ({e})") from None
    scales = tensors.get(TENSOR)
    want = [cfg.num_hidden_layers, 2, cfg.num_key_value_heads]
    if scales is None:
        raise ConfigError(f"--kv-scales {path}: no tensor {TENSOR!r} (found {sorted(tensors)}); "
                          f"make the file with `tprt calibrate-kv`")
    if list(scales.shape) != want:
        raise ConfigError(f"--kv-scales {path}: tensor {TENSOR!r} is {list(scales.shape)}, this model needs {want} "
                          f"(layers, k/v, kv heads): calibrated for another model?")
    scales = scales.float()
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise ConfigError(f"--kv-scales {path}: tensor {TENSOR!r} must hold finite positive scales")
    low, high = float(scales.min()), float(scales.max())
    if low < MIN_SCALE or high > MAX_SCALE:
        bad = low if low < MIN_SCALE else high
        raise ConfigError(f"--kv-scales {path}: tensor {TENSOR!r} holds a scale of {bad:.3g}, outside "
                          f"[{MIN_SCALE:g}, {MAX_SCALE:g}] (a key or value range of 127 x scale that no model "
                          f"writes: every value would be clipped or rounded to zero); calibrate again with "
                          f"`tprt calibrate-kv`")
    return scales


def kv_cache_flags(name: str | None, kv_scales: Path | None, cfg: ModelConfig) -> str | None:
    """Checks --kv-cache-dtype and --kv-scales together, before any rank starts: the cache dtype
    name to use (--kv-scales makes auto, or no name, int8); a ConfigError naming the flag when
    another dtype is named or the file does not fit the model."""
    if kv_scales is None:
        if name is not None:
            kv_cache_dtype(name)
        return name
    if name not in (None, "auto", "int8"):
        raise ConfigError(f"--kv-scales holds static int8 scales: use it with --kv-cache-dtype int8, not {name}")
    load_kv_scales(kv_scales, cfg)
    return "int8"
