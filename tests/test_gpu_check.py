"""bench/gpu_check.sh would start on a GPU machine: its dry run here (no GPU needed), its usage
errors, the GPU bench scripts importing with torch alone (a bare machine has no registry), and the
graphs step's scenarios on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEPS = ("tests", "graphs", "graphs-fp8", "attention", "decode", "memory", "mfu")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *args], capture_output=True, text=True,
                          timeout=120)


def test_dry_run_lists_the_steps_and_checks_the_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = run("--dry-run", "--out", str(out), "--wheels", str(tmp_path / "no-wheels"))
    assert proc.returncode == 0, proc.stderr
    plan = (out / "plan.txt").read_text().splitlines()[1:]
    assert [line.split()[0] for line in plan] == list(STEPS)
    for script in ("gpu_graphs.py", "gpu_attention.py", "gpu_bench.py --random", "gpu_memory.py", "gpu_mfu.py",
                   "pytest"):
        assert any(script in line for line in plan), script
    assert "--batches 1,16,64" in "\n".join(plan)
    deps = dict(line.split("\t") for line in (out / "deps.tsv").read_text().splitlines())
    assert deps["torch"] and deps["pytest"] != "missing"
    assert "torch" in (out / "env.txt").read_text()
    for step in STEPS:
        assert f"{step}: ready" in proc.stdout
    assert not (out / "summary.tsv").exists()  # nothing ran


def test_usage_errors_are_one_line() -> None:
    proc = run("--bogus")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("gpu_check.sh: unknown argument '--bogus' "
                                   "(expected --out DIR, --wheels DIR, --python PY, --dry-run)")
    proc = run("--out")
    assert (proc.returncode, proc.stderr.strip()) == (2, "gpu_check.sh: --out needs a folder")
    proc = subprocess.run(["bash", str(SCRIPT), "--python", "no-such-python", "--dry-run"], capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stderr.strip()) == (
        2, "gpu_check.sh: no Python interpreter 'no-such-python' (pass --python)")


def test_bench_scripts_import_with_torch_alone() -> None:
    """With every optional dependency made unimportable, the GPU bench scripts still import."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        BLOCKED = {"numpy", "safetensors", "tokenizers", "sentencepiece", "gguf", "tqdm", "psutil", "grpc",
                   "google", "prometheus_client", "transformers", "peft", "huggingface_hub", "pytest"}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"no module {name!r}", name=name)
        for name in list(sys.modules):
            if name.split(".")[0] in BLOCKED:
                del sys.modules[name]
        sys.meta_path.insert(0, Block())
        import bench.gpu_attention, bench.gpu_bench, bench.gpu_graphs, bench.gpu_memory, bench.gpu_mfu
        assert "numpy" not in sys.modules
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_graphs_step_runs_its_scenarios_on_the_cpu(tmp_path: Path) -> None:
    """bench/gpu_graphs.py's scenarios (plain, four adapters mixed, verifying rows) on eager static
    steps (--device cpu): the same tokens as the eager path, and every graph shape reached."""
    config = json.loads((ROOT / "bench" / "configs" / "llama-3.1-8b" / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "graphs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_graphs.py"), "--device", "cpu", "--config",
                           str(tmp_path / "config.json"), "--layers", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["failures"] == [] and "steps" not in result  # host syncs and launches: CUDA only
    assert all(result[s]["same_tokens"] for s in ("plain", "adapters", "speculative"))
    assert result["speculative"]["widest_row"] == 5 and result["adapters"]["most_adapters"] == 4
