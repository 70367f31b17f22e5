"""The serving part of `tprt demo`: `tprt serve` on loopback at the checkpoint's TP degree, a chat
answer streamed through the Python client, a JSON-schema answer and a tool call through the
OpenAI client (HTTP), a short LoRA fine-tune job through the API, the same question asked with the
job's adapter (served without a restart), and the server's metrics."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve.client import Client, state_name
from serve.client.local import LocalServer
from tprt.errors import TprtError

QUESTION = "What is your name?"
METRICS_SHOWN = ("tprt_requests_total", "tprt_generated_tokens_total", "tprt_time_to_first_token_seconds_count",
                 "tprt_finetune_jobs", "tprt_finetune_tokens_total")

def run_serve_demo(tp_dir: Path, out_dir: Path, chats_jsonl: str, steps: int = 10, max_new_tokens: int = 64,
                   say: Callable[[str], None] = print) -> None:
    """Runs the serving walk-through against `tp_dir`, keeping the server's --data-dir and log
    under `out_dir`. `chats_jsonl`: the fine-tune job's dataset, sent inline."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir, log = out_dir / "data", out_dir / "server.log"
    say(f"Serving: tprt serve --model {tp_dir} --port 0 --metrics-port 0 --data-dir {data_dir}")
    t0 = time.perf_counter()
    server = LocalServer(["--model", str(tp_dir), "--host", "127.0.0.1", "--metrics-port", "0", "--http-port", "0",
                          "--data-dir", str(data_dir), "--log-level", "warning"], log)
    try:
        say(f"  {server.banner.removeprefix('tprt serve: ')} (ready in {time.perf_counter() - t0:.0f}s)")
        client = Client(server.target)
        _ask(client, say, max_new_tokens)
        api = re.search(r"OpenAI API (http://\S+/v1)", server.banner)
        if api is not None:
            _openai_calls(api.group(1), say)
        say(f"  fine-tune job through the API (LoRA, {steps} steps on {len(chats_jsonl.splitlines())} chats), "
            "served as adapter 'tippy' when done:")
        # batch_size counts examples (one per row): 8 a step, so 10 steps see the 20 chats 4 times.
        job = client.create_job(inline_jsonl=chats_jsonl, adapter_id="tippy", steps=steps, learning_rate=2e-3,
                                batch_size=8, max_seq_len=128, lora_rank=8, lora_alpha=16.0, warmup_steps=2)
        for progress in client.watch_job(job.id, timeout=1800):
            say(f"    {job.id}: {state_name(progress.state)}, step {progress.step}/{progress.total_steps}, "
                f"loss {progress.loss:.3f}")
        done = client.get_job(job.id)
        if state_name(done.state) != "succeeded":
            raise TprtError(f"the demo's fine-tune job ended {state_name(done.state)}: {done.error}")
        _ask(client, say, max_new_tokens, adapter_id="tippy")
        if server.metrics_url is not None:
            text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
            say(f"  metrics ({server.metrics_url}), a few of them:")
            for line in text.splitlines():
                if line.startswith(METRICS_SHOWN):
                    say(f"    {line}")
        client.close()
    finally:
        code = server.stop()
        say(f"  SIGTERM: the server drained and exited with status {code}")


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def _openai_calls(base_url: str, say: Callable[[str], None]) -> None:
    """Structured output and a tool call through the official OpenAI client, as any OpenAI user's
    program would make them."""
    try:
        import openai
    except ImportError:
        say("  (pip install openai to see a JSON-schema answer and a tool call through the OpenAI client)")
        return
    # Any: the SDK's overloads want its TypedDicts where a user's program passes plain dicts
    api: Any = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)  # no --auth-token-file
    model = api.models.list().data[0].id
    say(f"  OpenAI client at {base_url}: a JSON-schema answer (response_format json_schema):")
    answer = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": CITY}},
        max_tokens=40, temperature=0)
    content, finish = answer.choices[0].message.content or "", answer.choices[0].finish_reason
    try:
        parsed = f"a JSON object with keys {sorted(json.loads(content))}"
    except ValueError:
        parsed = "not complete JSON"
    say(f"    {content}  ({parsed}; finish_reason {finish!r})")
    say("  a tool call (tools=[get_weather], tool_choice required):")
    call = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
        tools=[WEATHER], tool_choice="required", max_tokens=40, temperature=0)
    calls = [fn for c in call.choices[0].message.tool_calls or [] if (fn := getattr(c, "function", None))]
    for fn in calls:
        say(f"    {fn.name}({fn.arguments})  finish_reason {call.choices[0].finish_reason!r}")
    if not calls:
        say(f"    no complete call within max_tokens (finish_reason {call.choices[0].finish_reason!r})")
    api.close()


def _ask(client: Client, say: Callable[[str], None], max_new_tokens: int, adapter_id: str = "") -> None:
    """Streams the answer to QUESTION through the client, text as it arrives."""
    say(f"  client.generate(chat=[user: {QUESTION!r}]{f', adapter_id={adapter_id!r}' if adapter_id else ''}):")
    print("    assistant: ", end="", flush=True)
    for msg in client.generate(chat=[{"role": "user", "content": QUESTION}], max_new_tokens=max_new_tokens,
                               temperature=0, adapter_id=adapter_id, timeout=600):
        print(msg.text, end="", flush=True)
    print(flush=True)
