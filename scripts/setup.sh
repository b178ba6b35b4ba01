#!/usr/bin/env bash
# Create .venv/ at the repo root with torch and zfctl (editable, with test extras).
# Idempotent: a second run only checks. Works offline apart from the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch          # regular (CUDA) build
  else
    "$VPY" -m pip install -q torch==2.13.0  # CPU build; a plain 'torch' would pull CUDA
  fi
fi
stamp=.venv/.zfctl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VPY" -m pip install -q -e '.[test]'
  touch "$stamp"
fi
.venv/bin/zfctl --help >/dev/null
