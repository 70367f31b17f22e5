"""A suite of JSON schemas for structured outputs (tests/test_constraints.py, and the validity
bench): enums, patterns, nested objects, arrays with minItems/maxItems, anyOf, $ref and $defs,
required and optional properties, numbers with bounds, consts, formats, and tool-call shapes."""

from __future__ import annotations

from typing import Any

_ADDRESS = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                             "city": {"type": "string", "maxLength": 30},
                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"], "additionalProperties": False}

SCHEMAS: dict[str, Any] = {
    "string": {"type": "string", "maxLength": 20},
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "enum_colors": {"enum": ["red", "green", "blue"]},
    "enum_mixed": {"enum": [1, "two", None, True, 3.5]},
    "const": {"const": {"version": 2}},
    "int_bounds": {"type": "integer", "minimum": 10, "maximum": 20},
    "int_exclusive": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
    "number_bounds": {"type": "number", "minimum": 0, "maximum": 1},
    "negative_int": {"type": "integer", "maximum": -1},
    "pattern_date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "pattern_word": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 12},
    "pattern_hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
    "string_lengths": {"type": "string", "minLength": 3, "maxLength": 6},
    "format_date": {"type": "string", "format": "date"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "format_email": {"type": "string", "format": "email", "maxLength": 24},
    "object_required": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                        "required": ["name", "age"], "additionalProperties": False},
    "object_optional": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                        "additionalProperties": False},
    "object_empty": {"type": "object", "properties": {}, "additionalProperties": False},
    "object_any": {"type": "object"},
    "object_additional_typed": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                            "maxItems": 3}}, "required": ["id", "tags"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "deep_nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "object", "properties": {"d": {"type": "integer"}},
                                              "required": ["d"], "additionalProperties": False}},
        "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "address": _ADDRESS,
    "array_ints": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
    "array_min_max": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    "array_exact": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 3, "maxItems": 3},
    "array_objects": {"type": "array", "items": _ADDRESS, "minItems": 1, "maxItems": 2},
    "array_prefix_items": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 5}],
                           "items": False},
    "array_nested": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                     "maxItems": 3},
    "anyof_scalar": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]},
    "anyof_objects": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1}},
         "required": ["kind", "side"], "additionalProperties": False}]},
    "oneof_types": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
    "nullable": {"type": ["string", "null"], "maxLength": 10},
    "type_list": {"type": ["integer", "boolean"]},
    "ref_defs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                     "required": ["x", "y"], "additionalProperties": False}},
                 "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
                 "required": ["from", "to"], "additionalProperties": False},
    "ref_definitions": {"definitions": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}},
                        "type": "array", "items": {"$ref": "#/definitions/name"}, "minItems": 1, "maxItems": 3},
    "ref_recursive": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["value"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "allof": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string", "maxLength": 5}}, "required": ["b"]}]},
    "enum_in_object": {"type": "object", "properties": {"status": {"enum": ["open", "closed", "pending"]},
                                                        "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
                       "required": ["status", "priority"], "additionalProperties": False},
    "unicode_enum": {"enum": ["ünïcödé", "日本語", "emoji 🎉"]},
    "quoted_strings": {"type": "object", "properties": {"q": {"const": "say \"hi\"\n\\ok"}}, "required": ["q"]},
    "person_list": {"type": "object", "properties": {"people": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "email": {"type": "string", "format": "email", "maxLength": 24},
                                         "score": {"type": "number", "minimum": 0, "maximum": 100}},
        "required": ["name"], "additionalProperties": False}}}, "required": ["people"], "additionalProperties": False},
    "tool_call_weather": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"], "additionalProperties": False}},
        "required": ["name", "parameters"], "additionalProperties": False},
    "tool_call_choice": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "add"}, "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False}},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "echo"}, "parameters": {"type": "object", "properties": {
            "text": {"type": "string", "maxLength": 10}}, "required": ["text"], "additionalProperties": False}},
         "required": ["name", "parameters"], "additionalProperties": False}]},
    "dependent_mix": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                                       "when": {"type": "string", "format": "date-time"},
                                                       "ok": {"type": "boolean"}},
                      "required": ["id", "ok"], "additionalProperties": False},
    "min_properties": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "minProperties": 2, "additionalProperties": False},
    "big_enum": {"enum": [f"item-{i:03d}" for i in range(200)]},
    "array_unique_free": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
    "number_multiple": {"type": "integer", "minimum": 0, "maximum": 1000, "multipleOf": 5},
    "true_schema_props": {"type": "object", "properties": {"anything": True}, "required": ["anything"],
                          "additionalProperties": False},
}

# Schemas llguidance (and so tprt) refuses: what the request gets is a 400 naming the field.
UNSUPPORTED: dict[str, Any] = {
    "not": {"not": {"type": "string"}},
    "unknown_type": {"type": "strng"},
    "bad_ref": {"$ref": "#/$defs/missing"},
    "unknown_format": {"type": "string", "format": "no-such-format"},
    "bad_pattern": {"type": "string", "pattern": "(unclosed"},
    "min_properties_optional": {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1},
}
