#!/usr/bin/env bash
# One command for a bare GPU machine (one H100/H200, a CUDA build of torch, no package registry):
# every GPU check this project has, each under its own time limit (about 9 minutes at most, 6 as
# measured), every result written to one folder. See docs/PERF.md ("GPU check").
#
#   bash bench/gpu_check.sh [--out DIR] [--wheels DIR] [--python PY] [--dry-run]
#
# --out DIR     where results go (default gpu-check/<UTC time>); created if missing
# --wheels DIR  wheels carried to the machine (default bench/wheels, or $TPRT_WHEELS), installed
#               with pip --no-index before anything runs; the test step needs pytest, numpy,
#               transformers and peft, the bench scripts only torch
# --python PY   the interpreter with CUDA torch (default $PYTHON or python3)
# --dry-run     check that the run would start (arguments, folder, interpreter, the scripts'
#               imports, which optional modules are present), list the steps, run none
#
# Writes to DIR: plan.txt (the steps), env.txt, deps.tsv (module -> version or "missing"),
# <step>.log for each step, the steps' JSON (graphs.json, graphs-fp8.json, attention.json,
# gpu_bench.json, memory.json, mfu.json), traces/ (profiler traces of a decode step, eager and
# replayed) and tests.xml (JUnit), and summary.tsv (step, status, seconds). A failing step
# does not stop the others. Exit status: 0 when every step passed, 1 otherwise, 2 on bad usage.
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=""
WHEELS=${TPRT_WHEELS:-$ROOT/bench/wheels}
PY=${PYTHON:-python3}
DRY=0

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_check.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT=$2; shift 2 ;;
        --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; WHEELS=$2; shift 2 ;;
        --python) [ $# -ge 2 ] || die "--python needs an interpreter"; PY=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (expected --out DIR, --wheels DIR, --python PY, --dry-run)" ;;
    esac
done
[ -n "$OUT" ] || OUT="$ROOT/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT" || die "cannot create the results folder $OUT"
OUT=$(cd "$OUT" && pwd)
command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter '$PY' (pass --python)"
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # the steps run from the repo root
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

CFG8=bench/configs/llama-3.1-8b/config.json
CFG70=bench/configs/llama-3.1-70b/config.json
CORE_TESTS="tests/test_model_tp.py tests/test_engine.py tests/test_backward_tp.py tests/test_lora.py"
CORE_TESTS="$CORE_TESTS tests/test_attention.py tests/test_triton_attention.py"

# name | time limit (s) | command. Tests first: if the machine is taken back early, the
# correctness results are already written. Limits from the first run (2026-11-28, H100/H200):
# tests 190 s, graphs 11, decode 85, memory 27, mfu 15; the graphs step has run three scenarios
# since (not timed on a GPU yet).
STEPS=(
    "tests|230|TPRT_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider $CORE_TESTS --junitxml=$OUT/tests.xml"
    "graphs|50|$PY bench/gpu_graphs.py --config $CFG8 --out $OUT/graphs.json --trace $OUT/traces"
    "graphs-fp8|35|$PY bench/gpu_graphs.py --config $CFG8 --weight-dtype fp8 --out $OUT/graphs-fp8.json"
    "attention|50|$PY bench/gpu_attention.py --out $OUT/attention.json"
    "decode|95|$PY bench/gpu_bench.py --random $CFG8 --batches 1,16,64 --tokens 128 --out $OUT/gpu_bench.json"
    "memory|40|$PY bench/gpu_memory.py --config $CFG8 --out $OUT/memory.json"
    "mfu|35|$PY bench/gpu_mfu.py --config $CFG70 --out $OUT/mfu.json"
)
# What each step needs beyond torch (checked before it runs).
declare -A NEEDS=([tests]="pytest numpy transformers peft safetensors")
OPTIONAL="numpy safetensors tokenizers sentencepiece gguf jinja2 tqdm psutil grpc prometheus_client transformers peft pytest jsonschema llguidance"

{
    echo "gpu_check.sh steps (limit in seconds), run from $ROOT:"
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name limit cmd <<< "$step"
        printf '%-7s %4ss  %s\n' "$name" "$limit" "$cmd"
    done
} > "$OUT/plan.txt"
cat "$OUT/plan.txt"

if [ "$DRY" = 0 ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "installing the carried wheels from $WHEELS"
    "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl > "$OUT/wheels.log" 2>&1 \
        || echo "gpu_check.sh: installing wheels from $WHEELS failed (see wheels.log); going on" >&2
fi

# deps.tsv: module -> version, or "missing"
"$PY" - "$OPTIONAL" > "$OUT/deps.tsv" <<'EOF'
import importlib, sys
for name in ["torch", *sys.argv[1].split()]:
    try:
        module = importlib.import_module(name)
        print(f"{name}\t{getattr(module, '__version__', 'present')}")
    except Exception as e:  # noqa: BLE001 - any import failure means the module cannot be used
        print(f"{name}\tmissing ({type(e).__name__})")
EOF
missing() { awk -F'\t' -v m="$1" '$1 == m && $2 ~ /^missing/ {found = 1} END {exit !found}' "$OUT/deps.tsv"; }
missing torch && die "torch is not importable by $PY (see $OUT/deps.tsv)"

# The scripts must import here with torch alone (jinja2 comes with torch).
"$PY" -c "import bench.gpu_bench, bench.gpu_graphs, bench.gpu_memory, bench.gpu_mfu" > "$OUT/imports.log" 2>&1 \
    || die "the bench scripts do not import (see $OUT/imports.log)"

"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
EOF
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The modules a step needs that are missing here, as " a b"; empty when it can run.
absent_for() {
    local module absent=""
    for module in ${NEEDS[$1]:-}; do
        missing "$module" && absent="$absent $module"
    done
    echo "$absent"
}

if [ "$DRY" = 1 ]; then
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name limit cmd <<< "$step"
        absent=$(absent_for "$name")
        if [ -n "$absent" ]; then echo "$name: would not run: missing$absent"; else echo "$name: ready"; fi
    done
    echo "dry run: nothing was run; results would go to $OUT"
    exit 0
fi
grep -q "cuda available True" "$OUT/env.txt" || die "no CUDA device visible to $PY (see $OUT/env.txt)"

printf 'step\tstatus\tseconds\n' > "$OUT/summary.tsv"
failed=0
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "$step"
    absent=$(absent_for "$name")
    if [ -n "$absent" ]; then
        status="not run: missing${absent} (carry their wheels in $WHEELS)"
        seconds=0
        failed=1
    else
        echo "== $name (limit ${limit}s)"
        start=$(date +%s)
        timeout --kill-after=10 "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
        rc=$?
        seconds=$(( $(date +%s) - start ))
        case $rc in
            0) status=ok ;;
            124|137) status="timeout after ${limit}s"; failed=1 ;;
            *) status="FAIL (exit $rc)"; failed=1 ;;
        esac
        tail -n 5 "$OUT/$name.log"
    fi
    printf '%s\t%s\t%s\n' "$name" "$status" "$seconds" >> "$OUT/summary.tsv"
    echo "-- $name: $status (${seconds}s)"
done
echo "results in $OUT"
column -t -s $'\t' "$OUT/summary.tsv" 2>/dev/null || cat "$OUT/summary.tsv"
exit $failed
