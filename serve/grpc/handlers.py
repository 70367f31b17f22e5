"""The Generation and FineTuning services: protobuf <-> the generation core and the job manager.

Generate and Complete read the request (serve/grpc/validation.py) into the core's request, which
the core checks and queues (serve/core/generation.py), and turn its events into responses; the
core's errors are renamed to the proto's field paths. The RPC's end, whatever the reason (done,
client cancel, disconnect, deadline), cancels its ticket through a gRPC callback: the sequence
leaves the batch at the next step and its KV blocks are freed. A handler waits on its events with a
timeout and rechecks that the call is alive, so it never blocks forever; the engine loop (or the
rank watcher) ends every ticket with an event or an error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc

from serve.adapters.catalogue import AdapterCatalogue
from serve.adapters.pool import AdapterPool
from serve.adapters.registry import AdapterInfo
from serve.core.generation import ChoiceEvent, Generation, GenerationCore, Prepared, TokenText
from serve.errors import (AlreadyExists, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, ServeError,
                          Unavailable, echo)
from serve.jobs.core import JobsCore
from serve.jobs.store import SUCCEEDED, JobStore
from serve.jobs.spec import ADAPTER_ID
from serve.grpc.jobs import PB_STATE, job_pb, job_request, progress_pb
from serve.grpc.pb import finetuning_pb2 as ft_pb
from serve.grpc.pb import finetuning_pb2_grpc as ft_grpc
from serve.grpc.pb import generation_pb2 as pb
from serve.grpc.pb import generation_pb2_grpc as pb_grpc
from serve.core.loop import EngineLoop
from serve.core.reasoning import ReasoningSplit, split_reply
from serve.core.structured import Structured
from serve.grpc.validation import generation_request, grpc_error, prompt_of, structured_of
from tprt.distributed.ranks import CommandFailed
from tprt.engine.sampling import MAX_TOP_LOGPROBS

GenerationServicer: Any = pb_grpc.GenerationServicer
FineTuningServicer: Any = ft_grpc.FineTuningServicer
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "cancelled": pb.FINISH_REASON_CANCELLED}
_POLL_S = 0.5


class GenerationService(GenerationServicer):
    """tprt.v1.Generation on rank 0."""

    def __init__(self, core: GenerationCore, pool: AdapterPool | None = None, store: JobStore | None = None,
                 catalogue: AdapterCatalogue | None = None) -> None:
        self.core = core
        self.loop: EngineLoop = core.loop  # type: ignore[assignment]  # LoadAdapter's calls
        self.tokenizer = core.tokenizer
        self.facts = core.facts
        self.adapters = core.adapters
        self.pool = pool  # the adapter tiers (LoadAdapter, UnloadAdapter); None: adapters come from jobs only
        self.store = store  # the job store, for LoadAdapter(job_id)
        self.catalogue = catalogue  # a fleet's: loads and unloads through this replica reach the others

    # ----------------------------------------------------------------- RPCs

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        generation, prepared = self._start(request, context)
        split = ReasoningSplit(prepared.reasoning) if prepared.reasoning is not None else None
        text = []
        for ev in self._events(generation, context):
            finished = ev.finish_reason is not None
            reasoning, answer = split.feed(ev.text, finished) if split is not None else ("", ev.text)
            out = pb.GenerateResponse(request_id=generation.request_id, text=answer, reasoning=reasoning)
            if ev.token is not None:
                out.token.CopyFrom(_token(ev.token))
            text.append(answer)
            if finished:
                _finish(out, ev)
                _tool_calls(out, prepared.structured, "".join(text))
            yield out

    def Complete(self, request: Any, context: grpc.ServicerContext) -> Any:
        generation, prepared = self._start(request, context)
        out = pb.CompleteResponse(request_id=generation.request_id)
        text = []
        for ev in self._events(generation, context):
            text.append(ev.text)
            if ev.token is not None:
                out.tokens.append(_token(ev.token))
            if ev.finish_reason is not None:
                _finish(out, ev)
        out.text = "".join(text)
        if prepared.reasoning is not None:
            reasoning, out.text = split_reply(out.text, prepared.reasoning)
            out.reasoning = reasoning or ""
        _tool_calls(out, prepared.structured, out.text)
        return out

    def Tokenize(self, request: Any, context: grpc.ServicerContext) -> Any:
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        structured = structured_of(request) if request.WhichOneof("input") == "chat" else None
        try:
            ids = self.core.prompt_ids(prompt_of(request), structured, add_special_tokens=add)
        except ServeError as e:
            raise grpc_error(e) from None
        tok = self.tokenizer
        tokens = [(tok.id_to_token(i) or "") if tok is not None else "" for i in ids]
        return pb.TokenizeResponse(ids=ids, tokens=tokens)

    def ModelInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        f, c = self.facts, self.facts.config
        config = pb.ModelConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
            max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
            tie_word_embeddings=c.tie_word_embeddings)
        adapters = [adapter_pb(a) for a in self.adapters.list()]
        return pb.ModelInfoResponse(
            model=f.name, config=config, tp_size=f.tp_size, context_length=f.context_length,
            max_batch_size=f.max_batch_size, dtype=f.dtype, eos_token_ids=list(f.eos_token_ids),
            has_chat_template=bool(self.tokenizer is not None and self.tokenizer.chat_template),
            adapters=adapters, max_top_logprobs=MAX_TOP_LOGPROBS, kv_cache_dtype=f.kv_cache_dtype,
            kv_cache_tokens=f.kv_cache_tokens)

    def LoadAdapter(self, request: Any, context: grpc.ServicerContext) -> Any:
        pool = self._need_pool()
        adapter_id, job_id = request.id, ""
        source = request.WhichOneof("source")
        if source == "job_id":
            rec = self.store.get(request.job_id) if self.store is not None and request.job_id else None
            if rec is None:
                raise NotFound(f"no job {echo(request.job_id)}", "job_id")
            if rec.method != "lora" or rec.state != SUCCEEDED or not rec.output_path:
                raise FailedPrecondition(f"job {rec.id} has no adapter (a {rec.method} job, {rec.state})", "job_id")
            path, adapter_id, job_id = pool.data_dir / rec.output_path, adapter_id or rec.adapter_id, rec.id
            if self.catalogue is not None:  # trained on another replica: its directory comes first
                self.catalogue.fetch_job(rec.id)
        elif source == "path":
            path = pool.resolve_path(request.path)
        else:
            raise InvalidArgument("give the adapter's path (under --data-dir) or a job_id", "path")
        if not ADAPTER_ID.fullmatch(adapter_id):
            raise InvalidArgument("1-64 characters: letters, digits, '.', '_', '-' (starting with a letter or digit)",
                                  "id")
        if adapter_id in pool.reserved:
            raise AlreadyExists(f"{echo(adapter_id)} is the served base model's name", "id")
        pool.describe(path, "path" if source == "path" else "job_id")  # rank limit, base model
        future = self.loop.call(lambda ranks: pool.load(ranks, adapter_id, path, request.pin, job_id))
        try:
            info = _wait(future, context)
        except CommandFailed as e:
            raise InvalidArgument(f"the adapter could not be loaded: {e}", "path") from None
        if self.catalogue is not None:
            self.catalogue.loaded(adapter_id, path, job_id)
        return adapter_pb(info)

    def UnloadAdapter(self, request: Any, context: grpc.ServicerContext) -> Any:
        pool = self._need_pool()
        # In a fleet the tombstone comes first: no replica resolves the id again meanwhile.
        elsewhere = self.catalogue is not None and self.catalogue.unloaded(request.id, pool.registry.has(request.id))
        try:
            pool.begin_unload(request.id)
        except NotFound:
            if elsewhere:  # loaded on other replicas only: they unload it at their next poll
                return pb.UnloadAdapterResponse()
            raise
        self.loop.wake()
        while not self.adapters.wait_removed(request.id, _POLL_S):
            if self.loop.broken is not None:
                raise Unavailable(f"the server cannot unload adapters: {self.loop.broken}")
            if not context.is_active():
                raise DeadlineExceeded("the adapter's requests had not finished; it is still being unloaded")
        return pb.UnloadAdapterResponse()

    def ListAdapters(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ListAdaptersResponse(adapters=[adapter_pb(a) for a in self.adapters.list()])

    # ----------------------------------------------------------------- helpers

    def _need_pool(self) -> AdapterPool:
        if self.pool is None:
            raise FailedPrecondition("this server has no adapter pool", "id")
        return self.pool

    def _start(self, request: Any, context: grpc.ServicerContext) -> tuple[Generation, Prepared]:
        """Checks the request and queues it (the core's rules, the proto's field names); the RPC's
        end cancels it."""
        try:
            req = generation_request(request)
            prepared = self.core.prepare(req)
            remaining = context.time_remaining()
            deadline = time.monotonic() + remaining if remaining is not None else None
            generation = self.core.start(prepared, deadline)
        except ServeError as e:
            raise grpc_error(e) from None
        context.add_callback(lambda: self._ended(generation, context))
        return generation, prepared

    @staticmethod
    def _ended(generation: Generation, context: grpc.ServicerContext) -> None:
        """gRPC's end-of-call callback: cancels what has not finished."""
        generation.close(_why_ended(context))

    @staticmethod
    def _events(generation: Generation, context: grpc.ServicerContext) -> Iterator[ChoiceEvent]:
        """The request's events up to its last; raises its error, or CANCELLED / DEADLINE_EXCEEDED
        (also when the call ended before its callback ran)."""
        yield from generation.events(lambda: None if context.is_active() else _why_ended(context))


def _why_ended(context: grpc.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "deadline" if remaining is not None and remaining <= 0 else "client"


def _token(t: TokenText) -> Any:
    token = pb.Token(id=t.id, text=t.text)
    if t.logprob is not None:
        token.logprob = t.logprob
    for tid, text, lp in t.top_logprobs:
        token.top_logprobs.append(pb.TopLogprob(token_id=tid, logprob=lp, text=text))
    return token


def _finish(out: Any, ev: ChoiceEvent) -> None:
    out.finish_reason = _FINISH[ev.finish_reason or "stop"]
    if ev.stop_reason is not None:
        out.stop_reason = str(ev.stop_reason)
    if ev.usage is not None:
        out.usage.prompt_tokens = ev.usage.prompt_tokens
        out.usage.completion_tokens = ev.usage.completion_tokens
        out.usage.cached_prompt_tokens = ev.usage.cached_prompt_tokens


def _tool_calls(out: Any, structured: Structured, text: str) -> None:
    """A finished response's tool calls, when its text is calls (chats with tools)."""
    calls = structured.tool_calls(text)
    if not calls:
        return
    for c in calls:
        out.tool_calls.append(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments))
    if out.finish_reason == pb.FINISH_REASON_STOP:
        out.finish_reason = pb.FINISH_REASON_TOOL_CALLS


def adapter_pb(a: AdapterInfo) -> Any:
    return pb.Adapter(id=a.id, rank=a.rank, alpha=a.alpha, source_job_id=a.source_job_id, targets=list(a.targets),
                      tier=a.tier, pinned=a.pinned, requests=a.requests)


def _wait(future: Future[Any], context: grpc.ServicerContext) -> Any:
    """The engine loop's result of a call, while the RPC is alive."""
    while True:
        try:
            return future.result(timeout=_POLL_S)
        except FutureTimeout:
            if not context.is_active():
                raise DeadlineExceeded("the call ended before the server finished it") from None


class FineTuningService(FineTuningServicer):
    """tprt.v1.FineTuning on rank 0: the jobs core (serve/jobs/core.py) in protobuf."""

    def __init__(self, jobs: JobsCore) -> None:
        self.jobs = jobs

    def CreateJob(self, request: Any, context: grpc.ServicerContext) -> Any:
        return job_pb(self.jobs.create(job_request(request)))

    def GetJob(self, request: Any, context: grpc.ServicerContext) -> Any:
        return job_pb(self.jobs.get(request.job_id))

    def ListJobs(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.limit < 0:
            raise InvalidArgument(f"must be >= 0, got {request.limit}", "limit")
        if request.state and request.state not in PB_STATE:
            raise InvalidArgument(f"unknown state {request.state}", "state")
        state = PB_STATE.get(request.state) if request.state else None
        recs = self.jobs.store.select(state, limit=min(request.limit or 100, 10_000))
        return ft_pb.ListJobsResponse(jobs=[job_pb(self.jobs.shown(r)) for r in recs])

    def CancelJob(self, request: Any, context: grpc.ServicerContext) -> Any:
        return job_pb(self.jobs.cancel(request.job_id))

    def WatchJob(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        rec = self.jobs.get(request.job_id)
        store = self.jobs.store
        version, last = store.version, None
        while context.is_active():
            key = (rec.state, rec.step, rec.loss, rec.error)
            if key != last:
                yield progress_pb(rec)
                last = key
            if rec.terminal or not self.jobs.accepting:
                return
            version = store.wait(version, _POLL_S)
            rec = self.jobs.get(request.job_id)
