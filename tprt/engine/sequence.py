"""One request's state inside the engine (rank 0 only), and the events the engine reports.

A `Sequence` is what the scheduler (tprt.engine.scheduler) schedules: its prompt, output, KV
blocks and progress; the driver (tprt.engine.core) adds its sampling state and stop checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tprt.engine.constraints import Matcher
from tprt.engine.sampling import SamplingParams, make_generator
from tprt.engine.scheduler import Status
from tprt.engine.stopping import StepOutput, StopChecker
from tprt.engine.thinking import ThinkingState
from tprt.text.tokenizer import IncrementalDetokenizer, Tokenizer

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values were reused, not computed


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request: a token (with its text delta), or its end.

    A request's events concatenate to its output: `text` deltas join to the full text, and the
    last event has `finish_reason` set. A cancelled request ends with an event whose token_id is
    None. `logprob` is the raw model log-probability of the token (None unless asked for, see
    SamplingParams.logprobs); `top_logprobs` the n most likely (id, logprob), most likely first.
    """

    request_id: str
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop id or stop string that ended the request
    usage: Usage | None = None  # set on the last event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    """A request being served: prompt, progress through it, generated ids and stop state."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int | None,
                 tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], device: torch.device,
                 adapter: int = 0, priority: int = 0) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.status = Status.WAITING
        self.adapter = adapter  # adapter index its rows are routed to (tprt.lora.routing); 0: the base model
        self.priority = priority  # 0: interactive; higher: background (tprt.engine.scheduler)
        self.blocks: list[int] = []  # its KV block table (tprt.engine.prefix_cache.BlockPool)
        self.digests: list[bytes] = []  # the names of its full blocks, in order
        self.num_computed = 0  # leading tokens whose keys and values are in the cache (and kept)
        self.prefill_target = len(prompt)  # tokens to prefill before sampling: the prompt, or all so far after preemption
        self.cached_prompt_tokens = 0  # prompt tokens reused from shared blocks (tprt.engine.prefix_cache)
        self.cache_key: tuple[int, int] = (adapter, 0)  # what its keys and values are computed with
        self.output: list[int] = []
        self.draft: list[int] = []  # tokens proposed after the last one, verified in its next decode row
        # Its output constraint's state (tprt.engine.constraints.Matcher; set by the engine), which
        # follows the output ids and so survives preemption.
        self.matcher: Matcher | None = None
        # A reasoning model's thinking (tprt.engine.thinking): where it is, and the constraint's
        # matcher parked until the block closes (the constraint applies to the answer).
        self.thinking = ThinkingState(params.thinking) if params.thinking is not None else None
        self.parked: Matcher | None = None
        # Sits out the coming decode step: the engine throttles rows whose constraint's masks cost
        # more than their share of a step (Engine._throttle_masks); mask_credit is that share, saved.
        self.held = False
        self.mask_credit = 0.0
        # In a step not yet finished (pipeline stages keep several in flight: tprt.engine.core):
        # it sits out later steps and is never preempted until that step's tokens are chosen.
        self.in_flight = False
        self.generator = make_generator(seed, device) if seed is not None else None
        detok = IncrementalDetokenizer(tokenizer, prompt) if tokenizer is not None else None
        self.stop = StopChecker(params, eos_token_ids, detok)
        self._history: torch.Tensor | None = None  # prompt + output ids, for the penalties
        if params.reads_history:
            self._history = torch.empty(len(prompt) + params.max_new_tokens, dtype=torch.long, device=device)
            self._history[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)

    @property
    def needs_logits(self) -> bool:
        """Whether choosing this sequence's next token needs the full logits (not just the argmax)."""
        p = self.params
        return not p.greedy or p.logprobs or p.shapes_logits or self.matcher is not None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def history(self) -> torch.Tensor | list[int]:
        """Prompt and output ids so far (a view; empty when no penalty needs them)."""
        return self._history[: self.length] if self._history is not None else []

    def append(self, token_id: int) -> StepOutput:
        """Records a generated token; returns its text and, at the end, why it ended."""
        if self._history is not None:
            self._history[self.length] = token_id
        self.output.append(token_id)
        out = self.stop.step(token_id)
        if self.thinking is not None and self.thinking.observe(token_id) and self.parked is not None:
            self.matcher, self.parked = self.parked, None  # thinking over: the answer is constrained
        elif self.matcher is not None and out.finish_reason is None:
            # The mask allowed only what the constraint accepts; when it has ended, so has the output.
            # A matcher that fails (over one of llguidance's limits or its mask time budget
            # mid-sequence) ends it too, and says so, rather than stopping the engine.
            accepted = self.matcher.accept(token_id)
            if not accepted or self.matcher.finished:
                end = self.stop.finish("stop")
                out = StepOutput(out.text + end.text, "stop", None if accepted else "constraint_error")
        elif self.matcher is not None and self.matcher.error:  # its failed mask offered only the end
            out = StepOutput(out.text, "stop", "constraint_error")
        if out.finish_reason is not None:
            self.status = Status.FINISHED
        return out

    def tokens(self, n: int) -> list[int]:
        """Its first n ids (prompt, then output)."""
        return self.prompt[:n] if n <= len(self.prompt) else self.prompt + self.output[: n - len(self.prompt)]

    def usage(self) -> Usage:
        return Usage(len(self.prompt), len(self.output), self.cached_prompt_tokens)
