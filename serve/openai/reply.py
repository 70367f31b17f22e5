"""One chat or completions request's OpenAI response, whole or as stream chunks, from the
generation core's events (serve/core/generation.py): the text, logprobs, finish reasons and
usage of each choice; tool calls (forced ones streamed as call deltas, "auto" answers held until
they are known to be calls or text); a reasoning model's thinking as `reasoning_content`; and
completions' `echo`. The Responses and Anthropic Messages APIs build on the chat deltas it makes.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import Any

from serve.core.generation import ChoiceEvent, Prepared, TokenText
from serve.core.reasoning import ReasoningSplit, split_reply
from serve.core.structured import CallDelta, ToolCallStream
from serve.errors import Unavailable
from tprt.engine.sequence import Usage


def _call_delta(d: CallDelta) -> dict[str, Any]:
    """OpenAI's streamed tool-call piece: the first names the call, the rest add arguments."""
    if d.name is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


def _by_text(top: list[dict[str, Any]]) -> dict[str, float]:
    """The legacy completions format's {text: logprob}: tokens of the same text (bytes of a
    character) share a key, which keeps the most likely of them."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out


MIN_LOGPROB = -9999.0  # OpenAI's stand-in for a probability of zero; JSON has no -Infinity


def json_logprob(value: float) -> float | None:
    """A log-probability as JSON can carry it: -inf as MIN_LOGPROB, NaN (never from a sound model) as null."""
    if math.isnan(value):
        return None
    return max(min(value, 0.0), MIN_LOGPROB)


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt as `echo` returns it: its tokens' texts and, where logprobs were asked, the
    log-probabilities of tokens 1 .. n-1 and their most likely alternatives (text, logprob)."""

    tokens: list[str]
    logprobs: list[float] | None = None
    top: list[list[tuple[str, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class PromptScores:
    """What a request shows of its prompts: `echo`'s (per prompt), and vLLM's `prompt_logprobs`
    (per prompt: None for the first token, then {token id: {logprob, rank, decoded_token}} for the
    token and its likeliest alternatives)."""

    echoed: list[EchoedPrompt] | None = None
    prompt_logprobs: list[list[dict[str, Any] | None]] | None = None


def prompt_logprob_entries(ids: list[int], scored: Any, top: int,
                           text: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs of one prompt from its scores (serve.ranks.commands.PromptTokenLogprobs)."""
    out: list[dict[str, Any] | None] = [None]
    for j, token in enumerate(ids[1:]):
        entry = {str(token): {"logprob": json_logprob(scored.logprobs[j]), "rank": scored.ranks[j],
                              "decoded_token": text(token)}}
        for rank, (alt, lp) in enumerate(scored.top[j][:top] if top else (), 1):
            entry.setdefault(str(alt), {"logprob": json_logprob(lp), "rank": rank, "decoded_token": text(alt)})
        out.append(entry)
    return out


def best_choices(choices: list[dict[str, Any]], generated: int, keep: int, show_logprobs: bool) -> list[dict[str, Any]]:
    """Of each prompt's `generated` choices (completions' best_of), the `keep` with the highest
    log-probability per token, most likely first, re-indexed; their logprobs hidden unless asked."""
    def per_token(choice: dict[str, Any]) -> float:
        values = [v for v in (choice.get("logprobs") or {}).get("token_logprobs") or () if v is not None]
        return sum(values) / len(values) if values else -math.inf

    out = []
    for start in range(0, len(choices), generated):
        out += sorted(choices[start:start + generated], key=per_token, reverse=True)[:keep]
    for i, choice in enumerate(out):
        choice["index"] = i
        if not show_logprobs:
            choice["logprobs"] = None
    return out


class Reply:
    """Builds one request's OpenAI response (whole, or as stream chunks) from its events."""

    def __init__(self, kind: str, model: str, prepared: Prepared) -> None:
        self.chat = kind == "chat.completion"
        self.kind = kind
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.prepared = prepared
        count = len(prepared.choices)
        self.text: list[list[str]] = [[] for _ in range(count)]
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.usage_of: list[Any] = [None] * count
        self.offset = [0] * count
        # Tool calls (chat with tools): forced calls stream as call deltas; under "auto", text that
        # starts like a call (JSON, or a <tool_call> tag) is held until the end, when it is either
        # calls or text.
        self.structured = prepared.structured
        self.tool_mode = self.structured.tool_mode if self.chat and self.structured.tools else "none"
        self.call_streams = ([ToolCallStream(self.structured.syntax) for _ in range(count)]
                             if self.structured.expects_tool_calls else [])
        self.holding: list[bool | None] = [None] * count  # None: not decided yet (only leading space seen)
        self.held = [""] * count
        # A reasoning model's chat replies: the thinking goes to `reasoning_content` (serve/core/reasoning.py).
        self.opened = prepared.reasoning if self.chat else None
        self.splits = [ReasoningSplit(self.opened) for _ in range(count)] if self.opened is not None else []

    def _logprob_entry(self, index: int, t: TokenText) -> dict[str, Any]:
        assert t.logprob is not None
        token = t.text
        top = [(text, lp) for _, text, lp in t.top_logprobs]
        entry = {"token": token, "logprob": json_logprob(t.logprob), "bytes": list(token.encode()),
                 "top_logprobs": [{"token": x, "logprob": json_logprob(lp), "bytes": list(x.encode())}
                                  for x, lp in top],
                 "text_offset": self.offset[index]}
        return entry

    def add(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        """Records one event; returns its logprob entry, if the request asked for logprobs. OpenAI's
        API has no finish reason for a request the server cancelled (a drain): a 503."""
        if ev.finish_reason == "cancelled":
            raise Unavailable("the request was cancelled: the server is shutting down")
        index, entry = ev.index, None
        if ev.token is not None and ev.token.logprob is not None:
            entry = self._logprob_entry(index, ev.token)
            self.logprobs[index].append(entry)
        self.text[index].append(ev.text)
        self.offset[index] += len(ev.text)
        if ev.finish_reason is not None:
            self.finish[index] = _finish_reason(ev)
            self.usage_of[index] = ev.usage
        return entry

    def echoed(self, prompts: list[EchoedPrompt], generated: bool) -> Reply:
        """Puts each choice's prompt before its output (completions' `echo`): its text, and its
        tokens' logprob entries (the first token's null, as OpenAI's); without `generated` (max_tokens
        0) the choices end there, at "length", with the prompt as their usage."""
        for i, (p, _) in enumerate(self.prepared.choices):
            prompt, ids = prompts[p], self.prepared.prompts[p]
            text = "".join(prompt.tokens)
            if prompt.logprobs is not None:
                entries, offset = [], 0
                for j, token in enumerate(prompt.tokens):
                    lp = None if j == 0 else json_logprob(prompt.logprobs[j - 1])
                    top = [] if j == 0 or not prompt.top else [
                        {"token": t, "logprob": json_logprob(v)} for t, v in prompt.top[j - 1]]
                    entries.append({"token": token, "logprob": lp, "top_logprobs": top, "text_offset": offset,
                                    "first": j == 0})
                    offset += len(token)
                for e in self.logprobs[i]:
                    e["text_offset"] += len(text)
                self.logprobs[i][:0] = entries
            self.text[i].insert(0, text)
            if not generated:
                self.finish[i] = "length"
                self.usage_of[i] = Usage(len(ids), 0, 0)
        return self

    def echo_opening(self, prompts: list[EchoedPrompt], generated: bool) -> list[dict[str, Any]]:
        """A streamed `echo`: `echoed`, then one chunk per choice with its prompt's text and logprob
        entries (the output's text offsets follow the prompt); without `generated` each chunk ends
        its choice."""
        self.echoed(prompts, generated)
        out = []
        for i in range(len(self.text)):
            text = self.text[i][0]
            self.offset[i] += len(text)
            choice = {"index": i, "text": text, "logprobs": self._choice_logprobs(self.logprobs[i]),
                      "finish_reason": self.finish[i]}
            out.append({**self._head("text_completion"), "choices": [choice]})
        return out

    def _choice_logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not entries:
            return None
        if self.chat:
            return {"content": [{k: v for k, v in e.items() if k != "text_offset"} for e in entries]}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [None if e.get("first") else _by_text(e["top_logprobs"]) for e in entries],
                "text_offset": [e["text_offset"] for e in entries]}

    def usage(self) -> dict[str, Any]:
        """Prompt tokens once per prompt (its first choice), completion tokens of every choice."""
        n = self.prepared.n
        firsts = [u for i, u in enumerate(self.usage_of) if i % n == 0 and u is not None]
        prompt = sum(u.prompt_tokens for u in firsts)
        completion = sum(u.completion_tokens for u in self.usage_of if u is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in firsts)}}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self) -> dict[str, Any]:
        choices = []
        for i in range(len(self.text)):
            text, reasoning = "".join(self.text[i]), None
            if self.opened is not None:
                reasoning, text = split_reply(text, self.opened)
            choice: dict[str, Any] = {"index": i, "finish_reason": self.finish[i],
                                      "logprobs": self._choice_logprobs(self.logprobs[i])}
            if self.finish[i] == "error":
                choice["stop_reason"] = CONSTRAINT_ERROR
            calls = self.structured.tool_calls(text) if self.tool_mode != "none" else None
            if calls:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]}
                if self.finish[i] == "stop":
                    choice["finish_reason"] = "tool_calls"
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if reasoning is not None:
                choice["message"]["reasoning_content"] = reasoning
            choices.append(choice)
        return {**self._head(self.kind), "choices": choices, "usage": self.usage()}

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams start with each choice's assistant role (as OpenAI's do)."""
        if not self.chat:
            return []
        return [{**self._head("chat.completion.chunk"),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]} for i in range(len(self.text))]

    def chunk(self, ev: ChoiceEvent, include_usage: bool) -> dict[str, Any] | None:
        """The stream chunk of one event; None when it has nothing to show yet (held text)."""
        index = ev.index
        entry = self.add(ev)
        logprobs = self._choice_logprobs([entry]) if entry is not None else None
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                  "finish_reason": None if ev.finish_reason is None else _finish_reason(ev)}
        if choice["finish_reason"] == "error":
            choice["stop_reason"] = CONSTRAINT_ERROR
        reasoning = ""
        if self.splits:  # the answer's part goes on as the event's text
            reasoning, text = self.splits[index].feed(ev.text, final=ev.finish_reason is not None)
            ev = replace(ev, text=text)
        if self.chat and self.tool_mode != "none":
            delta = self._tool_delta(index, ev)
            if delta is None and not reasoning:
                return None
            choice["delta"] = delta or {}
            if choice["finish_reason"] == "stop" and (self.call_streams or "tool_calls" in choice["delta"]):
                choice["finish_reason"] = "tool_calls"
        elif self.chat:
            choice["delta"] = {"content": ev.text} if ev.text or (ev.finish_reason is None and not reasoning) else {}
        else:
            choice["text"] = ev.text
        if reasoning:
            choice["delta"]["reasoning_content"] = reasoning
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def _tool_delta(self, index: int, ev: ChoiceEvent) -> dict[str, Any] | None:
        """A chat-with-tools event's delta: tool-call pieces, text, or None while text is held."""
        finished = ev.finish_reason is not None
        if self.call_streams:  # forced calls: the text is the calls
            deltas = self.call_streams[index].feed(ev.text)
            if not deltas:
                return {} if finished else None
            return {"tool_calls": [_call_delta(d) for d in deltas]}
        if self.holding[index] is None:  # "auto": does the answer start like a call?
            self.held[index] += ev.text
            start = self.held[index].lstrip()
            self.holding[index] = self.structured.starts_call(start)
            if self.holding[index] is None and start and not finished:  # a tag's first characters: wait
                return None
            if not self.holding[index]:
                text, self.held[index] = self.held[index], ""
                return {"content": text} if text or not finished else ({} if finished else None)
            ev_text = ""
        else:
            ev_text = ev.text
        if not self.holding[index]:
            return {"content": ev_text} if ev_text or not finished else {}
        self.held[index] += ev_text
        if not finished:
            return None
        calls = self.structured.tool_calls(self.held[index])
        if calls is None:
            return {"content": self.held[index]}
        return {"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(calls)]}

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}


CONSTRAINT_ERROR = "constraint_error"


def _finish_reason(ev: ChoiceEvent) -> str:
    """The OpenAI finish_reason of a choice's last event: "error" (with stop_reason
    "constraint_error" beside it) when its output constraint failed mid-output (over a limit or
    its mask time budget), so the cut text is never mistaken for a complete answer."""
    assert ev.finish_reason is not None
    return "error" if ev.stop_reason == CONSTRAINT_ERROR else ev.finish_reason
