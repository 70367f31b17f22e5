"""Which CUDA graph a step shape maps to (tprt.engine.step_graphs): the buckets of tokens, key
lengths and adapters, torch-free so `tprt plan` counts the same graphs the runner captures."""

from __future__ import annotations

GRAPH_MODES = ("auto", "off", "decode", "all")
MAX_GRAPH_TOKENS = 512  # wider steps run eagerly: launches are a small share of them
MAX_GRAPH_ADAPTERS = 4  # adapters one step may mix and still replay a graph


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 below max_tokens, then max_tokens (included)."""
    out = [b for b in (1, 2, 4, 8) if b < max_tokens] + list(range(16, max_tokens, 16))
    return out + [max_tokens]


def kv_buckets(max_seq_len: int, smallest: int = 256) -> list[int]:
    """smallest, 2 * smallest, ... below max_seq_len, then max_seq_len (included)."""
    out, k = [], smallest
    while k < max_seq_len:
        out.append(k)
        k *= 2
    return out + [max_seq_len]


def adapter_buckets(max_adapters: int) -> list[int]:
    """0 (no adapter), then 1, 2, 4, ... up to max_adapters (included)."""
    out, g = [0], 1
    while g < max_adapters:
        out.append(g)
        g *= 2
    return out + [max_adapters] if max_adapters else out


def graph_widths(mode: str, max_draft: int) -> int:
    """The longest row a graph takes under `--cuda-graphs mode`: 1 for decode, 1 + the drafted
    tokens for all; 0 when off."""
    return {"off": 0, "decode": 1}.get(mode, 1 + max_draft)


def graph_max_tokens(max_batch: int, width: int) -> int:
    """The widest step a graph covers: every running row at its widest, at most MAX_GRAPH_TOKENS."""
    return min(MAX_GRAPH_TOKENS, max_batch * width)
