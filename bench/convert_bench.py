"""Converter benchmark: a synthetic checkpoint with Llama 3 70B shapes, converted HF -> TP8 ->
TP2 -> HF and HF -> TP2, each timed against `cp -r` of the same source in the same run, with the
converter's peak RSS. Every step runs the converter in a fresh child process, which reports its own peak RSS.

    python bench/convert_bench.py --layers 2            # about 7.6 GB of bf16 weights
    python bench/convert_bench.py --layers 4            # about 11 GB: RSS must not grow
    python bench/convert_bench.py --hub-stream --layers 4 --shard-gb 1   # from a fake Hub on loopback
    python bench/convert_bench.py --layers 2 --quantize int8 --group-size 128   # + hf -> tp8 quantized in the stream

--hub-stream serves the checkpoint from tests/fake_hub.py on loopback (HF_ENDPOINT) and compares
`tprt-convert hf-to-tp org/name --stream` with downloading first (the same files, with
huggingface_hub's hf_hub_download, into the cache) and converting the download: wall time and peak disk
(cache, temporary and final output, sampled every 50 ms).

Needs about 3x the checkpoint size of free disk under --workdir; intermediates are deleted as
soon as the next step has read them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tprt.checkpoint.safetensors_io import SafetensorsFile, build_header  # noqa: E402

LLAMA3_70B = dict(
    hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
    vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)
SHARD_BYTES = 5 * 1024**3  # HF's default max_shard_size


def tensor_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = LLAMA3_70B["hidden_size"], LLAMA3_70B["intermediate_size"], LLAMA3_70B["vocab_size"]
    kv = 8 * 128
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_synthetic(path: Path, layers: int, shard_bytes: int = SHARD_BYTES) -> int:
    """Writes the checkpoint in HF's sharded layout, streaming from one 64 MB block of bf16 noise."""
    path.mkdir(parents=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=layers,
               torch_dtype="bfloat16", tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
               hidden_act="silu", **LLAMA3_70B)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(layers):
        nbytes = 2 * int(torch.tensor(shape).prod())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    noise = (torch.randn(32 << 20) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy()
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(path / fname, "wb") as f:
            f.write(build_header([(n, "BF16", s) for n, s in shard], {"format": "pt"}))
            for name, shape in shard:
                weight_map[name] = fname
                left = 2 * int(torch.tensor(shape).prod())
                total += left
                while left:
                    n = min(left, len(noise))
                    f.write(noise[:n])
                    left -= n
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


# Runs the converter in a fresh interpreter and reports that process's own VmHWM. (ru_maxrss from
# wait4 is useless here: Linux carries the parent's high-water mark into a forked child.)
_CHILD = (
    "import sys, convert.cli as c\n"
    "rc = c.main(sys.argv[2:])\n"
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
    "open(sys.argv[1], 'w').write(hwm)\n"
    "sys.exit(rc)\n"
)


def timed(argv: list[str], workdir: Path) -> tuple[float, float]:
    """Runs `tprt-convert argv`; returns (wall seconds, the converter's peak RSS in MiB)."""
    hwm_file = workdir / "hwm.txt"
    cmd = [sys.executable, "-c", _CHILD, str(hwm_file), *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed: tprt-convert {' '.join(argv)}")
    rss_mib = int(hwm_file.read_text()) / 1024
    hwm_file.unlink()
    return wall, rss_mib


def cp_seconds(src: Path, dst: Path) -> float:
    """`cp -r` followed by `sync`: the converter fsyncs its output, so cp gets the same durability."""
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(dst)
    return wall


def same_tensors(a: Path, b: Path) -> bool:
    """Streams every tensor of two HF directories and compares bytes."""
    def index(d: Path) -> dict[str, str]:
        return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    ia, ib = index(a), index(b)
    if ia.keys() != ib.keys():
        return False
    fa = {f: SafetensorsFile(a / f) for f in set(ia.values())}
    fb = {f: SafetensorsFile(b / f) for f in set(ib.values())}
    for name in ia:
        x, y = fa[ia[name]].raw(name).reshape(-1), fb[ib[name]].raw(name).reshape(-1)
        for s in range(0, x.size, 1 << 26):
            if not (x[s:s + (1 << 26)] == y[s:s + (1 << 26)]).all():
                return False
    return True


def run(workdir: Path, layers: int, check: bool, quantize: list[str] | None = None) -> list[dict[str, object]]:
    src = workdir / "hf"
    t0 = time.perf_counter()
    total = write_synthetic(src, layers)
    print(f"synthetic checkpoint: {layers} layers, {total / 1e9:.2f} GB in {time.perf_counter() - t0:.1f}s",
          flush=True)
    steps = [
        ("hf -> tp8", ["hf-to-tp", str(src), str(workdir / "tp8"), "--tp", "8"], None),
        *([("hf -> tp8 " + quantize[1], ["hf-to-tp", str(src), str(workdir / "tp8q"), "--tp", "8", *quantize],
            "tp8q")] if quantize else []),
        ("tp8 -> tp2", ["reshard", str(workdir / "tp8"), str(workdir / "tp2"), "--tp", "2"], "tp8"),
        ("tp2 -> hf", ["tp-to-hf", str(workdir / "tp2"), str(workdir / "hf_back")], "tp2"),
        ("hf -> tp2", ["hf-to-tp", str(src), str(workdir / "tp2b"), "--tp", "2"], "tp2b"),
    ]
    rows: list[dict[str, object]] = []
    for label, cmd, drop in steps:
        cp = cp_seconds(src, workdir / "cp")
        wall, rss = timed([*cmd, "--no-progress"], workdir)
        row = dict(step=label, layers=layers, gb=round(total / 1e9, 2), seconds=round(wall, 2),
                   cp_seconds=round(cp, 2), ratio_to_cp=round(wall / cp, 2), peak_rss_mib=round(rss))
        if quantize and label.startswith("hf -> tp8 "):  # the same conversion without --quantize, same run
            row["ratio_to_unquantized"] = round(wall / float(rows[0]["seconds"]), 2)  # type: ignore[arg-type]
        print(json.dumps(row), flush=True)
        rows.append(row)
        if label == "tp2 -> hf":
            if check:
                ok = same_tensors(src, workdir / "hf_back")
                print(f"round trip HF -> TP8 -> TP2 -> HF bit-identical: {ok}", flush=True)
                if not ok:
                    raise SystemExit("round trip differs")
            shutil.rmtree(workdir / "hf_back")
        if drop:
            shutil.rmtree(workdir / drop)
    shutil.rmtree(src)
    return rows


class DiskPeak:
    """Samples the bytes of regular files under some directories (symlinks not followed)."""

    def __init__(self, *roots: Path) -> None:
        self.roots, self.peak, self._stop = roots, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _usage(self) -> int:
        total = 0
        for root in self.roots:
            for d, _, files in os.walk(root):
                for f in files:
                    try:
                        st = os.lstat(os.path.join(d, f))
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_blocks * 512
        return total

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._usage())

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._usage())


_DOWNLOAD = (  # the files tprt-convert reads, downloaded one by one into the cache; prints the snapshot
    "import os, sys\n"
    "from huggingface_hub import HfApi, hf_hub_download\n"
    "names = [s.rfilename for s in HfApi().model_info(sys.argv[1]).siblings if s.rfilename.endswith(('.safetensors', '.json'))]\n"
    "print(os.path.dirname([hf_hub_download(sys.argv[1], n) for n in names][0]))\n"
)


def run_hub(workdir: Path, layers: int, shard_gb: float, tp: int) -> list[dict[str, object]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_hub import FakeHub, load_dir

    src = workdir / "hf"
    total = write_synthetic(src, layers, int(shard_gb * 1e9))
    n_shards = len(list(src.glob("*.safetensors")))
    print(f"synthetic checkpoint: {layers} layers, {total / 1e9:.2f} GB in {n_shards} shards", flush=True)
    hub = FakeHub()
    hub.add("bench/llama-70b-shaped", load_dir(src, on_disk=True))
    server, url = hub.start()
    rows: list[dict[str, object]] = []
    try:
        for mode in ("download, then convert", "--stream"):
            run_dir = workdir / "run"  # everything this mode writes: cache, output, temporary output
            cache, out = run_dir / "cache", run_dir / "out"
            env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
            t0 = time.perf_counter()
            with DiskPeak(run_dir) as disk:
                if mode == "--stream":
                    subprocess.run([sys.executable, "-m", "convert", "hf-to-tp", "bench/llama-70b-shaped", str(out),
                                    "--tp", str(tp), "--stream", "--no-progress"], env=env, check=True)
                else:
                    snap = subprocess.run([sys.executable, "-c", _DOWNLOAD, "bench/llama-70b-shaped"],
                                          env=env, check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
                    subprocess.run([sys.executable, "-m", "convert", "hf-to-tp", snap, str(out), "--tp", str(tp),
                                    "--no-progress"], env=env, check=True)
            wall = time.perf_counter() - t0
            row = dict(mode=mode, layers=layers, gb=round(total / 1e9, 2), shards=n_shards, tp=tp,
                       seconds=round(wall, 1), peak_disk_gb=round(disk.peak / 1e9, 2),
                       peak_over_output=round(disk.peak / total, 2))
            print(json.dumps(row), flush=True)
            rows.append(row)
            shutil.rmtree(run_dir)
    finally:
        server.shutdown()
        shutil.rmtree(src)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2], help="layer counts to run (default 2)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-identity check of the round trip")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--hub-stream", action="store_true",
                    help="instead: from a fake Hub on loopback, --stream vs download-then-convert")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="--hub-stream: shard size in GB (default 5)")
    ap.add_argument("--tp", type=int, default=8, help="--hub-stream: TP degree (default 8)")
    ap.add_argument("--quantize", choices=("int8", "fp8"),
                    help="also time hf -> tp8 with --quantize (its ratio to the unquantized conversion)")
    ap.add_argument("--group-size", type=int, help="with --quantize int8: --group-size G")
    args = ap.parse_args()
    quantize = None
    if args.quantize:
        quantize = ["--quantize", args.quantize] + (["--group-size", str(args.group_size)] if args.group_size else [])
    rows = []
    for layers in args.layers:
        workdir = Path(tempfile.mkdtemp(prefix="tprt-convbench-", dir=args.workdir))
        try:
            if args.hub_stream:
                rows += run_hub(workdir, layers, args.shard_gb, args.tp)
            else:
                rows += run(workdir, layers, not args.no_check, quantize)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.hub_stream:
        print(f"\n{'mode':<24}{'layers':>7}{'GB':>7}{'shards':>7}{'s':>8}{'peak disk GB':>14}{'/ output':>10}")
        for r in rows:
            print(f"{r['mode']:<24}{r['layers']:>7}{r['gb']:>7}{r['shards']:>7}{r['seconds']:>8}"
                  f"{r['peak_disk_gb']:>14}{r['peak_over_output']:>10}")
    else:
        print(f"\n{'step':<12}{'layers':>7}{'GB':>7}{'tprt s':>9}{'cp s':>8}{'ratio':>7}{'peak RSS MiB':>14}")
        for r in rows:
            print(f"{r['step']:<12}{r['layers']:>7}{r['gb']:>7}{r['seconds']:>9}{r['cp_seconds']:>8}"
                  f"{r['ratio_to_cp']:>7}{r['peak_rss_mib']:>14}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
