"""Per-token log-probabilities of given text under the model, and perplexity.

The logits stay split over the TP group: each rank computes its vocabulary block and the
vocab-parallel cross-entropy (`tprt.parallel.cross_entropy`) reduces three numbers per token, so
no rank ever holds [tokens, vocab]. The LM head runs over chunks of positions to bound memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tprt.model.attention import backend
from tprt.model.batch import BatchRow, TokenBatch
from tprt.model.kv_cache import blocks_for
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.cross_entropy import vocab_parallel_logprobs

HEAD_CHUNK = 512  # positions per LM-head call: [chunk, local_vocab] float32 at most
CACHE_CHUNK = 512  # positions per forward when scoring through a KV cache
CACHE_BLOCK = 16


@torch.inference_mode()
def token_logprobs(model: TPLlamaForCausalLM, ids: Sequence[int], cache_dtype: torch.dtype | None = None,
                   kv_scales: torch.Tensor | None = None, through_cache: bool = False,
                   attention: str = "auto") -> list[float]:
    """log p(ids[i] | ids[:i]) for i = 1..len(ids)-1, float32; collective over the TP group.

    `ids` must fit in the model's context (max_position_embeddings). One causal pass without a
    KV cache, unless `through_cache` (or a `cache_dtype` or `kv_scales` is given): then the text
    is prefilled CACHE_CHUNK positions at a time through a paged cache of `cache_dtype` (the
    model's default when None; `kv_scales`: static int8 scales, tprt.model.kv_scales), each part
    attending to the earlier ones as the cache stores them, as served prompts do, read by the
    attention backend `attention` names (tprt.model.attention.backend)."""
    if len(ids) < 2:
        return []
    x = torch.tensor([list(ids)], dtype=torch.long, device=model.tp.device)  # [1, T]
    if through_cache or cache_dtype is not None or kv_scales is not None:
        hidden = _prefill_through_cache(model, x, cache_dtype, kv_scales, attention)[0, :-1]
    else:
        hidden = model.forward_hidden(x)[0, :-1]  # [T - 1, hidden]: position i predicts ids[i + 1]
    target = x[0, 1:]  # [T - 1]
    out = []
    for start in range(0, hidden.shape[0], HEAD_CHUNK):
        h = model.norm(hidden[start : start + HEAD_CHUNK])  # [chunk, hidden]
        local = model.lm_head(h)  # [chunk, local_vocab]
        out.append(vocab_parallel_logprobs(local, target[start : start + HEAD_CHUNK], model.tp,
                                           model.config.vocab_size))
    return torch.cat(out).tolist()


def _prefill_through_cache(model: TPLlamaForCausalLM, x: torch.Tensor, cache_dtype: torch.dtype | None,
                           kv_scales: torch.Tensor | None, attention: str) -> torch.Tensor:
    """x [1, T] -> hidden states [1, T, hidden], CACHE_CHUNK positions per forward through a fresh cache."""
    n_blocks = blocks_for(x.shape[1], CACHE_BLOCK) + 1  # block 0 is scratch
    cache = model.new_cache(n_blocks, CACHE_BLOCK, cache_dtype, kv_scales)
    table = tuple(range(1, n_blocks))
    reader = backend(attention, model.tp.device, cache)
    ids = x[0].tolist()
    parts = []
    for a in range(0, len(ids), CACHE_CHUNK):
        chunk = tuple(ids[a : a + CACHE_CHUNK])
        step = reader.prepare(TokenBatch.of([BatchRow(table, a, chunk, 0)]), cache)
        parts.append(model.forward_hidden(x[0, a : a + len(chunk)], attention=step))  # [chunk, hidden]
    return torch.cat(parts)[None]


@dataclass(frozen=True)
class Perplexity:
    """Totals over scored tokens: perplexity = exp(-logprob / tokens)."""

    tokens: int
    logprob: float

    @property
    def perplexity(self) -> float:
        return math.exp(-self.logprob / self.tokens) if self.tokens else math.nan

    @classmethod
    def of(cls, logprobs: Sequence[float]) -> Perplexity:
        return cls(len(logprobs), math.fsum(logprobs))

    def __add__(self, other: Perplexity) -> Perplexity:
        return Perplexity(self.tokens + other.tokens, self.logprob + other.logprob)
