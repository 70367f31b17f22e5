"""Speculative decoding's methods and defaults (tprt.engine.speculative), torch-free so that the
command line's flags (tprt.cli.speculative_flags) can name them without loading the engine."""

METHODS = ("ngram", "suffix", "draft")
DEFAULT_NUM_TOKENS = 4
DEFAULT_MIN_N = 2
DEFAULT_MAX_N = 4
