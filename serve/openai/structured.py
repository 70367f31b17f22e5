"""OpenAI's chat and completions fields -> the core's output constraint and tools
(serve/core/structured.py): `response_format`, vLLM's `structured_outputs` ({json, regex, choice,
grammar}) and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `tools`
({type: function, function: {name, description, parameters}}), `tool_choice` and
`parallel_tool_calls`. Errors are ValidationErrors naming the parameter as OpenAI spells it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from serve.core.structured import MAX_TOOLS, NAME_CHARS, Structured, Tool, ToolMode, check_tool
from tprt.engine.constraints import ConstraintSpec
from tprt.errors import ValidationError

GUIDED_KINDS = ("json", "regex", "choice", "grammar")


def read_structured(*, response_format: Any = None, structured_outputs: Any = None, tools: Any = None,
                    tool_choice: Any = None, parallel_tool_calls: Any = None,
                    guided: Mapping[str, Any] | None = None) -> Structured:
    """The fields (already parsed JSON values; `guided`: {"json": guided_json, ...}) as the core's
    Structured: at most one output constraint among them."""
    constraints = [c for c in (response_format_constraint(response_format), _structured_outputs(structured_outputs),
                               _guided(guided or {})) if c is not None]
    if len(constraints) > 1:
        fields = ", ".join(c.field.split(".")[0] for c in constraints)
        raise ValidationError(constraints[1].field, f"{constraints[1].field}: only one output constraint per "
                                                    f"request, got several ({fields})")
    parsed = _tools(tools)
    mode, named = _tool_choice(tool_choice)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValidationError("parallel_tool_calls", "parallel_tool_calls: expected true or false")
    return Structured.build(constraints[0] if constraints else None, parsed, mode, named,
                            parallel_tool_calls is not False, named_field="tool_choice.function.name")


def response_format_constraint(value: Any, field: str = "response_format") -> ConstraintSpec | None:
    """OpenAI's response_format ({type: text | json_object | json_schema, json_schema: {name,
    schema, strict}}); the Responses API's `text.format` is the same with json_schema's members
    beside `type` (`flat`)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise ValidationError(field, f"{field}: expected an object with a string `type`")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec.json_object(field)
    if kind == "json_schema":
        return json_schema_format(value.get("json_schema"), f"{field}.json_schema")
    raise ValidationError(f"{field}.type", f"{field}.type: expected text, json_object or json_schema, "
                                           f"got {str(kind)[:40]!r}")


def json_schema_format(spec: Any, field: str) -> ConstraintSpec:
    """A named JSON Schema format ({name, schema, strict, description}): strict or not, the output
    follows the schema, so a schema that cannot be enforced is refused."""
    if not isinstance(spec, Mapping):
        raise ValidationError(field, f"{field}: expected an object with `name` and `schema`")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= NAME_CHARS:
        raise ValidationError(f"{field}.name", f"{field}.name: expected 1-64 characters of a-z, A-Z, 0-9, _ and -")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValidationError(f"{field}.strict", f"{field}.strict: expected true or false")
    return ConstraintSpec.json_schema(spec.get("schema", {}), f"{field}.schema")


def _structured_outputs(value: Any) -> ConstraintSpec | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValidationError("structured_outputs", "structured_outputs: expected an object with one of "
                                                    "json, regex, choice, grammar")
    given = {k: v for k, v in value.items() if v is not None}
    unknown = sorted(set(given) - set(GUIDED_KINDS))
    if unknown:
        raise ValidationError(f"structured_outputs.{unknown[0]}"[:80], f"structured_outputs.{unknown[0][:40]}: "
                              "unknown; expected one of json, regex, choice, grammar")
    if len(given) != 1:
        raise ValidationError("structured_outputs", "structured_outputs: give exactly one of json, regex, choice, "
                                                    "grammar")
    (kind, spec), = given.items()
    return _constraint(kind, spec, f"structured_outputs.{kind}")


def _guided(guided: Mapping[str, Any]) -> ConstraintSpec | None:
    """vLLM's guided_* fields, the older spelling of structured_outputs: at most one of them."""
    given = [(kind, guided[kind]) for kind in GUIDED_KINDS if guided.get(kind) is not None]
    if len(given) > 1:
        raise ValidationError(f"guided_{given[1][0]}", f"guided_{given[1][0]}: give one of guided_json, guided_regex, "
                                                      "guided_choice, guided_grammar, not several")
    return _constraint(given[0][0], given[0][1], f"guided_{given[0][0]}") if given else None


def _constraint(kind: str, spec: Any, field: str) -> ConstraintSpec:
    """One constraint of `kind` (json, regex, choice or grammar), errors naming `field`."""
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except (ValueError, RecursionError) as e:
                raise ValidationError(field, f"{field}: not JSON ({e})") from None
        return ConstraintSpec.json_schema(spec, field)
    if kind == "regex":
        return ConstraintSpec.regex(spec, field)
    if kind == "choice":
        return ConstraintSpec.choice(spec, field)
    return ConstraintSpec.grammar(spec, field)


def _tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValidationError("tools", "tools: expected a list of {type: function, function: {...}}")
    if len(value) > MAX_TOOLS:
        raise ValidationError("tools", f"tools: at most {MAX_TOOLS}, got {len(value)}")
    tools = []
    for i, item in enumerate(value):
        field = f"tools[{i}]"
        if not isinstance(item, Mapping) or item.get("type") != "function" or not isinstance(item.get("function"),
                                                                                               Mapping):
            raise ValidationError(field, f"{field}: expected {{type: function, function: {{name, parameters}}}}")
        fn = item["function"]
        tools.append(check_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), {
            key: f"{field}.function.{key}" for key in ("name", "description", "parameters")}))
    return tools


def _tool_choice(value: Any) -> tuple[ToolMode | None, str | None]:
    if value is None:
        return None, None
    if value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("function"), Mapping):
        name = value["function"].get("name")
        if not isinstance(name, str):
            raise ValidationError("tool_choice.function.name", "tool_choice.function.name: expected a string")
        return "named", name
    raise ValidationError("tool_choice", "tool_choice: expected none, auto, required or "
                                         "{type: function, function: {name}}")
