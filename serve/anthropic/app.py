"""The Messages API's routes, on the HTTP app of serve/openai/app.py (its token check, body limit,
metrics and error handlers, which answer /v1/messages errors in Anthropic's shape): a body is read
into the generation core's request (serve/anthropic/messages.py), the core checks and queues it,
and its events become a Message, or Anthropic's server-sent events (`stream: true`); an error
after the headers is an `error` event. Clients authenticate with `x-api-key` (as Anthropic's SDK
sends it) or the bearer token.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.concurrency import run_in_threadpool

from serve.anthropic.errors import anthropic_error_body
from serve.anthropic.messages import (MESSAGES_PARAMS, CountTokensBody, MessageBuilder, MessagesBody,
                                      messages_request)
from serve.core.generation import ChoiceEvent, by_prefix, rename_field
from serve.errors import Cancelled, ServeError
from serve.openai.app import HttpApi
from serve.openai.reply import Reply

_rename = partial(rename_field, name=by_prefix(MESSAGES_PARAMS))


class MessagesApi(HttpApi):
    """POST /v1/messages and /v1/messages/count_tokens."""

    async def create_message(self, request: Request) -> Any:
        body = await self._body(request, MessagesBody)
        req = messages_request(body, self._adapter(body.model))
        try:
            prepared = await run_in_threadpool(self.core.prepare, req.request)
            generation = self.core.start_async(prepared)
        except ServeError as e:
            raise _rename(e) from None
        reply, builder = Reply("chat.completion", body.model, prepared), MessageBuilder(body.model,
                                                                                       len(prepared.prompts[0]))
        if body.stream:
            return EventSourceResponse(self._stream(request, generation.aevents(), reply, builder, _rename))
        try:
            async for ev in generation.aevents(request.is_disconnected):
                chunk = reply.chunk(ev, False)
                if chunk is not None:
                    builder.feed(chunk["choices"][0], ev)
        except ServeError as e:
            if isinstance(e, Cancelled):
                self._count(request, "cancelled")
            raise _rename(e) from None
        builder.finish(reply.usage())
        return self._ok(request, builder.message())

    async def _stream(self, request: Request, events: AsyncGenerator[ChoiceEvent, None], reply: Reply,
                      builder: MessageBuilder, rename: Callable[[ServeError], ServeError]) -> AsyncIterator[bytes]:
        outcome = "cancelled"

        def sse(evs: list[dict[str, Any]]) -> bytes:
            return b"".join(format_sse_event(data_str=json.dumps(e), event=e["type"]) for e in evs)

        try:
            yield sse(builder.opening())
            async for ev in events:
                chunk = reply.chunk(ev, False)
                if chunk is not None:
                    out = builder.feed(chunk["choices"][0], ev)
                    if out:
                        yield sse(out)
            yield sse(builder.finish(reply.usage()))
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - after the headers, an error is an event of the stream
            _, body, outcome = anthropic_error_body(rename(e) if isinstance(e, ServeError) else e)
            body["error"]["message"] = self.d.redact(body["error"]["message"])
            yield sse([body])
        finally:
            await events.aclose()
            self._count(request, outcome)

    async def count_tokens(self, request: Request) -> dict[str, Any]:
        """The input tokens a Messages body would use (its chat rendered with its tools)."""
        body = await self._body(request, CountTokensBody)
        req = messages_request(body, self._adapter(body.model))
        try:
            prepared = await run_in_threadpool(self.core.prepare, req.request)
        except ServeError as e:
            raise _rename(e) from None
        return self._ok(request, {"input_tokens": len(prepared.prompts[0])})
