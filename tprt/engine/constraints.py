"""Output constraints (structured outputs): a JSON schema, any JSON object, a regular expression,
a choice among strings or a Lark grammar, enforced token by token with llguidance.

Three layers, each with one job:
- `ConstraintSpec` is what a request asks for, as plain data: the kind, its canonical source text
  and the request field it came from (named in every error). Front ends build it with
  `ConstraintSpec.json_schema(...)`, `.json_object()`, `.regex(...)`, `.choice(...)`, `.grammar(...)`.
- `StructuredOutputs` belongs to one tokenizer (one engine): it builds llguidance's view of the
  vocabulary once, compiles specs into grammars (checked, refused with a `ValidationError` naming
  the field when invalid, unsupported or over the limits below) and caches them by content, and
  makes a `Matcher` per constrained sequence.
- `Matcher` follows one sequence: `fill_bitmask` writes the tokens allowed next (one bit per
  token, computed in Rust with the GIL released, so a thread can do it while the forward pass
  runs), `accept` advances by a sampled token, `finished` says the grammar has ended (the sequence
  stops with finish_reason "stop"), `rollback` gives back tokens (rejected drafts).
  `apply_bitmask` masks a batch of logits rows in place (-inf where not allowed), before
  temperature, top-k/top-p and the other samplers, which therefore act on the masked distribution.

Limits (each refusal is a `ValidationError` naming the field; see docs/DESIGN.md): a spec's
source text at most `MAX_SPEC_BYTES`; llguidance's parser limits (`PARSER_LIMITS`: grammar size,
lexer states and per-step fuel), which bound compile and mask time and memory, so a pathological
schema or regex is refused or stopped instead of stalling the batch; a choice has at most
`MAX_CHOICES` strings.

JSON is generated compact (no free whitespace between tokens): a small model given a choice of
whitespace can emit it without end, and compact JSON parses the same.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tprt.errors import ValidationError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
MAX_SPEC_BYTES = 64 << 10
MAX_CHOICES = 1024
CACHE_ENTRIES = 256
_JSON_OPTIONS = {"whitespace_flexible": False}


def _parser_limits() -> Any:
    import llguidance

    # llguidance's defaults bound time (about 20 ms to build the lexer, 15 ms of lexer work and
    # 2.5 ms of parser work per mask); these two tighten memory: lexer states cost 1-2 kB each.
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=50_000)


@dataclass(frozen=True)
class ConstraintSpec:
    """A request's output constraint: `kind`, its canonical `source` and the `field` it came from."""

    kind: Kind
    source: str
    field: str

    @property
    def key(self) -> str:
        """The cache key: the kind and a digest of the source (the field does not matter)."""
        return self.kind + ":" + hashlib.sha256(self.source.encode("utf-8", "surrogatepass")).hexdigest()

    @staticmethod
    def json_schema(schema: Any, field: str) -> ConstraintSpec:
        if isinstance(schema, bool):  # JSON Schema allows `true` (anything) and `false` (nothing)
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, Mapping):
            raise ValidationError(field, f"{field}: expected a JSON Schema object, got {type(schema).__name__}")
        try:
            source = json.dumps(schema, sort_keys=True, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValidationError(field, f"{field}: the schema is not plain JSON ({e})") from None
        return ConstraintSpec("json_schema", _sized(source, field), field)

    @staticmethod
    def json_object(field: str) -> ConstraintSpec:
        return ConstraintSpec("json_object", '{"type": "object"}', field)

    @staticmethod
    def regex(pattern: Any, field: str) -> ConstraintSpec:
        if not isinstance(pattern, str) or not pattern:
            raise ValidationError(field, f"{field}: expected a non-empty regular expression string")
        return ConstraintSpec("regex", _sized(pattern, field), field)

    @staticmethod
    def choice(options: Any, field: str) -> ConstraintSpec:
        if (not isinstance(options, Sequence) or isinstance(options, str) or not options
                or not all(isinstance(o, str) and o for o in options)):
            raise ValidationError(field, f"{field}: expected a non-empty list of non-empty strings")
        if len(options) > MAX_CHOICES:
            raise ValidationError(field, f"{field}: at most {MAX_CHOICES} choices, got {len(options)}")
        return ConstraintSpec("choice", _sized(json.dumps(list(options), ensure_ascii=False), field), field)

    @staticmethod
    def grammar(lark: Any, field: str) -> ConstraintSpec:
        if not isinstance(lark, str) or not lark.strip():
            raise ValidationError(field, f"{field}: expected a non-empty Lark grammar string")
        return ConstraintSpec("grammar", _sized(lark, field), field)


def _sized(source: str, field: str) -> str:
    n = len(source.encode("utf-8", "surrogatepass"))
    if n > MAX_SPEC_BYTES:
        raise ValidationError(field, f"{field}: {n} bytes, over the limit of {MAX_SPEC_BYTES}")
    if "\x00" in source:
        raise ValidationError(field, f"{field}: contains a NUL character")
    return source


def _llguidance_grammar(spec: ConstraintSpec) -> str:
    """The llguidance grammar text of `spec` (not yet checked)."""
    from llguidance import LLMatcher

    if spec.kind in ("json_schema", "json_object"):
        try:
            return LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValidationError(spec.field, f"{spec.field}: {_one_line(str(e))}") from None
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        options = json.loads(spec.source)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    return LLMatcher.grammar_from_lark(spec.source)


def _one_line(message: str, limit: int = 300) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Grammar:
    """A compiled, checked constraint, ready to make matchers."""

    spec: ConstraintSpec
    text: str  # llguidance's grammar
    compile_s: float


class StructuredOutputs:
    """Compiles constraints for one tokenizer and makes matchers (see the module docstring).

    `on_compile(seconds)` and `on_mask(seconds)` are called with each compile's and each mask's
    duration (the server's tprt_structured_* metrics). Thread-safe: the cache is locked, and
    compiling happens outside the lock."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, *,
                 on_compile: Callable[[float], None] | None = None,
                 on_mask: Callable[[float], None] | None = None, cache_entries: int = CACHE_ENTRIES) -> None:
        self.ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        self.vocab_size = self.ll_tokenizer.vocab_size
        self.limits = _parser_limits()
        self._on_compile = on_compile
        self._on_mask = on_mask
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses)

    def compile(self, spec: ConstraintSpec) -> Grammar:
        """`spec` checked and compiled, from the cache when the same content was compiled before."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return Grammar(spec, hit.text, hit.compile_s)
        from llguidance import LLMatcher

        start = time.perf_counter()
        text = _llguidance_grammar(spec)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, self.ll_tokenizer, limits=self.limits)
        if is_error:
            raise ValidationError(spec.field, f"{spec.field}: {_one_line(messages[0] if messages else 'invalid')}")
        # Building one matcher and its first mask compiles the lexer: a grammar over the limits
        # fails here, at request time, rather than in the batch.
        probe = LLMatcher(self.ll_tokenizer, text, log_level=0, limits=self.limits)
        probe.compute_bitmask()
        if probe.is_error():
            raise ValidationError(spec.field, f"{spec.field}: {_one_line(probe.get_error())}")
        if probe.is_stopped() and not probe.is_accepting():
            raise ValidationError(spec.field, f"{spec.field}: the constraint matches no text")
        elapsed = time.perf_counter() - start
        grammar = Grammar(spec, text, elapsed)
        with self._lock:
            self.compiles += 1
            self._cache[spec.key] = grammar
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        if self._on_compile is not None:
            self._on_compile(elapsed)
        return grammar

    def warm_up(self) -> None:
        """Compiles a small grammar outside the cache: llguidance builds its per-vocabulary tables
        on first use (about 0.6 s for 49k tokens), which the first request should not wait for."""
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.limits).compute_bitmask()

    def matcher(self, grammar: Grammar) -> Matcher:
        from llguidance import LLMatcher

        return Matcher(LLMatcher(self.ll_tokenizer, grammar.text, log_level=0, limits=self.limits),
                       self.vocab_size, self._on_mask)

    def bitmask(self, rows: int) -> torch.Tensor:
        """A zeroed bitmask for `rows` matchers: int32 [rows, ceil(vocab / 32)]."""
        return torch.zeros((rows, (self.vocab_size + 31) // 32), dtype=torch.int32)


class Matcher:
    """The constraint's state for one sequence (see the module docstring)."""

    def __init__(self, inner: Any, vocab_size: int, on_mask: Callable[[float], None] | None) -> None:
        self._m = inner
        self.vocab_size = vocab_size
        self._on_mask = on_mask

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Writes the tokens allowed next into `row` (int32, contiguous, ceil(vocab / 32) words)."""
        if row.dtype != torch.int32 or not row.is_contiguous() or row.numel() * 32 < self.vocab_size \
                or row.device.type != "cpu":
            raise ValueError("fill_bitmask: row must be a contiguous CPU int32 tensor of ceil(vocab/32) words")
        start = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if self._on_mask is not None:
            self._on_mask(time.perf_counter() - start)

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next as a bool tensor of the vocabulary's size."""
        words = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self.fill_bitmask(words[0])
        return bits_to_bool(words, self.vocab_size)[0]

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False when the grammar does not allow it."""
        return bool(self._m.consume_token(int(token_id)))

    def accept_prefix(self, token_ids: Sequence[int]) -> int:
        """Advances by as many of `token_ids` as the grammar allows (drafted tokens); how many."""
        return int(self._m.try_consume_tokens([int(t) for t in token_ids]))

    def validates(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` the grammar would take in turn from here (nothing advances)."""
        return int(self._m.validate_tokens([int(t) for t in token_ids]))

    def rollback(self, n: int) -> None:
        """Gives back the last `n` accepted tokens."""
        if n and not self._m.rollback(n):
            raise RuntimeError(f"constraint matcher could not roll back {n} tokens: {self._m.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar has ended: nothing but end-of-sequence may follow."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete match (end-of-sequence is allowed)."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str:
        return str(self._m.get_error()) if self._m.is_error() else ""


_BIT = torch.arange(32, dtype=torch.int32)


def bits_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool (bit j of word w is token 32w + j)."""
    bits = (bitmask.unsqueeze(-1) >> _BIT) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """Sets to -inf, in place, every logit of `logits` [rows, V] that `bitmask` [rows, words] does
    not allow; columns from `vocab_size` on (the model's padding) are never allowed, whatever
    the bitmask's spare bits say."""
    vocab = min(logits.shape[-1], vocab_size)
    allowed = bits_to_bool(bitmask.to(logits.device), vocab)
    logits[:, :vocab].masked_fill_(~allowed, float("-inf"))
    if logits.shape[-1] > vocab:
        logits[:, vocab:] = float("-inf")


def _ll_tokenizer(tokenizer: Any, vocab_size: int | None) -> Any:
    """llguidance's view of a tprt Tokenizer (tokenizer.json: read by llguidance directly;
    sentencepiece: each piece's bytes)."""
    import llguidance

    eos = sorted(tokenizer.eos_token_ids)
    n_vocab = vocab_size or tokenizer.vocab_size
    json_text = getattr(tokenizer, "tokenizer_json", None)
    if json_text is not None:
        return llguidance.LLTokenizer(json_text, n_vocab=n_vocab, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_PieceTable(tokenizer, n_vocab, eos)),
                                  n_vocab=n_vocab, eos_token=eos)


class _PieceTable:
    """What llguidance's TokenizerWrapper reads from a tokenizer without a tokenizer.json."""

    def __init__(self, tokenizer: Any, n_vocab: int, eos: list[int]) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.tokens = [_piece_bytes(tokenizer.id_to_token(i)) for i in range(n_vocab)]
        self._encode = tokenizer.encode_fragment

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text))


def _piece_bytes(piece: str | None) -> bytes:
    """A sentencepiece piece's bytes: "<0xNN>" is one byte, "▁" a space."""
    if piece is None:
        return b""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
