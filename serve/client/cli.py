"""`tprt client ...`: one call to a running server, printed for people (or as JSON)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from serve.client import FINISH_NAMES, Client, field_of, state_name
from tprt.errors import ConfigError

_SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop",
             "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs")
_HP = ("steps", "batch_size", "max_seq_len", "lora_rank", "warmup_steps", "seed", "checkpoint_every",
       "learning_rate", "lora_alpha", "weight_decay")


def _client(args: argparse.Namespace) -> Client:
    token = os.environ.get("TPRT_TOKEN")
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            raise ConfigError(f"--token-file {args.token_file}: cannot read it ({e.strerror})") from None
    return Client(args.server, token=token, tls_ca=args.tls_ca, timeout=args.timeout)


def _show(msg: Any) -> None:
    print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True), indent=2, ensure_ascii=False))


def _request_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    given = [x for x in (args.prompt, args.chat, args.ids) if x is not None]
    if len(given) != 1:
        raise ConfigError("give exactly one of PROMPT, --chat TEXT or --ids")
    kw: dict[str, Any] = {k: getattr(args, k) for k in _SAMPLING}
    kw["adapter_id"] = args.adapter_id
    if args.chat is not None:
        system = [{"role": "system", "content": args.system}] if args.system else []
        kw["chat"] = [*system, {"role": "user", "content": args.chat}]
    elif args.ids is not None:
        kw["prompt_ids"] = args.ids
    else:
        kw["prompt"] = args.prompt
    return kw


def _generate(c: Client, args: argparse.Namespace) -> int:
    kw = _request_kwargs(args)
    if args.client_command == "complete":
        resp = c.complete(**kw)
        if args.json:
            _show(resp)
        else:
            print(resp.text)
        return 0
    last = None
    for chunk in c.generate(**kw):
        if args.json:
            print(json.dumps(MessageToDict(chunk, preserving_proto_field_name=True), ensure_ascii=False), flush=True)
        else:
            print(chunk.text, end="", flush=True)
        last = chunk
    if not args.json and last is not None:
        cached = f" ({last.usage.cached_prompt_tokens} reused)" if last.usage.cached_prompt_tokens else ""
        print(f"\n[{FINISH_NAMES.get(last.finish_reason, '?')}: {last.usage.prompt_tokens} prompt{cached} + "
              f"{last.usage.completion_tokens} generated tokens]", file=sys.stderr)
    return 0


def _jobs(c: Client, args: argparse.Namespace) -> int:
    action = args.jobs_command
    if action == "create":
        if (args.dataset is None) == (args.inline_file is None):
            raise ConfigError("give exactly one of --dataset PATH or --inline-file FILE")
        inline = args.inline_file.read_text() if args.inline_file is not None else None
        hp = {k: getattr(args, k) for k in _HP}
        _show(c.create_job(dataset_path=args.dataset, inline_jsonl=inline, full=args.full,
                           adapter_id=args.adapter_id, validation_dataset_path=args.validation_dataset, **hp))
    elif action == "get":
        _show(c.get_job(args.job_id))
    elif action == "cancel":
        _show(c.cancel_job(args.job_id))
    elif action == "list":
        for job in c.list_jobs(args.state, args.limit):
            print(f"{job.id}  {state_name(job.state):9s}  step {job.step}/{job.total_steps}  "
                  f"loss {job.loss:.4f}  adapter {job.adapter_id or '-'}  {job.error}")
    else:
        for p in c.watch_job(args.job_id):
            print(f"{state_name(p.state):9s} step {p.step}/{p.total_steps} loss {p.loss:.4f} "
                  f"{p.tokens_per_second:.0f} tok/s {p.error}", flush=True)
    return 0


def _adapters(c: Client, args: argparse.Namespace) -> int:
    action = args.adapters_command
    if action == "load":
        if (args.path is None) == (args.job_id is None):
            raise ConfigError("give exactly one of --path DIR or --job-id ID")
        _show(c.load_adapter(args.id or "", path=args.path, job_id=args.job_id, pin=args.pin))
    elif action == "unload":
        c.unload_adapter(args.id)
        print(f"unloaded {args.id}")
    else:
        for a in c.list_adapters():
            print(f"{a.id}  {a.tier:6s}  rank {a.rank}  alpha {a.alpha:g}  targets {','.join(a.targets) or '-'}  "
                  f"{'pinned  ' if a.pinned else ''}requests {a.requests}")
    return 0


def run_client(args: argparse.Namespace) -> int:
    """Runs one `tprt client` call; a server error prints its code and message (exit 1)."""
    try:
        with _client(args) as c:
            cmd = args.client_command
            if cmd in ("generate", "complete"):
                return _generate(c, args)
            if cmd == "tokenize":
                resp = c.tokenize(args.prompt)
                print(json.dumps({"ids": list(resp.ids), "tokens": list(resp.tokens)}, ensure_ascii=False))
            elif cmd == "info":
                _show(c.model_info())
            elif cmd == "health":
                print(c.health_check())
            elif cmd == "adapters":
                return _adapters(c, args)
            else:
                return _jobs(c, args)
            return 0
    except grpc.RpcError as e:
        field = field_of(e)
        where = f" [{field}]" if field else ""
        print(f"tprt client: {e.code().name}{where}: {e.details()}", file=sys.stderr)
        return 1
