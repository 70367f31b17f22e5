"""Hugging Face tokenizer files rebuilt from a GGUF file's `tokenizer.*` metadata.

Two GGUF vocabulary kinds are handled (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE. tokens + merges ("left right") go into a `tokenizers` BPE model; the
  pre-tokenizer follows `tokenizer.ggml.pre` (llama.cpp's name for the split regex).
- "llama": SentencePiece BPE. Pieces are scored instead of merged; the merge of two pieces ranks
  by the score of the piece it makes (higher first), which reproduces SentencePiece's greedy
  highest-score-pair merging. Spaces become "▁", a "▁" is prepended to each text segment when
  `tokenizer.ggml.add_space_prefix`, and characters outside the vocabulary fall back to the
  <0xXX> byte pieces.

Token types (`tokenizer.ggml.token_type`) CONTROL and UNKNOWN become special added tokens,
USER_DEFINED plain added tokens; both match the raw text before any normalisation.
"""

from __future__ import annotations

import json
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tprt.errors import CheckpointError

SPACE = "\u2581"  # SentencePiece's visible space "▁"
# llama.cpp `tokenizer.ggml.pre` values whose split is GPT-2's byte-level regex.
GPT2_PRE = ("default", "gpt-2", "gpt2", "phi-2", "olmo", "roberta-bpe", "jina-es", "jina-de")
# ... and those that isolate every digit first, then split like GPT-2 (SmolLM's tokenizer).
DIGITS_PRE = ("smollm",)
# ... and the Llama 3 regex (numbers in groups of up to three, case-insensitive contractions).
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (and Qwen2.5's, Qwen3's): Llama 3's split with every digit on its own.
QWEN2_PRE = ("qwen2",)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _key(meta: dict[str, Any], key: str, source: str) -> Any:
    if key not in meta:
        raise CheckpointError(f"{source}: GGUF key {key!r} missing; cannot build the tokenizer")
    return meta[key]


def _vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id; a token listed twice keeps its first id (the later one is unreachable)."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def _split_merge(merge: str, vocab: dict[str, int], source: str) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) == 2:
        return parts[0], parts[1]
    for i, ch in enumerate(merge):  # a token holding a space: take the split whose halves exist
        if ch == " " and merge[:i] in vocab and merge[i + 1 :] in vocab:
            return merge[:i], merge[i + 1 :]
    raise CheckpointError(f"{source}: GGUF merge {merge!r} is not two vocabulary tokens separated by a space")


def _byte_level_pre(pre: str, add_prefix_space: bool, source: str) -> pre_tokenizers.PreTokenizer:
    if pre in GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in DIGITS_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
            ]
        )
    if pre in LLAMA3_PRE or pre in QWEN2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_REGEX if pre in LLAMA3_PRE else QWEN2_REGEX), behavior="isolated",
                                     invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    known = ", ".join(GPT2_PRE + DIGITS_PRE + LLAMA3_PRE + QWEN2_PRE)
    raise CheckpointError(f"{source}: GGUF key tokenizer.ggml.pre={pre!r} is not supported (known: {known})")


def gpt2_tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    """Byte-level BPE from tokens + merges."""
    tokens: list[str] = _key(meta, "tokenizer.ggml.tokens", source)
    vocab = _vocab(tokens)
    merges = [_split_merge(m, vocab, source) for m in _key(meta, "tokenizer.ggml.merges", source)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tok.pre_tokenizer = _byte_level_pre(str(meta.get("tokenizer.ggml.pre", "default")), add_prefix_space, source)
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scores: every split of a NORMAL piece into two
    vocabulary pieces, ranked by the piece's score (higher first), then by the piece's id."""
    vocab = _vocab(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] != TokenType.NORMAL or vocab[piece] != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    """SentencePiece-style BPE with byte fallback, from pieces + scores."""
    tokens: list[str] = _key(meta, "tokenizer.ggml.tokens", source)
    scores: list[float] = _key(meta, "tokenizer.ggml.scores", source)
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [int(TokenType.NORMAL)] * len(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    bpe = models.BPE(
        vocab=_vocab(tokens), merges=spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(bpe)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(SPACE)] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    dec: list[decoders.Decoder] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*dec, decoders.Strip(" ", 1, 0)] if add_prefix else dec)
    return tok


def _add_vocab_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    special = [t for t, ty in zip(tokens, types) if ty in (TokenType.CONTROL, TokenType.UNKNOWN)]
    user = [t for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _post_processor(tok: Tokenizer, bos: str | None, eos: str | None, byte_level: bool) -> None:
    """BOS/EOS around every sequence as the GGUF's add_bos/add_eos flags ask (None: not added)."""
    parts: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if bos is not None or eos is not None:
        pre = [f"{bos}:0"] if bos is not None else []
        post = [f"{eos}:0"] if eos is not None else []
        pair_pre = [f"{bos}:1"] if bos is not None else []
        pair_post = [f"{eos}:1"] if eos is not None else []
        specials = [(t, tok.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x is not None)]
        parts.append(
            processors.TemplateProcessing(
                single=[*pre, "$A:0", *post],
                pair=[*pre, "$A:0", *post, *pair_pre, "$B:1", *pair_post],
                special_tokens=specials,
            )
        )
    if parts:
        tok.post_processor = parts[0] if len(parts) == 1 else processors.Sequence(parts)


def _token(meta: dict[str, Any], tokens: list[str], kind: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{kind}_token_id")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def tokenizer_files(meta: dict[str, Any], model_max_length: int, source: str) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json; {} if the GGUF has no vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return {}
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{source}: GGUF key tokenizer.ggml.model={kind!r} is not supported (expected gpt2 or llama)")
    tok = gpt2_tokenizer(meta, source) if kind == "gpt2" else spm_tokenizer(meta, source)
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [int(TokenType.NORMAL)] * len(tokens)
    _add_vocab_tokens(tok, tokens, types)
    named = {k: _token(meta, tokens, k) for k in ("bos", "eos", "unknown", "padding")}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    _post_processor(tok, named["bos"] if add_bos else None, named["eos"] if add_eos else None, kind == "gpt2")
    hf_keys = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    special_map = {hf_keys[k]: v for k, v in named.items() if v is not None}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        **special_map,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {
        "tokenizer.json": tok.to_str(pretty=False).encode(),
        "tokenizer_config.json": (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode(),
        "special_tokens_map.json": (json.dumps(special_map, indent=2, ensure_ascii=False) + "\n").encode(),
    }
