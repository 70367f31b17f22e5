"""The speculative-decoding flags of `tprt serve` and `tprt generate` (tprt.engine.speculative),
defined once; light, so that building a parser imports no torch."""

from __future__ import annotations

from typing import Any

from tprt.engine.spec_defaults import DEFAULT_MAX_N, DEFAULT_MIN_N, DEFAULT_NUM_TOKENS, METHODS

# The parsed flags' names, which tprt.engine.speculative.speculative_from_flags reads.
SPECULATIVE_FLAGS = ("speculative", "num_speculative_tokens", "spec_min_n", "spec_max_n", "draft_model")


def add_speculative_flags(parser: Any) -> None:
    g = parser.add_argument_group("speculative decoding (the output is the same, in fewer steps when drafts hit)")
    g.add_argument("--speculative", choices=METHODS, help="draft tokens and verify them in one step: ngram "
                   "(prompt lookup), suffix (and a cache of recent outputs), draft (--draft-model); off by default")
    g.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_NUM_TOKENS, metavar="K",
                   help=f"drafted tokens per step at most ({DEFAULT_NUM_TOKENS}; adapted per request)")
    g.add_argument("--spec-min-n", type=int, default=DEFAULT_MIN_N, metavar="N",
                   help=f"shortest n-gram that prompt lookup matches ({DEFAULT_MIN_N})")
    g.add_argument("--spec-max-n", type=int, default=DEFAULT_MAX_N, metavar="N",
                   help=f"longest n-gram that prompt lookup matches, tried first ({DEFAULT_MAX_N})")
    g.add_argument("--draft-model", metavar="DIR",
                   help="a TP-1 checkpoint with the model's vocabulary (with --speculative draft), run on rank 0")
