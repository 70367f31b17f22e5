"""Output constraints (tprt.engine.constraints, on llguidance) without a model: every schema of
tests/json_schemas.py drives a "model" of random logits (greedy and sampled, two tokenizers: the
tests' byte-level one and SmolLM2's 49k-token BPE), and every output must parse and validate with
`jsonschema`; regexes, choices and Lark grammars likewise; bad specs are refused naming the
field; the cache compiles a schema once; masks cover the model's padded vocabulary; rollback
restores the state; a sentencepiece tokenizer (no tokenizer.json) works too.

The random logits favour a few closing characters (quote, braces, brackets, comma, digits) so
that strings and numbers end within the token cap; that changes what is generated, never what is
allowed, which the mask alone decides.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from helpers import rule_chain
from json_schemas import SCHEMAS, UNSUPPORTED
from tiny_chat import write_byte_tokenizer
from tprt.engine.constraints import MAX_SPEC_BYTES, ConstraintSpec, StructuredOutputs, apply_bitmask, bits_to_bool
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer

CAP = 1500  # tokens per generation: every output of the suite ends well within it
FIELD = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(d)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def smol_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from convert.gguf import GGUFSource
    from convert.gguf_tokenizer import tokenizer_files
    from tprt.cli.demo import smollm2_gguf

    d = tmp_path_factory.mktemp("smoltok")
    with GGUFSource(smollm2_gguf()) as src:
        files = tokenizer_files(src.metadata, 8192, "smollm2")
    for name, data in files.items():
        (d / name).write_bytes(data)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module", params=["bytes", "smollm2"])
def outputs(request: pytest.FixtureRequest, byte_tok: Tokenizer) -> Iterator[tuple[Tokenizer, StructuredOutputs]]:
    tok = byte_tok if request.param == "bytes" else request.getfixturevalue("smol_tok")
    yield tok, StructuredOutputs(tok, tok.vocab_size + 37)  # a padded model vocabulary, as real ones are


def generate(tok: Tokenizer, so: StructuredOutputs, spec: ConstraintSpec, seed: int, sample: bool) -> tuple[str, str]:
    """(text, finish) from random logits under `spec`: "stop" when the grammar ended or EOS came."""
    gen = torch.Generator().manual_seed(seed)
    favoured = [tok.encode(c, add_special_tokens=False)[0] for c in ['"', "}", "]", ",", "0", "1", "@", "."]]
    matcher = so.matcher(so.compile(spec))
    bitmask = so.bitmask(1)
    out: list[int] = []
    for _ in range(CAP):
        logits = torch.randn(1, so.vocab_size, generator=gen) * 2
        logits[0, favoured] += 6
        bitmask.zero_()
        matcher.fill_bitmask(bitmask[0])
        apply_bitmask(logits, bitmask, so.vocab_size)
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen)) if sample \
            else int(logits[0].argmax())
        if token in tok.eos_token_ids:
            assert matcher.accepting, "EOS was allowed before the text matched"
            return tok.decode(out), "stop"
        assert matcher.accept(token), matcher.error
        out.append(token)
        if matcher.finished:
            return tok.decode(out), "stop"
    return tok.decode(out), "length"


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_every_schema_of_the_suite_gives_valid_json(outputs: tuple[Tokenizer, StructuredOutputs], sample: bool) -> None:
    tok, so = outputs
    assert len(SCHEMAS) >= 50
    bad = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        text, finish = generate(tok, so, ConstraintSpec.json_schema(schema, FIELD), seed=i, sample=sample)
        try:
            assert finish == "stop", f"no end within {CAP} tokens"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{name}: {str(e)[:120]}: {text[:120]!r}")
    assert not bad, "\n".join(bad)


def test_json_object_regex_choice_and_grammar(outputs: tuple[Tokenizer, StructuredOutputs]) -> None:
    tok, so = outputs
    for seed in range(4):
        text, _ = generate(tok, so, ConstraintSpec.json_object("response_format"), seed, sample=True)
        assert isinstance(json.loads(text), dict)
        text, finish = generate(tok, so, ConstraintSpec.regex(r"[A-Z][a-z]{2,6} [0-9]{1,3}", "regex"), seed, True)
        assert finish == "stop" and re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,3}", text), text
        options = ['say "yes"', "no\nway", "ünï", "{x}", "maybe later"]
        text, finish = generate(tok, so, ConstraintSpec.choice(options, "choice"), seed, sample=True)
        assert finish == "stop" and text in options
        lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]+/'
        text, _ = generate(tok, so, ConstraintSpec.grammar(lark, "grammar"), seed, sample=True)
        assert re.fullmatch(r"The answer is [0-9]+\.", text), text


def test_bad_specs_are_refused_naming_the_field(byte_tok: Tokenizer) -> None:
    so = StructuredOutputs(byte_tok)
    for name, schema in UNSUPPORTED.items():
        with pytest.raises(ValidationError) as info:
            so.compile(ConstraintSpec.json_schema(schema, FIELD))
        assert info.value.field == FIELD and str(info.value).startswith(FIELD + ": "), name
        assert "\n" not in str(info.value)
    refused = [
        lambda: ConstraintSpec.json_schema([1, 2], "s"), lambda: ConstraintSpec.json_schema({"a": float("nan")}, "s"),
        lambda: ConstraintSpec.regex("", "r"), lambda: ConstraintSpec.regex(5, "r"),
        lambda: ConstraintSpec.choice([], "c"), lambda: ConstraintSpec.choice("abc", "c"),
        lambda: ConstraintSpec.choice(["a", ""], "c"), lambda: ConstraintSpec.choice(["a"] * 2000, "c"),
        lambda: ConstraintSpec.grammar(" ", "g"), lambda: ConstraintSpec.regex("a" * (MAX_SPEC_BYTES + 1), "r"),
        lambda: ConstraintSpec.regex("a\x00", "r"),
        lambda: so.compile(ConstraintSpec.regex("(unclosed", "r")),
        lambda: so.compile(ConstraintSpec.grammar("start: undefined_rule", "g")),
        lambda: so.compile(ConstraintSpec.grammar("this is not lark", "g")),
    ]
    for make in refused:
        with pytest.raises(ValidationError) as info:
            make()
        assert str(info.value).split(":")[0] in ("s", "r", "c", "g"), str(info.value)


def test_compiled_once_per_content(byte_tok: Tokenizer) -> None:
    seen: list[float] = []
    so = StructuredOutputs(byte_tok, on_compile=seen.append)
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    so.compile(ConstraintSpec.json_schema(a, "one"))
    g = so.compile(ConstraintSpec.json_schema(dict(a), "two"))
    assert so.compiles == 1 and len(seen) == 1 and g.spec.field == "two"
    so.compile(ConstraintSpec.regex("[ab]+", "three"))
    assert so.compiles == 2
    # Properties in another order are another output (the matcher writes them in the schema's order).
    b = {"type": "object", "properties": {"y": {"type": "string"}, "x": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
    m = so.matcher(so.compile(ConstraintSpec.json_schema(b, "four")))
    ids = byte_tok.encode('{"y":"a","x":1}', add_special_tokens=False)
    assert so.compiles == 3 and m.accept_prefix(ids) == len(ids) and m.accepting


def test_masks_cover_the_padded_vocabulary_and_rollback_restores(byte_tok: Tokenizer) -> None:
    so = StructuredOutputs(byte_tok, byte_tok.vocab_size + 5)
    m = so.matcher(so.compile(ConstraintSpec.choice(["abc", "abd"], "c")))
    a_id = byte_tok.encode("a", add_special_tokens=False)[0]
    allowed = m.allowed()
    assert allowed.shape == (so.vocab_size,) and allowed.nonzero().flatten().tolist() == [a_id]
    logits = torch.zeros(2, so.vocab_size + 11)  # the model's own padding past the vocabulary too
    words = so.bitmask(2)
    m.fill_bitmask(words[0])
    words[1] = -1  # row 2 unconstrained: everything in the vocabulary allowed
    apply_bitmask(logits, words, so.vocab_size)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [a_id]
    assert torch.isfinite(logits[1]).sum() == so.vocab_size
    assert bits_to_bool(words, so.vocab_size)[1].all()
    ids = byte_tok.encode("ab", add_special_tokens=False)
    for t in ids:
        assert m.accept(t)
    after_ab = m.allowed()
    assert m.accept(byte_tok.encode("c", add_special_tokens=False)[0]) and m.finished
    m.rollback(1)
    assert not m.finished and torch.equal(m.allowed(), after_ab)
    m.rollback(2)
    assert torch.equal(m.allowed(), allowed)
    assert m.accept_prefix(byte_tok.encode("abz", add_special_tokens=False)) == 2
    assert not m.accept(byte_tok.encode("z", add_special_tokens=False)[0]) and m.error


def test_sentencepiece_tokenizer(tmp_path: Path) -> None:
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(['{"name": "Ada", "age": 36}', "the quick brown fox", "[1, 2, 3]"] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=320,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.tokenizer_json is None
    so = StructuredOutputs(tok)
    schema = SCHEMAS["object_required"]
    text, finish = generate(tok, so, ConstraintSpec.json_schema(schema, FIELD), seed=0, sample=True)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_a_failing_matcher_ends_its_sequence_instead_of_the_engine(byte_tok: Tokenizer) -> None:
    """A matcher that fails mid-sequence (as over one of llguidance's limits): its row may only
    take EOS, and a token it refuses ends the sequence with stop_reason "constraint_error"."""
    from tprt.engine.sampling import SamplingParams
    from tprt.engine.sequence import Sequence
    from tprt.engine.structured import StructuredOutputManager

    so = StructuredOutputs(byte_tok)
    spec = ConstraintSpec.choice(["ab"], "c")

    def sequence(rid: str) -> Sequence:
        seq = Sequence(rid, [1, 2], SamplingParams(temperature=0, max_new_tokens=8, constraint=spec), None,
                       byte_tok, byte_tok.eos_token_ids, torch.device("cpu"))
        seq.matcher = so.matcher(so.compile(spec))
        return seq

    broken, fine = sequence("broken"), sequence("fine")
    z = byte_tok.encode("z", add_special_tokens=False)[0]
    assert broken.matcher is not None and not broken.matcher.accept(z)  # the matcher is now in error
    after = StructuredOutputManager(byte_tok, so.vocab_size + 3, byte_tok.eos_token_ids, mask_threads=0)
    after.outputs = so
    words = after.start([(broken, []), (fine, [])]).result()  # one position each, computed when asked
    a = byte_tok.encode("a", add_special_tokens=False)[0]
    logits = torch.zeros(2, so.vocab_size + 3)
    logits[:, z] = 1.0  # both rows' most likely token is one their constraints refuse
    best = logits.argmax(-1).tolist()
    mask = after.allowed([(words["broken"], best[:1], True), (words["fine"], best[1:], True)])
    assert mask is not None and mask.shape == (2, so.vocab_size + 3)
    assert mask[0].nonzero().flatten().tolist() == [byte_tok.eos_token_ids[0]]
    assert mask[1].nonzero().flatten().tolist() == [a]
    logits[:, a] = 2.0  # a greedy row whose best token is allowed needs no mask
    assert after.allowed([(words["fine"], logits[1:].argmax(-1).tolist(), True)]) is None
    beside = StructuredOutputManager(byte_tok, so.vocab_size + 3, byte_tok.eos_token_ids, mask_threads=1)
    beside.outputs = so
    ahead = beside.start([(fine, [])]).result()["fine"]  # filled on the mask thread
    (row,) = ahead.needed([z], greedy=False, known=so.vocab_size)
    assert row is not None and bits_to_bool(row[None], so.vocab_size)[0].nonzero().flatten().tolist() == [a]
    assert ahead.needed([a], greedy=True, known=so.vocab_size) == [None]
    out = fine.append(z)  # a token its matcher refuses ends the sequence
    assert out.finish_reason == "stop" and out.stop_reason == "constraint_error"


def test_a_chain_of_rules_as_long_as_the_size_limit_allows_compiles_without_killing_the_process(
        byte_tok: Tokenizer) -> None:
    """The hostile round's R1: 3,000 chained rules overflowed the compiling thread's stack
    (SIGSEGV, the whole server). Compiling runs on deep-stack threads now: the longest chain a
    request may send compiles, on this thread and on a thread with Python's default stack."""
    text, rules = rule_chain(MAX_SPEC_BYTES)
    assert rules > 7000 and len(text.encode()) <= MAX_SPEC_BYTES
    so = StructuredOutputs(byte_tok)
    m = so.matcher(so.compile(ConstraintSpec.grammar(text, "structured_outputs.grammar")))
    x = byte_tok.encode("x", add_special_tokens=False)[0]
    assert m.allowed().nonzero().flatten().tolist() == [x] and m.accept(x) and m.finished
    other = StructuredOutputs(byte_tok)  # not cached: compiled again, asked from another thread
    with ThreadPoolExecutor(1) as pool:
        grammar = pool.submit(other.compile, ConstraintSpec.grammar(text, "g")).result()
    assert grammar.spec.field == "g" and other.compiles == 1


def test_sequences_share_the_compiled_grammar(byte_tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """R3: a grammar is compiled once (one llguidance matcher, with its lexer) and every sequence's
    matcher is a deep copy of it, so a costly lexer is built once, not once per sequence."""
    import llguidance

    built: list[int] = []
    real = llguidance.LLMatcher

    class Counting:  # llguidance.LLMatcher, counting the matchers built
        def __call__(self, *args: Any, **kw: Any) -> Any:
            built.append(1)
            return real(*args, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    so = StructuredOutputs(byte_tok)
    grammar = so.compile(ConstraintSpec.regex("((a{10}){10}){10}", "regex"))
    assert len(built) == 1
    a = byte_tok.encode("a", add_special_tokens=False)[0]
    matchers = [so.matcher(so.compile(ConstraintSpec.regex("((a{10}){10}){10}", "regex"))) for _ in range(16)]
    for i, m in enumerate(matchers):
        for _ in range(i + 1):
            assert m.allowed()[a] and m.accept(a)
    assert len(built) == 1 and so.compiles == 1  # no matcher was built again
    fresh = so.matcher(grammar)  # the prototype itself never advanced
    assert fresh.allowed().nonzero().flatten().tolist() == [a]


def test_a_row_over_its_mask_budget_ends_with_its_constraint_error(byte_tok: Tokenizer) -> None:
    """R2: masks over the time budget on BUDGET_STRIKES steps in a row end the row: no token is
    allowed any more (the mask worker then offers EOS alone), and the sequence finishes with
    stop_reason "constraint_error" whatever it takes next."""
    from tprt.engine.constraints import BUDGET_STRIKES
    from tprt.engine.sampling import SamplingParams
    from tprt.engine.sequence import Sequence

    with pytest.raises(ValueError, match="mask_budget_s"):
        StructuredOutputs(byte_tok, mask_budget_s=0)
    spec = ConstraintSpec.grammar('start: s\ns: s s | s s s | "a" | "b"', "structured_outputs.grammar")
    so = StructuredOutputs(byte_tok, mask_budget_s=1e-12)  # every mask is over it
    seq = Sequence("r", [1, 2], SamplingParams(temperature=0, max_new_tokens=8, constraint=spec), None,
                   byte_tok, byte_tok.eos_token_ids, torch.device("cpu"))
    seq.matcher = m = so.matcher(so.compile(spec))
    a = byte_tok.encode("a", add_special_tokens=False)[0]
    for _ in range(BUDGET_STRIKES - 1):
        assert m.allowed()[a] and not m.error
    assert not m.allowed().any() and "budget" in m.error and "\n" not in m.error
    assert not m.accept(a) and m.validates([a]) == 0 and m.accept_prefix([a]) == 0
    out = seq.append(byte_tok.eos_token_ids[0])
    assert out.finish_reason == "stop" and out.stop_reason == "constraint_error"
    unlimited = StructuredOutputs(byte_tok, mask_budget_s=None).matcher(so.compile(spec))
    for _ in range(4 * BUDGET_STRIKES):
        assert unlimited.allowed()[a] and unlimited.accept(a)
    assert not unlimited.error


def test_errors_are_one_line_without_the_parser_state(byte_tok: Tokenizer) -> None:
    """R11: llguidance's verbose errors (its parser state and grammar) stay inside."""
    so = StructuredOutputs(byte_tok)
    for spec in (ConstraintSpec.grammar("start: a\na: b\nb: a", "g"),
                 ConstraintSpec.grammar('start: "a" /[/', "g"),
                 ConstraintSpec.regex("(unclosed", "r")):
        with pytest.raises(ValidationError) as info:
            so.compile(spec)
        message = str(info.value)
        assert "\n" not in message and len(message) <= 320 and "Earley" not in message, message
    m = so.matcher(so.compile(ConstraintSpec.choice(["ab"], "c")))
    assert not m.accept(byte_tok.encode("z", add_special_tokens=False)[0])
    assert m.error and "\n" not in m.error and len(m.error) <= 300
