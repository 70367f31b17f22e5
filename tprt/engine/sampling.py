"""Per-request sampling parameters and a batched sampler over true-vocabulary logits.

Processing follows Hugging Face `generate` (order and arithmetic): repetition penalty, temperature,
top-k, top-p, min-p; greedy rows (temperature 0) take the argmax after the repetition penalty.

Reported log-probabilities are the *raw* model distribution, `log_softmax(logits)` before any
processor (the OpenAI API and vLLM's default): they do not depend on the sampling settings.

Reproducibility: each row draws exactly one uniform number per sampled step from its own
`torch.Generator`, and every other operation is row-wise and deterministic. So the same seed and the
same logits give the same token whatever else is in the batch (bit-exact on CPU; on GPU reductions can
differ in the last bit with the batch shape, which changes a token only when a draw lands on a boundary).
Across TP ranks: with bit-identical logits (the vocab-parallel head gathers, it does not reduce) and
generators seeded identically, every rank picks the same token. Rows without a generator use the global
RNG, whose state may differ between ranks: the engine must either give every row a generator seeded
the same on all ranks, or sample on rank 0 and broadcast the ids (the safe default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tprt.engine.constraints import ConstraintSpec
from tprt.engine.thinking import Thinking

from tprt.errors import ValidationError

MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_NEW_TOKENS = 256  # every front end's default (tprt.engine.request shrinks it to fit the context)
_SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops. Off values: top_k 0, top_p 1, min_p 0, penalty 1."""

    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th kept, like HF)
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p * the top token's probability
    repetition_penalty: float = 1.0  # HF: positive logits / p, negative * p, for tokens in prompt+output
    # OpenAI's: each token's logit less frequency_penalty x its count in the output so far, less
    # presence_penalty once it occurs there at all (the prompt does not count).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit before anything else)
    seed: int | None = None  # per-request generator seed; None uses the global RNG
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # generated tokens at most
    stop_token_ids: tuple[int, ...] = ()  # ids that end generation besides EOS
    stop_strings: tuple[str, ...] = ()  # texts that end generation; removed from the output
    ignore_eos: bool = False  # keep going past EOS
    logprobs: bool = False  # report the chosen token's log-probability
    top_logprobs: int = 0  # also report the n most likely tokens (0..20); needs logprobs
    # Output constraint (JSON schema, regex, choice, grammar: tprt.engine.constraints); None: free text
    constraint: ConstraintSpec | None = None
    # Speculative decoding for this request (tprt.engine.speculative): None follows the engine's
    # setting, False turns it off (True: on where the engine drafts at all).
    speculate: bool | None = None
    # A reasoning model's thinking, where the engine steers it (tprt.engine.thinking): a budget,
    # or a constraint that applies after it; None: the output is taken as it comes.
    thinking: Thinking | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, protobuf) while staying hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def reads_history(self) -> bool:
        """Whether choosing a token reads the ids before it (the penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether the token chosen may differ from the argmax for reasons other than sampling."""
        return self.reads_history or bool(self.logit_bias)

    def validate(self, vocab_size: int) -> SamplingParams:
        """Raises ValidationError (with `.field`) for the first field out of range; returns self.

        Messages start with the field name, so a caller can substitute its own spelling of it
        (`--top-p`, a protobuf field path). Requests are checked as a whole (context length,
        defaults) by tprt.engine.request, which calls this."""
        _check_float("temperature", self.temperature, 0.0, math.inf, "a finite number >= 0 (0 = greedy)")
        _check_int("top_k", self.top_k, 0, vocab_size, f"an integer in [0, {vocab_size}] (0 = off)")
        _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1] (1 = off)", low_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1] (0 = off)")
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                     "a finite number > 0 (1 = off)", low_open=True)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0, "in [-2, 2] (0 = off)")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValidationError("logit_bias", f"logit_bias must hold (token id, bias) pairs, got {pair!r:.60}")
            t, b = pair
            _check_int("logit_bias", t, 0, vocab_size - 1, f"token ids in [0, {vocab_size - 1}]")
            _check_float("logit_bias", b, -100.0, 100.0, "biases in [-100, 100]")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, _SEED_MAX, f"an integer in [0, {_SEED_MAX}] or unset")
        _check_int("max_new_tokens", self.max_new_tokens, 1, 2**31 - 1, "an integer >= 1")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, vocab_size - 1, f"token ids in [0, {vocab_size - 1}]")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValidationError("stop_strings", f"stop_strings must be non-empty strings, got {s!r}")
        if self.constraint is not None and self.ignore_eos:
            raise ValidationError("ignore_eos", "ignore_eos cannot be combined with an output constraint "
                                                "(the constraint decides where the output ends)")
        if self.speculate is not None and not isinstance(self.speculate, bool):
            raise ValidationError("speculate", f"speculate must be true, false or unset, got {self.speculate!r}")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS,
                   f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise ValidationError("top_logprobs", "top_logprobs requires logprobs to be enabled")
        if self.thinking is not None:
            self.thinking.validate(vocab_size)
        return self


def _check_int(field: str, value: object, low: int, high: int, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValidationError(field, f"{field} must be {allowed}, got {value!r}")


def _check_float(field: str, value: object, low: float, high: float, allowed: str,
                 low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        assert isinstance(value, (int, float))
        ok = (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise ValidationError(field, f"{field} must be {allowed}, got {value!r}")


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request; seed it identically on every rank that samples."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass(frozen=True)
class SampleResult:
    """One step's choice for each row. `top_*` have n = the largest top_logprobs asked for in the batch
    (rows that asked for fewer read a prefix; n = 0 when nobody asked)."""

    token_ids: Tensor  # [B] long
    logprobs: Tensor  # [B] float32: raw log_softmax(logits) of the chosen token (zeros when no row asked)
    top_ids: Tensor  # [B, n] long, most likely first
    top_logprobs: Tensor  # [B, n] float32, raw


def sample(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           history: Sequence[Sequence[int] | Tensor], allowed: Tensor | None = None,
           output_starts: Sequence[int] | None = None) -> SampleResult:
    """Picks one token per row of `logits` [B, V].

    V must be the true vocabulary (slice TP padding off first). `history[i]` is row i's prompt and
    generated ids, read only where its penalties are on (`SamplingParams.reads_history`); its
    output starts at `output_starts[i]` (0 where not given: all of it counts for the presence and
    frequency penalties). `allowed` [B, V] bool, when
    given, masks each row before every other processor (output constraints: temperature, top-k,
    top-p and min-p then act on the allowed tokens); reported logprobs stay the raw model's.
    Computes in float32.

    Speculative decoding needs nothing more: a drafted token x (from a deterministic proposer,
    so its q is a point mass) is kept iff this function picks it at x's position. A greedy row
    picks the argmax; a sampled row's inverse-CDF draw picks x with probability p(x), exactly the
    acceptance min(1, p(x)/q(x)) of speculative rejection sampling, and on a miss its token is
    already a draw from p without x, the residual rule's. Coupling the test to the draw this way
    spends one uniform per emitted token, as plain decoding does, so a seeded request gives the
    same tokens with or without drafts, whatever they were."""
    batch = logits.shape[0]
    if not len(params) == len(generators) == len(history) == batch:
        raise ValueError(f"sample: {batch} logits rows but {len(params)} params, {len(generators)} "
                         f"generators, {len(history)} histories")
    raw = logits.float()  # [B, V]
    masked = raw if allowed is None else raw.masked_fill(~allowed, -math.inf)
    scores = process_logits(masked, params, history, output_starts)  # [B, V], -inf where filtered
    tokens = scores.argmax(dim=-1)  # [B]; kept for greedy rows
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = _index(rows, raw.device)
        u = _uniforms([generators[i] for i in rows], raw.device)
        tokens[index] = _inverse_cdf(torch.softmax(scores[index], dim=-1), u)
    n = max([p.top_logprobs for p in params if p.logprobs], default=0)
    if not any(p.logprobs for p in params):  # nobody reads them: spare the log-softmax
        return SampleResult(tokens, raw.new_zeros(batch), tokens.new_empty(batch, 0), raw.new_empty(batch, 0))
    lse = torch.logsumexp(raw, dim=-1)  # [B]
    chosen = raw.gather(1, tokens[:, None]).squeeze(1) - lse  # [B]
    top_vals, top_ids = raw.topk(n, dim=-1) if n else (raw.new_empty(batch, 0), tokens.new_empty(batch, 0))
    return SampleResult(tokens, chosen, top_ids, top_vals - lse[:, None])


def process_logits(logits: Tensor, params: Sequence[SamplingParams],
                   history: Sequence[Sequence[int] | Tensor], output_starts: Sequence[int] | None = None) -> Tensor:
    """HF's processor chain, row-wise: float32 [B, V] scores with filtered tokens at -inf. OpenAI's
    logit bias comes first, then HF's repetition penalty, OpenAI's presence and frequency
    penalties, temperature and the filters.

    Greedy rows get the bias and penalties only (the filters always keep the argmax)."""
    scores = logits.float()
    device = scores.device
    if any(p.logit_bias for p in params):
        scores = _logit_bias(scores, params)
    if any(p.repetition_penalty != 1.0 for p in params):
        scores = _repetition_penalty(scores, params, history)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        scores = _output_penalties(scores, params, history, output_starts or [0] * len(params))
    if any(p.temperature not in (0.0, 1.0) for p in params):
        temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        scores = scores / temp[:, None]
    rows = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
    if rows:  # sorting is the expensive part: only the rows that filter
        scores = _on_rows(scores, rows, _top_k_top_p(scores[_index(rows, device)], [params[i] for i in rows]))
    rows = [i for i, p in enumerate(params) if not p.greedy and p.min_p > 0]
    if rows:
        sub = scores[_index(rows, device)]  # [R, V]
        min_p = torch.tensor([params[i].min_p for i in rows], device=device)
        probs = torch.softmax(sub, dim=-1)  # [R, V]
        remove = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scores = _on_rows(scores, rows, sub.masked_fill(remove, -math.inf))
    return scores


def _index(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _on_rows(scores: Tensor, rows: list[int], values: Tensor) -> Tensor:
    """`scores` with `values` [R, V] in place of the listed rows (a copy unless every row is replaced)."""
    if len(rows) == scores.shape[0] and rows == list(range(len(rows))):
        return values
    return scores.index_copy(0, _index(rows, scores.device), values)


def _repetition_penalty(scores: Tensor, params: Sequence[SamplingParams],
                        history: Sequence[Sequence[int] | Tensor]) -> Tensor:
    """Divides positive / multiplies negative scores of every id seen in a row's history."""
    vocab = scores.shape[1]
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    ids = [torch.as_tensor(history[i], dtype=torch.long, device=scores.device).reshape(-1) for i in rows]
    longest = max([len(t) for t in ids], default=0)
    padded = torch.full((len(rows), longest), vocab, dtype=torch.long, device=scores.device)  # [R, L]
    for r, t in enumerate(ids):
        padded[r, : len(t)] = t.clamp(0, vocab)  # out-of-range ids land in the spare column
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=scores.device)
    seen.scatter_(1, padded, True)  # [R, V + 1]
    penalty = torch.tensor([params[i].repetition_penalty for i in rows], device=scores.device)[:, None]
    sub = scores[_index(rows, scores.device)]  # [R, V]
    penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
    return _on_rows(scores, rows, torch.where(seen[:, :vocab], penalised, sub))


def _logit_bias(scores: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Adds each row's biases to its tokens' scores (a bias of -100 all but bans a token, +100 all but forces it)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    bias = torch.zeros(len(rows), scores.shape[1], device=scores.device)  # [R, V]
    for r, i in enumerate(rows):
        ids, values = zip(*params[i].logit_bias)
        bias[r, list(ids)] = torch.tensor(values, device=scores.device)
    return _on_rows(scores, rows, scores[_index(rows, scores.device)] + bias)


def _output_penalties(scores: Tensor, params: Sequence[SamplingParams], history: Sequence[Sequence[int] | Tensor],
                      output_starts: Sequence[int]) -> Tensor:
    """OpenAI's presence and frequency penalties: score - frequency x count - presence x (count > 0),
    over each row's output ids (its history from output_starts[i] on)."""
    vocab = scores.shape[1]
    rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    counts = torch.zeros(len(rows), vocab + 1, device=scores.device)  # [R, V + 1]: out-of-range ids in the spare
    for r, i in enumerate(rows):
        ids = torch.as_tensor(history[i], dtype=torch.long, device=scores.device).reshape(-1)[output_starts[i]:]
        counts[r].index_add_(0, ids.clamp(0, vocab), torch.ones(len(ids), device=scores.device))
    counts = counts[:, :vocab]
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=scores.device)[:, None]
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=scores.device)[:, None]
    sub = scores[_index(rows, scores.device)]
    return _on_rows(scores, rows, sub - frequency * counts - presence * (counts > 0).float())


def _top_k_top_p(scores: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Top-k then top-p in one ascending sort, with HF's thresholds (ties at the k-th value kept;
    top-p drops the low tail whose cumulative probability is <= 1 - top_p, always keeping the top)."""
    vocab = scores.shape[-1]
    device = scores.device
    k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
    ascending, order = torch.sort(scores, dim=-1)  # [R, V]
    kth = ascending.gather(1, (vocab - k)[:, None])  # [R, 1]: k-th largest value
    drop = ascending < kth
    ascending = ascending.masked_fill(drop, -math.inf)  # still ascending: the smallest were dropped
    if any(p.top_p < 1.0 for p in params):
        # 1 - top_p in double then float32, as HF compares against the Python float.
        tail = torch.tensor([1.0 - p.top_p if p.top_p < 1.0 else -1.0 for p in params], device=device)
        cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)  # [R, V]
        drop_p = cumulative <= tail[:, None]
        drop_p[:, -1] = False
        drop = drop | drop_p
    remove = torch.zeros_like(drop).scatter(1, order, drop)  # back to vocab order
    return scores.masked_fill(remove, -math.inf)


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> Tensor:
    """One float64 uniform in [0, 1) per row, each from the row's own generator (no host sync)."""
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[torch.tensor(shared, device=device)] = torch.rand(len(shared), dtype=torch.float64, device=device)
    own = [(i, g) for i, g in enumerate(generators) if g is not None]
    if own:
        draws = [torch.rand((), generator=g, dtype=torch.float64, device=g.device).to(device) for _, g in own]
        u[torch.tensor([i for i, _ in own], device=device)] = torch.stack(draws)
    return u


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Row-wise inverse-CDF draw: the first token whose cumulative probability exceeds u * total.

    `right=True` never lands on a zero-probability token; a draw past the end takes the last
    token with non-zero probability."""
    vocab = probs.shape[-1]
    cdf = probs.double().cumsum(dim=-1)  # [R, V]
    target = (u * cdf[:, -1])[:, None]  # [R, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [R]
    last_nonzero = (vocab - 1) - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.where(tokens >= vocab, last_nonzero, tokens)
