"""The HTTP app (FastAPI): OpenAI's /v1/models, /v1/completions, /v1/chat/completions,
/v1/responses, /v1/batches, /v1/files and /v1/fine_tuning/jobs, and Anthropic's /v1/messages
(its routes in serve/anthropic/app.py, on this module's `HttpApi`).

It sits beside gRPC on rank 0 and shares its generation core, jobs core, bearer token and
metrics: a body is read into the generation core's request (serve/openai/requests.py), which the
core checks and queues, one ticket per choice (serve/core/generation.py); the events, handed into
the event loop by the engine loop's thread, become an OpenAI response, or server-sent events
(`stream: true`, framed by FastAPI's SSE encoder, ending with `data: [DONE]`). Whatever ends a
request early (the client disconnects, an error) cancels its unfinished tickets, so their
sequences leave the batch at the next step.

Files and fine-tuning jobs are thin routes over serve/openai/files.py (the uploaded files) and
serve/openai/jobs.py (OpenAI's job body and objects <-> the jobs core's jobs, which gRPC's
FineTuning service sees too); responses over serve/openai/responses.py and response_store.py;
batches over serve/openai/batches.py, whose runner calls `run_line` (the same endpoint code, at
background priority).

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with the HTTP status
of their `serve.errors.Status` (serve/openai/requests.py), Anthropic's under /v1/messages
(serve/anthropic/errors.py), made safe to show as gRPC's are (serve.errors.Redactor), in a
stream's error event too; unknown routes and methods (404, 405) as well.
Every call is counted in `tprt_requests_total` with `protocol="http"` and the route as `method`.

Before any route runs, `Authenticate` checks the bearer token on the request's headers (a 401
that closes the connection, the body never read) and `BodyLimit` the body's size (413). JSON
bodies are parsed by serve/openai/requests.py's `parse_body`, on a thread when they are large;
dataset uploads and job creations read and tokenize files on threads of their own
(serve/jobs/datasets.py), never those that tokenize completions.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.adapters.registry import AdapterRegistry
from serve.auth import TokenCheck
from serve.jobs.datasets import DatasetWork
from serve.core.loop import BACKGROUND
from serve.core.generation import ChoiceEvent, GenerationCore, ModelFacts, Prepared, by_prefix, rename_field
from functools import partial
from serve.errors import Cancelled, NotFound, ServeError, Unauthenticated, Unavailable, echo, is_disk_full
from serve.jobs.preference import adapter_on_disk
from serve.jobs.core import JobsCore
from serve.jobs.spec import JobSpec
from serve.metrics import Metrics
from serve.anthropic.errors import anthropic_error_body, is_anthropic
from serve.openai.batches import ENDPOINTS as BATCH_ENDPOINTS, BatchBody, BatchRunner, new_batch, read_batch_file
from serve.openai.files import FileStore, dataset_path
from serve.openai.jobs import (FineTuningJobBody, OpenAIJob, job_checkpoints, job_events, job_object, page,
                               store_job_id, write_sidecar)
from serve.openai.reply import EchoedPrompt, PromptScores, Reply, best_choices, prompt_logprob_entries
from serve.openai.response_store import ResponseStore
from serve.openai.responses import (RESPONSES_PARAMS, ResponseBuilder, ResponsesBody, ResponsesRequest, input_items,
                                    responses_request, with_ids)
from serve.openai.requests import (ChatBody, CompletionBody, OpenAIRequest, ParamError, PayloadTooLarge,
                                   chat_request, completion_request, error_body, invalid_param, parse_body)
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer

log = logging.getLogger("tprt.serve")

PARSE_ON_THREAD_BYTES = 64 << 10  # JSON bodies larger than this are parsed off the event loop

Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class HttpDeps:
    """What the HTTP app shares with the gRPC services: the server's one generation core and one
    jobs core, its metrics and bearer token."""

    core: GenerationCore  # the engine loop, tokenizer, model facts, adapters and request rules
    jobs: JobsCore  # the fine-tuning jobs, shared with gRPC
    metrics: Metrics
    token: str | None  # the bearer token (--auth-token-file); None: no auth
    max_body_bytes: int  # --max-message-bytes
    started: float  # the models' `created` time
    files: FileStore  # the uploaded datasets
    redact: Callable[[str], str]  # serve.errors.Redactor: error messages as callers may see them
    datasets: DatasetWork = field(default_factory=DatasetWork)  # uploads' and job creations' file work
    ignore_unknown_fields: bool = False  # --ignore-unknown-fields: drop them instead of refusing the request
    responses: ResponseStore | None = None  # stored Responses (`store`); None: none are kept
    batches: BatchRunner | None = None  # the Batch API's runner; None: no batches
    # Probes and metrics for routers and Kubernetes, answered without the token: /health (the
    # process can serve: no rank is down), /ready (it takes requests now: started, not draining),
    # /metrics (the server's Prometheus registry, its routers' series included).
    alive: Callable[[], bool] = lambda: True
    ready: Callable[[], bool] = lambda: True
    registry: Any = None

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.core.tokenizer

    @property
    def facts(self) -> ModelFacts:
        return self.core.facts

    @property
    def adapters(self) -> AdapterRegistry:
        return self.core.adapters


UPLOAD_OVERHEAD = 64 << 10
OPEN_PATHS = ("/health", "/ready", "/metrics")  # probes and scrapes carry no token  # a multipart body's framing and form fields, beyond the file itself


class Authenticate:
    """ASGI middleware: a request without the bearer token gets 401 in OpenAI's shape from its
    headers alone; its body is never read, and the connection is closed (the rest of a large
    body is not worth receiving)."""

    def __init__(self, app: ASGIApp, check: TokenCheck, on_refused: Callable[[Scope], None]) -> None:
        self.app = app
        self.check = check
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.check(scope["headers"]):
            await self.app(scope, receive, send)
            return
        self.on_refused(scope)
        why = Unauthenticated("missing or invalid token (header 'Authorization: Bearer <token>' or 'x-api-key: <token>')")
        await _send_error(scope, send, why, close=True)


class BodyLimit:
    """ASGI middleware: 413 for a body over the limit, by its Content-Length or as it streams in.
    A file upload may be as large as a dataset (the file itself is checked by serve/openai/files.py)."""

    def __init__(self, app: ASGIApp, limit: int, upload_limit: int) -> None:
        self.app = app
        self.limit = limit
        self.upload_limit = upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["path"] == "/v1/files"
        limit = self.upload_limit if upload else self.limit
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(scope, send, self._too_large(limit, upload))
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise self._too_large(limit, upload)
            return message

        await self.app(scope, counted, send)

    @staticmethod
    def _too_large(limit: int, upload: bool) -> PayloadTooLarge:
        flag = "--max-dataset-bytes" if upload else "--max-message-bytes"
        return PayloadTooLarge(f"the request body is over {limit} bytes ({flag})")


def http_error_body(path: str, e: BaseException) -> tuple[int, dict[str, Any], str]:
    """(HTTP status, error JSON, outcome) in the shape of the API that `path` belongs to:
    Anthropic's for /v1/messages (serve/anthropic/errors.py), OpenAI's for every other route."""
    if is_anthropic(path):
        return anthropic_error_body(e, too_large=isinstance(e, PayloadTooLarge))
    return error_body(e)


def _redacted(body: dict[str, Any], redact: Callable[[str], str]) -> dict[str, Any]:
    body["error"]["message"] = redact(body["error"]["message"])
    return body


async def _send_error(scope: Scope, send: Send, e: BaseException, close: bool = False) -> None:
    status, body, _ = http_error_body(scope["path"], e)
    headers = {"connection": "close"} if close else None
    await JSONResponse(body, status_code=status, headers=headers)(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def create_app(deps: HttpDeps) -> FastAPI:
    """The FastAPI app serving the OpenAI API over `deps`."""
    api = OpenAIApi(deps)
    app = FastAPI(title="tprt OpenAI-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=deps.max_body_bytes, upload_limit=deps.jobs.max_dataset_bytes + UPLOAD_OVERHEAD)
    app.add_middleware(Authenticate, check=TokenCheck(deps.token),  # the outermost: before any body is read
                       on_refused=lambda scope: api.count_scope(app, scope, "unauthenticated"))
    app.add_exception_handler(RequestValidationError, api.invalid_body)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, api.http_error)  # type: ignore[arg-type]  # 404, 405
    for known in (ServeError, ValidationError):  # a client's mistake, or a state of the server
        app.add_exception_handler(known, api.failed)  # type: ignore[arg-type]
    for storage in (OSError, sqlite3.Error):  # a full disk is 507; any other such error is a bug
        app.add_exception_handler(storage, api.storage_failed)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, api.failed)  # a bug: 500, and uvicorn logs the traceback
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.get("/ready")(api.ready)
    app.get("/metrics")(api.metrics)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/v1/files")(api.upload_file)
    app.get("/v1/files")(api.list_files)
    app.get("/v1/files/{file_id}")(api.get_file)
    app.get("/v1/files/{file_id}/content")(api.file_content)
    app.delete("/v1/files/{file_id}")(api.delete_file)
    app.post("/v1/fine_tuning/jobs")(api.create_job)
    app.get("/v1/fine_tuning/jobs")(api.list_jobs)
    app.get("/v1/fine_tuning/jobs/{job_id}")(api.get_job)
    app.post("/v1/fine_tuning/jobs/{job_id}/cancel")(api.cancel_job)
    app.get("/v1/fine_tuning/jobs/{job_id}/events")(api.job_events)
    app.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")(api.job_checkpoints)
    app.post("/v1/responses")(api.create_response)
    app.post("/v1/responses/input_tokens")(api.response_input_tokens)
    app.get("/v1/responses/{response_id}")(api.get_response)
    app.delete("/v1/responses/{response_id}")(api.delete_response)
    app.post("/v1/responses/{response_id}/cancel")(api.cancel_response)
    app.get("/v1/responses/{response_id}/input_items")(api.response_input_items)
    app.post("/v1/batches")(api.create_batch)
    app.get("/v1/batches")(api.list_batches)
    app.get("/v1/batches/{batch_id}")(api.get_batch)
    app.post("/v1/batches/{batch_id}/cancel")(api.cancel_batch)
    if deps.batches is not None:
        deps.batches.bind(api.run_line, deps.files.publish)
    from serve.anthropic.app import MessagesApi  # it builds on this module's HttpApi

    anthropic = MessagesApi(deps)
    app.post("/v1/messages")(anthropic.create_message)
    app.post("/v1/messages/count_tokens")(anthropic.count_tokens)
    return app


class HttpApi:
    """What every HTTP API's routes share: the deps, body parsing, counting, the error handlers."""

    def __init__(self, deps: HttpDeps) -> None:
        self.d = deps
        self.core = deps.core

    # ----------------------------------------------------------------- plumbing

    def _count(self, request: Request, outcome: str) -> None:
        route = request.scope.get("route")
        self.d.metrics.outcome(getattr(route, "path", "(no route)"), outcome, 0.0, protocol="http")

    def count_scope(self, app: FastAPI, scope: Scope, outcome: str) -> None:
        """Counts a request refused before routing, under the route it names (not its raw path:
        callers choose those, and each would be a metric series)."""
        path = next((getattr(r, "path", "") for r in app.router.routes if r.matches(scope)[0] == Match.FULL),
                    "(no route)")
        self.d.metrics.outcome(path, outcome, 0.0, protocol="http")

    async def _body(self, request: Request, model: type[Body]) -> Body:
        """The request's JSON body as `model`; parsed on a thread when it is large."""
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise Cancelled("the client disconnected") from None
        lenient = self.d.ignore_unknown_fields
        if len(raw) > PARSE_ON_THREAD_BYTES:
            return await run_in_threadpool(parse_body, raw, model, lenient)
        return parse_body(raw, model, lenient)

    def _ok(self, request: Request, value: Any) -> Any:
        self._count(request, "ok")
        return value

    async def failed(self, request: Request, e: Exception) -> JSONResponse:
        status, body, outcome = http_error_body(request.url.path, e)
        self._count(request, outcome)
        return JSONResponse(_redacted(body, self.d.redact), status_code=status)

    async def storage_failed(self, request: Request, e: Exception) -> JSONResponse:
        """A write the disk could not take is 507 (serve.errors.is_disk_full); other errors go on to
        the handler of bugs."""
        if not is_disk_full(e):
            raise e
        return await self.failed(request, e)

    async def invalid_body(self, request: Request, e: RequestValidationError) -> JSONResponse:
        """A query parameter of the wrong type (bodies are read by `_body`)."""
        errors = [{**err, "loc": tuple(p for p in err.get("loc", ()) if p != "query")} for err in e.errors()]
        return await self.failed(request, invalid_param(errors))

    async def http_error(self, request: Request, e: HTTPException) -> JSONResponse:
        """Starlette's own refusals (no such route: 404; a method the route lacks: 405) in OpenAI's shape."""
        self._count(request, "not_found" if e.status_code == 404 else "invalid_argument")
        what = f"{request.method} {echo(request.url.path)}"
        if is_anthropic(request.url.path):
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": f"{e.detail}: {what}"}}
        else:
            code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
            body = {"error": {"message": f"{e.detail}: {what}", "type": "invalid_request_error", "param": None,
                              "code": code}}
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    def _adapter(self, model: str) -> str:
        """The adapter id `model` names ("": the base model)."""
        if model == self.d.facts.name:
            return ""
        if not model:  # not the base model by default: a request names what it wants
            raise ParamError(f"empty; name the base model {self.d.facts.name!r} or an adapter "
                             "(the models endpoint lists them)", "model")
        return model



class OpenAIApi(HttpApi):
    """The OpenAI API's route handlers (see the module docstring)."""

    # ----------------------------------------------------------------- routes

    async def health(self, request: Request) -> JSONResponse:
        """Liveness: 503 once a rank is down (the server must be restarted)."""
        alive = self.d.alive()
        return JSONResponse({"status": "ok" if alive else "broken"}, status_code=200 if alive else 503)

    async def ready(self, request: Request) -> JSONResponse:
        """Readiness: 200 while the server takes requests; 503 before it starts, while it drains,
        and once a rank is down."""
        ready = self.d.ready()
        return JSONResponse({"status": "ready" if ready else "not ready"}, status_code=200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.d.registry is None:
            raise NotFound("this server exports no metrics here", "path")
        return Response(generate_latest(self.d.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> dict[str, Any]:
        created = int(self.d.started)
        base = self.d.facts.name
        data = [{"id": base, "object": "model", "created": created, "owned_by": "tprt", "root": base,
                 "parent": None}]
        data += [{"id": a.id, "object": "model", "created": created, "owned_by": "tprt", "root": base,
                  "parent": base} for a in self.d.adapters.list()]
        self._count(request, "ok")
        return {"object": "list", "data": data}

    async def completions(self, request: Request) -> Any:
        body = await self._body(request, CompletionBody)
        return await self._generate(request, body, "text_completion", completion_request)

    async def chat_completions(self, request: Request) -> Any:
        body = await self._body(request, ChatBody)
        return await self._generate(request, body, "chat.completion", chat_request)

    # ----------------------------------------------------------------- files

    async def upload_file(self, request: Request) -> dict[str, Any]:
        # The form is read here, not by FastAPI, which would answer a body over the limit
        # (BodyLimit's 413, raised as it streams in) with a 400.
        try:
            async with request.form(max_files=1, max_fields=16) as form:
                file, purpose = form.get("file"), form.get("purpose")
                if not isinstance(file, UploadFile):
                    raise ParamError("a file to upload is needed (multipart field 'file')", "file")
                if not isinstance(purpose, str):
                    raise ParamError("needed (multipart field 'purpose'), e.g. 'fine-tune'", "purpose")
                # Copying, syncing and tokenizing the dataset: on the dataset threads.
                obj = await self.d.datasets.run(self.d.files.add, file.file, file.filename or "upload.jsonl", purpose)
        except ClientDisconnect:
            raise Cancelled("the client disconnected") from None
        except HTTPException as e:  # starlette's refusal of a malformed form
            raise ParamError(f"not a valid multipart form ({e.detail})", "file") from None
        return self._ok(request, obj)

    async def list_files(self, request: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = 10_000, order: str = "desc") -> dict[str, Any]:
        _check_limit(limit, 10_000)
        if order not in ("asc", "desc"):
            raise ParamError(f"{echo(order)}; 'asc' or 'desc'", "order")
        files = await run_in_threadpool(self.d.files.list, purpose)  # a database read: off the event loop
        listed = page(files[::-1] if order == "asc" else files, after, limit, "file")
        return self._ok(request, listed)

    async def get_file(self, request: Request, file_id: str) -> dict[str, Any]:
        return self._ok(request, await run_in_threadpool(self.d.files.get, file_id))

    async def file_content(self, request: Request, file_id: str) -> FileResponse:
        path = await run_in_threadpool(self.d.files.content, file_id)
        return self._ok(request, FileResponse(path, media_type="application/jsonl"))

    async def delete_file(self, request: Request, file_id: str) -> dict[str, Any]:
        return self._ok(request, await run_in_threadpool(self.d.files.delete, file_id))

    # ----------------------------------------------------------------- fine-tuning jobs

    async def create_job(self, request: Request) -> dict[str, Any]:
        body = await self._body(request, FineTuningJobBody)
        # Reading and tokenizing the training file, and the store's writes: on the dataset threads.
        return self._ok(request, await self.d.datasets.run(self._create_job, body))

    def _create_job(self, body: FineTuningJobBody) -> dict[str, Any]:
        d = self.d
        if not d.jobs.accepting:
            raise Unavailable(d.jobs.manager.refusal)
        if body.model != d.facts.name and not d.adapters.has(body.model) \
                and not adapter_on_disk(body.model, d.jobs.data_dir):  # as gRPC's init_adapter takes them
            raise NotFound(f"model {echo(body.model)} is neither the served base model {d.facts.name!r} nor an "
                           "adapter", "model")
        job = OpenAIJob(body)
        # a fine-tuned model (adapter) to train on, e.g. DPO after SFT
        init_adapter = body.model if body.model != d.facts.name else ""
        with d.files.lock:  # the job's files stay until the job is stored
            d.files.content(body.training_file, "training_file")  # fetched when another replica took the upload
            training = dataset_path(body.training_file)
            validation = ""
            if body.validation_file:
                d.files.content(body.validation_file, "validation_file")
                validation = dataset_path(body.validation_file)
            job.fit(self._examples(training))

            def sidecar(spec: JobSpec) -> None:  # in the job's directory: gone if refused
                write_sidecar(d.jobs.data_dir, spec.record, job.sidecar())

            try:
                rec = d.jobs.create(job.request(training, validation, init_adapter), sidecar)
            except ServeError as e:
                raise job.error(e) if e.field else e from None
        return job_object(rec, d.facts.name, d.jobs.data_dir)

    def _examples(self, training: str) -> int:
        """The examples of the job's training file (n_epochs and an auto batch size count them);
        check_create reads and tokenizes the file afterwards."""
        from tprt.train.data import read_jsonl

        try:
            return sum(1 for _ in read_jsonl(self.d.jobs.data_dir / training))
        except ValidationError as e:
            raise ParamError(str(e), "training_file") from None

    # The store's reads and the job objects (a sidecar and a metrics log read per job) are
    # blocking work: every job route runs off the event loop.

    async def list_jobs(self, request: Request, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        _check_limit(limit, 100)
        return self._ok(request, await run_in_threadpool(self._list_jobs, after, limit))

    def _list_jobs(self, after: str | None, limit: int) -> dict[str, Any]:
        try:
            recs = self.d.jobs.store.page(store_job_id(after) if after is not None else None, limit + 1)
        except KeyError:
            raise NotFound(f"no job {echo(after or '')}", "after") from None
        data = [self._job_object(r) for r in recs[:limit]]
        return {"object": "list", "data": data, "has_more": len(recs) > limit}

    def _job_object(self, rec: Any) -> dict[str, Any]:
        return job_object(self.d.jobs.shown(rec), self.d.facts.name, self.d.jobs.data_dir)

    async def get_job(self, request: Request, job_id: str) -> dict[str, Any]:
        rec = await run_in_threadpool(self.d.jobs.get, store_job_id(job_id))
        return self._ok(request, await run_in_threadpool(self._job_object, rec))

    async def cancel_job(self, request: Request, job_id: str) -> dict[str, Any]:
        rec = await run_in_threadpool(self.d.jobs.cancel, store_job_id(job_id))
        return self._ok(request, await run_in_threadpool(self._job_object, rec))

    async def job_events(self, request: Request, job_id: str, after: str | None = None,
                         limit: int = 20) -> dict[str, Any]:
        _check_limit(limit, 1000)

        def events() -> list[dict[str, Any]]:
            return job_events(self.d.jobs.get(store_job_id(job_id)), self.d.jobs.data_dir)[::-1]  # newest first

        return self._ok(request, page(await run_in_threadpool(events), after, limit, "event"))

    async def job_checkpoints(self, request: Request, job_id: str, after: str | None = None,
                              limit: int = 10) -> dict[str, Any]:
        _check_limit(limit, 100)
        rec = await run_in_threadpool(self.d.jobs.get, store_job_id(job_id))
        return self._ok(request, page(job_checkpoints(rec), after, limit, "checkpoint"))

    # ----------------------------------------------------------------- responses

    async def create_response(self, request: Request) -> Any:
        body = await self._body(request, ResponsesBody)
        req = await self._responses_request(body)
        rename = partial(rename_field, name=by_prefix(RESPONSES_PARAMS))
        try:
            prepared = await run_in_threadpool(self.core.prepare, req.request)
            generation = self.core.start_async(prepared)
        except ServeError as e:
            raise rename(e) from None
        reply, builder = Reply("chat.completion", body.model, prepared), ResponseBuilder(body, req)
        if body.stream:
            return EventSourceResponse(self._stream_response(request, generation.aevents(), reply, builder, rename))
        try:
            async for ev in generation.aevents(request.is_disconnected):
                chunk = reply.chunk(ev, False)
                if chunk is not None:
                    builder.feed(chunk["choices"][0])
        except ServeError as e:
            if isinstance(e, Cancelled):
                self._count(request, "cancelled")
            raise rename(e) from None
        builder.finish(reply.usage())
        await self._store_response(body, builder)
        return self._ok(request, builder.response())

    async def _responses_request(self, body: ResponsesBody) -> ResponsesRequest:
        previous = None
        if body.previous_response_id is not None:
            previous = await run_in_threadpool(self._stored().conversation, body.previous_response_id)
        return responses_request(body, self._adapter(body.model), previous)

    def _stored(self) -> ResponseStore:
        if self.d.responses is None:
            raise NotFound("this server keeps no responses", "response_id")
        return self.d.responses

    async def _store_response(self, body: ResponsesBody, builder: ResponseBuilder) -> None:
        if body.store is not False and self.d.responses is not None:
            await run_in_threadpool(self.d.responses.put, builder.response(), with_ids(input_items(body.input)),
                                    builder.conversation())

    async def _stream_response(self, request: Request, events: AsyncGenerator[ChoiceEvent, None], reply: Reply,
                               builder: ResponseBuilder, rename: Callable[[ServeError], ServeError],
                               ) -> AsyncIterator[bytes]:
        """The Responses API's named events; an error after the headers ends the stream with
        response.failed (nothing is stored)."""
        outcome = "cancelled"

        def sse(evs: list[dict[str, Any]]) -> bytes:
            return b"".join(format_sse_event(data_str=json.dumps(e), event=e["type"]) for e in evs)

        try:
            yield sse(builder.opening())
            async for ev in events:
                chunk = reply.chunk(ev, False)
                if chunk is not None:
                    out = builder.feed(chunk["choices"][0])
                    if out:
                        yield sse(out)
            done = builder.finish(reply.usage())
            await self._store_response(builder.body, builder)
            yield sse(done)
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - after the headers, an error is an event of the stream
            _, body, outcome = error_body(rename(e) if isinstance(e, ServeError) else e)
            yield sse(builder.failed(_redacted(body, self.d.redact)["error"]))
        finally:
            await events.aclose()
            self._count(request, outcome)

    async def response_input_tokens(self, request: Request) -> dict[str, Any]:
        """The input tokens a Responses body would use (its chat rendered with its tools)."""
        body = await self._body(request, ResponsesBody)
        req = await self._responses_request(body)
        try:
            prepared = await run_in_threadpool(self.core.prepare, req.request)
        except ServeError as e:
            raise rename_field(e, by_prefix(RESPONSES_PARAMS)) from None
        return self._ok(request, {"object": "response.input_tokens", "input_tokens": len(prepared.prompts[0])})

    async def get_response(self, request: Request, response_id: str) -> dict[str, Any]:
        return self._ok(request, await run_in_threadpool(self._stored().get, response_id))

    async def delete_response(self, request: Request, response_id: str) -> dict[str, Any]:
        await run_in_threadpool(self._stored().delete, response_id)
        return self._ok(request, {"id": response_id, "object": "response", "deleted": True})

    async def cancel_response(self, request: Request, response_id: str) -> dict[str, Any]:
        await run_in_threadpool(self._stored().get, response_id)  # 404 when there is no such response
        raise ParamError("only background responses can be cancelled, and this server runs none", "response_id")

    async def response_input_items(self, request: Request, response_id: str, after: str | None = None,
                                   limit: int = 20, order: str = "desc") -> dict[str, Any]:
        _check_limit(limit, 100)
        if order not in ("asc", "desc"):
            raise ParamError(f"{echo(order)}; 'asc' or 'desc'", "order")
        items = await run_in_threadpool(self._stored().input_items, response_id)
        return self._ok(request, page(items[::-1] if order == "desc" else items, after, limit, "item"))

    # ----------------------------------------------------------------- generation

    async def _generate(self, request: Request, body: Any, kind: str,
                        read: Callable[[Any, str], OpenAIRequest]) -> Any:
        req = read(body, self._adapter(body.model))
        generation = None
        try:
            # Tokenizing, the chat template and compiling constraints are CPU work: off the event loop.
            prepared = await run_in_threadpool(self.core.prepare, req.request)
            scores = await run_in_threadpool(self._score_prompts, prepared, req)
            if req.generate:
                generation = self.core.start_async(prepared)
        except ServeError as e:
            raise req.error(e) from None
        reply = Reply(kind, body.model, prepared)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            opening = reply.echo_opening(scores.echoed, req.generate) if scores.echoed is not None else None
            events = generation.aevents() if generation is not None else _no_events()
            return EventSourceResponse(self._stream(request, events, reply, usage, req.error, opening))
        if generation is not None:
            try:
                async for ev in generation.aevents(request.is_disconnected):
                    reply.add(ev)
            except ServeError as e:  # the loop's refusal (the adapter pool's), or how the request ended
                if isinstance(e, Cancelled):
                    self._count(request, "cancelled")
                raise req.error(e) from None
        self._count(request, "ok")
        return self._answer(req, reply, scores)

    def _score_prompts(self, prepared: Prepared, req: OpenAIRequest) -> PromptScores:
        """What `echo` and `prompt_logprobs` show of each prompt: its tokens' texts and, where asked,
        their log-probabilities, ranks and likeliest alternatives (the base model's, one forward
        pass on every rank between engine steps; a thread waits for it)."""
        if not req.echo and req.prompt_logprobs is None:
            return PromptScores()
        param = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
        tok = self.d.tokenizer
        if tok is None:
            raise ParamError(f"{param} needs the model's tokenizer, which it does not have", param)
        if prepared.adapter_id:
            raise ParamError(f"{param} scores prompts with the base model only; name it as the model", param)

        def text(token_id: int) -> str:
            return tok.decode([token_id], skip_special_tokens=False)

        tops = [k for k in (req.echo_logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        echoed: list[EchoedPrompt] = []
        listed: list[list[dict[str, Any] | None]] = []
        for ids in prepared.prompts:
            scored = self.core.score_prompt(ids, max(tops)).result() if tops else None
            if req.echo:
                tokens = [text(t) for t in ids]
                if scored is None or req.echo_logprobs is None:
                    echoed.append(EchoedPrompt(tokens))
                else:
                    echoed.append(EchoedPrompt(tokens, list(scored.logprobs), [
                        [(text(t), lp) for t, lp in top[:req.echo_logprobs]] for top in scored.top]))
            if req.prompt_logprobs is not None:
                assert scored is not None
                listed.append(prompt_logprob_entries(ids, scored, req.prompt_logprobs, text))
        return PromptScores(echoed if req.echo else None, listed if req.prompt_logprobs is not None else None)

    def _answer(self, req: OpenAIRequest, reply: Reply, scores: PromptScores) -> dict[str, Any]:
        """The response object: echoed prompts, prompt_logprobs, and of best_of the best."""
        if scores.echoed is not None:
            reply.echoed(scores.echoed, generated=req.generate)
        out = reply.whole()
        if scores.prompt_logprobs is not None:
            if reply.chat:  # vLLM's place for them: the response's, a chat having one prompt
                out["prompt_logprobs"] = scores.prompt_logprobs[0]
            else:
                for choice, (p, _) in zip(out["choices"], reply.prepared.choices):
                    choice["prompt_logprobs"] = scores.prompt_logprobs[p]
        if req.keep is not None:
            out["choices"] = best_choices(out["choices"], reply.prepared.n, req.keep, req.show_logprobs)
        return out

    # ----------------------------------------------------------------- batches

    def _batches(self) -> BatchRunner:
        if self.d.batches is None:
            raise NotFound("this server runs no batches", "batch_id")
        return self.d.batches

    async def create_batch(self, request: Request) -> dict[str, Any]:
        body = await self._body(request, BatchBody)
        return self._ok(request, await self.d.datasets.run(self._create_batch, body))

    def _create_batch(self, body: BatchBody) -> dict[str, Any]:
        runner = self._batches()
        if body.endpoint not in BATCH_ENDPOINTS:
            raise ParamError(f"{echo(body.endpoint)}; one of {', '.join(BATCH_ENDPOINTS)}", "endpoint")
        if body.completion_window != "24h":
            raise ParamError("only '24h'", "completion_window")
        file = self.d.files.get(body.input_file_id, "input_file_id")
        if file["purpose"] != "batch":
            raise ParamError(f"file {body.input_file_id} has purpose {file['purpose']!r}; upload the requests with "
                             "purpose 'batch'", "input_file_id")
        path = self.d.files.content(body.input_file_id, "input_file_id")
        lines = read_batch_file(path, body.endpoint)
        models = {line.body.get("model") for line in lines}
        for n, line in enumerate(lines, 1):  # every request names a model this server serves
            model = line.body.get("model")
            if not isinstance(model, str) or (model != self.d.facts.name and not self.d.adapters.has(model)
                                              and not adapter_on_disk(model, self.d.jobs.data_dir)):
                raise ParamError(f"line {n}: model {echo(str(model))} is neither the served base model "
                                 f"{self.d.facts.name!r} nor an adapter", "input_file_id")
        model = next(iter(models)) if len(models) == 1 else None
        return runner.submit(new_batch(body, len(lines), model), path)

    async def list_batches(self, request: Request, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        _check_limit(limit, 100)
        data, more = await run_in_threadpool(self._batches().store.page, after, limit)
        return self._ok(request, {"object": "list", "data": data, "has_more": more,
                                  "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})

    async def get_batch(self, request: Request, batch_id: str) -> dict[str, Any]:
        return self._ok(request, await run_in_threadpool(self._batches().store.get, batch_id))

    async def cancel_batch(self, request: Request, batch_id: str) -> dict[str, Any]:
        return self._ok(request, await run_in_threadpool(self._batches().cancel, batch_id))

    # ----------------------------------------------------------------- a batch's requests

    def run_line(self, url: str, body: dict[str, Any], gone: Callable[[], str | None]) -> tuple[int, dict[str, Any]]:
        """One request of a batch (serve/openai/batches.py), on a runner's thread: its HTTP status
        and body as the endpoint would answer it, generated at BACKGROUND priority. Cancelled or
        Unavailable escape: the request is not answered."""
        try:
            raw = json.dumps(body).encode()
            lenient = self.d.ignore_unknown_fields
            if url == "/v1/responses":
                return 200, self._respond_background(parse_body(raw, ResponsesBody, lenient), gone)
            if url == "/v1/chat/completions":
                return 200, self._complete_background(parse_body(raw, ChatBody, lenient), "chat.completion",
                                                      chat_request, gone)
            return 200, self._complete_background(parse_body(raw, CompletionBody, lenient), "text_completion",
                                                  completion_request, gone)
        except (Cancelled, Unavailable):
            raise
        except Exception as e:  # noqa: BLE001 - the request's own error is its answer
            status, error, _ = error_body(e)
            if status >= 500 and not isinstance(e, ServeError):
                log.error("a batch's request failed: %s", e, exc_info=True)
            return status, _redacted(error, self.d.redact)

    def _complete_background(self, body: Any, kind: str, read: Callable[[Any, str], OpenAIRequest],
                             gone: Callable[[], str | None]) -> dict[str, Any]:
        req = read(body, self._adapter(body.model))
        try:
            prepared = self.core.prepare(req.request)
            scores = self._score_prompts(prepared, req)
            reply = Reply(kind, body.model, prepared)
            if req.generate:
                for ev in self.core.start(prepared, priority=BACKGROUND).events(gone):
                    reply.add(ev)
        except ServeError as e:
            raise req.error(e) from None
        return self._answer(req, reply, scores)

    def _respond_background(self, body: ResponsesBody, gone: Callable[[], str | None]) -> dict[str, Any]:
        previous = None
        if body.previous_response_id is not None:
            previous = self._stored().conversation(body.previous_response_id)
        req = responses_request(body, self._adapter(body.model), previous)
        try:
            prepared = self.core.prepare(req.request)
            reply, builder = Reply("chat.completion", body.model, prepared), ResponseBuilder(body, req)
            for ev in self.core.start(prepared, priority=BACKGROUND).events(gone):
                chunk = reply.chunk(ev, False)
                if chunk is not None:
                    builder.feed(chunk["choices"][0])
        except ServeError as e:
            raise rename_field(e, by_prefix(RESPONSES_PARAMS)) from None
        builder.finish(reply.usage())
        if body.store is not False and self.d.responses is not None:
            self.d.responses.put(builder.response(), with_ids(input_items(body.input)), builder.conversation())
        return builder.response()

    async def _stream(self, request: Request, events: AsyncGenerator[ChoiceEvent, None], reply: Reply,
                      include_usage: bool, rename: Callable[[ServeError], ServeError],
                      opening: list[dict[str, Any]] | None = None) -> AsyncIterator[bytes]:
        """A streaming response notices the disconnect itself (it closes this generator, and so
        `events`). `opening`: the first chunks (an echoed prompt), else the reply's own."""
        outcome = "cancelled"  # unless it ends below: the client went away mid-stream
        try:
            for chunk in opening if opening is not None else reply.opening():
                yield format_sse_event(data_str=json.dumps(chunk))
            async for ev in events:
                piece = reply.chunk(ev, include_usage)
                if piece is not None:
                    yield format_sse_event(data_str=json.dumps(piece))
            if include_usage:
                yield format_sse_event(data_str=json.dumps(reply.usage_chunk()))
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - after the headers, an error is an event of the stream
            _, body, outcome = error_body(rename(e) if isinstance(e, ServeError) else e)
            body["error"]["message"] = self.d.redact(body["error"]["message"])  # as `failed` shows it
            yield format_sse_event(data_str=json.dumps(body))
        finally:
            await events.aclose()  # cancels what has not finished
            self._count(request, outcome)
        yield format_sse_event(data_str="[DONE]")


async def _no_events() -> AsyncGenerator[ChoiceEvent, None]:
    """The events of a request that generates nothing (echo with max_tokens 0)."""
    return
    yield  # an async generator


def _check_limit(limit: int, most: int) -> None:
    if not 1 <= limit <= most:
        raise ParamError(f"must be in [1, {most}], got {limit}", "limit")
