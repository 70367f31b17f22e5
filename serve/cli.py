"""`tprt serve` and `tprt client ...`: argument parsing into ServeConfig / client calls."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tprt.engine.settings import CacheSettings, SchedulerSettings

# --http-* limits, in serve.openai.http_guard.HttpLimits' order
HTTP_LIMIT_FLAGS = ("http_header_timeout", "http_body_timeout", "http_max_connections", "http_max_unauthenticated")
from tprt.cli.speculative_flags import SPECULATIVE_FLAGS, add_speculative_flags

COMMANDS = ("serve", "client")

SERVE_EPILOG = """examples:
  tprt serve --model ./smollm2-tp3 --port 50051 --metrics-port 9400 --data-dir ./tprt-data
  tprt serve --model ./llama-tp2 --auth-token-file token.txt --tls-cert srv.pem --tls-key srv.key
  torchrun --nproc-per-node 2 -m tprt.cli serve --model ./llama-tp2

Without torchrun the checkpoint's TP number of local ranks is started (this process is rank 0
and hosts gRPC). Port 0 picks a free port; the line "tprt serve: listening on HOST:PORT ..." is
printed to stdout when the server is ready. SIGTERM/SIGINT: stop accepting, drain for up to
--drain-timeout seconds, checkpoint a running fine-tuning job, exit 0.
"""

CLIENT_EPILOG = """examples:
  tprt client generate "Once upon a time" --max-new-tokens 32
  tprt client generate --chat "What is the capital of France?" --temperature 0.7 --seed 1
  tprt client complete "2 + 2 =" --logprobs --top-logprobs 3 --json
  tprt client jobs create --inline-file train.jsonl --steps 20 --adapter-id my-lora
  tprt client jobs watch job-0123456789ab
  tprt client jobs list --state running
"""


def _serve_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve a TP checkpoint over gRPC (generation, fine-tuning jobs, /metrics)",
                       epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", type=Path, required=True, metavar="DIR", help="TP checkpoint directory")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="gRPC port (50051; 0 = any free port)")
    s.add_argument("--http-port", type=int, metavar="PORT",
                   help="also serve the HTTP APIs on this port: OpenAI's (/v1/chat/completions, /v1/completions, "
                        "/v1/responses, /v1/batches, /v1/files, /v1/fine_tuning/jobs, /v1/models) and Anthropic's "
                        "(/v1/messages), with the same host, token and TLS (default: off; 0 = any)")
    s.add_argument("--ignore-unknown-fields", action="store_true",
                   help="HTTP APIs: drop request fields the endpoint does not know instead of "
                        "answering 400 naming them (OpenAI's behaviour, the default), for clients that send extras")
    s.add_argument("--http-header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds from a new HTTP connection (TLS handshake included), or from a later request's "
                        "first byte, to the end of the request's headers; slower connections are closed (10)")
    s.add_argument("--http-body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds an HTTP request body may stall between bytes before the connection is closed (30)")
    s.add_argument("--http-max-connections", type=int, default=512, metavar="N",
                   help="open HTTP connections; past N a new one gets 503, or takes the place of the oldest "
                        "unauthenticated one (512; lowered to fit the process's file descriptor limit)")
    s.add_argument("--http-max-unauthenticated", type=int, default=64, metavar="N",
                   help="HTTP connections that have not yet sent a request with a valid token (without "
                        "--auth-token-file: a complete request); past N the oldest is closed (64)")
    s.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (9400; 0 = any; -1 = off)")
    SchedulerSettings.add_flags(s)
    CacheSettings.add_flags(s)
    s.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests waiting for the batch; more are refused with RESOURCE_EXHAUSTED (256)")
    s.add_argument("--auth-token-file", type=Path, metavar="FILE", help="require 'authorization: Bearer <token>'")
    s.add_argument("--tls-cert", type=Path, metavar="PEM", help="TLS certificate chain (with --tls-key)")
    s.add_argument("--tls-key", type=Path, metavar="PEM", help="TLS private key")
    s.add_argument("--data-dir", type=Path, default=Path("tprt-data"), metavar="DIR",
                   help="job store, fine-tuning datasets and outputs (./tprt-data)")
    s.add_argument("--store", metavar="URL",
                   help="keep jobs, files, adapters, stored responses and batches in this PostgreSQL database "
                        "(postgresql://user:password@host/db), shared by the replicas of a fleet: each job and "
                        "batch runs once, on the replica holding its lease; an adapter loaded or unloaded "
                        "through one replica is on all of them (docs/FLEET.md). Needs "
                        "pip install 'tprt[fleet]'. Default: SQLite files under --data-dir, for one server")
    s.add_argument("--artifacts", metavar="URL",
                   help="share job directories (inline datasets, checkpoints, trained adapters), uploaded files, "
                        "loaded adapters and batches' files with the other replicas through this store: a "
                        "directory, file://, or s3:// and the "
                        "like with fsspec's package for them (s3fs); published atomically, checksummed on "
                        "read. Default: none (the replicas share --data-dir, or there is one server)")
    s.add_argument("--replica-id", metavar="NAME",
                   help="this server's name as a job's lease holder, in the store and the logs (default: host, "
                        "process id and a random part)")
    s.add_argument("--job-lease", type=float, default=30.0, metavar="S",
                   help="with --store: seconds a replica's claim on a running job or batch lasts unless renewed; "
                        "a replica silent that long loses them to another, which resumes each where it was "
                        "saved (a job's checkpoint, a batch's answered lines) (30)")
    s.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish KV-cache events (blocks stored and removed, with their adapter) on this ZeroMQ "
                        "endpoint, e.g. tcp://*:5557, in the format vLLM documents, for routers that route on "
                        "cached prefixes (llm-d, Dynamo). Needs pip install 'tprt[fleet]'. Default: off")
    s.add_argument("--kv-events-replay", metavar="ENDPOINT",
                   help="answer replay requests for missed KV-cache events here, e.g. tcp://*:5558")
    s.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="the topic frame of every KV-cache event message (default: empty)")
    s.add_argument("--no-jobs", dest="run_jobs", action="store_false",
                   help="accept fine-tuning jobs (for the replicas that run them) but train none here")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="S", help="seconds to drain on SIGTERM (30)")
    s.add_argument("--dtype", metavar="{fp32,bf16,fp16}", help="compute dtype (default: the checkpoint's)")
    s.add_argument("--max-message-bytes", type=int, default=16 << 20, metavar="N", help="gRPC message size limit")
    s.add_argument("--collective-timeout", type=float, default=120.0, metavar="S",
                   help="seconds before a stuck collective marks the ranks broken (120)")
    s.add_argument("--threads", type=int, metavar="N", help="torch threads per rank (default: cores / ranks)")
    s.add_argument("--pp", type=int, default=1, metavar="N",
                   help="pipeline stages: the layers split over N stages of the checkpoint's TP ranks each (TP x N "
                        "ranks; each holds 1/N of the weights and of the KV cache); they generate, fine-tuning "
                        "jobs need a replica without --pp (give --no-jobs). Default 1")
    s.add_argument("--max-dataset-bytes", type=int, default=64 << 20, metavar="N",
                   help="largest fine-tuning dataset, inline or a file under --data-dir (64 MiB)")
    s.add_argument("--max-queued-jobs", type=int, default=64, metavar="N",
                   help="fine-tuning jobs waiting to run; more are refused with RESOURCE_EXHAUSTED (64)")
    s.add_argument("--max-stored-jobs", type=int, default=10_000, metavar="N",
                   help="fine-tuning jobs kept in the store; beyond it the oldest failed and cancelled jobs are "
                        "removed, and new jobs are refused with RESOURCE_EXHAUSTED when none is (10000)")
    s.add_argument("--max-stored-responses", type=int, default=10_000, metavar="N",
                   help="Responses API responses kept for GET and previous_response_id (store: true); storing one "
                        "more removes the oldest (10000)")
    s.add_argument("--max-stored-bytes", type=int, metavar="N",
                   help="bytes of uploaded files (/v1/files) kept under --data-dir; more are refused with HTTP 507 "
                        "(default: no quota beyond the free space)")
    s.add_argument("--max-open-calls", type=int, default=8, metavar="N",
                   help="calls needing no token (health checks and watches, calls refused for a missing token) in "
                        "flight, N unary and N streaming; more get RESOURCE_EXHAUSTED (8)")
    s.add_argument("--job-memory-limit", type=int, metavar="BYTES",
                   help="memory a fine-tuning job may need (a conservative estimate, all local ranks); "
                        "larger jobs get RESOURCE_EXHAUSTED (default: the memory available at CreateJob)")
    s.add_argument("--max-loras", type=int, default=8, metavar="N",
                   help="LoRA adapters on the device at once, mixed in one batch (8); more are evicted "
                        "least recently used first, pinned ones never")
    s.add_argument("--max-cpu-loras", type=int, default=8, metavar="N",
                   help="more adapters kept in host memory, beyond --max-loras (8; 0 = none)")
    s.add_argument("--max-lora-rank", type=int, default=64, metavar="R", help="largest LoRA rank accepted (64)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_speculative_flags(s)


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (or --chat TEXT, or --ids)")
    p.add_argument("--chat", metavar="TEXT", help="send TEXT as a user message through the chat template")
    p.add_argument("--system", metavar="TEXT", help="a system message before --chat")
    p.add_argument("--ids", type=int, nargs="+", metavar="ID", help="prompt token ids")
    p.add_argument("--adapter-id", default="", help="serve with this LoRA adapter")
    p.add_argument("--max-new-tokens", type=int)
    for name in ("temperature", "top-p", "min-p", "repetition-penalty"):
        p.add_argument(f"--{name}", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    p.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", metavar="ID")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--logprobs", action="store_true", default=None)
    p.add_argument("--top-logprobs", type=int)
    p.add_argument("--json", action="store_true", help="print the response as JSON")


def _client_parser(sub: Any) -> None:
    c = sub.add_parser("client", help="call a running `tprt serve`", epilog=CLIENT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--server", default=os.environ.get("TPRT_SERVER", "127.0.0.1:50051"),
                   help="HOST:PORT ($TPRT_SERVER or 127.0.0.1:50051)")
    c.add_argument("--token-file", type=Path, help="bearer token file ($TPRT_TOKEN holds the token otherwise)")
    c.add_argument("--tls-ca", type=Path, help="CA certificate for a TLS server")
    c.add_argument("--timeout", type=float, help="deadline per call, seconds")
    cs = c.add_subparsers(dest="client_command", required=True, metavar="CALL")
    for name, text in (("generate", "stream generated text"), ("complete", "the whole completion at once")):
        _sampling_flags(cs.add_parser(name, help=text))
    t = cs.add_parser("tokenize", help="token ids of a prompt")
    t.add_argument("prompt")
    cs.add_parser("info", help="model, TP degree, context length, adapters")
    cs.add_parser("health", help="the health status")
    adapters = cs.add_parser("adapters", help="LoRA adapters: list, load, unload")
    ads = adapters.add_subparsers(dest="adapters_command", required=True, metavar="ACTION")
    ads.add_parser("list", help="every adapter with its tier, rank, targets and requests served")
    load = ads.add_parser("load", help="load an adapter (replaces one loaded under the same id)")
    load.add_argument("id", nargs="?", help="the id requests name (default with --job-id: the job's adapter id)")
    load.add_argument("--path", metavar="DIR", help="PEFT adapter directory under the server's --data-dir")
    load.add_argument("--job-id", metavar="ID", help="a succeeded LoRA job's adapter")
    load.add_argument("--pin", action="store_true", help="never evict it from the device")
    ads.add_parser("unload", help="unload an adapter once its requests finish").add_argument("id")
    jobs = cs.add_parser("jobs", help="fine-tuning jobs")
    js = jobs.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    create = js.add_parser("create", help="start a fine-tuning job")
    create.add_argument("--dataset", metavar="PATH", help="JSONL path under the server's --data-dir")
    create.add_argument("--inline-file", type=Path, metavar="FILE", help="send this local JSONL file inline")
    create.add_argument("--validation-dataset", metavar="PATH", default="",
                        help="held-out JSONL under the server's --data-dir: its loss after the last step is the "
                             "job's eval_loss")
    create.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    create.add_argument("--adapter-id", default="")
    for name in ("steps", "batch-size", "max-seq-len", "lora-rank", "warmup-steps", "seed", "checkpoint-every"):
        create.add_argument(f"--{name}", type=int)
    for name in ("learning-rate", "lora-alpha", "weight-decay"):
        create.add_argument(f"--{name}", type=float)
    for action in ("get", "cancel", "watch"):
        js.add_parser(action, help=f"{action} a job").add_argument("job_id")
    lst = js.add_parser("list", help="list jobs, newest first")
    lst.add_argument("--state", choices=("queued", "running", "succeeded", "failed", "cancelled"))
    lst.add_argument("--limit", type=int, default=0)


def add_parsers(sub: Any) -> None:
    """Registers `serve` and `client` on the `tprt` subcommand parser."""
    _serve_parser(sub)
    _client_parser(sub)


def run(args: argparse.Namespace) -> int:
    """Runs a parsed `serve` or `client` command; errors are raised as TprtError / grpc.RpcError."""
    if args.command == "serve":
        return _run_serve(args)
    from serve.client.cli import run_client

    return run_client(args)


def _run_serve(args: argparse.Namespace) -> int:
    from serve.server import ServeConfig, run_serve

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s tprt serve [%(process)d] %(levelname)s %(message)s")
    from tprt.engine.speculative import speculative_from_flags

    from serve.openai.http_guard import HttpLimits

    nested = (*SPECULATIVE_FLAGS, *CacheSettings.FLAGS, *SchedulerSettings.FLAGS, *HTTP_LIMIT_FLAGS)
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "log_level", *nested)}
    fields["speculative"] = speculative_from_flags(vars(args))
    fields["cache"], fields["scheduler"] = CacheSettings.from_args(args), SchedulerSettings.from_args(args)
    fields["http_limits"] = HttpLimits(*(getattr(args, f) for f in HTTP_LIMIT_FLAGS))
    return run_serve(ServeConfig(**fields))


def main(argv: list[str] | None = None) -> int:
    """`python -m serve.cli ...` (the same as `tprt serve|client ...`)."""
    from tprt.errors import TprtError

    ap = argparse.ArgumentParser(prog="tprt")
    add_parsers(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    try:
        return run(args)
    except TprtError as e:
        print(f"tprt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
