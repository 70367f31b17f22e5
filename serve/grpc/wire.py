"""Why a request's bytes do not parse, and which field is at fault, without trusting them.

gRPC hands a handler only messages that parsed; bytes that do not (junk, truncated data, a string
field that is not UTF-8, a UTF-8-encoded lone surrogate) would otherwise end as INTERNAL with a
stack trace in the log. `lenient` turns such bytes into an `Undecodable` value the error
interceptor answers with INVALID_ARGUMENT, naming the field when the wire data shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_MAX_DEPTH = 32  # deeper nesting than any tprt message has: stop looking


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that did not parse: `field` is the path of the bad string field, when found."""

    message: str  # the message type's name
    field: str | None


def lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer`, returning an Undecodable instead of raising on bad bytes."""
    if deserializer is None:
        return None
    descriptor: Descriptor | None = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:  # noqa: BLE001 - whatever the parser raises, the bytes are the caller's
            name = descriptor.name if descriptor is not None else "request"
            return Undecodable(name, bad_string_field(descriptor, data) if descriptor is not None else None)

    return parse


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def bad_string_field(descriptor: Descriptor, data: bytes, prefix: str = "", depth: int = 0) -> str | None:
    """The path (`chat.messages.content`) of the first string field whose bytes are not UTF-8, or None."""
    if depth > _MAX_DEPTH:
        return None
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + size], pos + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                path = f"{prefix}{field.name}"
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return path
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = bad_string_field(field.message_type, chunk, f"{path}.", depth + 1)
                    if inner is not None:
                        return inner
            else:
                return None
    except ValueError:
        return None
    return None
