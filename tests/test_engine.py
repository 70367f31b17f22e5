"""The engine against transformers' generate() at TP 1 (in this process) and TP 2 (one gloo world).

One module-scoped setup writes a tiny random Llama with a byte-level tokenizer (tests/tiny_chat.py),
converts it to TP 1 and 2, and records transformers' greedy continuations of uneven prompts (plain
and with a repetition penalty) and the log-softmax at every generated position. Each check then
drives an Engine from rank 0 while the other rank follows: batched greedy decoding, chunked
prefill under a small token budget, sequences joining mid-run, cancellation, stop ids / strings /
EOS / max_new_tokens, logprobs, and seeded sampling (reproducible, batch-independent, and the
same ids fed to the model on every rank).
"""

from __future__ import annotations

import json
from dataclasses import replace
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import torch
import torch.distributed as dist

from helpers import chunk_rows, decode_rows, force_native_decode, forward_rows
from mp import Checks, WorldResults, names, run_single, run_world
from tiny_chat import make_tiny_chat_model
from tprt.distributed.context import TPContext
from tprt.distributed.protocol import Command
from serve.ranks.commands import LoadAdapter, TrainAbort, TrainSave
from tprt.distributed.ranks import CommandFailed, RankGroup, follower_loop
from tprt.engine.core import Completion, Engine, EngineConfig, run_to_completion
from tprt.engine.step_graphs import GraphKey
from tprt.errors import ConfigError, ValidationError
from tprt.checkpoint.loading import load_model
from tprt.model.llama import TPLlamaForCausalLM
from tprt.model.batch import BatchRow, TokenBatch
from tprt.engine.sampling import SamplingParams
from tprt.model.kv_cache import kv_cache_dtype
from tprt.text.tokenizer import Tokenizer

TPS = (1, 2)
TEXTS = ("Hello there", "The quick brown fox jumps", "Hi", "Tensor par")  # uneven prompt lengths
N_NEW = 6
PENALTY = 1.3
T = TypeVar("T")
R = TypeVar("R")


# ----------------------------------------------------------------------------- setup (parent only)


def _reference(root: Path) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    tok = Tokenizer.from_dir(root / "hf")
    model = LlamaForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts = [tok.encode(t) for t in TEXTS]
    greedy, penalised, logprobs = [], [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            kw: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
            out = model.generate(ids, **kw)[0, len(p):].tolist()
            greedy.append(out)
            penalised.append(model.generate(ids, repetition_penalty=PENALTY, **kw)[0, len(p):].tolist())
            full = torch.tensor([p + out[:-1]])
            logprobs.append(torch.log_softmax(model(full).logits[0, len(p) - 1:].float(), dim=-1))  # [N_NEW, vocab]
    return {"prompts": prompts, "greedy": greedy, "penalised": penalised, "logprobs": logprobs}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_tiny_chat_model(tmp_path_factory.mktemp("engine"), TPS)
    torch.save(_reference(root), root / "ref.pt")
    return root


# ----------------------------------------------------------------------------- helpers (every rank)

_MODELS: dict[tuple[str, int], TPLlamaForCausalLM] = {}


def _model(ctx: TPContext, wd: Path) -> TPLlamaForCausalLM:
    key = (str(wd), ctx.world_size, str(ctx.device))  # TPRT_TEST_DEVICE=cuda runs TP 1 on the GPU too
    if key not in _MODELS:
        _MODELS[key] = load_model(wd / f"tp{ctx.world_size}", ctx)
    return _MODELS[key]


def _ref(wd: Path) -> dict[str, Any]:
    ref: dict[str, Any] = torch.load(wd / "ref.pt")
    return ref


def _greedy(n: int = N_NEW, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


def _share(ctx: TPContext, value: Any) -> Any:
    """Rank 0's value on every rank."""
    if ctx.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=ctx.group, group_src=0)
    return box[0]


def _drive(ctx: TPContext, wd: Path, config: EngineConfig, fn: Callable[[Engine], T],
           plans: list[TokenBatch] | None = None, model: TPLlamaForCausalLM | None = None,
           setup: Callable[[Engine], None] | None = None, **kw: Any) -> T:
    """Runs fn(engine) on rank 0 while the other ranks follow; returns rank 0's result everywhere.
    `plans` collects every batch this rank executed; `setup(engine)` runs on every rank first. A
    failure on rank 0 fails every rank."""
    engine = Engine(model or _model(ctx, wd), Tokenizer.from_dir(wd / "hf"), config, **kw)
    if setup is not None:
        setup(engine)
    if plans is not None:
        execute = engine.runner.execute
        engine.runner.execute = lambda plan: (plans.append(plan), execute(plan))[1]  # type: ignore[method-assign]
    outcome: tuple[str, Any] = ("ok", None)
    if engine.is_driver:
        with engine:
            try:
                outcome = ("ok", fn(engine))
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                outcome = ("error", f"{type(e).__name__}: {e}")
    else:
        engine.follow()
    status, value = _share(ctx, outcome)
    if status != "ok":
        raise AssertionError(f"rank 0: {value}")
    return value  # type: ignore[no-any-return]


def _agreement(got: dict[str, list[int]], want: dict[Any, list[int]]) -> float:
    """The share of positions where each request's tokens equal the wanted ones (in order)."""
    pairs = [(a, b) for g, w in zip(got.values(), want.values()) for a, b in zip(g, w)]
    return sum(a == b for a, b in pairs) / len(pairs)


def _ids(done: dict[str, Completion]) -> dict[str, list[int]]:
    return {k: c.token_ids for k, c in done.items()}


# ----------------------------------------------------------------------------- checks (every rank)


def check_greedy_batch(ctx: TPContext, wd: Path) -> None:
    """Uneven prompts in one batch: each equals transformers' greedy generate() alone."""
    ref = _ref(wd)

    def fn(engine: Engine) -> dict[str, list[int]]:
        for i, p in enumerate(ref["prompts"]):
            engine.add(p, _greedy(), str(i))
        return _ids(run_to_completion(engine))

    out = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=64), fn)
    for i, want in enumerate(ref["greedy"]):
        assert out[str(i)] == want, f"prompt {i}: {out[str(i)]} != transformers' {want}"


def check_small_budget(ctx: TPContext, wd: Path) -> None:
    """2 sequences at once, 5 tokens per step and KV blocks of an odd size (3): prompts prefill
    in chunks across block edges and wait their turn, finished sequences' blocks are reused by
    later ones, and every output still equals transformers'."""
    ref, plans = _ref(wd), []

    def fn(engine: Engine) -> dict[str, list[int]]:
        for i, p in enumerate(ref["prompts"]):
            engine.add(p, _greedy(N_NEW - i), str(i))  # different lengths: sequences leave at different steps
        return _ids(run_to_completion(engine))

    cfg = EngineConfig(max_batch=2, max_seq_len=64, token_budget=5, kv_block_size=3, prefix_cache=False)
    out = _drive(ctx, wd, cfg, fn, plans)
    for i, want in enumerate(ref["greedy"]):
        assert out[str(i)] == want[: N_NEW - i], f"prompt {i}: {out[str(i)]} != {want[: N_NEW - i]}"
    assert any(chunk_rows(p) and decode_rows(p) for p in plans), "no step mixing a prompt chunk and decoding"
    assert all(p.num_tokens <= 5 for p in plans), "token budget exceeded"
    tables = [t for p in plans for t in p.tables]
    assert all(len(t) == len(set(t)) and 0 not in t for t in tables), "a block twice in a table, or scratch"
    firsts = {t[0] for t in tables}
    assert len(firsts) < len(ref["prompts"]), f"no block was reused by a later sequence: {firsts}"


def check_join_midrun(ctx: TPContext, wd: Path) -> None:
    """Sequences added while others are decoding give the same tokens as alone."""
    ref = _ref(wd)
    prompts = ref["prompts"]

    def fn(engine: Engine) -> dict[str, list[int]]:
        done: dict[str, Completion] = {}

        def steps(n: int) -> None:
            for _ in range(n):
                for ev in engine.step():
                    done.setdefault(ev.request_id, Completion(ev.request_id)).add(ev)

        engine.add(prompts[0], _greedy(), "a")
        engine.add(prompts[1], _greedy(), "b")
        steps(2)
        engine.add(prompts[2], _greedy(), "c")
        steps(2)
        engine.add(prompts[3], _greedy(), "d")
        steps(1)
        engine.add(prompts[0], _greedy(), "e")
        while engine.has_work:
            steps(1)
        return _ids(done)

    want = dict(zip("abcde", [ref["greedy"][i] for i in (0, 1, 2, 3, 0)]))
    for block_size in (1, 16):  # a block per token; every sequence in one block
        out = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=64, kv_block_size=block_size), fn)
        assert out == want, f"blocks of {block_size}: {out} != {want}"


def check_preemption(ctx: TPContext, wd: Path, kv: str = "auto") -> None:
    """A KV pool too small for every running sequence (40 positions, in blocks of 4, for four
    sequences of up to 32): the most recently admitted are preempted and recomputed, and every
    request still gives its greedy tokens; an ample pool gives the same without preempting.
    `kv`: the KV cache dtype (--kv-cache-dtype)."""
    ref = _ref(wd)
    preempted: list[int] = []

    def fn(engine: Engine) -> dict[str, list[int]]:
        for i, p in enumerate(ref["prompts"]):
            engine.add(p, _greedy(), str(i))
        done = _ids(run_to_completion(engine))
        preempted.append(engine.kv_stats.preemptions)
        assert engine.kv_stats.blocks_used == 0, "blocks still held"
        return done

    dtype = kv_cache_dtype(kv)
    small = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=40, kv_cache_tokens=40, kv_block_size=4,
                                         cache_dtype=dtype), fn)
    ample = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=40, kv_block_size=4, cache_dtype=dtype), fn)
    want = {str(i): want for i, want in enumerate(ref["greedy"])}
    assert small == ample, (small, ample)  # recomputing a preempted sequence rewrites the same (quantized) k/v
    if kv == "auto":
        assert small == want, small
    else:  # quantized: near-ties of the tiny random model may flip
        assert _agreement(small, want) >= 0.8, (small, want)
    if ctx.rank == 0:
        assert preempted[0] > 0 and preempted[1] == 0, preempted


def check_cancel(ctx: TPContext, wd: Path) -> None:
    """Cancelling a running request frees its place for a waiting one; a waiting one can be cancelled."""
    ref = _ref(wd)

    def fn(engine: Engine) -> dict[str, Any]:
        prompts = ref["prompts"]
        for rid, i in (("a", 0), ("b", 1), ("c", 2), ("d", 3)):
            engine.add(prompts[i], _greedy(), rid)
        first = engine.step() + engine.step()
        assert engine.cancel("b") and engine.cancel("d") and not engine.cancel("zz")
        assert not engine.cancel("b"), "cancelled twice"
        events = engine.step()
        cancelled = sorted(e.request_id for e in events if e.finish_reason == "cancelled")
        assert all(e.token_id is None for e in events if e.finish_reason == "cancelled")
        done = run_to_completion(engine)
        assert engine.num_unfinished == 0 and not engine.has_work
        return {"cancelled": cancelled, "b": [e.token_id for e in first if e.request_id == "b"],
                "a": [e.token_id for e in first + events if e.request_id == "a"] + done["a"].token_ids,
                "c": [e.token_id for e in events if e.request_id == "c"] + done["c"].token_ids,
                "free": engine.kv_stats.blocks_used == 0}

    out = _drive(ctx, wd, EngineConfig(max_batch=2, max_seq_len=64), fn)
    assert out["cancelled"] == ["b", "d"]
    assert out["b"] == ref["greedy"][1][:2]
    assert out["a"] == ref["greedy"][0] and out["c"] == ref["greedy"][2], out
    assert out["free"], "blocks not released"


def check_stops(ctx: TPContext, wd: Path) -> None:
    """Stop ids, stop strings, EOS and max_new_tokens end a request with the right reason and text."""
    ref = _ref(wd)
    prompt, full = ref["prompts"][1], ref["greedy"][1]
    tok = Tokenizer.from_dir(wd / "hf")
    text = tok.decode(full, skip_special_tokens=True)
    k = next(i for i in range(2, len(full)) if tok.decode([full[i]]).isalnum() and tok.decode([full[i]]) not in text[:i])
    stop_str = tok.decode([full[k]])

    def fn(engine: Engine) -> dict[str, Completion]:
        engine.add(prompt, _greedy(stop_token_ids=(full[2],)), "id")
        engine.add(prompt, _greedy(stop_strings=(stop_str,)), "str")
        engine.add(prompt, _greedy(3), "len")
        engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=N_NEW), "eos")
        return run_to_completion(engine)

    out = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=64), fn, eos_token_ids=(full[1],))
    c = out["id"]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (full[:3], "stop", full[2]), c
    assert c.text == tok.decode(full[:2], skip_special_tokens=True)
    c = out["str"]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (full[: k + 1], "stop", stop_str), c
    assert c.text == text[: text.index(stop_str)]
    c = out["len"]
    assert (c.token_ids, c.finish_reason) == (full[:3], "length") and c.usage and c.usage.completion_tokens == 3
    c = out["eos"]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (full[:2], "stop", None), c


def check_logprobs(ctx: TPContext, wd: Path) -> None:
    """Reported logprobs and top alternatives equal transformers' log-softmax; the repetition
    penalty follows transformers' generate()."""
    ref = _ref(wd)

    def fn(engine: Engine) -> dict[str, Completion]:
        for i, p in enumerate(ref["prompts"]):
            engine.add(p, _greedy(logprobs=True, top_logprobs=3), str(i))
            engine.add(p, _greedy(repetition_penalty=PENALTY), f"rp{i}")
        return run_to_completion(engine)

    out = _drive(ctx, wd, EngineConfig(max_batch=8, max_seq_len=64), fn)
    for i, lp in enumerate(ref["logprobs"]):
        c = out[str(i)]
        assert c.token_ids == ref["greedy"][i]
        want = lp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
        top = lp.topk(3, dim=-1)
        assert [[t for t, _ in row] for row in c.top_logprobs] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in c.top_logprobs]), top.values,
                                   atol=1e-4, rtol=0)
        assert out[f"rp{i}"].token_ids == ref["penalised"][i], f"repetition penalty, prompt {i}"


def check_sequence_parallel_prefill(ctx: TPContext, wd: Path, prepack: bool) -> None:
    """Prefill steps under sequence parallelism (each TP rank normalising 1/TP of a step's
    tokens, padded where they do not split): the tokens and logprobs of transformers, prompt
    chunks and decode rows mixed in steps of a small budget; on CPU with and without the packed
    weights and compiled layers. At TP 1 there is nothing to split."""
    ref = _ref(wd)
    model = load_model(wd / f"tp{ctx.world_size}", ctx)
    split: list[int] = []
    whole_step = model._sequence_parallel_step
    model._sequence_parallel_step = lambda ids, attention: (split.append(attention.tokens),  # type: ignore[method-assign]
                                                            whole_step(ids, attention))[1]

    def fn(engine: Engine) -> dict[str, Completion]:
        for i, p in enumerate(ref["prompts"]):
            engine.add(p, _greedy(logprobs=True), str(i))
        return run_to_completion(engine)

    config = EngineConfig(max_batch=4, max_seq_len=64, token_budget=7, sequence_parallel_tokens=3, cpu_prepack=prepack)
    out = _drive(ctx, wd, config, fn, model=model)
    for i, lp in enumerate(ref["logprobs"]):
        c = out[str(i)]
        assert c.token_ids == ref["greedy"][i], f"prompt {i}"
        torch.testing.assert_close(torch.tensor(c.logprobs), lp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1),
                                   atol=1e-4, rtol=0)
    if ctx.world_size > 1:  # steps of 3..7 tokens were split, odd counts padded
        assert split and min(split) >= 3 and any(n % ctx.world_size for n in split), split
    else:
        assert not split


def check_seeded(ctx: TPContext, wd: Path) -> None:
    """Seeded sampling is reproducible and independent of the rest of the batch; every rank feeds
    the model the ids rank 0 sampled."""
    ref, plans = _ref(wd), []
    prompts = ref["prompts"]
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11, max_new_tokens=N_NEW, ignore_eos=True)

    def alone(engine: Engine) -> list[int]:
        engine.add(prompts[0], params, "x")
        return run_to_completion(engine)["x"].token_ids

    def batched(engine: Engine) -> dict[str, list[int]]:
        engine.add(prompts[1], _greedy(), "g")
        engine.add(prompts[2], SamplingParams(temperature=1.2, seed=5, max_new_tokens=3, ignore_eos=True), "s")
        engine.add(prompts[0], params, "x")
        engine.add(prompts[3], SamplingParams(temperature=1.0, max_new_tokens=N_NEW, ignore_eos=True), "u")
        return _ids(run_to_completion(engine))

    cfg = EngineConfig(max_batch=4, max_seq_len=64, seed=3)
    x = _drive(ctx, wd, cfg, alone, plans)
    fed = [p.tokens[0] for p in plans if decode_rows(p) == [0] and p.num_tokens == 1 and p.starts[0] > 0]
    assert fed == x[:-1], f"rank {ctx.rank} fed {fed}, rank 0 sampled {x}"
    assert _drive(ctx, wd, cfg, alone) == x, "not reproducible"
    b1, b2 = _drive(ctx, wd, cfg, batched), _drive(ctx, wd, cfg, batched)
    assert b1["x"] == x, "depends on the rest of the batch"
    assert b1 == b2, "unseeded requests not reproducible from the engine's base seed"
    assert b1["g"] == ref["greedy"][1]


def check_step_graphs(ctx: TPContext, wd: Path) -> None:
    """Steps on static shapes (what CUDA graphs replay; eager on CPU): batches padded to token
    buckets (3 rows in 4 slots: the padding row writes into the scratch block), attention over a
    bucket of keys, sequences leaving one by one, steps with a prompt chunk run eagerly beside
    them - still transformers' tokens."""
    ref = _ref(wd)

    def fn(engine: Engine) -> dict[str, Any]:
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.token_buckets == [1, 2, 4]
        for i in range(4):
            engine.add(ref["prompts"][i], _greedy(N_NEW - i), str(i))
        return {"ids": _ids(run_to_completion(engine)), "keys": sorted((k.tokens, k.width) for k in graphs.graphs)}

    out = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=48, cuda_graphs="all"), fn)
    for i, want in enumerate(ref["greedy"]):
        assert out["ids"][str(i)] == want[: N_NEW - i], f"prompt {i}: {out['ids'][str(i)]} != {want}"
    assert out["keys"] == [(1, 1), (2, 1), (4, 1)], out["keys"]


def check_fused_one_row(ctx: TPContext, wd: Path) -> None:
    """CPU: one-row decode through each layer's two fused halves (tprt.cpu.native, forced here
    whatever prepack's timing chose), their partial products all-reduced over the TP group, and
    then through the one call running every layer (the all-reduces in C through shared memory
    where TP > 1): transformers' greedy tokens both ways, and the fused calls really ran on every rank."""
    from tprt.cpu import native

    ref = _ref(wd)

    def fn(engine: Engine) -> list[list[int]]:
        outs = []
        for i in (0, 3):  # alone: every decode step is one row
            engine.add(ref["prompts"][i], _greedy(), str(i))
            outs.append(run_to_completion(engine)[str(i)].token_ids)
        return outs

    native_runs = native.available() and ctx.device.type == "cpu"  # C kernels: CPU weights only
    for stack in (False, True):
        model = load_model(wd / f"tp{ctx.world_size}", ctx)  # its own: the fused kernels are set on it
        counters: list[list[int]] = []  # [half calls, stack calls]
        out = _drive(ctx, wd, EngineConfig(max_batch=2, max_seq_len=64), fn, model=model,
                     setup=lambda engine: counters.append(force_native_decode(engine.runner.model, stack)))
        assert out == [ref["greedy"][0], ref["greedy"][3]], (stack, out)
        calls = counters[0]
        half_calls, stack_calls = calls
        if stack:  # every one-row step in one call: no half called alone
            assert (stack_calls > 0, half_calls) == (native_runs, 0), calls
        else:
            assert (half_calls > 0, stack_calls) == (native_runs, 0), calls


def check_prefix_reuse(ctx: TPContext, wd: Path, kv: str = "auto") -> None:
    """Prompts starting with tokens held in named KV blocks point at those blocks (only the rest
    is prefilled) and still give transformers' tokens: the next turn of a finished sequence (its
    prompt and output, cached after it ended), the same prompt again (sharing the blocks the
    previous one's next turn holds, live, in the same step), and a request whose first tokens are
    shared. Blocks of one token, so every shared token counts. With prefix_cache off nothing is
    reused and the tokens are the same. `kv`: the KV cache dtype (shared blocks keep their scales)."""
    ref = _ref(wd)
    dtype = kv_cache_dtype(kv)
    p0, p1, want0 = ref["prompts"][0], ref["prompts"][2], ref["greedy"][0]
    turn = p0 + want0[:3]  # the conversation continued: A's prompt and the start of its answer

    def fn(engine: Engine) -> dict[str, Any]:
        engine.add(p0, _greedy(), "a")
        first = run_to_completion(engine)["a"]
        engine.add(turn, _greedy(N_NEW - 3), "turn")  # A's cached blocks hold p0 + want0[:N_NEW - 1]
        engine.add(p0, _greedy(), "again")  # only "turn" holds p0 now, live, at that step
        engine.add(p1, _greedy(), "other")  # "Hi" shares its first token(s) with "Hello there"
        done = run_to_completion(engine)
        done["a"] = first
        return {k: (c.token_ids, c.usage.cached_prompt_tokens if c.usage else -1) for k, c in done.items()}

    plans: list[TokenBatch] = []
    out = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=64, kv_block_size=1, cache_dtype=dtype), fn, plans)
    shared = next(i for i, (x, y) in enumerate(zip(p0, p1)) if x != y)
    assert out["a"] == (want0, 0), out["a"]
    assert out["turn"] == (want0[3:], len(turn) - 1), out["turn"]
    assert out["again"] == (want0, len(p0) - 1), out["again"]
    assert out["other"] == (ref["greedy"][2], shared), out["other"]
    joint = [p for p in plans if p.num_rows == 3]  # the first: their prompts' uncached tails
    assert joint, f"the three should be prefilled together: {plans}"
    assert joint[0].starts == (len(turn) - 1, len(p0) - 1, shared), joint[0]
    turn_table, again_table, other_table = joint[0].tables
    assert again_table[: len(p0) - 1] == turn_table[: len(p0) - 1], "the same prompt's blocks are not shared"
    assert other_table[:shared] == turn_table[:shared], "the shared first tokens' blocks are not shared"

    # Off: the same tokens, nothing reused.
    off = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=64, kv_block_size=1, prefix_cache=False,
                                       cache_dtype=dtype), fn)
    assert off == {k: (ids, 0) for k, (ids, _) in out.items()}, off


def check_drafts(ctx: TPContext, wd: Path, kv: str = "auto") -> None:
    """Decode rows of a last token and a draft (Engine.propose): drafted tokens are kept while
    they are the tokens the request's own sampling chooses, the positions of the others are given
    back and written again, so greedy and seeded outputs are those of plain decoding (right
    drafts, half-right ones and wrong ones, side by side in one batch), in fewer steps when the
    drafts are right; every rank ran the same rows of several tokens. `kv`: the KV cache dtype."""
    ref, plans = _ref(wd), []
    prompts, greedy = ref["prompts"], ref["greedy"]
    sampled = SamplingParams(temperature=0.9, top_k=40, seed=7, max_new_tokens=N_NEW, ignore_eos=True)

    Drafts = Callable[[str, list[int]], list[int]]

    def run(engine: Engine, drafts: Drafts | None) -> tuple[dict[str, list[int]], dict[str, int]]:
        for i in range(3):
            engine.add(prompts[i], _greedy(), str(i))
        engine.add(prompts[3], sampled, "s")
        done: dict[str, Completion] = {}
        ended: dict[str, int] = {}  # the step each request finished at
        step = 0
        while engine.has_work:
            step += 1
            for ev in engine.step():
                done.setdefault(ev.request_id, Completion(ev.request_id)).add(ev)
                if ev.finished:
                    ended[ev.request_id] = step
            for rid, c in done.items():
                if drafts is not None and c.finish_reason is None:
                    engine.propose(rid, drafts(rid, c.token_ids))
        return _ids(done), ended

    def fn(engine: Engine) -> dict[str, Any]:
        plain, plain_steps = run(engine, None)
        want = dict(plain)

        def drafts(rid: str, out: list[int]) -> list[int]:
            right = want[rid][len(out) : len(out) + 3]
            return {"0": right, "1": right[:1] + [5, 6], "2": [7, 8, 9], "s": right[:1] + [5, 6]}[rid]

        drafted, drafted_steps = run(engine, drafts)
        again, _ = run(engine, drafts)
        with pytest.raises(ValidationError, match="request_id"):
            engine.propose("nobody", [1])
        return {"plain": plain, "drafted": drafted, "again": again, "steps": (plain_steps, drafted_steps)}

    out = _drive(ctx, wd, EngineConfig(max_batch=4, max_seq_len=64, kv_block_size=2,
                                       cache_dtype=kv_cache_dtype(kv)), fn, plans)
    if kv == "auto":
        assert out["plain"] == {**{str(i): greedy[i] for i in range(3)}, "s": out["plain"]["s"]}
    else:  # quantized: near-ties of the tiny random model may flip
        assert _agreement({str(i): out["plain"][str(i)] for i in range(3)}, dict(enumerate(greedy[:3]))) >= 0.8, out
    # Greedy rows and the seeded sampled row (with half-right drafts) give plain decoding's tokens.
    assert out["drafted"] == out["plain"] and len(out["drafted"]["s"]) == N_NEW, out
    assert out["again"] == out["drafted"], out
    plain_steps, drafted_steps = out["steps"]
    assert drafted_steps["0"] < plain_steps["0"], out["steps"]
    assert drafted_steps["2"] == plain_steps["2"], out["steps"]
    widths = {p.lens[r] for p in plans for r in decode_rows(p)}
    assert widths >= {1, 2, 4}, widths


def check_k_token_rows(ctx: TPContext, wd: Path, kv: str = "auto") -> None:
    """A batch whose decode rows carry several tokens (one row of 3, one of 2 beside it)
    gives, for every token, the logits of decoding the tokens one at a time (float32), through the
    module path and through the native decode stack (one-token sub-rows sharing their row's
    block table); a row whose drafted tokens are then given back and decoded again gives the
    logits of never having written them. `kv`: the KV cache dtype (int8: the stack writes and
    reads it; FP8: the module path)."""
    from tprt.cpu import native

    ref = _ref(wd)
    (pa, pb), (ga, gb) = (ref["prompts"][0], ref["prompts"][2]), (ref["greedy"][0], ref["greedy"][2])
    tables = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])  # blocks of 4 positions

    native_runs = native.available() and ctx.device.type == "cpu"  # C kernels: CPU weights only
    for stack in (False, True):
        model = load_model(wd / f"tp{ctx.world_size}", ctx)  # its own: the fused kernels are set on it
        calls = force_native_decode(model, stack=True) if stack else [0, 0]

        def forward(cache: Any, rows: list[list[int]], starts: list[int], table: torch.Tensor) -> list[torch.Tensor]:
            """Each row's logits [tokens, vocab] for rows of tokens at starts[r], starts[r] + 1, ..."""
            return forward_rows(model, cache, rows, starts, table)

        with torch.inference_mode():
            one, many = model.new_cache(16, 4, kv_cache_dtype(kv)), model.new_cache(16, 4, kv_cache_dtype(kv))
            for cache in (one, many):
                forward(cache, [pa], [0], tables[:1])  # the prompts
                forward(cache, [pb], [0], tables[1:])
            want_a = [forward(one, [[t]], [len(pa) + j], tables[:1])[0][0] for j, t in enumerate(ga[:3])]
            want_b = [forward(one, [[t]], [len(pb) + j], tables[1:])[0][0] for j, t in enumerate(gb[:2])]
            stack_before = calls[1]
            got_a, got_b = forward(many, [ga[:3], [gb[0], 5]], [len(pa), len(pb)], tables)  # rows of 3 and 2
            stack_calls = calls[1] - stack_before
            # b kept its first token only: positions past it are given back and decoded again.
            again_b = forward(many, [[gb[1]]], [len(pb) + 1], tables[1:])[0][0]
        took = stack and native_runs and kv in ("auto", "int8")
        assert stack_calls == int(took), "the native stack did not take the rows"
        for got, want in ((got_a, torch.stack(want_a)), (got_b[:1], want_b[0][None]), (again_b, want_b[1])):
            torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
        assert got_a.argmax(-1).tolist() == ga[1:4], ("the row's greedy tokens", stack)


class _Recorder:
    """A CommandExecutor that records the commands it runs; LoadAdapter fails on the last rank."""

    def __init__(self, ctx: TPContext) -> None:
        self.ctx = ctx
        self.ran: list[Command[Any]] = []
        self.abandoned = 0

    def execute(self, cmd: Command[R]) -> R:
        self.ran.append(cmd)
        if isinstance(cmd, LoadAdapter) and self.ctx.rank == self.ctx.world_size - 1:
            raise ValueError(f"no adapter at {cmd.path}")
        return cast(R, f"rank {self.ctx.rank} ran {type(cmd).__name__}" if isinstance(cmd, TrainSave) else None)

    def abandon(self) -> None:
        self.abandoned += 1


def check_rank_protocol(ctx: TPContext, wd: Path) -> None:
    """Generation steps, keepalives and commands interleave over one TP group: every rank runs
    rank 0's commands in order between its plans, rank 0 gets its own result back, a failure on
    any rank fails the command on every rank (each abandons it) and the loop goes on, and EXIT
    ends it. The tokens are those of a run without commands."""
    ref = _ref(wd)
    engine = Engine(_model(ctx, wd), Tokenizer.from_dir(wd / "hf"), EngineConfig(max_batch=2, max_seq_len=32))
    recorder = _Recorder(ctx)
    outcome: dict[str, Any] = {}
    if engine.is_driver:
        ranks = RankGroup(ctx, recorder)
        try:
            engine.add(ref["prompts"][0], _greedy(3), "a")
            events = engine.step()
            ranks.keepalive()
            outcome["abort"] = ranks.run(TrainAbort())
            try:
                ranks.run(LoadAdapter("x", "/nowhere"))
            except CommandFailed as e:
                outcome["failed"] = str(e)
            events += engine.step()
            outcome["save"] = ranks.run(TrainSave())
            ranks.keepalive()
            outcome["tokens"] = [e.token_id for e in events] + run_to_completion(engine)["a"].token_ids
        finally:
            ranks.exit()
    else:
        follower_loop(engine.follow, ctx, recorder)
    records: list[Any] = [(recorder.ran, recorder.abandoned)]
    if ctx.world_size > 1:
        records = [None] * ctx.world_size
        dist.all_gather_object(records, (recorder.ran, recorder.abandoned), group=ctx.group)
    outcome = _share(ctx, outcome)
    last = ctx.world_size - 1
    assert outcome["abort"] is None and outcome["save"] == "rank 0 ran TrainSave", outcome
    assert outcome["failed"] == ("" if last == 0 else f"rank {last}: ") + "ValueError: no adapter at /nowhere", outcome
    assert outcome["tokens"] == ref["greedy"][0][:3], outcome
    want = [TrainAbort(), LoadAdapter("x", "/nowhere"), TrainSave()]
    assert records == [(want, 1)] * ctx.world_size, records


# Adapters routed per row in one batch: (targets, rank), different ranks and target sets.
ENGINE_ADAPTERS = ((("q", "v", "down"), 4), (("k", "o"), 2), (("gate", "up"), 8),
                   (("q", "k", "v", "o", "gate", "up", "down"), 3))


def _install_adapters(engine: Engine) -> None:
    """Installs ENGINE_ADAPTERS under indices 1.. with non-zero B (the same on every rank)."""
    from tprt.lora.attach import build_lora

    model = engine.runner.model
    for index, (targets, rank) in enumerate(ENGINE_ADAPTERS, start=1):
        adapter = build_lora(model, targets, rank, 2.0 * rank, seed=index)
        gen = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for _, module in adapter.pieces:
                for b in module.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
        engine.runner.adapters.install(index, adapter)


def check_mixed_adapters(ctx: TPContext, wd: Path) -> None:
    """Base rows and rows of four adapters (different ranks and targets) prefilled and decoded in
    the same batches give every request the tokens and log-probabilities it gets alone; so do
    static steps (what CUDA graphs replay, eager on CPU: each token's delta through its group's
    one-hot), mixing up to four adapters."""
    prompts = _ref(wd)["prompts"]
    # (prompt, adapter index): one prompt under the base model and every adapter, another under two
    requests = [(prompts[0], a) for a in range(5)] + [(prompts[1], 2), (prompts[1], 4)]

    def fn(engine: Engine) -> dict[str, Any]:
        def run(batch: list[int]) -> dict[str, Completion]:
            for i in batch:
                engine.add(requests[i][0], _greedy(5, logprobs=True), str(i), adapter=requests[i][1])
            return run_to_completion(engine)

        alone = {str(i): run([i])[str(i)] for i in range(len(requests))}
        mixed = run(list(range(len(requests))))
        graphs = engine.runner.graphs
        return {"out": {k: (alone[k].token_ids, alone[k].logprobs, mixed[k].token_ids, mixed[k].logprobs)
                        for k in alone},
                "keys": [] if graphs is None else [(k.tokens, k.adapters) for k in graphs.graphs]}

    runs = {}
    for graphs in ("off", "all"):
        plans: list[TokenBatch] = []
        model = load_model(wd / f"tp{ctx.world_size}", ctx)  # its own: the adapters stay on its layers
        runs[graphs] = _drive(ctx, wd, EngineConfig(max_batch=8, max_seq_len=64, cuda_graphs=graphs), fn, plans,
                              model=model, setup=_install_adapters)
        assert any(len({p.adapters[r] for r in decode_rows(p) if p.adapters}) == 5 for p in plans), \
            "no decode step mixed all five"
        assert any(len({p.adapters[r] for r in chunk_rows(p) if p.adapters}) == 5 for p in plans), \
            "no prefill mixed all five"
    out = runs["off"]["out"]
    for k, (ids, lps, mixed_ids, mixed_lps) in out.items():
        for name, (_, _, got_ids, got_lps) in (("mixed", out[k]), ("static", runs["all"]["out"][k])):
            assert got_ids == ids, f"request {k}, {name}"
            assert max(abs(a - b) for a, b in zip(got_lps, lps)) < 1e-4, f"request {k}, {name}"
        static_ids, static_lps = runs["all"]["out"][k][:2]
        assert static_ids == ids and max(abs(a - b) for a, b in zip(static_lps, lps)) < 1e-4, f"request {k} alone"
    for k in ("1", "2", "3", "4"):  # each adapter changes the base model's outputs for prompt 0
        assert max(abs(a - b) for a, b in zip(out[k][1], out["0"][1])) > 1e-3, f"adapter {k} changed nothing"
    assert runs["off"]["keys"] == [] and {0, 1, 4} <= {a for _, a in runs["all"]["keys"]}, runs["all"]["keys"]


SPEC_TEXTS = ("ab ab ab ab ab ab ab", "one two one two one two", "Hello there", "The quick brown fox jumps")
SPEC_NEW = 24
SPEC_REGEX = r"(ab|cd|ef){2,12}"


def check_speculative(ctx: TPContext, wd: Path) -> None:
    """Speculative decoding (EngineConfig.speculative: prompt lookup, the suffix cache, a draft
    model, and prompt lookup under a KV pool small enough to preempt speculating rows), with base
    and adapter rows in one batch: greedy requests give the token ids, logprobs and top logprobs
    of plain decoding; a stop string cuts the text where plain decoding does; max_new_tokens is
    never passed; a seeded sampled request is reproducible; constrained rows (greedy: plain
    decoding's tokens; sampled: a full match) verify drafts cut to their grammar, masked per
    position; drafts were made and some kept."""
    from tprt.engine.constraints import ConstraintSpec
    from tprt.engine.speculative import SpeculativeConfig

    tok = Tokenizer.from_dir(wd / "hf")
    prompts = [tok.encode(t) for t in SPEC_TEXTS]
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=11, max_new_tokens=SPEC_NEW, ignore_eos=True)
    requests = [(f"g{i}-{a}", p, _greedy(SPEC_NEW, logprobs=True, top_logprobs=2), a)
                for i, p in enumerate(prompts) for a in sorted({0, i % 4 + 1})]
    requests += [("seeded", prompts[0], seeded, 0), ("short", prompts[1], _greedy(3), 2),
                 ("off", prompts[1], _greedy(SPEC_NEW, speculate=False), 3)]
    regex = ConstraintSpec.regex(SPEC_REGEX, "regex")
    requests += [("regex", prompts[0], SamplingParams(temperature=0, max_new_tokens=SPEC_NEW, constraint=regex), 1),
                 ("regex-s", prompts[1], SamplingParams(temperature=1.0, seed=3, max_new_tokens=SPEC_NEW,
                                                        constraint=regex), 0)]

    def fn(engine: Engine) -> dict[str, Any]:
        rounds = []
        for r in range(2):  # the second round finds the first's outputs in the suffix cache
            for rid, prompt, params, adapter in requests:
                engine.add(prompt, params, rid, adapter=adapter)
            done = run_to_completion(engine)
            text = done["g0-0"].text
            stop = text[len(text) // 2 : len(text) // 2 + 2] or "a"
            engine.add(prompts[0], _greedy(SPEC_NEW, stop_strings=(stop,)), "stop")
            done.update(run_to_completion(engine))
            rounds.append({k: (c.token_ids, c.logprobs, [[i for i, _ in t] for t in c.top_logprobs], c.text,
                               c.finish_reason) for k, c in done.items()})
        stats, graphs = engine.spec_stats, engine.runner.graphs
        return {"rounds": rounds, "preemptions": engine.kv_stats.preemptions,
                "stats": None if stats is None else (stats.drafted, stats.accepted, stats.emitted, stats.rows),
                "keys": [] if graphs is None else [(k.width, k.adapters) for k in graphs.graphs]}

    def run(config: EngineConfig) -> dict[str, Any]:
        model = load_model(wd / f"tp{ctx.world_size}", ctx)  # its own: the adapters stay on its layers
        return _drive(ctx, wd, config, fn, model=model, setup=_install_adapters)

    base = EngineConfig(max_batch=len(requests), max_seq_len=64, kv_block_size=2)
    plain = run(base)
    wide = 256  # draft in batches of every request (the CPU default stops at 8 tokens a step)
    specs = {
        "ngram": SpeculativeConfig("ngram", num_tokens=4, min_n=1, max_n=3, adaptive=False, max_step_tokens=wide),
        "suffix": SpeculativeConfig("suffix", num_tokens=3, min_n=2, max_n=4, max_step_tokens=wide),
        "draft": SpeculativeConfig("draft", num_tokens=3, draft_model=str(wd / "tp1"), max_step_tokens=wide),
    }
    runs = {name: run(replace(base, speculative=spec)) for name, spec in specs.items()}
    # masks computed after each step, only where needed (when no core is spare)
    runs["preempted"] = run(replace(base, speculative=specs["ngram"], kv_cache_tokens=64, mask_threads=0))
    assert runs["preempted"]["preemptions"] > 0, "the small pool preempted nothing"
    # verifying rows of base and adapter rows on static shapes (CUDA graphs; eager on CPU)
    runs["graphs"] = run(replace(base, speculative=specs["ngram"], cuda_graphs="all"))
    keys = set(runs["graphs"]["keys"])
    assert (5, 0) in keys and any(w == 5 and a for w, a in keys), keys
    want = plain["rounds"][0]
    assert plain["stats"] is None

    def same(got: dict[str, Any], name: str) -> None:
        for rid, (ids, lps, tops, text, finish) in want.items():
            g_ids, g_lps, g_tops, g_text, g_finish = got[rid]
            if rid == "seeded":
                assert len(g_ids) == SPEC_NEW and g_finish == "length", (name, rid)
                continue
            if rid == "regex-s":
                assert g_finish == "length" or re.fullmatch(SPEC_REGEX, g_text), (name, g_text)
                continue
            assert g_ids == ids and g_tops == tops and (g_text, g_finish) == (text, finish), (name, rid)
            assert len(g_lps) == len(lps) and all(abs(a - b) < 1e-4 for a, b in zip(g_lps, lps)), (name, rid)

    same(plain["rounds"][1], "plain")
    for name, out in runs.items():
        drafted, accepted, emitted, rows = out["stats"]
        # A row emits its kept drafts and one token more, unless the request ended on a kept one.
        assert 0 < accepted < drafted and accepted <= emitted <= rows + accepted, (name, out["stats"])
        for r, got in enumerate(out["rounds"]):
            same(got, f"{name} round {r}")
        # Prompt lookup's and the draft model's drafts depend on the request alone: a seeded
        # request is reproducible.
        if name != "suffix":
            assert out["rounds"][0]["seeded"] == out["rounds"][1]["seeded"], name
    assert want["short"][0] == want["short"][0][:3] and want["short"][4] == "length"
    assert want["stop"][4] == "stop" and len(want["stop"][3]) < len(want["g0-0"][3]), want["stop"]

    # bf16 too: a row of drafted tokens goes through the few-row products, whose rows have the
    # one-row product's bits, so greedy output is plain decoding's token for token and logprob
    # for logprob (steps of up to 8 positions, the CPU default: wider ones take oneDNN's
    # many-row kernels).
    def greedy_ids(engine: Engine) -> dict[str, tuple[list[int], list[float]]]:
        for i, p in enumerate(prompts[:2]):
            engine.add(p, _greedy(SPEC_NEW, logprobs=True), f"b{i}")
        return {k: (c.token_ids, c.logprobs) for k, c in run_to_completion(engine).items()}

    if ctx.device.type != "cpu":  # cuBLAS picks its kernel by shape: a k-row step's bits differ from a 1-row one's
        return
    bf16 = {name: _drive(ctx, wd, replace(base, speculative=spec), greedy_ids,
                         model=load_model(wd / f"tp{ctx.world_size}", ctx, "bf16"))
            for name, spec in (("plain", None), ("ngram", SpeculativeConfig("ngram", num_tokens=4, min_n=1, max_n=3,
                                                                             adaptive=False)))}
    assert bf16["ngram"] == bf16["plain"], bf16


SMALL_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "ok": {"type": "boolean"}, "tag": {"enum": ["x", "yz"]}},
                "required": ["n", "ok", "tag"], "additionalProperties": False}
REGEX = r"[a-c]{2,5}-[0-9]{1,2}"
CHOICES = ("alpha", "beta", "gamma delta")


def check_constrained(ctx: TPContext, wd: Path) -> None:
    """Rows under output constraints (a JSON schema, greedy and seeded top-p; a regex on an
    adapter; a choice, sampled) beside a free row, alone, in one batch and under a KV pool small
    enough to preempt: every constrained output matches and ends with "stop" (or "length" when
    max_new_tokens runs out first), the free row keeps its reference tokens, and each request
    gives the same tokens in all three runs. Bad constraints are refused at `add`."""
    from tprt.engine.constraints import ConstraintSpec

    import jsonschema

    ref = _ref(wd)
    prompts = ref["prompts"]
    schema = ConstraintSpec.json_schema(SMALL_SCHEMA, "schema")
    requests = [  # (request id, prompt, params, adapter)
        ("free", prompts[0], _greedy(), 0),
        ("schema", prompts[1], SamplingParams(temperature=0, max_new_tokens=50, constraint=schema), 0),
        ("schema-sampled", prompts[2], SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_new_tokens=50,
                                                      constraint=schema), 0),
        ("regex", prompts[3], SamplingParams(temperature=0, max_new_tokens=20,
                                             constraint=ConstraintSpec.regex(REGEX, "regex")), 1),
        ("choice", prompts[0], SamplingParams(temperature=0.7, seed=1, max_new_tokens=20,
                                              constraint=ConstraintSpec.choice(CHOICES, "choice")), 0),
        ("short", prompts[1], SamplingParams(temperature=0, max_new_tokens=3, constraint=schema), 0),
    ]
    preemptions: list[int] = []

    def run(engine: Engine, batch: list[Any]) -> dict[str, Completion]:
        for rid, prompt, params, adapter in batch:
            engine.add(prompt, params, rid, adapter=adapter)
        return run_to_completion(engine)

    def alone_and_mixed(engine: Engine) -> dict[str, Any]:
        for bad in (ConstraintSpec.regex("(unclosed", "regex"), ConstraintSpec.grammar("start: nope", "grammar")):
            try:
                engine.add(prompts[0], SamplingParams(temperature=0, max_new_tokens=4, constraint=bad), "bad")
                raise AssertionError(f"{bad} was accepted")
            except ValidationError as e:
                assert e.field == bad.field, e
        try:
            engine.add(prompts[0], SamplingParams(max_new_tokens=4, ignore_eos=True, constraint=schema), "bad")
            raise AssertionError("ignore_eos with a constraint was accepted")
        except ValidationError as e:
            assert e.field == "ignore_eos", e
        assert not engine.has_work
        alone = {r[0]: run(engine, [r])[r[0]] for r in requests}
        return {"alone": alone, "mixed": run(engine, requests)}

    def mixed_only(engine: Engine) -> dict[str, Completion]:
        done = run(engine, requests)
        preemptions.append(engine.kv_stats.preemptions)
        return done

    model = load_model(wd / f"tp{ctx.world_size}", ctx)  # its own: the adapters stay on its layers
    out = _drive(ctx, wd, EngineConfig(max_batch=8, max_seq_len=96, mask_threads=1), alone_and_mixed,
                 model=model,
                 setup=_install_adapters)
    # ... and with masks computed after each step, where needed (alone and mixed: on a thread)
    small = _drive(ctx, wd, EngineConfig(max_batch=8, max_seq_len=96, kv_cache_tokens=96, kv_block_size=4,
                                         mask_threads=0),
                   mixed_only, model=load_model(wd / f"tp{ctx.world_size}", ctx), setup=_install_adapters)
    if ctx.rank == 0:
        assert preemptions[0] > 0, "the small pool preempted nothing"
    for rid, *_ in requests:
        runs = (out["alone"][rid], out["mixed"][rid], small[rid])
        assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids, (rid, [r.text for r in runs])
        done = runs[1]
        if rid == "free":
            assert done.token_ids == ref["greedy"][0]
        elif rid == "short":
            assert done.finish_reason == "length" and len(done.token_ids) == 3
        else:
            assert done.finish_reason == "stop", (rid, done.text, done.finish_reason)
            if rid.startswith("schema"):
                jsonschema.validate(json.loads(done.text), SMALL_SCHEMA)
            elif rid == "regex":
                assert re.fullmatch(REGEX, done.text), done.text
            else:
                assert done.text in CHOICES, done.text


CHECKS: Checks = [
    ("mixed_adapters", check_mixed_adapters),
    ("greedy_batch", check_greedy_batch),
    ("small_budget", check_small_budget),
    ("join_midrun", check_join_midrun),
    ("preemption", check_preemption),
    ("cancel", check_cancel),
    ("stops", check_stops),
    ("logprobs", check_logprobs),
    ("seeded", check_seeded),
    ("sequence_parallel_prefill", partial(check_sequence_parallel_prefill, prepack=True)),
    ("sequence_parallel_prefill_eager", partial(check_sequence_parallel_prefill, prepack=False)),
    ("step_graphs", check_step_graphs),
    ("fused_one_row", check_fused_one_row),
    ("prefix_reuse", check_prefix_reuse),
    ("drafts", check_drafts),
    ("speculative", check_speculative),
    ("k_token_rows", check_k_token_rows),
    ("rank_protocol", check_rank_protocol),
    ("constrained", check_constrained),
    # The quantized KV caches (tprt.model.kv_cache) through the engine: shared prefix blocks,
    # preemption, positions given back, rows of several tokens.
    *((f"{check.__name__[6:]}_{kv}", partial(check, kv=kv))
      for kv in ("int8", "fp8") for check in (check_prefix_reuse, check_preemption, check_drafts, check_k_token_rows)),
]


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def worlds(workdir: Path) -> dict[int, WorldResults]:
    return {1: run_single(CHECKS, workdir), 2: run_world(2, CHECKS, workdir)}


@pytest.mark.parametrize("check", names(CHECKS))
@pytest.mark.parametrize("tp", TPS)
def test_engine(worlds: dict[int, WorldResults], tp: int, check: str) -> None:
    worlds[tp].assert_ok(check)


def test_validation(workdir: Path) -> None:
    """Requests that cannot be served are refused with a ValidationError naming the field."""
    engine = Engine(_model(TPContext.single(), workdir), Tokenizer.from_dir(workdir / "hf"),
                    EngineConfig(max_batch=2, max_seq_len=32))
    bad: list[tuple[str, list[int], SamplingParams]] = [
        ("prompt", [5] * 32, _greedy(1)),
        ("prompt", [], _greedy(1)),
        ("prompt", [5, 400], _greedy(1)),
        ("max_new_tokens", [5] * 20, _greedy(13)),
        ("temperature", [5], SamplingParams(temperature=-1.0)),
        ("top_p", [5], SamplingParams(top_p=0.0, max_new_tokens=4)),
    ]
    for field, prompt, params in bad:
        with pytest.raises(ValidationError) as info:
            engine.add(prompt, params, "r")
        assert info.value.field == field and "\n" not in str(info.value), (field, str(info.value))
    engine.add([5] * 20, _greedy(12), "r")  # exactly fills the context
    with pytest.raises(ValidationError) as info:
        engine.add([5], _greedy(1), "r")
    assert info.value.field == "request_id"
    # Drafts: ids in the vocabulary, for a known request; none taken before it decodes.
    for field, rid, draft in (("draft", "r", [5, 400]), ("request_id", "nobody", [5])):
        with pytest.raises(ValidationError) as info:
            engine.propose(rid, draft)
        assert info.value.field == field, (field, str(info.value))
    assert engine.propose("r", [5, 6]) == 0  # still waiting: no token to follow yet
    no_tok = Engine(_model(TPContext.single(), workdir), None, EngineConfig(max_batch=1, max_seq_len=32))
    with pytest.raises(ValidationError) as info:
        no_tok.add([5], _greedy(1, stop_strings=("x",)), "r")
    assert info.value.field == "stop_strings"
    with pytest.raises(RuntimeError):
        engine.follow()


def test_the_cuda_graphs_flag_reaches_the_engine(workdir: Path) -> None:
    """--cuda-graphs on generate, serve and plan takes the modes the runner knows; an unknown mode
    in an EngineConfig is a one-line error naming the field; off builds no static steps."""
    from tprt.cli.main import build_parser
    from tprt.engine.graph_buckets import GRAPH_MODES
    from tprt.engine.settings import SchedulerSettings

    parser = build_parser()
    model = str(workdir / "tp1")
    assert parser.parse_args(["generate", "--model", model, "--cuda-graphs", "decode", "--prompt", "x"]).cuda_graphs == "decode"
    serve = parser.parse_args(["serve", "--model", model, "--cuda-graphs", "off"])
    assert SchedulerSettings.from_args(serve).cuda_graphs == "off"
    assert parser.parse_args(["plan", "--model", model, "--tp", "1", "serve", "--cuda-graphs", "all"]).cuda_graphs == "all"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--model", model, "--cuda-graphs", "always", "--prompt", "x"])
    assert GRAPH_MODES == ("auto", "off", "decode", "all")
    tp1 = load_model(workdir / "tp1", TPContext.single())
    with pytest.raises(ConfigError, match="cuda_graphs must be one of auto, off, decode, all, got 'always'"):
        Engine(tp1, None, EngineConfig(max_batch=2, max_seq_len=32, cuda_graphs="always"))
    assert Engine(tp1, None, EngineConfig(max_batch=2, max_seq_len=32)).runner.graphs is None  # auto: off on CPU


def test_kv_token_count(workdir: Path) -> None:
    """The engine counts the KV positions in blocks its live sequences hold (the server's usage
    gauge reads it); a finished sequence's full blocks stay cached for prefix reuse."""
    engine = Engine(_model(TPContext.single(), workdir), None,
                    EngineConfig(max_batch=2, max_seq_len=32, kv_block_size=4))

    def tokens() -> int:
        return engine.kv_stats.blocks_used * engine.kv_stats.block_size

    def blocks() -> tuple[int, int, int]:
        kv = engine.kv_stats
        return kv.blocks_used, kv.blocks_cached, kv.blocks_total

    assert (tokens(), engine.kv_stats.blocks_total * 4, blocks()) == (0, 64, (0, 0, 16))
    engine.add([5] * 7, _greedy(3), "a")
    engine.add([6] * 4, _greedy(2), "b")
    assert tokens() == 0  # waiting: no blocks yet
    engine.step()  # both prompts prefilled (blocks of 4: 2 + 1), a first token sampled for each
    assert tokens() == 4 * (2 + 1)
    engine.step()  # each first token computed (b needs a 2nd block); b has its two tokens and ends
    assert blocks() == (2, 1, 16)  # b's full block of [6] * 4 is cached, its partial one freed
    run_to_completion(engine)
    assert tokens() == 0


def test_batch_roundtrip() -> None:
    """A step's batch survives its wire encoding: prompt chunks, decode rows, a verifying row,
    adapters or none."""
    batch = TokenBatch.of([BatchRow((1,), 0, (5, 6, 7), 1), BatchRow((4, 2, 9), 16, (8,), 0, adapter=2),
                           BatchRow((3, 5), 9, (3, 11, 12), 3), BatchRow((6,), 2, (4,), 1)], full_logits=True)
    assert TokenBatch.decode_from(batch.encode()) == batch
    assert batch.adapters == (0, 2, 0, 0) and batch.logits_indices == (2, 4, 5, 6, 7)
    base = TokenBatch.of([BatchRow((1, 2), 3, (7, 8), 2)])
    assert TokenBatch.decode_from(base.encode()) == base and base.adapters == ()
    assert base.positions == (3, 4) and base.kv_len == 5


@pytest.mark.parametrize("dtype, tol", [("bf16", 2e-2), ("fp32", 1e-5)])
def test_prepack(workdir: Path, dtype: str, tol: float) -> None:
    """CPU: the repacked linears give the logits of F.linear (to rounding) for prompts and for
    one-row decode inputs, and are used only with autograd off (gradients still reach weights)."""
    from tprt.cpu.fast_linear import VARIANTS, FastLinear, prepack, supported

    ctx = TPContext.single()
    dense, packed = load_model(workdir / "tp1", ctx, dtype), load_model(workdir / "tp1", ctx, dtype)
    if not supported(packed):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    chosen = prepack(packed)
    layer = packed.layers[0]
    shapes = {tuple(m.weight.shape) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                              layer.mlp.down_proj)} | {tuple(packed.lm_head.weight_matrix().shape)}
    assert set(chosen) == {f"{a}x{b}" for a, b in shapes}, chosen
    assert set(chosen.values()) <= set(VARIANTS)
    assert all(isinstance(m.method, FastLinear) for m in packed.modules() if hasattr(m, "method"))
    vocab = dense.config.vocab_size  # the padding columns are -inf in both
    for ids in (torch.tensor([_ref(workdir)["prompts"][1]]), torch.tensor([[7]])):
        with torch.inference_mode():
            want, got = dense(ids)[..., :vocab].float(), packed(ids)[..., :vocab].float()
        assert (got - want).abs().max() <= tol * want.abs().max(), ids.shape
    packed.requires_grad_(True)
    loss = packed(ids).float()[..., :vocab].logsumexp(-1).sum()
    loss.backward()  # autograd on: F.linear, so gradients reach the weights
    assert packed.layers[0].mlp.down_proj.weight.grad is not None


def test_prepack_times_one_row_variants_as_decode_runs_them(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One-row steps run torch's ops on `one_row_threads` and the native kernels on their own pool
    (every thread given): the one-row variants are timed that way, so a torch product timed on
    two threads cannot win and then run on one."""
    from tprt.cpu import fast_linear, native

    model = load_model(workdir / "tp1", TPContext.single(), "fp32")
    if not fast_linear.supported(model):
        pytest.skip("no oneDNN fp32 on this CPU")
    timed: list[tuple[int, int, int]] = []  # (rows, torch threads, native pool threads) of each timing
    time_group = fast_linear._time_group

    def spy(fns: Any, x: torch.Tensor, repeats: int = 3) -> float:
        timed.append((x.shape[0], torch.get_num_threads(), native.threads()))
        return time_group(fns, x, repeats)

    monkeypatch.setattr(fast_linear, "_time_group", spy)
    with fast_linear.torch_thread_count(2):
        chosen = fast_linear.prepack(model, one_row_threads=1)
        assert torch.get_num_threads() == 2  # restored
    one_row = [(t, pool) for rows, t, pool in timed if rows == 1]
    per_shape = len(one_row) // len(chosen)
    assert per_shape == len(fast_linear.VARIANTS) - (not native.available())  # native skipped without a compiler
    # per shape: native (when built) first, on its pool of 2 with torch's 2; then packed, transposed, dense on 1
    want = ([(2, 2)] if native.available() else []) + [(1, native.threads())] * 3
    assert one_row == want * len(chosen), one_row


@pytest.mark.parametrize("dtype, tol", [("bf16", 2e-2), ("fp32", 1e-5)])
def test_native_decode_step_matches_torch(workdir: Path, dtype: str, tol: float) -> None:
    """CPU: decode through the compiled kernels (RoPE + cache write, attention, RMSNorm, one-row GEMV,
    and for one row each half of a layer in one call, or every layer in one call) gives the logits
    and the cache contents of the torch path (gather + SDPA), for rows in scattered KV blocks at
    uneven positions; every layer in one call gives the halves' bits."""
    from tprt.cpu import native
    from tprt.cpu.fast_linear import prepack, supported
    from tprt.cpu.native_layers import (NativeAttention, NativeDecoderLayer, NativeRMSNorm, install_native_layers,
                                        install_native_stack, use_native_halves)
    from tprt.model.attention import TorchAttention, backend as attention_backend
    from tprt.model.llama import DecoderLayer, LayerStack

    ctx = TPContext.single()
    plain, fast = load_model(workdir / "tp1", ctx, dtype), load_model(workdir / "tp1", ctx, dtype)
    if not supported(fast):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    chosen = prepack(fast)
    install_native_layers(fast)
    expect_native = native.available()
    assert isinstance(fast.norm, NativeRMSNorm) == expect_native
    for i, layer in enumerate(fast.layers):
        attn = layer.self_attn
        assert isinstance(attn, NativeAttention) == expect_native
        assert isinstance(layer.input_layernorm, NativeRMSNorm) == expect_native
        won = [chosen["x".join(map(str, m.weight.shape))] == "native" for m in fast.linears()[:4]]
        halves = (expect_native and won[0] and won[1], expect_native and won[2] and won[3])
        if any(halves):
            assert isinstance(layer, NativeDecoderLayer)
            assert ((layer.attention_half is not None), (layer.mlp_half is not None)) == halves
        else:
            assert type(layer) is DecoderLayer
        # each half in one call for one row, whatever the timing chose
        norm, mlp = layer.post_attention_layernorm, layer.mlp
        mlp_half = native.mlp_decode_kernel(norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        norm = layer.input_layernorm
        attention_half = native.attention_decode_kernel(norm.weight, norm.eps, attn.qkv_proj.weight,
                                                        attn.o_proj.weight, attn.n_heads, attn.n_kv)
        assert (attention_half is not None) == (mlp_half is not None) == expect_native
        if expect_native:
            assert use_native_halves(fast, i, attention_half, mlp_half).self_attn is attn
    prompts = _ref(workdir)["prompts"][:3]
    caches = [m.new_cache(40, 4) for m in (plain, fast)]  # blocks of 4 positions, block 0 scratch
    assert caches[0].dtype == caches[1].dtype == torch.float32
    order = torch.randperm(39, generator=torch.Generator().manual_seed(0)) + 1
    tables = [order[8 * i : 8 * i + 8] for i in range(3)]  # scattered blocks, 32 positions per row
    reference, compiled = TorchAttention(), attention_backend("auto", ctx.device, caches[1])
    assert compiled.name == ("native" if expect_native else "torch")

    def run(model: TPLlamaForCausalLM, cache: Any, rows: list[list[int]], starts: list[int], tables: Any,
            ) -> torch.Tensor:
        backend = reference if model is plain else compiled
        return torch.cat(forward_rows(model, cache, rows, starts, tables, backend))  # [tokens, vocab]

    with torch.inference_mode():
        for model, cache in zip((plain, fast), caches):  # prefill each prompt into its blocks
            for table, p in zip(tables, prompts):
                run(model, cache, [p], [0], [table])
        positions = [len(p) for p in prompts]
        for _ in range(2):  # uneven positions, crossing block edges
            ids = [[11], [12], [13]]
            want = run(plain, caches[0], ids, positions, tables)
            got = run(fast, caches[1], ids, positions, tables)
            assert (got - want).abs().max() <= tol * want.abs().max(), positions
            assert (caches[1].kv - caches[0].kv).abs().max() <= tol * caches[0].kv.abs().max()
            positions = [p + 1 for p in positions]
        stack = install_native_stack(fast)  # every layer of a one-row step in one call
        assert (stack is not None) == expect_native
        for step in range(2):  # one row: each half of a layer in one call, then all layers in one
            ids, pos, table = [[14 + step]], [positions[2] + step], tables[2:3]
            want = run(plain, caches[0], ids, pos, table)
            fast.stack = LayerStack()
            halves = run(fast, caches[1], ids, pos, table)
            fast.stack = stack
            got = run(fast, caches[1], ids, pos, table)  # writes the same k/v again
            assert torch.equal(got, halves), "one row: the stack's bits differ from the halves'"
            assert (got - want).abs().max() <= tol * want.abs().max(), "one row"
            assert (caches[1].kv - caches[0].kv).abs().max() <= tol * caches[0].kv.abs().max(), "one row"


@pytest.mark.parametrize("variant", ["packed", "transposed", "dense"])
def test_fast_linear_variants(variant: str) -> None:
    """Every variant computes x @ W^T for 1-, 2- and 3-d inputs."""
    from tprt.cpu.fast_linear import _MAKERS

    w = torch.randn(48, 32)
    fn = _MAKERS[variant](w)
    for x in (torch.randn(1, 32), torch.randn(5, 32), torch.randn(2, 3, 32), torch.randn(1, 1, 32)):
        torch.testing.assert_close(fn(x), torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


def test_step_graphs_are_bypassed_while_an_adapter_is_attached(workdir: Path) -> None:
    """A captured CUDA graph would replay the layers without an adapter attached after capture,
    so steps take the static path only while no adapter outside the slots acts (an attached
    training LoRA: eager); rows routed to an installed adapter take it, the slots' deltas staged."""
    from tprt.lora.attach import attach, build_lora, detach

    model = load_model(workdir / "tp1", TPContext.single())
    engine = Engine(model, Tokenizer.from_dir(workdir / "hf"), EngineConfig(max_batch=2, max_seq_len=48,
                                                                            cuda_graphs="decode"))
    graphs = engine.runner.graphs
    assert graphs is not None
    calls: list[bool] = []  # per static step: whether it ran static (False: sent back to the eager path)
    run = graphs.run

    def recording(batch: TokenBatch, key: GraphKey) -> torch.Tensor | None:
        out = run(batch, key)
        calls.append(out is not None)
        return out

    graphs.run = recording  # type: ignore[method-assign]
    prompt = _ref(workdir)["prompts"][0]

    def generate(adapter: int = 0) -> list[int]:
        calls.clear()
        engine.add(prompt, _greedy(6), "r", adapter=adapter)
        return run_to_completion(engine)["r"].token_ids

    base = generate()
    assert calls and all(calls), "the static path was not used without adapters"
    attach(model, build_lora(model, ["q", "down"], 4, 8.0))  # B = 0: the same tokens
    assert generate() == base and calls and not any(calls), "an attached adapter did not send steps eagerly"
    # Installed as a per-row adapter set: base rows and routed rows both take the static path.
    engine.runner.adapters.install(1, detach(model))
    assert generate() == base and all(calls), "base rows beside an installed adapter set left the static path"
    assert generate(adapter=1) == base and all(calls), "adapter rows left the static path"
    assert {k.adapters for k in graphs.graphs} == {0, 1}
    engine.close()


def test_rows_routed_to_different_adapters_match_each_alone(workdir: Path) -> None:
    """Two LoRA adapters installed side by side (tprt.lora.routing): a batch mixing rows of both and
    of the base model gives every request the tokens and log-probabilities it gets alone; a base
    request alone still decodes through the fused one-row layer halves, adapter requests never."""
    from tprt.lora.attach import build_lora

    model = load_model(workdir / "tp1", TPContext.single())
    engine = Engine(model, Tokenizer.from_dir(workdir / "hf"), EngineConfig(max_batch=4, max_seq_len=64,
                                                                          kv_block_size=1))
    for index, (seed, targets) in enumerate(((1, ["q", "v", "down"]), (2, ["k", "o", "gate", "up"])), start=1):
        adapter = build_lora(model, targets, 4, 8.0, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, module in adapter.pieces:  # a non-zero B, so each adapter changes the outputs
                for b in module.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
        engine.runner.adapters.install(index, adapter)
    from tprt.cpu import native

    fused = force_native_decode(model)  # calls of the fused halves, of the one-call stack
    prompts = _ref(workdir)["prompts"]
    requests = [(prompts[0], 0), (prompts[1], 1), (prompts[2], 2), (prompts[0], 1)]

    def run(batch: list[tuple[int, tuple[list[int], int]]]) -> dict[str, Completion]:
        for i, (prompt, adapter) in batch:
            engine.add(prompt, _greedy(5, logprobs=True), str(i), adapter=adapter)
        return run_to_completion(engine)

    alone = {}
    for i, r in enumerate(requests):
        before = list(fused)
        alone[str(i)] = run([(i, r)])[str(i)]
        # a base row alone decodes through the one-call stack; an adapter's rows never do, nor
        # through the halves (each adapter targets a layer of each half: 1 q/v and down, 2 k/o and gate/up)
        assert fused[1] - before[1] > 0 if r[1] == 0 and native.available() else fused[1] == before[1], (i, fused)
        assert fused[0] == before[0], (i, fused)
    mixed = run(list(enumerate(requests)))
    assert alone["0"].logprobs != alone["3"].logprobs, "adapter 1 did not change prompt 0's outputs"
    for k, want in alone.items():
        assert mixed[k].token_ids == want.token_ids, f"request {k}"
        assert max(abs(a - b) for a, b in zip(mixed[k].logprobs, want.logprobs)) < 1e-4, f"request {k}"
    # Prefix reuse is per adapter: adapter 1's record of prompt 0 serves it again, until the
    # adapter is reloaded (serve/ranks/executor.py calls forget_prefixes), when only base records remain.
    for rid, forget, reused in (("again", False, len(prompts[0]) - 1), ("reloaded", True, 0)):
        if forget:
            engine.forget_prefixes(1)
        engine.add(prompts[0], _greedy(5, logprobs=True), rid, adapter=1)
        done = run_to_completion(engine)[rid]
        assert done.usage is not None and done.usage.cached_prompt_tokens == reused, (rid, done.usage)
        assert done.token_ids == alone["3"].token_ids, rid
    engine.close()


def test_one_row_steps_run_on_one_thread_and_restore_the_count(workdir: Path) -> None:
    """CPU: a step of a single row of a few tokens (its decode steps, a short prompt) runs on
    `one_row_threads`; steps of several rows on the caller's thread count, which every step
    leaves as it found it. None leaves it alone."""
    seen: list[tuple[int, int]] = []  # (rows, threads) of each forward call
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for one_row_threads, want_one_row in ((1, 1), (None, 2)):
            model = load_model(workdir / "tp1", TPContext.single())
            forward = model.forward

            def spy(ids: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
                batch = kw["attention"].batch  # -1: a step with a prompt of several tokens
                seen.append((batch.num_rows if batch.max_query_len == 1 else -1, torch.get_num_threads()))
                return forward(ids, *a, **kw)

            model.forward = spy  # type: ignore[method-assign]
            engine = Engine(model, None, EngineConfig(max_batch=2, max_seq_len=32, one_row_threads=one_row_threads),
                            eos_token_ids=[])
            seen.clear()
            engine.add([5, 6, 7], _greedy(4), "a")
            run_to_completion(engine)  # a prefill, then one-row decode steps
            engine.add([5, 6], _greedy(4), "b")
            engine.add([8, 9], _greedy(4), "c")
            run_to_completion(engine)  # a two-row prefill, then two-row decode steps
            assert seen[0] == (-1, want_one_row) and seen[1:4] == [(1, want_one_row)] * 3, seen
            assert seen[4] == (-1, 2) and set(seen[5:]) == {(2, 2)}, seen
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="one_row_threads"):
        Engine(load_model(workdir / "tp1", TPContext.single()), None, EngineConfig(one_row_threads=0))


def test_which_path_runs_is_visible_in_the_modules(workdir: Path) -> None:
    """A loaded model is made of the reference modules with the dense linear method; the runner
    (cpu_prepack, the default) gives its linears packed methods and swaps in the native decode
    layers on CPU, where the kernels exist; with cpu_prepack off nothing changes."""
    from tprt.cpu import native
    from tprt.cpu.fast_linear import FastLinear, one_row_native, supported
    from tprt.cpu.native_layers import NativeAttention, NativeDecoderLayer, NativeRMSNorm
    from tprt.parallel.layers import DENSE

    native_types = (NativeRMSNorm, NativeAttention, NativeDecoderLayer)

    def reference_only(model: TPLlamaForCausalLM) -> bool:
        return (not any(isinstance(m, native_types) for m in model.modules())
                and all(m.method is DENSE for m in model.modules() if hasattr(m, "method")))

    ctx = TPContext.single()
    model = load_model(workdir / "tp1", ctx)
    assert reference_only(model)
    Engine(model, None, EngineConfig(max_batch=1, max_seq_len=32, cpu_prepack=False), eos_token_ids=[]).close()
    assert reference_only(model)
    if not supported(model):
        pytest.skip("no oneDNN for this dtype on this CPU")
    Engine(model, None, EngineConfig(max_batch=1, max_seq_len=32), eos_token_ids=[]).close()
    assert all(isinstance(m.method, FastLinear) for m in model.modules() if hasattr(m, "method"))
    if not native.available():
        assert not any(isinstance(m, native_types) for m in model.modules())
        return
    assert isinstance(model.norm, NativeRMSNorm)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn, NativeAttention) and isinstance(layer.post_attention_layernorm, NativeRMSNorm)
        fused = one_row_native(attn.qkv_proj, attn.o_proj) or one_row_native(mlp.gate_up_proj, mlp.down_proj)
        assert isinstance(layer, NativeDecoderLayer) == fused


def test_speculation_waits_for_a_narrow_batch(workdir: Path) -> None:
    """With the CPU default (8 tokens a step), nine decoding rows draft nothing (a row of k + 1
    tokens would pad all nine); one row alone drafts, and keeps plain decoding's tokens."""
    from tprt.engine.speculative import SpeculativeConfig

    tok = Tokenizer.from_dir(workdir / "hf")
    prompt = tok.encode(SPEC_TEXTS[0])
    engine = Engine(_model(TPContext.single(), workdir), tok,
                    EngineConfig(max_batch=9, max_seq_len=64, speculative=SpeculativeConfig("ngram", min_n=1)))
    for i in range(9):
        engine.add(prompt, _greedy(12), str(i))
    wide = run_to_completion(engine)
    stats = engine.spec_stats
    assert stats is not None and stats.drafted == 0, stats
    engine.add(prompt, _greedy(12), "alone")
    alone = run_to_completion(engine)["alone"]
    stats = engine.spec_stats
    assert stats is not None and stats.drafted > 0 and stats.accepted > 0, stats
    assert alone.token_ids == wide["0"].token_ids


def test_a_one_row_draft_step_runs_on_one_thread(workdir: Path) -> None:
    """CPU: a single decode row of a last token and a short draft (speculative decoding at batch
    1) runs on `one_row_threads` like a one-token row; several rows, a row longer than the native
    stack takes, or a prefill, on the caller's count."""
    from tprt.cpu.native import STACK_MAX_ROWS

    engine = Engine(_model(TPContext.single(), workdir), None, EngineConfig(max_batch=2, max_seq_len=32))
    before = torch.get_num_threads()

    def threads(batch: TokenBatch) -> int:
        with engine.runner.threads_for(batch):
            return torch.get_num_threads()

    def rows(*widths: int) -> TokenBatch:
        return TokenBatch.of([BatchRow((1,), 3, (5,) * w, w) for w in widths])

    try:
        torch.set_num_threads(2)
        assert threads(rows(1)) == threads(rows(5)) == 1  # one row of a few tokens: the native kernels
        assert threads(rows(STACK_MAX_ROWS + 1)) == 2
        assert threads(rows(2, 2)) == threads(rows(1, 1)) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_row_whose_masks_cost_more_than_its_share_sits_steps_out(workdir: Path) -> None:
    """Issue 38 (hostile constraints must not starve others): a constrained row whose masks cost
    far more than its share of a step is held while another row decodes every step; alone, it
    decodes every step; and holding changes none of its (seeded) tokens."""
    from tprt.engine.constraints import ConstraintSpec

    tok = Tokenizer.from_dir(workdir / "hf")
    prompt = tok.encode("Write some words:")
    costly = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5,
                            constraint=ConstraintSpec.regex("[a-z]+( [a-z]+)*", "regex"))

    def run(with_free_row: bool) -> tuple[list[int], list[str]]:
        engine = Engine(_model(TPContext.single(), workdir), tok, EngineConfig(max_batch=4, max_seq_len=64))
        engine.add(prompt, costly, "costly")
        if with_free_row:
            engine.add(prompt, _greedy(8), "free")
        order: list[str] = []  # which request emitted, step by step
        tokens: list[int] = []
        while engine.has_work:
            for seq in engine.scheduler.running:  # every mask of the costly row "took" a second
                if seq.request_id == "costly" and seq.matcher is not None:
                    seq.matcher.last_mask_s = 1.0
            for ev in engine.step():
                order.append(ev.request_id)
                if ev.request_id == "costly" and ev.token_id is not None:
                    tokens.append(ev.token_id)
        return tokens, order

    alone, _ = run(False)
    beside, order = run(True)
    assert beside == alone  # held steps change no token
    frees = [i for i, rid in enumerate(order) if rid == "free"]
    costly_while_free = [i for i, rid in enumerate(order) if rid == "costly" and frees[0] < i < frees[-1]]
    assert len(frees) == 8 and costly_while_free == [], order  # held while the free row decoded
    assert order.count("costly") == len(alone)  # then decoded alone, every step


def test_a_mixed_step_gives_the_tokens_and_logprobs_of_its_rows_run_apart(workdir: Path) -> None:
    """One TokenBatch holding a prompt chunk, plain decode rows and verifying rows (a last token
    and a draft) gives every row the logits, so the greedy tokens and the logprobs, of running
    each row in a step of its own, on caches holding the same history."""
    from tprt.engine.runner import ModelRunner, RunnerConfig

    model = load_model(workdir / "tp1", TPContext.single())
    prompts = _ref(workdir)["prompts"]
    runners = [ModelRunner(model, 64, 4, 4, 64, RunnerConfig(cuda_graphs="off")) for _ in range(2)]
    tables = [tuple(range(1 + 12 * i, 13 + 12 * i)) for i in range(4)]
    first = [BatchRow(tables[i], 0, tuple(prompts[i]), 1) for i in range(3)]  # three prompts in the cache
    for runner in runners:
        runner.execute(TokenBatch.of(first, full_logits=True))
    n = [len(p) for p in prompts]
    rows = [BatchRow(tables[0], n[0], (7,), 1),  # plain decode
            BatchRow(tables[1], n[1], (8, 9, 10), 3),  # verifying: a last token and a draft of two
            BatchRow(tables[3], 0, tuple(prompts[3]), 1),  # a whole prompt
            BatchRow(tables[2], n[2], (11, 12), 2),  # verifying: a draft of one
            BatchRow(tuple(range(49, 53)), 0, (5, 6, 7), 0)]  # a prompt chunk that does not end: no logits
    mixed = runners[0].execute(TokenBatch.of(rows, full_logits=True)).logits
    apart = [runners[1].execute(TokenBatch.of([row], full_logits=True)).logits for row in rows]
    assert mixed is not None and all(a is not None or row.logits == 0 for a, row in zip(apart, rows))
    want = torch.cat([a for a in apart if a is not None])
    assert mixed.shape == want.shape == (1 + 3 + 1 + 2, model.config.vocab_size)
    torch.testing.assert_close(mixed.log_softmax(-1), want.log_softmax(-1), atol=1e-5, rtol=0)
    assert mixed.argmax(-1).tolist() == want.argmax(-1).tolist()
