"""The serve core, the jobs and the HTTP APIs speak no protocol's vocabulary: importing every
module of serve/core, serve/jobs, serve/openai and serve/anthropic loads no gRPC or protobuf
module (gRPC's mapping lives in serve/grpc alone)."""

from __future__ import annotations

import subprocess
import sys

PACKAGES = ("serve.core", "serve.jobs", "serve.openai", "serve.anthropic")

PROBE = f"""
import importlib, pkgutil, sys
for name in {PACKAGES!r}:
    pkg = importlib.import_module(name)
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{{name}}.{{m.name}}")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "grpc_tools", "grpc_health")
                or m.startswith("google.protobuf") or m.startswith("serve.grpc") or m.startswith("serve._proto"))
print(" ".join(loaded))
"""


def test_core_jobs_and_http_apis_import_no_grpc() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], f"gRPC modules loaded by {PACKAGES}: {out.stdout}"
