"""Speculative decoding on rank 0: who proposes drafted tokens, and how many each request gets.

The engine (tprt.engine.core) verifies drafts; this module only proposes them. Before each step
the driver asks the `Speculator` for a draft per decoding request; the row then carries its last
token and the draft (k + 1 positions in one forward call), and a drafted token is kept iff the
sampler picks it at its position (tprt.engine.sampling.sample). Every proposer here is
deterministic, so the draft distribution q is a point mass: a greedy row keeps a drafted token
when it is the argmax, and a sampled row's draw keeps it with probability p(token), the
rejection rule's acceptance, with a miss already drawn from p without it. The output is the
model's own, token for token for a seed.

Proposers (`SpeculativeConfig.method`):
- "ngram" (prompt lookup): the last n tokens of prompt + output (n from max_n down to min_n) are
  looked up in the same prompt + output; the tokens that followed their latest earlier occurrence
  are the draft. An incremental index makes each lookup O(max_n - min_n).
- "suffix": prompt lookup first, then a cache of recent outputs of all requests, kept per adapter
  (outputs differ by adapter; an adapter's outputs are dropped when it is reloaded or leaves the
  pool, so the next one under its index never drafts from them) and bounded in tokens over all
  adapters together (`suffix_cache_tokens`, about `SUFFIX_BYTES_PER_TOKEN` each with the n-gram
  index), oldest evicted first (SuffixDecoding's idea with a hash index of n-grams instead of a
  suffix tree).
- "draft": a small model with the same vocabulary (any TP-1 checkpoint, `--draft-model DIR`)
  decodes k tokens greedily on rank 0, with its own paged KV cache (one slot per request); what it
  already computed for a request is kept between steps.

Adaptive k (`AdaptiveK`): each request estimates its per-token acceptance a from what it kept
(decayed counts) and drafts the k in [0, num_tokens] that maximises the expected tokens per step,
(1 - a^(k+1)) / (1 - a), per unit of the step's cost. That cost is measured (`StepCosts`): the
engine reports each decode step's time by its tokens (rows plus drafted tokens), and a step of n tokens is
priced at its own average once seen, else by a line fitted through those seen (before any, a
k-token row costs 1 + draft_cost * k one-token rows). So k follows the device and dtype: where
wider rows cost little (a GPU step bound by reading the weights) requests draft all they may,
and where they cost more (two CPU cores: 8 positions about twice one) they draft fewer. When
acceptance is low k falls to 0 and the request decodes plainly, trying a one-token draft every
`probe_every` steps; so free chat is not slowed down.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from tprt.engine.spec_defaults import DEFAULT_MAX_N, DEFAULT_MIN_N, DEFAULT_NUM_TOKENS, METHODS
from tprt.engine.scheduler import Status
from tprt.errors import ConfigError

# The suffix caches' bound, all adapters together, and what a token costs there with its n-gram
# index: about 550 bytes at the default n-grams of 2-4 (tracemalloc; tests/test_speculative.py
# holds the default under this bound), which tprt plan counts.
DEFAULT_SUFFIX_CACHE_TOKENS = 1 << 16
SUFFIX_BYTES_PER_TOKEN = 800

if TYPE_CHECKING:
    from tprt.engine.sequence import Sequence
    from tprt.model.llama import TPLlamaForCausalLM

Method = Literal["ngram", "suffix", "draft"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """How rank 0 drafts tokens (see the module docstring)."""

    method: Method = "ngram"
    num_tokens: int = DEFAULT_NUM_TOKENS  # drafted tokens per row at most (k)
    min_n: int = DEFAULT_MIN_N  # prompt lookup: shortest n-gram matched
    max_n: int = DEFAULT_MAX_N  # prompt lookup: longest n-gram matched (tried first)
    draft_model: str | None = None  # "draft": a TP-1 checkpoint directory with the same vocabulary
    adaptive: bool = True  # adapt k per request to its acceptance (False: always num_tokens)
    draft_cost: float = 0.15  # cost of one more position in a row, relative to a one-token row
    probe_every: int = 8  # steps without drafting before a one-token probe (adaptive)
    suffix_cache_tokens: int = DEFAULT_SUFFIX_CACHE_TOKENS  # "suffix": output tokens kept, all adapters together
    # Drafting only while a step of decode rows stays this small: its rows plus their drafted
    # tokens. None: 8 on CPU (the native decode stack's tokens: a wider step takes the much
    # slower module path), 1024 on a GPU.
    max_step_tokens: int | None = None

    def step_tokens(self, device_type: str) -> int:
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return 8 if device_type == "cpu" else 1024

    def validate(self) -> SpeculativeConfig:
        if self.method not in METHODS:
            raise ConfigError(f"--speculative must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_tokens <= 32:
            raise ConfigError(f"--num-speculative-tokens must be in [1, 32], got {self.num_tokens}")
        if not 1 <= self.min_n <= self.max_n <= 64:
            raise ConfigError(f"--spec-min-n and --spec-max-n need 1 <= min <= max <= 64, "
                              f"got {self.min_n} and {self.max_n}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ConfigError("--draft-model is needed with --speculative draft, and only with it")
        if self.draft_cost < 0 or self.probe_every < 1 or self.suffix_cache_tokens < 1 \
                or (self.max_step_tokens is not None and self.max_step_tokens < 2):
            raise ConfigError("draft_cost must be >= 0, probe_every and suffix_cache_tokens >= 1, "
                              "max_step_tokens >= 2")
        return self


# ----------------------------------------------------------------------------- per-request context


class Context:
    """One request's prompt + output, with an index of its n-grams (n in [min_n, max_n]) to the
    position right after their latest occurrence that has a token after it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.tokens: list[int] = []
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Seq[int]) -> None:
        for t in tokens:
            # The n-grams ending at the current last token now have a continuation: t.
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(t))

    def sync(self, prompt: Seq[int], output: Seq[int]) -> None:
        """Catches up with the request's prompt and output (which only grow)."""
        if not self.tokens:
            self.extend(prompt)
        self.extend(output[len(self.tokens) - len(prompt):])

    def lookup(self, k: int) -> list[int]:
        """Prompt lookup: up to k tokens that followed the longest matching recent n-gram."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._index.get(tuple(self.tokens[end - n :]))
            if start is not None:
                return self.tokens[start : start + k]
        return []

    def suffix(self, n: int) -> tuple[int, ...]:
        return tuple(self.tokens[-n:]) if n <= len(self.tokens) else ()


class SuffixCache:
    """Recent outputs of finished requests for one adapter, at most `capacity` tokens in all, with
    an index of their n-grams to (output, position after). Oldest outputs are evicted first, and
    with them the index entries that still point into them. Output ids come from `ids` (shared by
    the caches of one Speculator, so that the oldest output of them all can be found)."""

    def __init__(self, min_n: int, max_n: int, capacity: int, ids: Iterator[int] | None = None) -> None:
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}
        self._ids = ids if ids is not None else itertools.count()
        self.tokens = 0

    def add(self, tokens: Seq[int]) -> None:
        out = [int(t) for t in tokens][-self.capacity :]
        if len(out) < 2:
            return
        oid = next(self._ids)
        self._outputs[oid] = out
        self.tokens += len(out)
        for end in range(1, len(out)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index[tuple(out[end - n : end])] = (oid, end)
        while self.tokens > self.capacity:
            self.evict_oldest()

    @property
    def oldest(self) -> int | None:
        """The id of its oldest output (None when empty)."""
        return next(iter(self._outputs), None)

    def evict_oldest(self) -> None:
        old_id, old = self._outputs.popitem(last=False)
        self.tokens -= len(old)
        for end in range(1, len(old)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(old[end - n : end])
                if self._index.get(key, (None,))[0] == old_id:
                    del self._index[key]

    def lookup(self, context: Context, k: int) -> list[int]:
        for n in range(self.max_n, self.min_n - 1, -1):
            key = context.suffix(n)
            hit = self._index.get(key) if key else None
            if hit is not None:
                oid, start = hit
                return self._outputs[oid][start : start + k]
        return []

    @property
    def index_size(self) -> int:
        return len(self._index)


# ----------------------------------------------------------------------------- adaptive k


class StepCosts:
    """Decode step times by the step's tokens (rows plus their drafted tokens): a decayed average
    per token count seen, and the relative cost of drafting (see the module docstring)."""

    DECAY = 0.9

    def __init__(self, prior: float) -> None:
        self.prior = prior  # a drafted position's cost in one-token rows, until steps are measured
        self._mean: dict[int, float] = {}
        self._fit: tuple[float, float] | None = None  # (intercept, slope) of the line through _mean

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        old = self._mean.get(tokens)
        self._mean[tokens] = seconds if old is None else old * self.DECAY + seconds * (1 - self.DECAY)
        self._fit = None

    def seconds(self, tokens: int) -> float | None:
        """A step of `tokens` tokens: its average, else the fitted line's value (None: nothing seen)."""
        if tokens in self._mean:
            return self._mean[tokens]
        if not self._mean:
            return None
        if self._fit is None:
            xs, ys = list(self._mean), list(self._mean.values())
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else my * self.prior
            self._fit = (my - slope * mx, max(slope, 0.0))
        a, b = self._fit
        return max(a + b * tokens, 1e-9)

    def relative(self, rows: int, k: int) -> float:
        """A step of `rows` rows of 1 + k positions against one of `rows` single tokens."""
        base, wide = self.seconds(rows), self.seconds(rows * (1 + k))
        if base is None or wide is None:
            return 1.0 + self.prior * k
        return max(wide / base, 1.0)


class AdaptiveK:
    """How many tokens a request drafts next (see the module docstring)."""

    DECAY = 0.8

    def __init__(self, max_k: int, cost: float, probe_every: int, adaptive: bool = True) -> None:
        self.max_k, self.cost, self.probe_every, self.adaptive = max_k, cost, probe_every, adaptive
        self.accepted, self.trials = 1.0, 1.5  # a prior of a = 2/3 (decays away)
        self.idle = 0  # steps since it last drafted

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    def next_k(self, cost: Callable[[int], float] | None = None) -> int:
        """`cost(k)`: a step with this row drafting k against one without (1 + cost * k by default)."""
        if not self.adaptive:
            return self.max_k
        a = min(self.rate, 0.999)
        best_k, best = 0, 1.0
        for k in range(1, self.max_k + 1):
            value = (1 - a ** (k + 1)) / (1 - a) / (cost(k) if cost is not None else 1 + self.cost * k)
            if value > best + 1e-9:
                best_k, best = k, value
        if best_k == 0:
            self.idle += 1
            if self.idle >= self.probe_every:
                self.idle = 0
                return 1
        return best_k

    def observe(self, drafted: int, accepted: int) -> None:
        """A row drafted `drafted` tokens and kept the first `accepted` of them."""
        if drafted <= 0:
            return
        self.idle = 0
        # Per-token acceptance from a run: `accepted` successes, and one failure unless all were kept.
        self.accepted = self.accepted * self.DECAY + accepted
        self.trials = self.trials * self.DECAY + accepted + (accepted < drafted)


# ----------------------------------------------------------------------------- the draft model


class DraftModel:
    """A small model with the target's vocabulary decoding drafts greedily on rank 0, with a paged
    KV cache of one slot of max_seq_len positions per request (at most `max_batch` requests; the
    others get no draft)."""

    def __init__(self, model: TPLlamaForCausalLM, max_batch: int, max_seq_len: int, block_size: int = 16) -> None:
        from tprt.engine.runner import ModelRunner, RunnerConfig

        self.block_size = block_size
        self.per_slot = -(-(max_seq_len + 1) // block_size)
        self.runner = ModelRunner(model, 1 + max_batch * self.per_slot, block_size, max_batch, max_seq_len + 1,
                                  RunnerConfig(cuda_graphs="off"))
        self.max_seq_len = max_seq_len
        self._free = list(range(max_batch))
        self._slots: dict[str, int] = {}
        self._written: dict[str, list[int]] = {}  # the tokens whose keys and values the slot holds

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._written.pop(request_id, None)

    def _table(self, slot: int) -> tuple[int, ...]:
        first = 1 + slot * self.per_slot
        return tuple(range(first, first + self.per_slot))

    def propose(self, rows: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """rows: (request id, its tokens so far, k): up to k greedy tokens each, in k forward calls."""
        from tprt.model.batch import BatchRow, TokenBatch

        live = []
        for rid, tokens, k in rows:
            k = min(k, self.max_seq_len - len(tokens))
            if k <= 0:
                continue
            if rid not in self._slots:
                if not self._free:
                    continue
                self._slots[rid] = self._free.pop()
                self._written[rid] = []
            written = self._written[rid]
            same = 0
            for a, b in zip(written, tokens):
                if a != b:
                    break
                same += 1
            start = min(same, len(tokens) - 1)  # at least the last token, for its logits
            live.append((rid, tokens, k, start))
        if not live:
            return {}
        tables = [self._table(self._slots[rid]) for rid, *_ in live]
        first = TokenBatch.of([BatchRow(table, s, tuple(t[s:]), 1) for table, (_, t, _, s) in zip(tables, live)])
        ids = self.runner.execute(first).ids
        assert ids is not None
        drafts = {rid: [int(i)] for (rid, *_), i in zip(live, ids.tolist())}
        for step in range(1, max(k for _, _, k, _ in live)):
            going = [(j, r) for j, r in enumerate(live) if r[2] > step]
            batch = TokenBatch.of([BatchRow(tables[j], len(r[1]) + step - 1, (drafts[r[0]][-1],), 1)
                                   for j, r in going])
            ids = self.runner.execute(batch).ids
            assert ids is not None
            for (_, r), i in zip(going, ids.tolist()):
                drafts[r[0]].append(int(i))
        for rid, tokens, _, _ in live:
            self._written[rid] = tokens + drafts[rid][:-1]
        return drafts


def load_draft_model(path: str | Path, vocab_size: int, max_batch: int, max_seq_len: int) -> DraftModel:
    """The draft checkpoint at `path`, loaded at TP 1 on this process (rank 0); refuses one whose
    vocabulary differs from the target's (its drafts would be other tokens)."""
    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import TPContext

    check_draft_model(path, vocab_size)
    model = load_model(path, TPContext.single())
    context = min(max_seq_len, model.config.max_position_embeddings - 1)
    return DraftModel(model, max_batch, context)


# ----------------------------------------------------------------------------- the speculator


class Drafting(Protocol):
    """What the speculator reads of a sequence (tprt.engine.sequence.Sequence is one)."""

    request_id: str
    prompt: list[int]
    output: list[int]
    adapter: int


@dataclass
class SpecStats:
    """Counts since start, for metrics: tokens drafted, drafted tokens kept, tokens emitted by rows
    that carried a draft, and per draft position i (0-based) how often it was drafted and kept."""

    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    rows: int = 0  # decode rows that carried a draft
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def copy(self) -> SpecStats:
        return SpecStats(self.drafted, self.accepted, self.emitted, self.rows, list(self.drafted_at),
                         list(self.accepted_at))


@dataclass
class _Request:
    context: Context
    k: AdaptiveK


class Speculator:
    """Drafts for decoding requests (rank 0), learns from what was kept (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        self.config = config.validate()
        if config.method == "draft" and draft is None:
            raise ConfigError("--speculative draft needs a loaded draft model")
        self.draft = draft
        self._requests: dict[str, _Request] = {}
        self._caches: dict[int, SuffixCache] = {}
        self._output_ids = itertools.count()  # one order over every adapter's suffix cache
        self.costs = StepCosts(config.draft_cost)
        self.stats = SpecStats(drafted_at=[0] * config.num_tokens, accepted_at=[0] * config.num_tokens)

    def _request(self, seq: Drafting) -> _Request:
        req = self._requests.get(seq.request_id)
        if req is None:
            c = self.config
            req = self._requests[seq.request_id] = _Request(
                Context(c.min_n, c.max_n), AdaptiveK(c.num_tokens, c.draft_cost, c.probe_every, c.adaptive))
        return req

    def propose(self, seqs: Seq[Drafting], room: Seq[int], rows: int = 1) -> list[list[int]]:
        """A draft for each sequence, at most room[i] tokens (and its adaptive k, priced for a
        decode step of `rows` rows)."""
        out: list[list[int]] = [[] for _ in seqs]
        model_rows = []

        def cost(k: int) -> float:
            return self.costs.relative(rows, k)

        for i, seq in enumerate(seqs):
            req = self._request(seq)
            req.context.sync(seq.prompt, seq.output)
            k = min(req.k.next_k(cost), room[i])
            if k <= 0:
                continue
            if self.config.method == "draft":
                model_rows.append((i, seq.request_id, req.context.tokens, k))
                continue
            draft = req.context.lookup(k)
            if not draft and self.config.method == "suffix":
                cache = self._caches.get(seq.adapter)
                draft = cache.lookup(req.context, k) if cache is not None else []
            out[i] = draft
        if model_rows:
            assert self.draft is not None
            drafts = self.draft.propose([(rid, list(tokens), k) for _, rid, tokens, k in model_rows])
            for i, rid, _, _ in model_rows:
                out[i] = drafts.get(rid, [])
        return out

    def observe(self, seq: Drafting, drafted: int, accepted: int, emitted: int) -> None:
        """A row of `seq` carried `drafted` tokens, kept the first `accepted` and emitted `emitted`."""
        if drafted <= 0:
            return
        req = self._requests.get(seq.request_id)
        if req is not None:
            req.k.observe(drafted, accepted)
        s = self.stats
        s.rows += 1
        s.drafted += drafted
        s.accepted += accepted
        s.emitted += emitted
        for i in range(min(drafted, len(s.drafted_at))):
            s.drafted_at[i] += 1
            s.accepted_at[i] += i < accepted

    def finish(self, seq: Drafting, completed: bool) -> None:
        """`seq` ended: its state goes; a completed output joins its adapter's suffix cache."""
        self._requests.pop(seq.request_id, None)
        if self.draft is not None:
            self.draft.release(seq.request_id)
        if completed and self.config.method == "suffix" and seq.output:
            c = self.config
            cache = self._caches.get(seq.adapter)
            if cache is None:
                cache = self._caches[seq.adapter] = SuffixCache(c.min_n, c.max_n, c.suffix_cache_tokens,
                                                                self._output_ids)
            cache.add(seq.output)
            self._bound_suffix_caches()

    def _bound_suffix_caches(self) -> None:
        """Evicts the oldest outputs of all adapters until they hold suffix_cache_tokens at most."""
        while self.suffix_cache_tokens > self.config.suffix_cache_tokens:
            oldest = min((c for c in self._caches.values() if c.tokens), key=lambda c: c.oldest or 0)
            oldest.evict_oldest()

    @property
    def suffix_cache_tokens(self) -> int:
        """Output tokens the suffix caches hold, all adapters together."""
        return sum(c.tokens for c in self._caches.values())

    def forget(self, adapter: int) -> None:
        """Adapter index `adapter` was reloaded or left the pool: its outputs no longer say what
        the next adapter under that index writes."""
        self._caches.pop(adapter, None)


class SpeculativeDecoder:
    """The engine's speculative decoding (rank 0): before a step is scheduled it drafts for the
    decoding sequences that have no draft (their constraint's grammar cutting each draft to what
    it accepts); after it, it learns what was kept (`observe`) and what a step of decode rows
    costs (`observe_step`, the speculator's pricing of drafts)."""

    def __init__(self, speculator: Speculator, device_type: str,
                 grammar_prefix: Callable[[Sequence, list[int]], list[int]]) -> None:
        self.speculator = speculator
        self.step_tokens = speculator.config.step_tokens(device_type)
        self._grammar_prefix = grammar_prefix

    def propose(self, running: Seq[Sequence]) -> None:
        """Drafts for the decoding sequences that have none. A step's tokens stay within
        `step_tokens` (SpeculativeConfig.max_step_tokens): each decoding row may draft an even
        share of what one token per row leaves."""
        decoding = [s for s in running if s.status is Status.RUNNING]
        widest = (self.step_tokens - len(decoding)) // max(len(decoding), 1)
        seqs = [s for s in decoding if not s.draft and s.params.speculate is not False]
        if not seqs or widest < 1:
            return
        room = [min(widest, s.params.max_new_tokens - len(s.output) - 1) for s in seqs]
        for seq, draft in zip(seqs, self.speculator.propose(seqs, room, rows=len(decoding))):
            seq.draft = self._grammar_prefix(seq, draft)

    def observe_step(self, tokens: int, decode_only: bool, seconds: float) -> None:
        """A step's time, for pricing drafts: steps of decode rows only, as wide as drafting may
        make them (wider ones take other kernels, whose cost says nothing about drafting)."""
        if decode_only and tokens <= self.step_tokens:
            self.speculator.costs.observe(tokens, seconds)

    def observe(self, seq: Sequence, drafted: int, accepted: int, emitted: int) -> None:
        self.speculator.observe(seq, drafted, accepted, emitted)

    def finish(self, seq: Sequence, completed: bool) -> None:
        self.speculator.finish(seq, completed)

    def forget(self, adapter: int) -> None:
        self.speculator.forget(adapter)

    @property
    def stats(self) -> SpecStats:
        return self.speculator.stats.copy()


def build_speculator(config: SpeculativeConfig, vocab_size: int, max_batch: int, max_seq_len: int) -> Speculator:
    config = config.validate()
    draft = None
    if config.method == "draft":
        assert config.draft_model is not None
        draft = load_draft_model(config.draft_model, vocab_size, max_batch, max_seq_len)
    return Speculator(config, draft)


# ----------------------------------------------------------------------------- flags (tprt serve, tprt generate)


def speculative_from_flags(flags: Mapping[str, Any], vocab_size: int | None = None) -> SpeculativeConfig | None:
    """The SpeculativeConfig the flags ask for (None: --speculative not given), checked; with the
    model's `vocab_size`, a draft model's vocabulary is checked too (before any rank starts)."""
    if flags.get("speculative") is None:
        if flags.get("draft_model") is not None:
            raise ConfigError("--draft-model needs --speculative draft")
        return None
    draft = flags.get("draft_model")
    config = SpeculativeConfig(flags["speculative"], flags["num_speculative_tokens"], flags["spec_min_n"],
                               flags["spec_max_n"], None if draft is None else str(draft)).validate()
    if config.draft_model is not None and vocab_size is not None:
        check_draft_model(config.draft_model, vocab_size)
    return config


def check_draft_model(path: str | Path, vocab_size: int) -> None:
    """Raises ConfigError naming --draft-model unless `path` is a TP-1 checkpoint of `vocab_size` tokens."""
    from tprt.checkpoint.format import TPCheckpoint
    from tprt.errors import CheckpointError

    try:
        ckpt = TPCheckpoint(path)
    except (CheckpointError, OSError) as e:
        raise ConfigError(f"--draft-model {path}: {e}") from None
    if ckpt.config.vocab_size != vocab_size:
        raise ConfigError(f"--draft-model {path}: vocab_size {ckpt.config.vocab_size} differs from the model's "
                          f"{vocab_size}; a draft model must share the model's tokenizer and vocabulary")
    if ckpt.tp_size != 1:
        raise ConfigError(f"--draft-model {path}: sharded for tp_size={ckpt.tp_size}; the draft runs on rank 0 "
                          "alone: reshard it to 1 with `tprt-convert reshard`")
