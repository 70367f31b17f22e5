"""TP x PP across two hosts for real (issue 44): two network namespaces on this machine joined by
a virtual ethernet link are the hosts (real TCP between them, each with an address of its own),
and torchrun's multi-node rendezvous (c10d) starts two ranks on each. The ranks form a
[pp 2, tp 2] pipeline (tests/two_hosts_worker.py): each host is one stage, its two ranks that
stage's TP group; activations and their gradients cross the link point to point. Two full
fine-tuning steps give transformers' losses and gradient norms.

Creating namespaces needs root and iproute2; where the machine cannot, the test is skipped with
the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers import make_hf_llama
from pg import free_port
from test_backward_tp import make_batch

ROOT = Path(__file__).resolve().parents[1]
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
ADDRESSES = ("10.231.77.1", "10.231.77.2")
IFACE = "tprt0"  # the link's name inside each namespace


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _why_not() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"tprt-probe-{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "delete", probe)
    return None


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[str, str]]:
    """Two namespaces joined by a veth pair, addressed ADDRESSES; removed at the end."""
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    tag = str(os.getpid())[-6:]
    names = (f"tprt-{tag}-a", f"tprt-{tag}-b")
    ends = (f"tp{tag}a", f"tp{tag}b")
    try:
        for ns in names:
            assert _ip("netns", "add", ns).returncode == 0
        made = _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        assert made.returncode == 0, made.stderr
        for ns, end, address in zip(names, ends, ADDRESSES):
            for args in (("link", "set", end, "netns", ns), ("-n", ns, "link", "set", end, "name", IFACE),
                         ("-n", ns, "addr", "add", f"{address}/24", "dev", IFACE),
                         ("-n", ns, "link", "set", IFACE, "up"), ("-n", ns, "link", "set", "lo", "up")):
                done = _ip(*args)
                assert done.returncode == 0, (args, done.stderr)
        yield names
    finally:
        for ns in names:
            _ip("netns", "delete", ns)  # takes its end of the link with it


def _reference(hf_dir: Path, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], list[float]]:
    """transformers' losses and gradient norms over the same steps of torch's AdamW."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **HP)  # type: ignore[arg-type]
    losses, norms = [], []
    for ids, labels in batches:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        losses.append(loss.item())
        opt.step()
    return losses, norms


def test_a_pipeline_over_two_hosts_trains_as_one_process(hosts: tuple[str, str], tmp_path: Path) -> None:
    from convert.api import hf_to_tp

    hf_dir = make_hf_llama(tmp_path / "hf", "gqa", seed=3, num_hidden_layers=4)
    hf_to_tp(hf_dir, tmp_path / "tp2", 2)
    vocab = 256
    batches = [make_batch(seed, vocab) for seed in (5, 6)]
    torch.save(batches, tmp_path / "batches.pt")
    ref_losses, ref_norms = _reference(hf_dir, batches)
    out = tmp_path / "result.json"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "GLOO_SOCKET_IFNAME": IFACE,
           "OMP_NUM_THREADS": "1"}
    procs = []
    logs = []
    for i, ns in enumerate(hosts):
        log = (tmp_path / f"{ns}.log").open("w")
        logs.append(log)
        # The first host serves the rendezvous, and each names its own address: both namespaces
        # share one host name, which torchrun would otherwise go by.
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRESSES[0]}:{port}",
             "--rdzv-id", "tprt-two-hosts", "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", ADDRESSES[i],
             str(ROOT / "tests" / "two_hosts_worker.py"), str(tmp_path / "tp2"), str(out)],
            env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    tails = "\n".join((tmp_path / f"{ns}.log").read_text()[-2000:] for ns in hosts)
    assert codes == [0, 0], tails
    got = json.loads(out.read_text())
    assert got["host_rank"] in (2, 3)  # the last stage: the second host's ranks
    for ours, want in zip(got["losses"], ref_losses):
        assert abs(ours - want) <= 1e-5 * abs(want), (got["losses"], ref_losses)
    for ours, want in zip(got["norms"], ref_norms):
        assert abs(ours - want) <= 1e-5 * want, (got["norms"], ref_norms)
