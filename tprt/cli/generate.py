"""`tprt generate` and `tprt score`: checking the request, starting the ranks, printing results.

Everything that can be wrong with the input (the checkpoint directory, the prompts, a sampling
flag, the length) is checked in the starting process, before any rank starts, and reported as
one line. The work itself runs on the checkpoint's TP number of ranks: under torchrun (one or
more nodes) on the ranks it started (the world size must equal the checkpoint's TP size), else
on local ranks (in this process when TP is 1): `tprt.distributed.launcher.run_on_ranks`. Rank 0
holds the tokenizer and prints; the other ranks follow its plans.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tprt.checkpoint.format import TPCheckpoint
from tprt.distributed.context import init_distributed
from tprt.distributed.launcher import run_on_ranks
from tprt.engine.constraints import ConstraintSpec, StructuredOutputs
from tprt.cpu.threads import spare_cores
from tprt.engine.core import Completion, Engine, EngineConfig, run_to_completion
from tprt.engine.request import ContextLengthError, resolve_sampling
from tprt.engine.settings import check_sequence_parallel
from tprt.errors import ConfigError, ValidationError
from tprt.checkpoint.loading import load_model, load_stage, parse_dtype
from tprt.distributed.pipeline_mesh import PipelineMesh, init_pipeline
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.stages import stages
from tprt.model.kv_cache import kv_cache_dtype
from tprt.model.kv_scales import kv_cache_flags, load_kv_scales
from tprt.engine.sampling import SamplingParams
from tprt.engine.sequence import TokenEvent
from tprt.cli.speculative_flags import SPECULATIVE_FLAGS
from tprt.engine.speculative import SpeculativeConfig, speculative_from_flags
from tprt.text.tokenizer import Tokenizer

MAX_BATCH = 32  # sequences in flight at once; more prompts wait for a free slot
# Canonical request field (tprt.engine.request) -> its flag, where that is not --field-name.
FLAGS = {"stop_strings": "--stop", "stop_token_ids": "--stop-token-id"}


@dataclass(frozen=True)
class GenerateArgs:
    model: Path
    prompts: tuple[str, ...] = ()
    prompts_file: Path | None = None
    chat: bool = False
    system: str | None = None
    max_new_tokens: int | None = None  # None: tprt.engine.request's default, or less where the context ends
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    dtype: str | None = None
    kv_cache_dtype: str = "auto"  # tprt.model.kv_cache.KV_CACHE_DTYPES
    kv_scales: Path | None = None  # static int8 KV scales (tprt.model.kv_scales)
    attention_backend: str = "auto"  # tprt.model.attention.backend
    cuda_graphs: str = "auto"  # tprt.engine.step_graphs
    json: bool = False
    adapter: Path | None = None  # LoRA adapter directory (tprt finetune or PEFT), applied unmerged
    threads: int | None = None  # torch threads per rank; None: cores / TP
    pp: int = 1  # pipeline stages of the checkpoint's TP ranks each (tprt.engine.stage_runner)
    sequence_parallel: int = 0  # prefill steps of at least this many tokens split over TP; 0: off
    # Output constraint, at most one (tprt.engine.constraints): a JSON Schema file, a regular
    # expression, a choice among strings, or a Lark grammar file.
    json_schema: Path | None = None
    regex: str | None = None
    choice: tuple[str, ...] = ()
    grammar: Path | None = None
    # Speculative decoding (tprt.engine.speculative.add_speculative_flags); None: off.
    speculative: str | None = None
    num_speculative_tokens: int = SpeculativeConfig.num_tokens
    spec_min_n: int = SpeculativeConfig.min_n
    spec_max_n: int = SpeculativeConfig.max_n
    draft_model: str | None = None


@dataclass(frozen=True)
class GenerateJob:
    """What every rank needs (picklable): token ids and parameters, already checked."""

    model: str
    dtype: str | None
    prompts: list[list[int]]
    params: list[SamplingParams]
    max_seq_len: int
    json: bool
    adapter: str | None = None
    speculative: SpeculativeConfig | None = None
    kv_cache_dtype: str = "auto"
    kv_scales: str | None = None
    attention_backend: str = "auto"
    cuda_graphs: str = "auto"
    pp: int = 1
    sequence_parallel: int = 0


def flag_error(e: ValidationError, prefix: str = "") -> ConfigError:
    """The same message with the request field spelled as its command-line flag."""
    msg = str(e)
    if e.field == "prompt":  # the prefix says which prompt
        return ConfigError(prefix + msg)
    flag = FLAGS.get(e.field, "--" + e.field.replace("_", "-"))
    msg = msg.replace(f"{e.field}=", f"{flag} ")
    if msg.startswith(e.field):
        msg = flag + msg[len(e.field):]
    return ConfigError(prefix + msg)


def _read_prompts(args: GenerateArgs) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        path = args.prompts_file
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts-file {path}: cannot read it ({e.__class__.__name__}: {e})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT or --prompts-file FILE (one prompt per line)")
    return prompts


def _encode(tok: Tokenizer, text: str, args: GenerateArgs) -> list[int]:
    if not args.chat:
        return tok.encode(text)
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
    return tok.encode_chat(messages + [{"role": "user", "content": text}])


def _constraint(args: GenerateArgs, tok: Tokenizer) -> ConstraintSpec | None:
    """The output constraint flag as a spec, compiled once here so that a bad one is refused
    before any rank starts (errors name the flag)."""
    given = [flag for flag, value in (("--json-schema", args.json_schema), ("--regex", args.regex),
                                      ("--choice", args.choice), ("--grammar", args.grammar)) if value]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)}: give at most one output constraint")
    if not given:
        return None
    try:
        if args.json_schema is not None:
            spec = ConstraintSpec.json_schema(_read_json_file(args.json_schema, "--json-schema"), "json_schema")
        elif args.regex is not None:
            spec = ConstraintSpec.regex(args.regex, "regex")
        elif args.choice:
            spec = ConstraintSpec.choice(list(args.choice), "choice")
        else:
            assert args.grammar is not None
            spec = ConstraintSpec.grammar(_read_text_file(args.grammar, "--grammar"), "grammar")
        StructuredOutputs(tok).compile(spec)
    except ValidationError as e:
        raise flag_error(e) from None
    return spec


def _read_text_file(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.__class__.__name__}: {e})") from None


def _read_json_file(path: Path, flag: str) -> Any:
    try:
        return json.loads(_read_text_file(path, flag))
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{flag} {path}: not JSON ({e})") from None


def _requested(args: GenerateArgs, index: int, constraint: ConstraintSpec | None = None) -> dict[str, object]:
    """The sampling flags as canonical request fields (None: unset) for prompt `index`."""
    return {
        "constraint": constraint,
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty, "max_new_tokens": args.max_new_tokens,
        "seed": args.seed + index if args.seed is not None else None,
        "stop_token_ids": args.stop_token_ids, "stop_strings": args.stop,
        "logprobs": args.logprobs or args.top_logprobs > 0, "top_logprobs": args.top_logprobs,
    }


def _sampling(args: GenerateArgs, prompts: list[list[int]], context: int, vocab_size: int,
              constraint: ConstraintSpec | None = None) -> list[SamplingParams]:
    """Each prompt's request resolved (tprt.engine.request); errors name the flag, and the prompt
    when it is about that prompt."""
    params = []
    for i, ids in enumerate(prompts):
        try:
            params.append(resolve_sampling(_requested(args, i, constraint), len(ids), context, vocab_size,
                                           what="the model's max_position_embeddings"))
        except ValidationError as e:
            about_prompt = e.field == "prompt" or isinstance(e, ContextLengthError)
            raise flag_error(e, f"prompt {i + 1}: " if about_prompt else "") from None
    return params


def prepare_generate(args: GenerateArgs) -> GenerateJob:
    """Reads and checks everything; raises ConfigError/CheckpointError with one line."""
    ckpt = TPCheckpoint(args.model)
    stages(ckpt.config.num_hidden_layers, args.pp)  # refuses a --pp the layers cannot take
    check_sequence_parallel(args.sequence_parallel)
    if args.dtype is not None:
        parse_dtype(args.dtype)
    kv_dtype = kv_cache_flags(args.kv_cache_dtype, args.kv_scales, ckpt.config)
    if args.system is not None and not args.chat:
        raise ConfigError("--system needs --chat")
    tok = Tokenizer.from_dir(args.model)
    context = ckpt.config.max_position_embeddings
    prompts = [_encode(tok, text, args) for text in _read_prompts(args)]
    params = _sampling(args, prompts, context, ckpt.config.vocab_size, _constraint(args, tok))
    max_seq_len = max(len(ids) + p.max_new_tokens for ids, p in zip(prompts, params))
    if args.adapter is not None and not (args.adapter / "adapter_config.json").is_file():
        raise ConfigError(f"--adapter {args.adapter}: no adapter_config.json; expected a LoRA adapter directory")
    adapter = None if args.adapter is None else str(args.adapter)
    spec = speculative_from_flags({f: getattr(args, f) for f in SPECULATIVE_FLAGS}, ckpt.config.vocab_size)
    return GenerateJob(str(args.model), args.dtype, prompts, params, max_seq_len, args.json, adapter, spec,
                       kv_dtype or "auto", None if args.kv_scales is None else str(args.kv_scales),
                       args.attention_backend, args.cuda_graphs, args.pp, args.sequence_parallel)


def run_generate(args: GenerateArgs) -> int:
    job = prepare_generate(args)
    run_on_ranks(job.model, generate_rank, (job,), threads=args.threads, tp1_in_process=True, pp=job.pp)
    return 0


def _load(job: GenerateJob) -> tuple[TPLlamaForCausalLM, PipelineMesh | None]:
    """This rank's model (its pipeline stage's, with --pp) and its pipeline's groups."""
    if job.pp == 1:
        return load_model(job.model, init_distributed(), job.dtype), None
    ckpt = TPCheckpoint(job.model)
    mesh = init_pipeline(ckpt.tp_size, job.pp)
    stage = stages(ckpt.config.num_hidden_layers, job.pp)[mesh.stage_index]
    return load_stage(job.model, mesh.tp, stage, job.dtype), mesh


def generate_rank(job: GenerateJob) -> None:
    """One rank's part of `tprt generate`: rank 0 drives the engine and prints, the others follow."""
    model, mesh = _load(job)
    ctx = model.tp
    tok = Tokenizer.from_dir(job.model) if ctx.global_rank == 0 else None
    config = EngineConfig(max_batch=min(len(job.prompts), MAX_BATCH), max_seq_len=job.max_seq_len,
                          token_budget=max(2048, MAX_BATCH + 1), speculative=job.speculative,
                          cache_dtype=kv_cache_dtype(job.kv_cache_dtype),
                          kv_scales=None if job.kv_scales is None else load_kv_scales(job.kv_scales, model.config),
                          mask_threads=spare_cores(ctx.device), attention_backend=job.attention_backend,
                          cuda_graphs=job.cuda_graphs, sequence_parallel_tokens=job.sequence_parallel)
    engine = Engine(model, tok, config, pipeline=mesh)
    adapter = 0
    if job.adapter is not None:  # installed like a server's (every request routed to it), so steps keep their graphs
        from tprt.lora.peft_io import read_adapter

        adapter = 1
        engine.runner.adapters.install(adapter, read_adapter(model, job.adapter, ctx))
    if not engine.is_driver:
        engine.follow()
        return
    assert tok is not None
    with engine:
        for i, (ids, params) in enumerate(zip(job.prompts, job.params)):
            engine.add(ids, params, str(i), adapter=adapter)
        printer = None if job.json else OrderedPrinter(len(job.prompts), sys.stdout)
        t0 = time.perf_counter()
        done = run_to_completion(engine, printer.on_event if printer else None)
        seconds = time.perf_counter() - t0
    results = [done[str(i)] for i in range(len(job.prompts))]
    if job.json:
        for i, c in enumerate(results):
            print(json.dumps(_completion_json(i, c, tok)), flush=True)
    n_tokens = sum(len(c.token_ids) for c in results)
    print(f"tprt: {len(results)} sequence(s), {n_tokens} tokens in {seconds:.2f}s "
          f"({n_tokens / max(seconds, 1e-9):.1f} tokens/s, {_layout(ctx.world_size, job)})", file=sys.stderr, flush=True)
    spec = engine.spec_stats
    if spec is not None:
        print(f"tprt: speculative: {spec.drafted} tokens drafted, {spec.accepted} accepted "
              f"({spec.accepted / max(spec.drafted, 1):.0%}) in {spec.rows} rows", file=sys.stderr, flush=True)


def _layout(tp: int, job: GenerateJob) -> str:
    """How the ranks ran it, for the summary line."""
    out = f"TP={tp}" + (f" x PP={job.pp}" if job.pp > 1 else "")
    if job.sequence_parallel and tp > 1 and job.pp == 1:
        out += f", sequence-parallel steps of {job.sequence_parallel}+ tokens"
    return out


def _completion_json(index: int, c: Completion, tok: Tokenizer) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "usage": {"prompt_tokens": c.usage.prompt_tokens if c.usage else None, "completion_tokens": len(c.token_ids)},
    }
    if c.logprobs:
        out["logprobs"] = c.logprobs
        out["tokens"] = [tok.decode([t]) for t in c.token_ids]
    if any(c.top_logprobs):
        out["top_logprobs"] = [[{"id": i, "token": tok.decode([i]), "logprob": lp} for i, lp in row]
                               for row in c.top_logprobs]
    return out


class OrderedPrinter:
    """Streams several sequences' text in prompt order: the first unfinished one live, the later
    ones buffered until their turn. With more than one prompt each gets a `=== i/n ===` header."""

    def __init__(self, n: int, out: TextIO) -> None:
        self.n, self.out = n, out
        self.buffers = [""] * n
        self.done = [False] * n
        self.current = 0
        self._header(0)

    def _header(self, i: int) -> None:
        if self.n > 1:
            self.out.write(f"=== {i + 1}/{self.n} ===\n")

    def on_event(self, event: TokenEvent) -> None:
        i = int(event.request_id)
        if i == self.current:
            self.out.write(event.text)
            self.out.flush()
        else:
            self.buffers[i] += event.text
        if event.finished:
            self.done[i] = True
            while self.current < self.n and self.done[self.current]:
                self.out.write("\n")
                self.current += 1
                if self.current < self.n:
                    self._header(self.current)
                    self.out.write(self.buffers[self.current])
            self.out.flush()


# ----------------------------------------------------------------------------- tprt score


@dataclass(frozen=True)
class ScoreArgs:
    model: Path
    file: Path
    dtype: str | None = None
    json: bool = False
    threads: int | None = None  # torch threads per rank; None: cores / TP
    kv_cache_dtype: str | None = None  # score through a KV cache of this dtype; None: no cache
    kv_scales: Path | None = None  # static int8 KV scales (implies an int8 cache)
    attention_backend: str = "auto"  # with a KV cache: tprt.model.attention.backend


@dataclass(frozen=True)
class ScoreJob:
    model: str
    dtype: str | None
    documents: list[list[int]]
    json: bool
    kv_cache_dtype: str | None = None
    kv_scales: str | None = None
    attention_backend: str = "auto"


def read_documents(path: Path) -> list[str]:
    """.jsonl: one {"text": ...} object per non-empty line; anything else: the whole file is one document."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--file {path}: cannot read it ({e.__class__.__name__}: {e})") from None
    if path.suffix.lower() != ".jsonl":
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ConfigError(f'{path}:{n}: expected an object with a "text" string, e.g. {{"text": "..."}}')
        docs.append(obj["text"])
    if not docs:
        raise ConfigError(f"{path}: no documents (expected one JSON object per line)")
    return docs


def prepare_score(args: ScoreArgs) -> ScoreJob:
    """Reads, tokenizes and checks the documents; raises ConfigError/CheckpointError with one line."""
    ckpt = TPCheckpoint(args.model)
    if args.dtype is not None:
        parse_dtype(args.dtype)
    tok = Tokenizer.from_dir(args.model)
    context = ckpt.config.max_position_embeddings
    docs = []
    for i, text in enumerate(read_documents(args.file), start=1):
        ids = tok.encode(text)
        where = f"{args.file}" + (f": document {i}" if args.file.suffix.lower() == ".jsonl" else "")
        if len(ids) < 2:
            raise ConfigError(f"{where}: {len(ids)} token(s); scoring needs at least 2")
        if len(ids) > context:
            raise ConfigError(f"{where}: {len(ids)} tokens, longer than the model's context "
                              f"(max_position_embeddings={context}); split it")
        docs.append(ids)
    kv_dtype = kv_cache_flags(args.kv_cache_dtype, args.kv_scales, ckpt.config)
    return ScoreJob(str(args.model), args.dtype, docs, args.json, kv_dtype,
                    None if args.kv_scales is None else str(args.kv_scales), args.attention_backend)


def run_score(args: ScoreArgs) -> int:
    job = prepare_score(args)
    run_on_ranks(job.model, score_rank, (job,), threads=args.threads, tp1_in_process=True)
    return 0


def score_rank(job: ScoreJob) -> None:
    """One rank's part of `tprt score`: every rank scores every document (collective); rank 0 prints."""
    from tprt.engine.scoring import Perplexity, token_logprobs

    ctx = init_distributed()
    model = load_model(job.model, ctx, job.dtype)
    tok = Tokenizer.from_dir(job.model) if ctx.rank == 0 else None
    through_cache = job.kv_cache_dtype is not None
    cache_dtype = kv_cache_dtype(job.kv_cache_dtype) if job.kv_cache_dtype is not None else None
    kv_scales = None if job.kv_scales is None else load_kv_scales(job.kv_scales, model.config)
    total = Perplexity(0, 0.0)
    docs_json = []
    for i, ids in enumerate(job.documents, start=1):
        lps = token_logprobs(model, ids, cache_dtype, kv_scales, through_cache, job.attention_backend)
        doc = Perplexity.of(lps)
        total = total + doc
        if tok is None:
            continue
        if job.json:
            tokens = [{"id": t, "text": tok.decode([t]), "logprob": lp} for t, lp in zip(ids, [None, *lps])]
            docs_json.append({"index": i, "num_tokens": doc.tokens, "logprob": doc.logprob,
                              "perplexity": doc.perplexity, "tokens": tokens})
        else:
            print(f"document {i}: {doc.tokens} tokens scored, logprob {doc.logprob:.4f}, "
                  f"perplexity {doc.perplexity:.4f}", flush=True)
    if tok is None:
        return
    overall = {"documents": len(job.documents), "num_tokens": total.tokens, "logprob": total.logprob,
               "perplexity": total.perplexity}
    if job.json:
        print(json.dumps({"documents": docs_json, "overall": overall}), flush=True)
    else:
        print(f"overall: {total.tokens} tokens in {len(job.documents)} document(s), logprob {total.logprob:.4f}, "
              f"perplexity {total.perplexity:.4f}", flush=True)
