"""Reasoning models' replies split in two: the thinking between `<think>` and `</think>` (OpenAI
chat's `reasoning_content`, as vLLM and SGLang return it) and the answer after it (`content`).

Qwen3 and the DeepSeek-R1 distills think first. A reply is reasoning from its start when the
prompt already opened the block (R1's templates end the generation prompt with `<think>`), or
when it begins with `<think>` itself (Qwen3's); it stays reasoning until `</think>`. A reply
that begins otherwise (Qwen3 with `enable_thinking` false, whose template writes an empty block
into the prompt) is all answer. `ReasoningSplit` does this on streamed text, holding back only
what could still be the start of a tag.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thinks(chat_template: str | None) -> bool:
    """Whether a chat template belongs to a reasoning model (it writes `</think>`)."""
    return bool(chat_template) and THINK_CLOSE in (chat_template or "")


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` block open for the reply."""
    text = prompt_text.rstrip()
    return text.endswith(THINK_OPEN)


def prompt_closes_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt holds the reply's block already closed (Qwen3 with
    `enable_thinking` false): the reply is all answer."""
    return prompt_text.rstrip().endswith(THINK_CLOSE)


class ReasoningSplit:
    """Splits one reply's text, fed as it streams, into (reasoning, content) deltas."""

    def __init__(self, opened: bool) -> None:
        self._state = "reasoning" if opened else "start"  # start -> reasoning -> content, or start -> content
        self._pending = ""
        self._strip = opened  # newlines right after a tag are the tag's, not the text's

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content this text adds; `final`: the reply ends here (nothing held)."""
        self._pending += text
        reasoning = ""
        if self._state == "start":
            head = self._pending.lstrip()
            if head.startswith(THINK_OPEN):
                self._state, self._pending, self._strip = "reasoning", head[len(THINK_OPEN):], True
            elif THINK_OPEN.startswith(head) and not final:
                return "", ""  # only blanks, or the tag's first characters: not known yet
            else:
                self._state = "content"
        if self._state == "reasoning":
            self._lstrip()
            end = self._pending.find(THINK_CLOSE)
            if end < 0:
                keep = 0 if final else _partial_suffix(self._pending, THINK_CLOSE)
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                return reasoning, ""
            reasoning = self._pending[:end]
            self._state, self._pending, self._strip = "content", self._pending[end + len(THINK_CLOSE):], True
        self._lstrip()
        content, self._pending = self._pending, ""
        return reasoning, content

    def _lstrip(self) -> None:
        if self._strip:
            self._pending = self._pending.lstrip("\n")
            self._strip = not self._pending


def split_reply(text: str, opened: bool) -> tuple[str | None, str]:
    """A whole reply's (reasoning or None when it has none, content)."""
    split = ReasoningSplit(opened)
    reasoning, content = split.feed(text, final=True)
    return (reasoning.strip() if opened or reasoning or text.lstrip().startswith(THINK_OPEN) else None), content


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
