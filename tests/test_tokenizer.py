"""tprt.text.tokenizer, tprt.text.chat and tprt.engine.stopping against transformers, on tokenizers trained in the test."""

from __future__ import annotations

import json
import random
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tprt.text.chat import NoChatTemplateError, render_chat
from tprt.errors import ConfigError, ValidationError
from tprt.engine.sampling import SamplingParams
from tprt.engine.stopping import StopChecker, StopStringMatcher
from tprt.text.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "日本語のテキストです。中文文本也在这里。한국어 텍스트도 있습니다.",
    "Emoji: 😀🎉👍🏽 🦙 café naïve résumé Ünïcödé ñ ß ø",
    "Numbers 12345 and symbols #$%^&*() <b>tags</b> tabs\tand  double  spaces\nnew lines\n\n",
    "def f(x):\n    return x * 2  # code\n",
]
TEXTS = [
    "Hello world",
    "hello there, the lazy dog!",
    "日本語 and 中文 mixed with English.",
    "Emoji 😀🎉👍🏽🦙 and café",
    "line one\nline two\n\n  indented\ttab",
    "unseen: Ωμέγα ЖЖЖ 🧪",
    "<|eot_id|>special<|begin_of_text|> inside",
    "a",
]
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = 'You are a helpful assistant.' %}
{% endif %}
{{ '<|start_header_id|>system<|end_header_id|>\n\n' + system | trim + '<|eot_id|>' }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% endif %}"""
TOOLS = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}Date: {{ strftime_now("%d %b %Y") }}
{% if tools %}
Tools:
{% for t in tools %}
{{ t | tojson(indent=2) }}
{% endfor %}
{% endif %}
{% for m in messages %}
{% if m.role == 'skip' %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}
{{ ns.n }}. {{ m.role }}: {{ m.content | tojson }}{% if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}

{% endfor %}
{% if add_generation_prompt %}assistant:{% endif %}"""
CONVERSATION = [
    {"role": "system", "content": "  Be brief. <b>html</b> & café 😀  "},
    {"role": "user", "content": "What's 2+2? 日本語"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": 'Quote "this"\nand a newline'},
]


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def bytelevel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-style byte-level BPE tokenizer.json with a BOS-adding post-processor."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    d = tmp_path_factory.mktemp("bytelevel")
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    tok.save(str(d / "tokenizer.json"))
    _write_json(d / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False, "chat_template": LLAMA3})
    _write_json(d / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [1, 2]})
    return d


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-2-style sentencepiece BPE model with byte fallback, trained here."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "tokenizer"), vocab_size=450, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    corpus.unlink()
    (d / "tokenizer.vocab").unlink()
    _write_json(d / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": CHATML,
        "clean_up_tokenization_spaces": False})
    return d


@pytest.fixture(scope="module")
def converted_dir(sp_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' own tokenizer.json conversion of the sentencepiece model (Metaspace + byte fallback)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("converted")
    AutoTokenizer.from_pretrained(sp_dir).save_pretrained(d)
    assert (d / "tokenizer.json").is_file()
    (d / "tokenizer.model").unlink(missing_ok=True)
    return d


# ---------------------------------------------------------------- tokenizer.json

@pytest.mark.parametrize("fixture", ["bytelevel_dir", "converted_dir"])
def test_tokenizer_json_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d: Path = request.getfixturevalue(fixture)
    ours = Tokenizer.from_dir(d)
    refs = [AutoTokenizer.from_pretrained(d), PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))]
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == refs[0].encode(text, add_special_tokens=add), (text, add)
            assert ids == refs[1].encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == refs[0].decode(ids, skip_special_tokens=skip)
    assert ours.vocab_size == len(refs[0])
    assert ours.bos_token_id == refs[0].bos_token_id
    assert ours.eos_token_ids[0] == refs[0].eos_token_id
    assert frozenset(refs[0].all_special_ids) <= ours.special_ids


def test_special_ids_and_generation_config(bytelevel_dir: Path) -> None:
    tok = Tokenizer.from_dir(bytelevel_dir)
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == (2, 1)  # tokenizer_config's eos first, then generation_config's
    assert tok.encode("hi")[0] == 0 and tok.encode("hi", add_special_tokens=False)[0] != 0
    assert tok.token_to_id("<|eot_id|>") == 2 and tok.id_to_token(2) == "<|eot_id|>"
    assert tok.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def test_no_post_processor_falls_back_to_add_bos_token(bytelevel_dir: Path, tmp_path: Path) -> None:
    spec = json.loads((bytelevel_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["post_processor"] = None
    _write_json(tmp_path / "tokenizer.json", spec)
    cfg = json.loads((bytelevel_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    _write_json(tmp_path / "tokenizer_config.json", {**cfg, "add_bos_token": True})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hi") == [0] + tok.encode("hi", add_special_tokens=False)
    _write_json(tmp_path / "tokenizer_config.json", cfg)
    assert Tokenizer.from_dir(tmp_path).encode("hi")[0] != 0


# ---------------------------------------------------------------- sentencepiece

def test_sentencepiece_matches_sentencepiece(sp_dir: Path) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = Tokenizer.from_dir(sp_dir)
    for text in TEXTS + [" leading space", "  two"]:
        if "<|" in text:
            continue
        assert tok.encode(text) == [1] + sp.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.vocab_size == 450
    assert {0, 1, 2} <= tok.special_ids


def test_sentencepiece_matches_transformers(sp_dir: Path) -> None:
    """transformers 5 converts tokenizer.model to a tokenizers BPE; it agrees with sentencepiece except
    for text starting with whitespace (it skips the dummy prefix there), which is left out here."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(sp_dir)
    tok = Tokenizer.from_dir(sp_dir)
    texts = [t for t in TEXTS if "<|" not in t] + ["<s>hi</s> there", "x<s> y</s>", "</s>"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert tok.decode(tok.encode("<s>hi</s> there", add_special_tokens=False)) == "<s>hi</s> there"


def test_sentencepiece_legacy_encodes_each_piece_with_a_prefix(sp_dir: Path, tmp_path: Path) -> None:
    import sentencepiece as spm

    (tmp_path / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    cfg = json.loads((sp_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    _write_json(tmp_path / "tokenizer_config.json", {**cfg, "legacy": True, "add_eos_token": True,
                                                     "added_tokens_decoder": {
                                                         "450": {"content": "<tool>", "special": True},
                                                         "451": {"content": "[W]", "special": False}}})
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = Tokenizer.from_dir(tmp_path)
    text = "<s>hi</s> there<tool>x[W]y"
    expect = [1, 1] + sp.encode("hi") + [2] + sp.encode(" there") + [450] + sp.encode("x") + [451] \
        + sp.encode("y") + [2]
    assert tok.encode(text) == expect
    assert tok.vocab_size == 452
    assert tok.decode(expect[1:-1]) == text  # the dummy prefix of each piece is dropped again
    assert tok.decode(expect, skip_special_tokens=True) == "hi therex[W]y"


def test_errors_name_the_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tokenizer.json or tokenizer.model") as e:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(e.value)
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")  # a tiktoken file
    with pytest.raises(ConfigError, match="not a sentencepiece model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------- incremental detokenizer

STREAM_TEXTS = ["Emoji 😀🎉👍🏽🦙 and café", "日本語のテキスト 한국어 🧪Ωμέγα", "tabs\tand  double  spaces\n\nend"]


@pytest.mark.parametrize("fixture", ["bytelevel_dir", "sp_dir", "converted_dir"])
def test_incremental_detokenizer(fixture: str, request: pytest.FixtureRequest) -> None:
    tok = Tokenizer.from_dir(request.getfixturevalue(fixture))
    held = 0
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.add(i) for i in ids]
        assert not any("\ufffd" in d for d in deltas), deltas
        assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=True) == text
        held += deltas[1:].count("")
    assert held > 0  # multi-byte characters really were split across tokens


@pytest.mark.parametrize("fixture", ["bytelevel_dir", "sp_dir", "converted_dir"])
def test_incremental_detokenizer_after_prompt(fixture: str, request: pytest.FixtureRequest) -> None:
    tok = Tokenizer.from_dir(request.getfixturevalue(fixture))
    full = tok.encode("The quick brown fox says hello world 😀 日本語!")
    prompt = tok.encode("The quick brown fox says")
    generated = full[len(prompt):]
    assert full[: len(prompt)] == prompt  # ids as a model would generate them after the prompt
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.add(i) for i in generated) + detok.flush()
    whole, before = (tok.decode(prompt + generated, skip_special_tokens=True),
                     tok.decode(prompt, skip_special_tokens=True))
    assert whole.startswith(before) and streamed == whole[len(before):]
    assert streamed == " hello world 😀 日本語!"


def test_detokenizer_flush_releases_incomplete_bytes(bytelevel_dir: Path) -> None:
    tok = Tokenizer.from_dir(bytelevel_dir)
    ids = tok.encode("ok 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add(i) for i in ids[:-1])
    assert "\ufffd" not in text
    assert (text + detok.flush()).endswith("\ufffd")


# ---------------------------------------------------------------- chat templates

def _hf_render(template: str, d: Path, messages: list[dict[str, Any]], **kw: Any) -> str:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(d)
    return str(ref.apply_chat_template(messages, chat_template=template, tokenize=False, **kw))


@pytest.mark.parametrize("template", [CHATML, LLAMA3, TOOLS], ids=["chatml", "llama3", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(template: str, add_generation_prompt: bool, bytelevel_dir: Path,
                                            tmp_path: Path) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((bytelevel_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((bytelevel_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    _write_json(d / "tokenizer_config.json", {**cfg, "chat_template": template})
    tok = Tokenizer.from_dir(d)
    messages = CONVERSATION + [{"role": "skip", "content": "x"}] if template is TOOLS else CONVERSATION
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Météo ☀",
                                               "parameters": {"type": "object", "properties": {}}}}]
    kw: dict[str, Any] = {"tools": tools} if template is TOOLS else {}
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kw)
    assert ours == _hf_render(template, d, messages, add_generation_prompt=add_generation_prompt, **kw)
    if template is TOOLS:
        assert datetime.now().strftime("%d %b %Y") in ours and "☀" in ours and '"café 😀' not in ours
        assert "<b>html</b> & café 😀" in ours  # tojson does not HTML-escape or ASCII-escape
        assert "3. assistant" in ours and "<|eot_id|>" in ours
    assert tok.encode_chat(messages, **kw) == tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, **kw), add_special_tokens=False)


def test_chat_template_from_jinja_file_and_named_templates(bytelevel_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((bytelevel_dir / "tokenizer.json").read_bytes())
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
           "chat_template": [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOLS}]}
    _write_json(tmp_path / "tokenizer_config.json", cfg)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == CHATML
    assert tok.apply_chat_template(CONVERSATION, tools=[{"name": "f"}]).startswith("<|begin_of_text|>Date")
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}{{ eos_token }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION) == "4<|eot_id|>"


def test_chat_template_errors(bytelevel_dir: Path, sp_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(bytelevel_dir)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValidationError, match="roles must alternate") as e:
        tok.apply_chat_template(bad)
    assert e.value.field == "messages"
    from jinja2.exceptions import TemplateError
    with pytest.raises(TemplateError):
        _hf_render(LLAMA3, bytelevel_dir, bad)
    with pytest.raises(ValidationError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])
    (tmp_path / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    with pytest.raises(NoChatTemplateError, match="no chat template") as e2:
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)
    assert str(tmp_path) in str(e2.value) and isinstance(e2.value, ConfigError)
    with pytest.raises(ConfigError, match="does not parse"):
        render_chat("{% for %}", CONVERSATION)
    with pytest.raises(ConfigError, match="unsafe"):
        render_chat("{{ messages.__class__.__mro__ }}{% set ns = namespace() %}{% set ns._x = 1 %}", CONVERSATION)


# ---------------------------------------------------------------- stop handling

def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[str]:
    return [matcher.feed(d) for d in deltas]


def test_stop_string_split_across_deltas() -> None:
    m = StopStringMatcher(["STOP", "\n\nUser:"])
    out = feed_all(m, ["Hel", "lo ST", "O", "P more"])
    assert out == ["Hel", "lo ", "", ""] and m.matched == "STOP"
    m = StopStringMatcher(["STOP"])
    assert feed_all(m, ["a S", "T", "x"]) == ["a ", "", "STx"] and m.matched is None
    assert m.feed("yS") == "y" and m.flush() == "S"
    m = StopStringMatcher(["abc", "bcd"])
    assert feed_all(m, ["xab", "cd"]) == ["x", ""] and m.matched == "abc"


def test_stop_strings_random_splits() -> None:
    rng = random.Random(0)
    stops = ["</s>", "###", "ab"]
    for _ in range(200):
        text = "".join(rng.choice(["a", "b", "#", "<", "/", "s", ">", "x", "😀", " "]) for _ in range(30))
        cuts = sorted(rng.sample(range(1, 30), 6))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [30])]
        m = StopStringMatcher(stops)
        first = min([(i, s) for s in stops if (i := text.find(s)) >= 0], default=None)
        expect = text[: first[0]] if first else text
        emitted = ""
        for d in deltas:
            emitted += m.feed(d)
            assert expect.startswith(emitted)  # never streams text that a stop string later removes
        if not m.matched:
            emitted += m.flush()
        assert emitted == expect and m.matched == (first[1] if first else None)


class FakeDetok:
    """Each id is one character of `text`; ids >= 100 hold back (like half of a UTF-8 sequence)."""

    def __init__(self, text: dict[int, str]) -> None:
        self.text, self.pending = text, ""

    def add(self, token_id: int) -> str:
        self.pending += self.text.get(token_id, "")
        if token_id >= 100:
            return ""
        out, self.pending = self.pending, ""
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


CHARS = {1: "E", 3: "a", 4: "b", 5: "c", 6: "S", 7: "T", 100: "~"}


def run_checker(ids: list[int], **params: Any) -> tuple[str, str | None, Any, int]:
    checker = StopChecker(SamplingParams(**params), eos_token_ids=[1], detokenizer=FakeDetok(CHARS))
    text = ""
    for i in ids:
        out = checker.step(i)
        text += out.text
        if out.finish_reason:
            return text, out.finish_reason, out.stop_reason, checker.num_generated
    return text, None, None, checker.num_generated


def test_stop_checker() -> None:
    assert run_checker([3, 4, 1, 5]) == ("ab", "stop", None, 3)  # EOS, its text not emitted
    assert run_checker([3, 6, 1], stop_strings=("ST",)) == ("aS", "stop", None, 3)  # held S released
    assert run_checker([3, 1, 4], ignore_eos=True, max_new_tokens=3) == ("aEb", "length", None, 3)
    assert run_checker([3, 5, 4], stop_token_ids=(5,)) == ("a", "stop", 5, 2)
    assert run_checker([3, 6, 7, 4], stop_strings=("ST",)) == ("a", "stop", "ST", 3)
    assert run_checker([3, 6], stop_strings=("ST",), max_new_tokens=2) == ("aS", "length", None, 2)
    assert run_checker([3, 100, 4], max_new_tokens=2) == ("a~", "length", None, 2)  # flushed at the end
    assert run_checker([6, 100, 7], stop_strings=("S~T",)) == ("", "stop", "S~T", 3)
    checker = StopChecker(SamplingParams(stop_strings=("ab",)), [1], FakeDetok(CHARS))
    assert checker.step(3).text == ""
    out = checker.finish()
    assert (out.text, out.finish_reason) == ("a", "length")
    with pytest.raises(RuntimeError):
        checker.step(3)


def test_stop_checker_on_real_stream(bytelevel_dir: Path) -> None:
    tok = Tokenizer.from_dir(bytelevel_dir)
    ids = tok.encode("Hello world 😀 User: ignored", add_special_tokens=False) + [2]
    checker = StopChecker(SamplingParams(stop_strings=("😀 User",)), tok.eos_token_ids, IncrementalDetokenizer(tok))
    text = ""
    for i in ids:
        out = checker.step(i)
        text += out.text
        if out.finish_reason:
            break
    assert text == "Hello world " and out.stop_reason == "😀 User"


def test_long_encode_does_not_hold_the_interpreter(tmp_path: Path) -> None:
    """A long text's encode leaves the GIL to other threads (a server's stepping thread keeps
    running while a handler tokenizes): the main thread's longest pause during the call is a small
    part of it (tokenizers' `encode`, which holds the GIL, pauses it for ~90% of the call)."""
    import threading
    import time

    from train_fixtures import write_tokenizer

    tok = Tokenizer.from_dir(write_tokenizer(tmp_path / "tok"))
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 40_000  # 2.5 MB
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    start = last = time.perf_counter()
    longest = 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    total = time.perf_counter() - start
    assert longest < 0.5 * total, f"the main thread stopped for {longest:.3f} s of a {total:.3f} s encode"
