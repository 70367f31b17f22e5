"""Tokenizers read from a model directory, and an incremental detokenizer for streaming.

Two backends:
- tokenizer.json through the `tokenizers` library (preferred when both files exist). As in
  transformers 5, its post-processor decides which special tokens `encode` adds; only when the file
  has no post-processor and tokenizer_config.json says add_bos_token/add_eos_token are they added here.
- tokenizer.model through sentencepiece, with the semantics of transformers' slow LlamaTokenizer:
  special and added tokens written in the text are matched first (longest first); each text piece is
  encoded by sentencepiece (a dummy-prefix space on every piece with `legacy` true, the default, only
  at the start of the text with `"legacy": false`); BOS/EOS follow add_bos_token (default true) and
  add_eos_token. sentencepiece itself is the reference: unlike transformers 5's converted tokenizer,
  a text starting with a space keeps both the dummy prefix and that space.

Decoding never applies transformers' `clean_up_tokenization_spaces` (it alters text and would make
streamed text differ from the full decode).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tprt.text.chat import render_chat
from tprt.errors import ConfigError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def special_ids(self) -> frozenset[int]: ...


@dataclass(frozen=True)
class AddedToken:
    """An entry of tokenizer_config.json's added_tokens_decoder."""

    id: int
    content: str
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False


class _TokenizersBackend:
    """tokenizer.json through `tokenizers`."""

    def __init__(self, path: Path, prepend: list[int], append: list[int]) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise ConfigError(f"{path}: not a valid tokenizer.json ({e})") from None
        # Only used when the file has no post-processor (see the module docstring).
        has_post = self._tok.post_processor is not None
        self._prepend, self._append = ([], []) if has_post else (prepend, append)
        self._special = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: the same ids, but it releases the GIL while it works, so a long
        # text tokenized on a server's handler thread does not stall the thread that steps the model.
        ids = list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        if add_special_tokens and (self._prepend or self._append):
            ids = self._prepend + ids + self._append
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special

    def to_json(self) -> str:
        return str(self._tok.to_str())


class _SentencePieceBackend:
    """tokenizer.model through sentencepiece, split around special/added tokens like HF's slow tokenizers."""

    def __init__(self, path: Path, added: Sequence[AddedToken], named: Mapping[str, str],
                 add_bos: bool, add_eos: bool, legacy: bool) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"{path}: not a sentencepiece model ({str(e).splitlines()[0]}); a tiktoken "
                              "tokenizer.model (Meta's original Llama 3 release) is not supported, "
                              "use the Hugging Face tokenizer.json") from None
        self._plain = self._sp if legacy else _without_dummy_prefix(self._sp)
        self._fragment: Any = None if legacy else self._plain  # no dummy prefix, whatever `legacy` says
        self._legacy = legacy
        self._tokens: dict[str, AddedToken] = {t.content: t for t in added}
        for content in named.values():  # bos/eos/unk/pad written in text are matched too
            i = self._sp.piece_to_id(content) if content else -1
            if content and content not in self._tokens and self._sp.id_to_piece(i) == content:
                self._tokens[content] = AddedToken(i, content)
        self._by_id = {t.id: t for t in self._tokens.values()}
        pattern = "|".join(re.escape(c) for c in sorted(self._tokens, key=len, reverse=True) if c)
        self._split = re.compile(f"({pattern})") if pattern else None
        bos, eos = self.token_to_id(named.get("bos_token", "")), self.token_to_id(named.get("eos_token", ""))
        self._bos = [bos] if add_bos and bos is not None else []
        self._eos = [eos] if add_eos and eos is not None else []
        n = self._sp.get_piece_size()
        self._special = frozenset([i for i in range(n) if self._sp.is_control(i) or self._sp.is_unknown(i)]
                                  + [t.id for t in self._tokens.values() if t.special])
        self._size = max([n] + [t.id + 1 for t in self._tokens.values()])

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = list(self._bos) if add_special_tokens else []
        pieces = self._split.split(text) if self._split else [text]
        for k, piece in enumerate(pieces):
            if k % 2:  # odd positions hold the matched special/added tokens
                ids.append(self._tokens[piece].id)
                continue
            if k > 0 and self._tokens[pieces[k - 1]].rstrip:
                piece = piece.lstrip()
            if k + 1 < len(pieces) and self._tokens[pieces[k + 1]].lstrip:
                piece = piece.rstrip()
            if piece:
                ids.extend((self._sp if k == 0 else self._plain).encode(piece))
        return ids + (self._eos if add_special_tokens else [])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        out: list[str] = []
        run: list[int] = []
        after_text = False  # has a sentencepiece run or a non-special token been decoded yet?
        for i in list(ids) + [-1]:
            if i != -1 and i not in self._by_id and i not in self._special:
                run.append(i)
                continue
            if run:
                out.append(self._decode_run(run, restore_space=after_text and not self._legacy))
                after_text, run = True, []
            if i == -1 or (skip_special_tokens and i in self._special):
                continue
            token = self._by_id.get(i)
            out.append(token.content if token else self._sp.id_to_piece(i))
            after_text = after_text or not (token is None or token.special)
        return "".join(out)

    def encode_fragment(self, text: str) -> list[int]:
        if self._fragment is None:
            self._fragment = _without_dummy_prefix(self._sp)
        return list(self._fragment.encode(text))

    def _decode_run(self, run: list[int], restore_space: bool) -> str:
        """sentencepiece drops the leading space of every call: the dummy prefix, except where the
        encoder added none (inside the text with legacy false), where it is put back."""
        text = str(self._sp.decode(run))
        if restore_space and self._sp.id_to_piece(run[0]).startswith("\u2581") and not text.startswith(" "):
            text = " " + text
        return text

    def token_to_id(self, token: str) -> int | None:
        if token in self._tokens:
            return self._tokens[token].id
        i = self._sp.piece_to_id(token) if token else self._sp.unk_id()
        return i if i != self._sp.unk_id() or token == self._sp.id_to_piece(i) else None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._by_id:
            return self._by_id[token_id].content
        return str(self._sp.id_to_piece(token_id)) if 0 <= token_id < self._sp.get_piece_size() else None

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special


def _without_dummy_prefix(sp: Any) -> Any:
    """A copy of the model that does not prepend a space (for text after a special token)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    proto = model_pb2.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString(sp.serialized_model_proto())
    if not proto.normalizer_spec.add_dummy_prefix:
        return sp
    proto.normalizer_spec.add_dummy_prefix = False
    plain = spm.SentencePieceProcessor()
    plain.LoadFromSerializedProto(proto.SerializeToString())
    return plain


class Tokenizer:
    """A model's tokenizer: encode/decode, its special ids and its chat template."""

    def __init__(self, backend: _Backend, *, source: str, special_tokens: Mapping[str, str],
                 bos_token_id: int | None, eos_token_ids: Sequence[int], pad_token_id: int | None,
                 chat_templates: Mapping[str, str]) -> None:
        self._backend = backend
        self.source = source  # the directory (or file) it was read from, for messages
        self.special_tokens = dict(special_tokens)  # e.g. {"bos_token": "<s>"}: chat template variables
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)  # tokenizer_config's eos then generation_config's
        self.pad_token_id = pad_token_id
        self.chat_templates = dict(chat_templates)  # name -> template; "default" is the usual one

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Reads tokenizer.json (or tokenizer.model), tokenizer_config.json, special_tokens_map.json,
        generation_config.json and chat_template.jinja/.json from a model directory."""
        return _load(Path(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; use add_special_tokens=False for rendered chat prompts (they hold their BOS)."""
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's may be larger)."""
        return self._backend.vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that decode(skip_special_tokens=True) leaves out."""
        return self._backend.special_ids

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def encode_fragment(self, text: str) -> list[int]:
        """`text` as it is tokenized inside a sequence: no special tokens and, for sentencepiece,
        no dummy-prefix space (for libraries that tokenize pieces of output, like llguidance)."""
        fragment = getattr(self._backend, "encode_fragment", None)
        return fragment(text) if fragment is not None else self.encode(text, add_special_tokens=False)

    @property
    def tokenizer_json(self) -> str | None:
        """The tokenizer.json text (for libraries that read it, like llguidance); None for sentencepiece."""
        to_json = getattr(self._backend, "to_json", None)
        return to_json() if to_json is not None else None

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            documents: Sequence[Mapping[str, Any]] | None = None,
                            template_name: str | None = None, **extra: Any) -> str:
        """The prompt text, as transformers' apply_chat_template(..., tokenize=False) renders it.

        Raises NoChatTemplateError when the model has none."""
        from tprt.text.chat import NoChatTemplateError

        name = template_name or ("tool_use" if tools and "tool_use" in self.chat_templates else "default")
        template = self.chat_templates.get(name)
        if template is None:
            what = f"no chat template named {name!r}" if template_name else "no chat template"
            raise NoChatTemplateError(
                f"{self.source}: the tokenizer has {what} (no 'chat_template' in tokenizer_config.json, "
                "no chat_template.jinja); send a plain prompt instead of chat messages")
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           documents=documents, special_tokens=self.special_tokens, source=self.source,
                           **extra)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """The rendered chat prompt's ids (the template supplies any BOS)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return d


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _added_tokens(cfg: Mapping[str, Any], source: Path) -> list[AddedToken]:
    out = []
    for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
        content = _content(entry)
        if content is None or not str(key).isdigit():
            raise ConfigError(f"{source}: added_tokens_decoder[{key!r}] must map an id to a token, got {entry!r}")
        out.append(AddedToken(int(key), content, bool(entry.get("special", True)),
                              bool(entry.get("lstrip", False)), bool(entry.get("rstrip", False))))
    return out


def _chat_templates(directory: Path, cfg: Mapping[str, Any]) -> dict[str, str]:
    """chat_template.jinja, then chat_template.json, then tokenizer_config.json's chat_template
    (a string, or a list of {"name", "template"})."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return {"default": jinja.read_text(encoding="utf-8")}
    value = _read_json(directory / "chat_template.json").get("chat_template") or cfg.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {str(t["name"]): str(t["template"]) for t in value if isinstance(t, dict) and "name" in t}
    return {}


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _load(path: Path) -> Tokenizer:
    directory = path.parent if path.is_file() else path
    if not directory.is_dir():
        raise ConfigError(f"{path}: not a directory; expected a model directory with tokenizer.json "
                          "or tokenizer.model")
    cfg = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
    gen = _read_json(directory / "generation_config.json")
    named = {k: c for k in SPECIAL_TOKEN_KEYS if (c := _content(cfg.get(k))) is not None}
    backend: _Backend
    if (directory / "tokenizer.json").is_file() and path.name != "tokenizer.model":
        prepend, append = _fallback_specials(directory / "tokenizer.json", cfg, named)
        backend = _TokenizersBackend(directory / "tokenizer.json", prepend, append)
    elif (directory / "tokenizer.model").is_file():
        named = named or _sentencepiece_names(directory / "tokenizer.model")
        backend = _SentencePieceBackend(directory / "tokenizer.model", _added_tokens(cfg, directory), named,
                                        add_bos=bool(cfg.get("add_bos_token", True)),
                                        add_eos=bool(cfg.get("add_eos_token", False)),
                                        legacy=bool(cfg.get("legacy", True)))
    else:
        raise ConfigError(f"{directory}: no tokenizer.json or tokenizer.model; expected the Hugging Face "
                          "tokenizer files next to the model")
    ids = {k: backend.token_to_id(c) for k, c in named.items()}
    eos = [i for i in [ids.get("eos_token")] + _ids(gen.get("eos_token_id")) if i is not None]
    bos = ids.get("bos_token")
    pad = ids.get("pad_token")
    return Tokenizer(backend, source=str(directory), special_tokens=named,
                     bos_token_id=bos if bos is not None else next(iter(_ids(gen.get("bos_token_id"))), None),
                     eos_token_ids=list(dict.fromkeys(eos)),
                     pad_token_id=pad if pad is not None else next(iter(_ids(gen.get("pad_token_id"))), None),
                     chat_templates=_chat_templates(directory, cfg))


def _fallback_specials(path: Path, cfg: Mapping[str, Any], named: Mapping[str, str]) -> tuple[list[int], list[int]]:
    """BOS/EOS ids to add around the text when tokenizer.json has no post-processor of its own."""
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    table = {t.get("content"): t.get("id") for t in vocab.get("added_tokens") or [] if isinstance(t, dict)}
    model_vocab = (vocab.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        table = {**model_vocab, **table}
    def pick(flag: str, key: str) -> list[int]:
        i = table.get(named.get(key)) if cfg.get(flag) else None
        return [i] if isinstance(i, int) else []
    return pick("add_bos_token", "bos_token"), pick("add_eos_token", "eos_token")


def _sentencepiece_names(path: Path) -> dict[str, str]:
    """bos/eos/unk/pad pieces from the model itself, when there is no tokenizer_config.json."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError):
        return {}  # the backend reports the error
    ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id(), "pad_token": sp.pad_id()}
    return {k: str(sp.id_to_piece(i)) for k, i in ids.items() if i >= 0}


class IncrementalDetokenizer:
    """Turns token ids, one at a time, into text deltas for streaming.

    Each step decodes a short window (a few ids already emitted, then the unemitted ones) and emits
    what the new ids added, holding back while the text ends in U+FFFD (an unfinished UTF-8
    sequence). The deltas concatenate to decode(prompt + generated) minus decode(prompt), and to
    decode(generated) with no prompt; `flush()` at the end releases anything held back."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 context: int = 5) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids)
        self._prefix = max(len(self._ids) - context, 0)  # start of the decoded window
        self._read = len(self._ids)  # ids before this have been emitted
        self._prefix_text = self._decode(self._prefix, self._read)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Appends one id; returns the text it completes (possibly "")."""
        self._ids.append(token_id)
        text = self._decode(self._prefix)
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix)
        return delta

    def flush(self) -> str:
        """Everything not yet emitted, incomplete characters included (call once generation ends)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._prefix)
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    @property
    def ids(self) -> list[int]:
        return list(self._ids)
