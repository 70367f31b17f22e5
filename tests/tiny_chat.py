"""A tiny random Llama with a real byte-level tokenizer and chat template, for engine and CLI tests.

Token ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3..258 the 256 byte-level symbols, so every id the
model can produce decodes to text (vocab_size 259, padded by the converter at TP > 1).
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import make_hf_llama

VOCAB = 259
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def write_byte_tokenizer(d: Path) -> None:
    """tokenizer.json (byte-level BPE without merges), tokenizer_config.json with a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(specials + alphabet)}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}))


def make_tiny_chat_model(root: Path, tps: tuple[int, ...], max_positions: int = 96) -> Path:
    """root/hf (transformers' own save) and root/tp{N} for each N; returns root."""
    from convert.api import hf_to_tp

    hf = make_hf_llama(root / "hf", "gqa", vocab_size=VOCAB, max_position_embeddings=max_positions)
    write_byte_tokenizer(hf)
    for tp in tps:
        hf_to_tp(hf, root / f"tp{tp}", tp)
    return root
