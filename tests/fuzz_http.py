"""Random requests for the OpenAI HTTP API of `tprt serve --http-port` (hypothesis strategies),
shared by the bounded fuzz test in tests/test_http_outputs.py and the longer run of
bench/serve_fuzz.py --http.

`http_calls()` draws one request: a completion or chat completion whose body mixes plausible and
random values in OpenAI's fields (wrong types, huge and negative numbers, NaN written as a bare
JSON token, lone surrogate escapes, unknown keys, random model and adapter names), sometimes
streamed and dropped after the first event; a file upload (random bytes, text in other
encodings, JSON lines of random objects, random purposes); a fine-tuning job with random
hyperparameters, metadata and methods; a listing with random paging; a lookup or deletion of a
random id; or raw bytes posted to a random route with a random content type. The bearer token is
sometimes missing or wrong.

`send_http` makes the call and returns an `Outcome`: the status, whether the body is well formed
(an error is OpenAI's `{"error": {...}}` shape; no body carries a bare NaN or Infinity, which is
not JSON), and the ids of jobs it created (to cancel).
"""

from __future__ import annotations

import json
from urllib.parse import quote
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

_TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "hi", "Say hello", "\x00", "\ud800", "tp2", "../x"]),
                  st.integers(0, 3000).map(lambda n: "y" * n))
_INT = st.one_of(st.integers(-3, 300), st.sampled_from([0, -1, 2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30]))
_FLOAT = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True))
_SCALAR = st.one_of(st.none(), st.booleans(), _INT, _FLOAT, _TEXT)
JSON = st.recursive(_SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(_TEXT, inner, max_size=4)), max_leaves=12)


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes any JSON at all."""
    return st.one_of(value, value, value, JSON)


_ROLE = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "bogus", ""])
_CONTENT = st.one_of(_TEXT, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                                           "text": _TEXT}), max_size=3))
_MESSAGE = st.fixed_dictionaries({"role": _maybe(_ROLE), "content": _maybe(_CONTENT)},
                                 optional={"name": _TEXT, "tool_calls": JSON, "tool_call_id": _TEXT})
_SAMPLING = {
    "max_tokens": _maybe(st.integers(-2, 12)), "temperature": _maybe(_FLOAT), "top_p": _maybe(_FLOAT),
    "n": _maybe(st.integers(-1, 3)), "stop": _maybe(st.one_of(_TEXT, st.lists(_TEXT, max_size=5))),
    "seed": _maybe(_INT), "logprobs": JSON, "presence_penalty": _FLOAT, "frequency_penalty": _FLOAT,
    "logit_bias": JSON, "user": _TEXT, "top_k": _INT, "min_p": _FLOAT, "repetition_penalty": _FLOAT,
    "stream_options": JSON, "response_format": JSON, "tools": JSON, "tool_choice": JSON,
    "max_completion_tokens": _maybe(st.integers(-2, 12)), "top_logprobs": _INT, "echo": JSON, "best_of": JSON,
    "suffix": JSON, "extra_unknown_key": JSON,
}
_PROMPT = st.one_of(_TEXT, st.lists(_TEXT, max_size=3), st.lists(_INT, max_size=6),
                    st.lists(st.lists(_INT, max_size=4), max_size=3))


@dataclass(frozen=True)
class HttpCall:
    method: str
    path: str
    json_body: Any = None
    raw: bytes | None = None
    content_type: str = "application/json"
    files: dict[str, Any] | None = None
    form: dict[str, str] | None = None
    auth: str = "good"  # good | none | bad
    stream_drop: bool = False  # read the first SSE event, then hang up
    params: dict[str, Any] = field(default_factory=dict)


def _generation(model: st.SearchStrategy[Any]) -> st.SearchStrategy[HttpCall]:
    sampling = st.fixed_dictionaries({}, optional=_SAMPLING)
    chat = st.builds(lambda m, msgs, s, stream: {"model": m, "messages": msgs, **s, "stream": stream},
                     model, _maybe(st.lists(_MESSAGE, max_size=4)), sampling, st.booleans())
    completion = st.builds(lambda m, p, s, stream: {"model": m, "prompt": p, **s, "stream": stream},
                           model, _maybe(_PROMPT), sampling, st.booleans())
    return st.one_of(
        st.builds(lambda b, drop: HttpCall("POST", "/chat/completions", b, stream_drop=drop), chat, st.booleans()),
        st.builds(lambda b, drop: HttpCall("POST", "/completions", b, stream_drop=drop), completion, st.booleans()))


_UPLOAD_CONTENT = st.one_of(
    st.binary(max_size=512),
    st.lists(JSON, max_size=6).map(lambda xs: "".join(json.dumps(x) + "\n" for x in xs).encode()),
    st.lists(st.fixed_dictionaries({"messages": st.lists(_MESSAGE, max_size=3)}), max_size=6)
      .map(lambda xs: "".join(json.dumps(x) + "\n" for x in xs).encode()),
    st.text(max_size=200).map(lambda s: s.encode("utf-16")),
    st.sampled_from([b"\xff\xfe\x00", b'{"text": "\xc3\x28"}\n', b"", b"\n\n\n"]))


def _upload() -> st.SearchStrategy[HttpCall]:
    return st.builds(lambda content, purpose, name: HttpCall(
        "POST", "/files", files={"file": (name, content, "application/octet-stream")}, form={"purpose": purpose}),
        _UPLOAD_CONTENT, st.one_of(st.just("fine-tune"), _TEXT), st.one_of(st.just("train.jsonl"), _TEXT))


def _job(model: st.SearchStrategy[Any], training_files: list[str]) -> st.SearchStrategy[HttpCall]:
    files = st.one_of(st.sampled_from(training_files), _TEXT) if training_files else _TEXT
    hyper = st.fixed_dictionaries({}, optional={"n_epochs": _maybe(st.integers(1, 2)), "batch_size": _INT,
                                                "learning_rate_multiplier": _FLOAT})
    body = st.fixed_dictionaries({"model": model, "training_file": _maybe(files)},
                                 optional={"hyperparameters": _maybe(hyper), "suffix": _TEXT, "seed": _INT,
                                           "metadata": JSON, "validation_file": _maybe(files),
                                           "method": JSON, "integrations": JSON})
    return body.map(lambda b: HttpCall("POST", "/fine_tuning/jobs", b))


def _lookups() -> st.SearchStrategy[HttpCall]:
    some_id = st.one_of(_TEXT.map(lambda s: quote(s.encode("utf-8", "surrogatepass"), safe="")),
                        st.just("file-0"), st.just("ftjob-0"))
    return st.one_of(
        st.builds(lambda p: HttpCall("GET", "/fine_tuning/jobs", params=p),
                  st.fixed_dictionaries({}, optional={"limit": _INT, "after": _TEXT})),
        st.builds(lambda i: HttpCall("GET", f"/fine_tuning/jobs/{i}"), some_id),
        st.builds(lambda i: HttpCall("GET", f"/fine_tuning/jobs/{i}/events"), some_id),
        st.builds(lambda i: HttpCall("POST", f"/fine_tuning/jobs/{i}/cancel"), some_id),
        st.builds(lambda i: HttpCall("GET", f"/files/{i}"), some_id),
        st.builds(lambda i: HttpCall("GET", f"/files/{i}/content"), some_id),
        st.builds(lambda i: HttpCall("DELETE", f"/files/{i}"), some_id),
        st.builds(lambda i: HttpCall("GET", f"/models/{i}"), some_id),
        st.just(HttpCall("GET", "/models")), st.just(HttpCall("GET", "/files")))


def _raw() -> st.SearchStrategy[HttpCall]:
    routes = st.sampled_from(["/completions", "/chat/completions", "/files", "/fine_tuning/jobs", "/models", "/nope"])
    return st.builds(lambda m, p, raw, ct: HttpCall(m, p, raw=raw, content_type=ct),
                     st.sampled_from(["POST", "PUT", "PATCH", "GET"]), routes,
                     st.one_of(st.binary(max_size=256), st.just(b'{"model": "tp2", "prompt": "x", "max_tokens": NaN}'),
                               st.just(b'{"model": "tp2", "messages": [{"role": "user", "content": "\\udc00"}]}')),
                     st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x",
                                      "multipart/form-data", "application/x-www-form-urlencoded"]))


def http_calls(model_names: list[str], training_files: list[str] = []) -> st.SearchStrategy[HttpCall]:
    """One random HTTP call; `model_names` are real model/adapter ids (mixed with random ones)."""
    model = _maybe(st.one_of(st.sampled_from(model_names), _TEXT))
    call = st.one_of(_generation(model), _generation(model), _upload(), _job(model, training_files), _lookups(), _raw())
    return st.tuples(call, st.sampled_from(["good"] * 8 + ["none", "bad"])).map(
        lambda ca: HttpCall(**{**ca[0].__dict__, "auth": ca[1]}))


@dataclass
class Outcome:
    status: int
    problem: str = ""  # why the answer is malformed ("" when it is well formed)
    job_ids: list[str] = field(default_factory=list)


def _bare_constant(name: str) -> Any:
    raise ValueError(f"bare {name} in a JSON body")


def _check_json(text: str) -> str:
    try:
        json.loads(text, parse_constant=_bare_constant)
    except ValueError as e:
        return f"not JSON: {e}: {text[:200]!r}"
    return ""


def _check_error_shape(text: str) -> str:
    try:
        body = json.loads(text, parse_constant=_bare_constant)
    except ValueError as e:
        return f"error body is not JSON: {e}: {text[:200]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return f"error body is not OpenAI's shape: {text[:200]!r}"
    return ""


def _sendable(text: str) -> str:
    """`text` with lone surrogates replaced: a form field or query is UTF-8 on the wire, which
    cannot carry them (JSON bodies can, as escapes, and keep them)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def send_http(client: httpx.Client, token: str, call: HttpCall, timeout: float = 30.0) -> Outcome:
    """Makes `call` on `client` (whose base_url ends in /v1)."""
    headers = {"good": {"Authorization": f"Bearer {token}"}, "none": {},
               "bad": {"Authorization": "Bearer wrong"}}[call.auth]
    kw: dict[str, Any] = {"headers": headers, "timeout": timeout,
                          "params": {k: _sendable(v) if isinstance(v, str) else v for k, v in call.params.items()}}
    if call.files is not None:
        files = {k: (_sendable(name), content, ctype) for k, (name, content, ctype) in call.files.items()}
        kw.update(files=files, data={k: _sendable(v) for k, v in (call.form or {}).items()})
    elif call.raw is not None:
        kw.update(content=call.raw, headers={**headers, "Content-Type": call.content_type})
    elif call.json_body is not None:
        # allow_nan: NaN and Infinity go out as the bare tokens a careless client might send.
        kw.update(content=json.dumps(call.json_body, allow_nan=True).encode(),
                  headers={**headers, "Content-Type": "application/json"})
    with client.stream(call.method, call.path, **kw) as r:
        ctype = r.headers.get("content-type", "")
        if "text/event-stream" in ctype:
            return Outcome(r.status_code, _read_sse(r, call.stream_drop))
        text = r.read().decode("utf-8", "replace")
    if r.status_code >= 400:
        return Outcome(r.status_code, _check_error_shape(text))
    problem = _check_json(text) if "json" in ctype else ""
    ids: list[str] = []
    if not problem and call.path == "/fine_tuning/jobs" and call.method == "POST":
        ids = [json.loads(text)["id"]]
    return Outcome(r.status_code, problem, ids)


def _read_sse(r: httpx.Response, drop: bool) -> str:
    """Checks every `data:` event until [DONE] (or the first one, when dropping the stream)."""
    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return ""
        problem = _check_json(data)
        if problem:
            return "SSE " + problem
        event = json.loads(data)
        if isinstance(event, dict) and "error" in event and (problem := _check_error_shape(data)):
            return "SSE " + problem
        if drop:
            return ""  # leaving the `with` block hangs up mid-stream
    return "" if drop else "SSE stream ended without [DONE]"


def assert_acceptable(call: HttpCall, out: Outcome) -> None:
    """No 5xx but the 503/507 the server means, and a well-formed body."""
    assert out.status < 500 or out.status in (503, 507), (call, out)
    assert not out.problem, (call, out)


def cancel_jobs(client: httpx.Client, token: str, job_ids: list[str]) -> None:
    for job_id in job_ids:
        client.post(f"/fine_tuning/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {token}"}, timeout=30)

