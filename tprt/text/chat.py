"""Chat templates rendered with Hugging Face's semantics (`apply_chat_template(..., tokenize=False)`).

The environment matches transformers': a sandboxed, immutable jinja2 environment with
trim_blocks and lstrip_blocks, the loop-controls extension, a `{% generation %}` block (rendered as
its body; transformers uses it to mark assistant tokens), `raise_exception(msg)`, `strftime_now(fmt)`,
and a `tojson` filter that does not HTML-escape (ensure_ascii=False, optional indent/separators/sort_keys).
Variables: messages, tools, documents, add_generation_prompt, the special tokens (bos_token,
eos_token, unk_token, pad_token) and any extra keyword (e.g. enable_thinking).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The roles a conversation may hold, in generation and in training data alike.
CHAT_ROLES = ("system", "user", "assistant", "tool")

from tprt.errors import ConfigError, ValidationError


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes (no reaching into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=16)
def compile_template(template: str, source: str = "chat template") -> jinja2.Template:
    """Parses a template once; a syntax error is a ConfigError naming `source` and the line."""
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(f"{source}: chat template does not parse: {e.message} (line {e.lineno})") from None


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                tools: Sequence[Mapping[str, Any]] | None = None,
                documents: Sequence[Mapping[str, Any]] | None = None,
                special_tokens: Mapping[str, str] | None = None, source: str = "chat template",
                **extra: Any) -> str:
    """Renders `messages` to the prompt text (tokenize it with add_special_tokens=False).

    A template that rejects the conversation (`raise_exception`, e.g. roles that do not alternate)
    raises ValidationError with field "messages"."""
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValidationError("messages", f"messages[{i}] must be an object with a string 'role', got {m!r}")
    compiled = compile_template(template, source)
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(extra)
    try:
        return compiled.render(messages=[dict(m) for m in messages], tools=_plain(tools),
                               documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.exceptions.SecurityError as e:
        raise ConfigError(f"{source}: chat template tried an unsafe operation: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ValidationError("messages", f"messages: the chat template rejected them: {e}") from None


def _plain(items: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    return None if items is None else [dict(x) for x in items]


class NoChatTemplateError(ConfigError):
    """The model's tokenizer has no chat template, but chat messages were given."""
