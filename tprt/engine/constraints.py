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
source text at most `MAX_SPEC_BYTES`; llguidance's parser limits (`_parser_limits`: grammar size,
lexer states and per-step fuel), which bound compile and mask time and memory, so a pathological
schema or regex is refused or stopped instead of stalling the batch; a choice has at most
`MAX_CHOICES` strings.

Hostile constraints (docs/DESIGN.md, "Constraints a client cannot weaponise"):
- Compiling runs on threads with a deep stack (`COMPILE_STACK_BYTES`): llguidance's compiler
  recurses once per rule of a chain (`r0: r1`, `r1: r2`, ...), and 3,000 such rules overflow a
  default 8 MiB thread stack, which kills the process. 64 MiB takes the longest chain that fits
  in `MAX_SPEC_BYTES` (about 7,400 rules) with room to spare.
- A compiled grammar is one llguidance matcher, kept in the cache; each sequence gets a deep copy
  of it, which shares the grammar and its lexer (built lazily, bounded by `max_lexer_states`):
  a regex whose lexer costs 0.8 s and tens of MiB is paid once, not once per sequence.
- A mask has a time budget (`mask_budget_s`): a row whose masks take longer on
  `BUDGET_STRIKES` steps in a row ends with its constraint error, so an ambiguous grammar whose
  masks grow with the output cannot stall every other row of the batch.

JSON is generated compact (no free whitespace between tokens): a small model given a choice of
whitespace can emit it without end, and compact JSON parses the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from tprt.errors import ValidationError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
MAX_SPEC_BYTES = 64 << 10
MAX_CHOICES = 1024
CACHE_ENTRIES = 128
MAX_LEXER_STATES = 25_000  # 1-2 kB each: at most about 50 MB for one grammar, all its sequences together
MASK_BUDGET_S = 0.010
BUDGET_STRIKES = 2
COMPILE_STACK_BYTES = 64 << 20
_JSON_OPTIONS = {"whitespace_flexible": False}
T = TypeVar("T")


def _parser_limits() -> Any:
    import llguidance

    # llguidance's defaults bound time (about 20 ms to build the lexer, 15 ms of lexer work and
    # 2.5 ms of parser work per mask); these two tighten memory: lexer states cost 1-2 kB each.
    # verbose_errors=False: an error names the problem, not the parser's state (a client's eyes).
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=MAX_LEXER_STATES,
                                     verbose_errors=False)


class _DeepStackThreads:
    """A few threads with a deep stack that run functions and hand back their results (the
    grammar compiler's; see the module docstring). `threading.stack_size` applies to threads
    started while it is set, so they are all started at once, under a lock."""

    _lock = threading.Lock()

    def __init__(self, workers: int, stack_bytes: int) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        with self._lock:
            previous = threading.stack_size(stack_bytes)
            try:
                for i in range(workers):
                    threading.Thread(target=self._serve, name=f"tprt-grammar-{i}", daemon=True).start()
            finally:
                threading.stack_size(previous)

    def _serve(self) -> None:
        while True:
            fn, future = self._tasks.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
                    future.set_exception(e)

    def run(self, fn: Callable[[], T]) -> T:
        future: Future[T] = Future()
        self._tasks.put((fn, future))
        return future.result()


_compiler_threads: _DeepStackThreads | None = None
_compiler_lock = threading.Lock()


def _on_deep_stack(fn: Callable[[], T]) -> T:
    """fn() on one of the grammar compiler's deep-stack threads (started at first use)."""
    global _compiler_threads
    with _compiler_lock:
        if _compiler_threads is None:
            _compiler_threads = _DeepStackThreads(min(4, os.cpu_count() or 1), COMPILE_STACK_BYTES)
    return _compiler_threads.run(fn)


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
            # Keys in the caller's order: the matcher writes an object's properties in the schema's
            # order (sorted, a model would have to write {"arguments": ..., "name": ...}).
            source = json.dumps(schema, allow_nan=False, ensure_ascii=False)
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
    """llguidance's message on one line, at most `limit` characters; a bare reason code (what it
    leaves of a parser-state dump with verbose_errors off) said in words."""
    text = " ".join(message.replace("<non-verbose/>", "").split())
    if re.fullmatch(r"[A-Z][A-Za-z]+", text):
        text = f"the constraint can produce no text from here ({text})"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Grammar:
    """A compiled, checked constraint, ready to make matchers: `prototype` is an llguidance
    matcher at the start of the output, which every sequence's matcher is a deep copy of."""

    spec: ConstraintSpec
    text: str  # llguidance's grammar
    compile_s: float
    prototype: Any


class StructuredOutputs:
    """Compiles constraints for one tokenizer and makes matchers (see the module docstring).

    `on_compile(seconds)` and `on_mask(seconds)` are called with each compile's and each mask's
    duration (the server's tprt_structured_* metrics). `mask_budget_s`: the time one mask may take
    (see the module docstring; None: no budget). Thread-safe: the cache is locked, and compiling
    happens outside the lock."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, *,
                 on_compile: Callable[[float], None] | None = None,
                 on_mask: Callable[[float], None] | None = None, cache_entries: int = CACHE_ENTRIES,
                 mask_budget_s: float | None = MASK_BUDGET_S) -> None:
        if mask_budget_s is not None and not mask_budget_s > 0:
            raise ValueError(f"mask_budget_s must be positive or None, got {mask_budget_s}")
        self.ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        self.vocab_size = self.ll_tokenizer.vocab_size
        self.limits = _parser_limits()
        self.mask_budget_s = mask_budget_s
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
                return Grammar(spec, hit.text, hit.compile_s, hit.prototype)
        start = time.perf_counter()
        text, prototype = _on_deep_stack(lambda: self._build(spec))
        elapsed = time.perf_counter() - start
        grammar = Grammar(spec, text, elapsed, prototype)
        with self._lock:
            self.compiles += 1
            self._cache[spec.key] = grammar
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        if self._on_compile is not None:
            self._on_compile(elapsed)
        return grammar

    def _build(self, spec: ConstraintSpec) -> tuple[str, Any]:
        """(llguidance's grammar text, the prototype matcher) of `spec`, checked; raises
        ValidationError naming its field. Runs on a deep-stack thread."""
        from llguidance import LLMatcher

        text = _llguidance_grammar(spec)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, self.ll_tokenizer, limits=self.limits)
        if is_error:
            raise ValidationError(spec.field, f"{spec.field}: {_one_line(messages[0] if messages else 'invalid')}")
        # Building the matcher and its first mask compiles the lexer: a grammar over the limits
        # fails here, at request time, rather than in the batch.
        prototype = LLMatcher(self.ll_tokenizer, text, log_level=0, limits=self.limits)
        prototype.compute_bitmask()
        if prototype.is_error():
            raise ValidationError(spec.field, f"{spec.field}: {_one_line(prototype.get_error())}")
        if prototype.is_stopped() and not prototype.is_accepting():
            raise ValidationError(spec.field, f"{spec.field}: the constraint matches no text")
        return text, prototype

    def warm_up(self) -> None:
        """Compiles a small grammar outside the cache: llguidance builds its per-vocabulary tables
        on first use (about 0.6 s for 49k tokens), which the first request should not wait for."""
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.limits).compute_bitmask()

    def matcher(self, grammar: Grammar) -> Matcher:
        """A sequence's matcher: a deep copy of the grammar's prototype (sharing its lexer)."""
        return Matcher(grammar.prototype.deep_copy(), self.vocab_size, self._on_mask, self.mask_budget_s)

    def bitmask(self, rows: int) -> torch.Tensor:
        """A zeroed bitmask for `rows` matchers: int32 [rows, ceil(vocab / 32)]."""
        return torch.zeros((rows, (self.vocab_size + 31) // 32), dtype=torch.int32)


class Matcher:
    """The constraint's state for one sequence (see the module docstring)."""

    def __init__(self, inner: Any, vocab_size: int, on_mask: Callable[[float], None] | None,
                 budget_s: float | None = None) -> None:
        self._m = inner
        self.vocab_size = vocab_size
        self._on_mask = on_mask
        self._budget_s = budget_s
        self._strikes = 0  # masks over the budget in a row
        self._over_budget = ""  # the error once the budget is spent
        self.last_mask_s = 0.0  # how long its last mask took (the engine's throttle reads it)

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Writes the tokens allowed next into `row` (int32, contiguous, ceil(vocab / 32) words):
        none once the matcher has failed or is over its time budget (`error` says why)."""
        if row.dtype != torch.int32 or not row.is_contiguous() or row.numel() * 32 < self.vocab_size \
                or row.device.type != "cpu":
            raise ValueError("fill_bitmask: row must be a contiguous CPU int32 tensor of ceil(vocab/32) words")
        if self._over_budget:
            row.zero_()
            return
        start = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        elapsed = time.perf_counter() - start
        self.last_mask_s = elapsed
        if self._on_mask is not None:
            self._on_mask(elapsed)
        if self._budget_s is not None:
            self._strikes = self._strikes + 1 if elapsed > self._budget_s else 0
            if self._strikes >= BUDGET_STRIKES:
                self._over_budget = (f"the constraint's next-token mask took {elapsed * 1000:.0f} ms, over its "
                                     f"budget of {self._budget_s * 1000:.0f} ms per step (an ambiguous grammar?)")
                row.zero_()

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next as a bool tensor of the vocabulary's size."""
        words = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self.fill_bitmask(words[0])
        return bits_to_bool(words, self.vocab_size)[0]

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False when the grammar does not allow it (or the matcher
        is over its time budget)."""
        return not self._over_budget and bool(self._m.consume_token(int(token_id)))

    def accept_prefix(self, token_ids: Sequence[int]) -> int:
        """Advances by as many of `token_ids` as the grammar allows (drafted tokens); how many."""
        return 0 if self._over_budget else int(self._m.try_consume_tokens([int(t) for t in token_ids]))

    def validates(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` the grammar would take in turn from here (nothing advances)."""
        return 0 if self._over_budget else int(self._m.validate_tokens([int(t) for t in token_ids]))

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
        """Why the matcher failed (one line), or ""."""
        if self._over_budget:
            return self._over_budget
        return _one_line(str(self._m.get_error())) if self._m.is_error() else ""


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
