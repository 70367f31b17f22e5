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

from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.cross_entropy import vocab_parallel_logprobs

HEAD_CHUNK = 512  # positions per LM-head call: [chunk, local_vocab] float32 at most


@torch.inference_mode()
def token_logprobs(model: TPLlamaForCausalLM, ids: Sequence[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i = 1..len(ids)-1, float32; collective over the TP group.

    `ids` must fit in the model's context (max_position_embeddings)."""
    if len(ids) < 2:
        return []
    x = torch.tensor([list(ids)], dtype=torch.long, device=model.tp.device)  # [1, T]
    hidden = model.forward_hidden(x)[0, :-1]  # [T - 1, hidden]: position i predicts ids[i + 1]
    target = x[0, 1:]  # [T - 1]
    out = []
    for start in range(0, hidden.shape[0], HEAD_CHUNK):
        h = model.norm(hidden[start : start + HEAD_CHUNK])  # [chunk, hidden]
        local = model.lm_head(h)  # [chunk, local_vocab]
        out.append(vocab_parallel_logprobs(local, target[start : start + HEAD_CHUNK], model.tp,
                                           model.config.vocab_size))
    return torch.cat(out).tolist()


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
