"""The engine's third beat (rank 0): a step's result turned into chosen tokens and events.

`OutputProcessor.process(schedule, result, masks)` chooses the token at every position of every
row that returns logits, all at once: a prompt chunk that ends its prompt chooses its first
token; a decode row chooses one token per position, the position after its last token and one
after each drafted token. One `sample` call covers them all (masks where a constraint needs
one, each position's repetition-penalty history with the draft before it). Then each row keeps
its positions in order while the drafted token there is the one chosen, and ends at the first
replaced (or its end, or the request's): a draft is kept iff the sampler picks it at its
position, speculative sampling's rejection rule with a deterministic proposer (see
tprt.engine.sampling.sample). The positions after what a row kept are given back to the
scheduler.

Seeded reproducibility: a sampled row draws one uniform per position from its own generator, in
position order, and its generator is then set back to after the draws of the positions it kept,
so a request spends one draw per emitted token with or without drafts and gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tprt.engine.runner import StepResult
from tprt.engine.sampling import SamplingParams, sample
from tprt.engine.scheduler import Schedule, Scheduler, Status
from tprt.engine.sequence import Sequence, TokenEvent
from tprt.engine.speculative import SpeculativeDecoder
from tprt.engine.structured import RowMasks, StructuredOutputManager


@dataclass(frozen=True)
class _Row:
    """A row that chooses tokens: its sequence, the drafted tokens it verifies, its first result
    row, and whether it decodes (else it ends its prompt)."""

    seq: Sequence
    draft: list[int]
    first: int
    decoding: bool

    @property
    def positions(self) -> int:
        return 1 + len(self.draft)


@dataclass(frozen=True)
class _Choices:
    """The token chosen at every result row, what its event reports, and each drafting sampled
    row's generator state before the step's draws (by request id)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    tops: list[list[tuple[int, float]]] | None = None
    states: dict[str, torch.Tensor] = field(default_factory=dict)


class OutputProcessor:
    """Chooses, verifies and emits (see the module docstring)."""

    def __init__(self, scheduler: Scheduler[Sequence], structured: StructuredOutputManager,
                 speculative: SpeculativeDecoder | None, end: Callable[[Sequence, bool], None]) -> None:
        self.scheduler = scheduler
        self.structured = structured
        self.speculative = speculative
        self._end = end  # the engine's: a finished request leaves the registry and the scheduler

    def process(self, schedule: Schedule[Sequence], result: StepResult,
                masks: dict[str, RowMasks]) -> list[TokenEvent]:
        """The events of a step whose batch `schedule.batch` produced `result`."""
        assert schedule.batch is not None
        rows, first = [], 0
        kept: list[int] = []  # the result rows of the rows that choose
        # A sequence that ended while its step was in flight (cancelled) has nothing to choose.
        for seq, n in zip(schedule.decode, schedule.batch.lens):
            if seq.status is not Status.FINISHED:
                rows.append(_Row(seq, list(seq.draft[: n - 1]), len(kept), True))
                kept += range(first, first + n)
            first += n
        for seq, n in schedule.prefill:
            if seq.status is Status.FINISHED:
                first += int(schedule.ends_prompt(seq, n))
            elif self.scheduler.prefilled(seq, n):  # its prompt is done: the last token's logits choose
                rows.append(_Row(seq, [], len(kept), False))
                kept.append(first)
                first += 1
        if not rows:
            return []
        if len(kept) < first:
            result = _rows_of(result, kept)
        choices = self._choose(rows, result, masks)
        self._force(rows, choices, result)
        return [event for row in rows for event in self._keep(row, choices)]

    @staticmethod
    def _force(rows: list[_Row], choices: _Choices, result: StepResult) -> None:
        """A thinking sequence's forced id (tprt.engine.thinking) replaces the choice at its row's
        first position, with the model's log-probability of it where they are reported."""
        for row in rows:
            thinking = row.seq.thinking
            if thinking is None or not thinking.forced:
                continue
            token, i = thinking.forced[0], row.first
            choices.token_ids[i] = token
            if choices.logprobs is not None and result.logits is not None:
                choices.logprobs[i] = float(torch.log_softmax(result.logits[i].float(), dim=-1)[token])

    def _choose(self, rows: list[_Row], result: StepResult, masks: dict[str, RowMasks]) -> _Choices:
        """The token chosen at every position of every row, in result order."""
        if result.logits is None:  # greedy rows: the argmax, which keeps a draft iff it is the draft
            assert result.ids is not None
            return _Choices(result.ids.tolist())
        logits = result.logits
        params = [row.seq.params for row in rows for _ in range(row.positions)]
        allowed = None
        if any(row.seq.request_id in masks for row in rows):
            best = logits.argmax(dim=-1).tolist()
            allowed = self.structured.allowed([
                (masks.get(row.seq.request_id), best[row.first : row.first + row.positions],
                 _argmax_choice(row.seq.params)) for row in rows])
            if allowed is None and all(_plain_greedy(p) for p in params):  # every position takes its argmax
                return _Choices(best)
            allowed = None if allowed is None else allowed.to(logits.device)
        states = {row.seq.request_id: row.seq.generator.get_state() for row in rows
                  if row.draft and row.seq.generator is not None and not row.seq.params.greedy}
        chosen = sample(logits, params, [row.seq.generator for row in rows for _ in range(row.positions)],
                        [h for row in rows for h in _histories(row)], allowed,
                        [len(row.seq.prompt) for row in rows for _ in range(row.positions)])
        tops = None
        if chosen.top_ids.shape[1]:
            tops = [list(zip(i, lp)) for i, lp in zip(chosen.top_ids.tolist(), chosen.top_logprobs.tolist())]
        return _Choices(chosen.token_ids.tolist(), chosen.logprobs.tolist(), tops, states)

    def _keep(self, row: _Row, choices: _Choices) -> list[TokenEvent]:
        """Emits the row's positions while its drafts are chosen; gives back the rest."""
        seq, events, accepted = row.seq, [], 0
        for j in range(row.positions):
            i = row.first + j
            token = choices.token_ids[i]
            events.append(self._emit(seq, token, None if choices.logprobs is None else choices.logprobs[i],
                                     [] if choices.tops is None else choices.tops[i]))
            hit = j < len(row.draft) and token == row.draft[j]
            accepted += hit
            if seq.status is Status.FINISHED or not hit:
                break
        kept = len(events)
        state = choices.states.get(seq.request_id)
        if state is not None:  # back to after the draws of the kept positions
            assert seq.generator is not None
            seq.generator.set_state(state)
            for _ in range(kept):
                torch.rand((), generator=seq.generator, dtype=torch.float64, device=seq.generator.device)
        if row.decoding and seq.status is not Status.FINISHED:
            self.scheduler.decoded(seq, kept)
        if row.decoding and self.speculative is not None:
            self.speculative.observe(seq, len(row.draft), accepted, kept)
        return events

    def _emit(self, seq: Sequence, token_id: int, logprob: float | None, top: list[tuple[int, float]]) -> TokenEvent:
        """Appends a chosen token to its sequence; its event (the last one when it finished)."""
        out = seq.append(token_id)
        p = seq.params
        finished = out.finish_reason is not None
        event = TokenEvent(
            seq.request_id, token_id, out.text,
            logprob=logprob if p.logprobs else None,
            top_logprobs=tuple(top[: p.top_logprobs]) if p.logprobs else (),
            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            usage=seq.usage() if finished else None,
        )
        if finished:
            self._end(seq, True)
        return event


def _rows_of(result: StepResult, index: list[int]) -> StepResult:
    """The result's rows `index`, in order."""
    pick = torch.tensor(index)
    return StepResult(None if result.ids is None else result.ids[pick.to(result.ids.device)],
                      None if result.logits is None else result.logits[pick.to(result.logits.device)])


def _histories(row: _Row) -> list[torch.Tensor | list[int]]:
    """Each position's prompt and output before it (the draft up to it included), for the
    penalties (empty where the row has none)."""
    seq = row.seq
    history = seq.history()
    if not seq.params.reads_history or not row.draft:
        return [history] * row.positions
    assert isinstance(history, torch.Tensor)
    draft = torch.tensor(row.draft, dtype=history.dtype, device=history.device)
    return [torch.cat((history, draft[:j])) for j in range(row.positions)]


def _argmax_choice(p: SamplingParams) -> bool:
    """A row whose choice is its logits' argmax (what a mask must keep to be skipped)."""
    return p.greedy and not p.shapes_logits


def _plain_greedy(p: SamplingParams) -> bool:
    """A row whose choice is its logits' argmax and reports nothing else."""
    return _argmax_choice(p) and not p.logprobs
