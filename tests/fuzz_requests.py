"""Random requests for `tprt serve` (hypothesis strategies), shared by the fuzz test in
tests/test_server_hostile.py and the longer run of bench/serve_fuzz.py.

`calls()` draws a method (Generate, Complete, Tokenize, CreateJob) and either a message of its
request type with random values in every field (any text, NUL bytes and all; floats with NaN and
infinities; integers over their whole wire range; enums off their list; nested and repeated
fields), or random bytes sent as the serialized request. `send` makes the call; `outcome` is the
status code it ended with, OK included, and the ids of any jobs it created (to cancel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from serve.grpc.pb import finetuning_pb2 as ft_pb
from serve.grpc.pb import generation_pb2 as gen_pb

METHODS = {
    "/tprt.v1.Generation/Generate": (gen_pb.GenerateRequest, True),
    "/tprt.v1.Generation/Complete": (gen_pb.GenerateRequest, False),
    "/tprt.v1.Generation/Tokenize": (gen_pb.TokenizeRequest, False),
    "/tprt.v1.FineTuning/CreateJob": (ft_pb.CreateJobRequest, False),
}
F = FieldDescriptor
_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}

# Text: short and arbitrary (control characters, NUL, any plane), or long and plain.
TEXT = st.one_of(st.text(max_size=64), st.text(st.characters(codec="utf-8"), max_size=512),
                 st.integers(0, 40_000).map(lambda n: "x" * n),
                 st.sampled_from(["train.jsonl", "../../etc/passwd", "/", ".", "jobs", '{"text": "hi"}\n']))


def _small_ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers over the whole range, often near the values that matter (0, 1, the edges)."""
    return st.one_of(st.integers(max(lo, -3), min(hi, 300)), st.integers(lo, hi), st.sampled_from([lo, hi]))


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type in _INT_RANGES:
        return _small_ints(*_INT_RANGES[field.type])
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == F.TYPE_FLOAT else 64)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_ENUM:
        return st.integers(-2, 8)
    if field.type == F.TYPE_STRING:
        return TEXT
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=256)
    return message(field.message_type, depth + 1)


def message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[bytes]:
    """A serialized message of `descriptor`'s type with a random subset of its fields set."""
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls().SerializeToString())
    fields = list(descriptor.fields)

    @st.composite
    def build(draw: Callable[..., Any]) -> bytes:
        msg = cls()
        for field in draw(st.lists(st.sampled_from(fields), max_size=len(fields), unique_by=lambda f: f.name)):
            value = _value(field, depth)
            entry = field.message_type
            if field.is_repeated and entry is not None and entry.GetOptions().map_entry:  # a map
                keys, values = (_value(entry.fields_by_name[k], depth) for k in ("key", "value"))
                getattr(msg, field.name).update(draw(st.dictionaries(keys, values, max_size=4)))
            elif field.is_repeated:
                items = draw(st.lists(value, max_size=4))
                if field.type == F.TYPE_MESSAGE:
                    for raw in items:
                        getattr(msg, field.name).add().MergeFromString(raw)
                else:
                    getattr(msg, field.name).extend(items)
            elif field.type == F.TYPE_MESSAGE:
                getattr(msg, field.name).MergeFromString(draw(value))
            else:
                setattr(msg, field.name, draw(value))
        return bytes(msg.SerializeToString())

    return build()


@dataclass(frozen=True)
class Call:
    method: str
    payload: bytes


def calls() -> st.SearchStrategy[Call]:
    """One call: a method and a request for it (a random message, or random bytes)."""
    def for_method(method: str) -> st.SearchStrategy[Call]:
        cls, _ = METHODS[method]
        return st.one_of(message(cls.DESCRIPTOR), st.binary(max_size=256)).map(lambda p: Call(method, p))

    return st.sampled_from(sorted(METHODS)).flatmap(for_method)


def send(channel: grpc.Channel, token: str, call: Call, timeout: float = 30.0) -> tuple[grpc.StatusCode, list[str]]:
    """Makes `call`; (the status code it ended with, ids of jobs it created)."""
    _, streaming = METHODS[call.method]
    kw = {"metadata": (("authorization", f"Bearer {token}"),), "timeout": timeout}
    try:
        if streaming:
            for _ in channel.unary_stream(call.method)(call.payload, **kw):
                pass
            return grpc.StatusCode.OK, []
        raw = channel.unary_unary(call.method)(call.payload, **kw)
    except grpc.RpcError as e:
        return e.code(), []
    if call.method.endswith("/CreateJob"):
        return grpc.StatusCode.OK, [ft_pb.Job.FromString(raw).id]
    return grpc.StatusCode.OK, []
