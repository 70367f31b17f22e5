"""A Python client for `tprt serve` over the generated stubs.

    from serve.client import Client

    with Client("127.0.0.1:50051", token="...") as c:
        for chunk in c.generate("Once upon a time", max_new_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
        print(c.complete(chat=[{"role": "user", "content": "Hi"}]).text)
        job = c.create_job(inline_jsonl='{"text": "..."}\\n', steps=10)
        for p in c.watch_job(job.id):
            print(p.step, p.loss)

Requests are built from keyword arguments (`sampling_request`); responses are the protobuf
messages themselves. Errors are `grpc.RpcError` with the server's status code and message (for
INVALID_ARGUMENT and OUT_OF_RANGE, `field_of(error)` gives the field at fault).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve.grpc.errors import FIELD_METADATA_KEY
from serve.grpc.pb import finetuning_pb2 as ft_pb
from serve.grpc.pb import finetuning_pb2_grpc as ft_grpc
from serve.grpc.pb import generation_pb2 as pb
from serve.grpc.pb import generation_pb2_grpc as pb_grpc

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "max_new_tokens",
                   "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "speculate",
                   "presence_penalty", "frequency_penalty", "logit_bias")
HP_FIELDS = ("steps", "learning_rate", "batch_size", "max_seq_len", "lora_rank", "lora_alpha", "weight_decay",
             "warmup_steps", "seed", "checkpoint_every", "beta", "dpo_loss", "label_smoothing", "rpo_alpha")
FINISH_NAMES = {pb.FINISH_REASON_UNSPECIFIED: "", pb.FINISH_REASON_STOP: "stop",
                pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CANCELLED: "cancelled"}


def field_of(error: grpc.RpcError) -> str | None:
    """The request field a server error names (trailing metadata `tprt-field`), if any."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == FIELD_METADATA_KEY:
            return str(value)
    return None


def generate_request(prompt: str | None = None, *, chat: Sequence[Mapping[str, str]] | None = None,
                     prompt_ids: Sequence[int] | None = None, adapter_id: str = "",
                     add_generation_prompt: bool | None = None, constraint: Any = None,
                     tools: Sequence[Any] = (), tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                     **sampling: Any) -> Any:
    """A GenerateRequest: exactly one of prompt, chat or prompt_ids, plus sampling keywords
    (temperature, top_k, top_p, min_p, repetition_penalty, seed, max_new_tokens, stop,
    stop_token_ids, ignore_eos, logprobs, top_logprobs, speculate, presence_penalty,
    frequency_penalty, logit_bias: {token id: bias}); None values are left unset.
    `constraint`: a pb.OutputConstraint; with a chat, `tools` (pb.Tool) and `tool_choice` (pb.ToolChoice)."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    req = pb.GenerateRequest(adapter_id=adapter_id)
    if prompt is not None:
        req.prompt = prompt
    if chat is not None:
        req.chat.CopyFrom(_chat(chat, add_generation_prompt))
        req.chat.tools.extend(tools)
        if tool_choice is not None:
            req.chat.tool_choice.CopyFrom(tool_choice)
        if parallel_tool_calls is not None:
            req.chat.parallel_tool_calls = parallel_tool_calls
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    if prompt_ids is not None:
        req.prompt_ids.ids.extend(prompt_ids)
    for key, value in sampling.items():
        if value is None:
            continue
        if key in ("stop", "stop_token_ids"):
            getattr(req.sampling, key).extend([value] if isinstance(value, (str, int)) else value)
        elif key == "logit_bias":
            req.sampling.logit_bias.update({int(t): float(b) for t, b in dict(value).items()})
        else:
            setattr(req.sampling, key, value)
    return req


def _chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool | None) -> Any:
    chat = pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


class Client:
    """Generation, FineTuning and Health stubs over one channel."""

    def __init__(self, target: str, token: str | None = None, tls_ca: str | Path | None = None,
                 timeout: float | None = None, max_message_bytes: int = 16 * 1024 * 1024) -> None:
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout
        self.generation = pb_grpc.GenerationStub(self.channel)
        self.finetuning = ft_grpc.FineTuningStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _kw(self, timeout: float | None) -> dict[str, Any]:
        return {"metadata": self.metadata, "timeout": timeout if timeout is not None else self.timeout}

    # ----------------------------------------------------------------- generation

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw: Any) -> Iterator[Any]:
        """Streams GenerateResponse messages (see `generate_request` for the arguments). The
        returned iterator is also a grpc call: `.cancel()` stops the generation on the server."""
        return self.generation.Generate(generate_request(prompt, **kw), **self._kw(timeout))  # type: ignore[no-any-return]

    def complete(self, prompt: str | None = None, *, timeout: float | None = None, **kw: Any) -> Any:
        """The whole CompleteResponse at once."""
        return self.generation.Complete(generate_request(prompt, **kw), **self._kw(timeout))

    def tokenize(self, prompt: str | None = None, *, chat: Sequence[Mapping[str, str]] | None = None,
                 add_special_tokens: bool | None = None, timeout: float | None = None) -> Any:
        req = pb.TokenizeRequest()
        if prompt is not None:
            req.prompt = prompt
        if chat is not None:
            req.chat.CopyFrom(_chat(chat, None))
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        return self.generation.Tokenize(req, **self._kw(timeout))

    def model_info(self, timeout: float | None = None) -> Any:
        return self.generation.ModelInfo(pb.ModelInfoRequest(), **self._kw(timeout))

    def health_check(self, service: str = "", timeout: float | None = 5.0) -> str:
        """SERVING, NOT_SERVING, ... (health is exempt from authentication)."""
        resp = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    # ----------------------------------------------------------------- adapters

    def load_adapter(self, adapter_id: str = "", *, path: str | None = None, job_id: str | None = None,
                     pin: bool = False, timeout: float | None = None) -> Any:
        """Loads a LoRA adapter from `path` (under the server's --data-dir) or a succeeded job."""
        req = pb.LoadAdapterRequest(id=adapter_id, pin=pin)
        if path is not None:
            req.path = path
        if job_id is not None:
            req.job_id = job_id
        return self.generation.LoadAdapter(req, **self._kw(timeout))

    def unload_adapter(self, adapter_id: str, timeout: float | None = None) -> None:
        """Returns once the adapter's requests in flight have finished and it is freed."""
        self.generation.UnloadAdapter(pb.UnloadAdapterRequest(id=adapter_id), **self._kw(timeout))

    def list_adapters(self, timeout: float | None = None) -> list[Any]:
        return list(self.generation.ListAdapters(pb.ListAdaptersRequest(), **self._kw(timeout)).adapters)

    # ----------------------------------------------------------------- fine-tuning

    def create_job(self, *, dataset_path: str | None = None, inline_jsonl: str | None = None, full: bool = False,
                   adapter_id: str = "", validation_dataset_path: str = "", timeout: float | None = None,
                   objective: str = "supervised", init_adapter: str = "", **hyperparameters: Any) -> Any:
        """A new fine-tuning job (LoRA unless `full`); hyper-parameters as keywords (HP_FIELDS);
        `validation_dataset_path`: held-out data under --data-dir, evaluated after the last step;
        `objective` "dpo" for preference pairs; `init_adapter`: a served adapter to start from."""
        unknown = set(hyperparameters) - set(HP_FIELDS)
        if unknown:
            raise TypeError(f"unknown hyper-parameter(s): {', '.join(sorted(unknown))}")
        req = ft_pb.CreateJobRequest(method=ft_pb.METHOD_FULL if full else ft_pb.METHOD_LORA, adapter_id=adapter_id,
                                     validation_dataset_path=validation_dataset_path, init_adapter=init_adapter,
                                     objective=ft_pb.Objective.Value(f"OBJECTIVE_{objective.upper()}"))
        if dataset_path is not None:
            req.dataset_path = dataset_path
        if inline_jsonl is not None:
            req.inline_jsonl = inline_jsonl
        for key, value in hyperparameters.items():
            if value is not None:
                setattr(req.hyperparameters, key, value)
        return self.finetuning.CreateJob(req, **self._kw(timeout))

    def get_job(self, job_id: str, timeout: float | None = None) -> Any:
        return self.finetuning.GetJob(ft_pb.GetJobRequest(job_id=job_id), **self._kw(timeout))

    def list_jobs(self, state: str | None = None, limit: int = 0, timeout: float | None = None) -> list[Any]:
        value = ft_pb.JobState.Value(f"JOB_STATE_{state.upper()}") if state else 0
        resp = self.finetuning.ListJobs(ft_pb.ListJobsRequest(state=value, limit=limit), **self._kw(timeout))
        return list(resp.jobs)

    def cancel_job(self, job_id: str, timeout: float | None = None) -> Any:
        return self.finetuning.CancelJob(ft_pb.CancelJobRequest(job_id=job_id), **self._kw(timeout))

    def watch_job(self, job_id: str, timeout: float | None = None) -> Iterator[Any]:
        """Streams JobProgress until the job ends."""
        return self.finetuning.WatchJob(ft_pb.WatchJobRequest(job_id=job_id), **self._kw(timeout))  # type: ignore[no-any-return]


def state_name(value: int) -> str:
    """JOB_STATE_RUNNING -> "running"."""
    return str(ft_pb.JobState.Name(value)).removeprefix("JOB_STATE_").lower()
