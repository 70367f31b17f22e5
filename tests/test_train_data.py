"""tprt.train.data: record formats and their loss masks (checked against the rendered text),
packing, the batch order and its saved position, and one-line errors for bad input."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer
from tprt.train.data import (
    BatchStream, Document, assistant_spans, chat_document, load_documents, pack, prepare_data,
    rank_share, tokenize_record,
)
from train_fixtures import CHATML, write_tokenizer

LLAMA3_LIKE = (
    "{{ '<|im_start|>' }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'Be brief.' %}{% endif %}"
    "{{ 'system: ' + system | trim + '<|im_end|>' }}{% for m in messages %}"
    "{{ m['role'] + ': ' + m['content'] | trim + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
# Renders the final assistant turn differently from the same turn followed by more messages, so
# prefixes of the conversation are not prefixes of the whole: the content search must take over.
LAST_DIFFERS = (
    "{% for m in messages %}{{ m['role'] + '> ' + m['content'] }}"
    "{% if loop.last %}{{ '<|im_end|>' }}{% else %}{{ '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant> ' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": "Hello world, hello there!  "},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_tokenizer(tmp_path_factory.mktemp("tok")))


def _runs(doc: Document) -> list[list[int]]:
    """Maximal runs of consecutive loss tokens."""
    runs: list[list[int]] = []
    prev = False
    for i, m in zip(doc.ids, doc.mask):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(i)
        prev = m
    return runs


def _write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_text_record_trains_on_every_token_and_eos(tok: Tokenizer) -> None:
    doc = tokenize_record({"text": "Hello world"}, tok, "f:1")
    assert doc.ids == tok.encode("Hello world") + [2]
    assert doc.mask == [False] + [True] * (len(doc.ids) - 1)


def test_prompt_completion_mask_is_the_completion(tok: Tokenizer) -> None:
    doc = tokenize_record({"prompt": "Q: capital of France?\nA:", "completion": " Paris."}, tok, "f:1")
    runs = _runs(doc)
    assert len(runs) == 1 and doc.mask[-1]
    assert tok.decode(runs[0]) == " Paris.<|im_end|>"
    assert tok.decode(doc.ids) == "Q: capital of France?\nA: Paris.<|im_end|>"


@pytest.mark.parametrize("template", [CHATML, LLAMA3_LIKE, LAST_DIFFERS], ids=["chatml", "llama3_like", "last_differs"])
def test_chat_mask_is_the_assistant_turns_of_the_rendered_text(template: str, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path / "tok", template))
    doc = chat_document(CONVERSATION, tok, "f:1")
    rendered, spans = assistant_spans(CONVERSATION, tok, "f:1")
    assert tok.decode(doc.ids).startswith(rendered)
    # Each run of loss tokens decodes to exactly one assistant span of the rendered text ...
    assert [tok.decode(r) for r in _runs(doc)] == [rendered[a:b] for a, b in spans]
    # ... which holds the assistant's content, and nothing of the user's turns.
    for (a, b), m in zip(spans, [m for m in CONVERSATION if m["role"] == "assistant"]):
        assert m["content"].strip() in rendered[a:b]
        assert "capital of France?" not in rendered[a:b] and "Hello there!" not in rendered[a:b]
    assert len(spans) == 2


def test_chat_without_assistant_or_template_is_refused(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"f:3: 'messages' has no assistant turn"):
        chat_document([{"role": "user", "content": "hi"}], tok, "f:3")
    with pytest.raises(ValidationError, match=r"f:4: messages\[0\] must be an object"):
        chat_document([{"role": "user"}], tok, "f:4")
    # a role generation refuses is not trained on either
    with pytest.raises(ValidationError, match=r"f:5: messages\[1\] has role 'narrator'; expected one of system, "
                                              r"user, assistant, tool"):
        chat_document([{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"},
                       {"role": "assistant", "content": "ok"}], tok, "f:5")


def test_pack_keeps_documents_whole_and_masks_padding() -> None:
    docs = [Document([5, 6, 7, 2], [False, True, True, True]), Document([8, 9, 2], [False, True, True]),
            Document([10, 11, 12, 13, 2], [False, False, True, True, True])]
    rows = pack(docs, seq_len=8, pad_id=0)
    assert rows.input_ids.tolist() == [[5, 6, 7, 2, 8, 9, 2, 0], [10, 11, 12, 13, 2, 0, 0, 0]]
    assert rows.labels.tolist() == [[-100, 6, 7, 2, -100, 9, 2, -100], [-100, -100, 12, 13, 2, -100, -100, -100]]
    assert rows.doc_positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert rows.n_targets() == 8 and rows.n_targets([1]) == 3


def test_pack_per_example_gives_each_document_a_row_as_long_as_the_longest() -> None:
    """The server's jobs: batch_size counts examples, so each is a row of its own; the tokens of a
    step are counted without the padding."""
    docs = [Document([5, 6, 7, 2], [False, True, True, True]), Document([8, 9, 2], [False, True, True]),
            Document([10, 11, 12, 13, 2], [False, False, True, True, True])]
    rows = pack(docs, seq_len=8, pad_id=0, per_example=True)
    assert rows.input_ids.tolist() == [[5, 6, 7, 2, 0], [8, 9, 2, 0, 0], [10, 11, 12, 13, 2]]
    assert rows.labels.tolist() == [[-100, 6, 7, 2, -100], [-100, 9, 2, -100, -100], [-100, -100, 12, 13, 2]]
    assert len(rows) == 3 and rows.n_tokens([0, 2]) == 9 and rows.n_tokens([1]) == 3
    assert pack(docs, seq_len=8, pad_id=0).n_tokens([0, 1]) == 12  # packed: counted without the padding too


def test_a_line_that_is_not_utf8_is_named(tok: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValidationError, match=r"latin1.jsonl:2: not UTF-8 text"):
        load_documents(tmp_path / "latin1.jsonl", tok, 16)
    (tmp_path / "utf16.jsonl").write_text('{"text": "hello"}\n', encoding="utf-16")
    with pytest.raises(ValidationError, match=r"utf16.jsonl:1: not UTF-8 text"):
        load_documents(tmp_path / "utf16.jsonl", tok, 16)


def test_prepare_is_deterministic_and_holds_out_a_split(tok: Tokenizer, tmp_path: Path) -> None:
    recs = [{"text": f"hello world {i}"} for i in range(20)]
    path = _write_jsonl(tmp_path / "d.jsonl", recs)
    a = prepare_data(path, tok, seq_len=16, seed=3, eval_fraction=0.2)
    b = prepare_data(path, tok, seq_len=16, seed=3, eval_fraction=0.2)
    c = prepare_data(path, tok, seq_len=16, seed=4, eval_fraction=0.2)
    assert torch.equal(a.train.input_ids, b.train.input_ids) and a.eval is not None and b.eval is not None
    assert torch.equal(a.eval.input_ids, b.eval.input_ids)
    assert not torch.equal(a.train.input_ids, c.train.input_ids)
    n_docs = int((a.train.input_ids == 2).sum() + (a.eval.input_ids == 2).sum())
    assert n_docs == 20 and int((a.eval.input_ids == 2).sum()) == 4


def test_batch_stream_order_and_resume() -> None:
    s = BatchStream(n_rows=5, seed=1, rows_per_step=3)
    steps = [s.next_step() for _ in range(4)]
    flat = [r for st in steps for r in st]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))
    assert flat[:5] != flat[5:10]  # each epoch is shuffled anew
    s2 = BatchStream(n_rows=5, seed=1, rows_per_step=3)
    s2.next_step()
    state = s2.state_dict()
    s3 = BatchStream(n_rows=5, seed=1, rows_per_step=3)
    s3.load_state_dict(state)
    assert [s3.next_step() for _ in range(3)] == steps[1:]


def test_rank_share_splits_a_step_between_dp_ranks() -> None:
    rows = list(range(8))
    assert rank_share(rows, 0, 2, 2) == [[0, 1], [2, 3]]
    assert rank_share(rows, 1, 2, 2) == [[4, 5], [6, 7]]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("lines, match", [
    (['{"text": "ok"}', '{"text": "broken'], r"d\.jsonl:2: not valid JSON"),
    (['{"text": "ok"}', "", '{"title": "x"}'], r"d\.jsonl:3: expected a 'text', 'prompt' and 'completion', or "
                                                r"'messages' field; found keys 'title'"),
    (['["a list"]'], r"d\.jsonl:1: expected a JSON object"),
    (['{"text": 5}'], r"d\.jsonl:1: field 'text' must be a string"),
    (["", "  "], r"d\.jsonl: no examples"),
    (['{"prompt": "only a prompt"}'], r"d\.jsonl:1: expected a 'text'"),
])
def test_bad_records_are_one_line_errors(tok: Tokenizer, tmp_path: Path, lines: list[str], match: str) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(ValidationError, match=match) as e:
        prepare_data(path, tok, seq_len=32, seed=0)
    assert "\n" not in str(e.value)


def test_too_long_is_truncated_with_a_warning_or_refused(tok: Tokenizer, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "short"}, {"text": "The quick brown fox " * 10}])
    with caplog.at_level(logging.WARNING, logger="tprt"):
        docs, report = load_documents(path, tok, seq_len=16)
    assert report.n_truncated == 1 and len(docs[1].ids) == 16
    assert "d.jsonl:2" in caplog.text and "--no-truncate" in caplog.text
    with pytest.raises(ValidationError, match=r"d\.jsonl:2: example has \d+ tokens, more than --seq-len 16.*--no-truncate"):
        load_documents(path, tok, seq_len=16, truncate=False)


def test_eval_split_must_leave_training_data(tok: Tokenizer, tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(ValidationError, match="--eval-fraction 0.5 leaves no training example"):
        prepare_data(path, tok, seq_len=16, seed=0, eval_fraction=0.5)
    with pytest.raises(ValidationError, match=r"missing\.jsonl: cannot read"):
        prepare_data(tmp_path / "missing.jsonl", tok, seq_len=16, seed=0)


LLAMA2 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("legacy", [True, False])
def test_chat_mask_with_a_sentencepiece_tokenizer(tmp_path: Path, legacy: bool) -> None:
    """Turn boundaries in the middle of text (Llama-2 template) with sentencepiece's dummy prefix."""
    import sentencepiece as spm

    from train_fixtures import CORPUS

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20 + ["[INST] Hello [/INST] world"] * 5), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=450, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, remove_extra_whitespaces=False,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": legacy, "chat_template": LLAMA2}))
    tok = Tokenizer.from_dir(tmp_path)
    conv = [m for m in CONVERSATION if m["role"] != "system"]
    doc = chat_document(conv, tok, "f:1")
    rendered, spans = assistant_spans(conv, tok, "f:1")
    assert [rendered[a:b] for a, b in spans] == [" The capital of France is Paris. </s>", " Hello world, hello there!   </s>"]
    # sentencepiece drops the space a run of pieces starts with when decoding it alone
    assert [tok.decode(r) for r in _runs(doc)] == [rendered[a:b].lstrip() for a, b in spans]
    assert tok.decode(doc.ids) == rendered
