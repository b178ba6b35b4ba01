#!/usr/bin/env bash
# make gpu-check: on a GPU box with no network, the figures the design stands or falls by,
# within a budget (docs/GPU.md). Steps:
#   1. .venv-gpu: `python3 -m venv --system-site-packages`, so the box's own torch (CUDA) is
#      used, never a pip torch; when python3 is itself a venv (its packages are not the
#      "system" ones of the new venv) a .pth file adds that venv's site-packages too;
#   2. wheelhouse/*.whl (make gpu-wheels) with `pip install --no-index --no-deps`;
#   3. this project: `pip install --no-deps --no-build-isolation -e .` (or, failing that,
#      the repository on sys.path through a .pth file);
#   4. the native host ops built once; if they cannot be, ZENFLOW_OPS=reference for the run;
#   5. bench/gpu_check.py with what is left of the budget: host, link, a 1B-class Llama under
#      zenflow / device AdamW / offload at 16k and 4k tokens per step, the training
#      thread's CPU per piece (bench/piece_cost.py), the CUDA tier (tests/cuda); each
#      section skipped with a note when the budget runs out;
#   6. ONE JSON (gpu-check.json) and ONE log (gpu-check.log) in ${GPU_CHECK_OUT}.
# Every step says what it did; a failing step is recorded and the rest still runs.
# Without a CUDA device it is a rehearsal on the simulated device (`sim`), shapes scaled
# down, labelled "rehearsal (sim)" in the JSON and the log; what needs CUDA says so.
# Exit: 0 when no section failed (budget skips are not failures), else 1.
#
# GPU_CHECK_BUDGET (seconds for everything, setup included; default 480; the older name
# GPU_CHECK_BUDGET_S is read too), GPU_CHECK_OUT (default gpu-check), GPU_CHECK_PYTHON
# (default: python3 when it has torch, else this checkout's .venv/bin/python: a rehearsal),
# GPU_CHECK_VENV (default .venv-gpu), GPU_CHECK_SCALE (auto, gpu, rehearsal, tiny),
# GPU_CHECK_ONLY (comma-separated sections, e.g. host,link,llama).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then  # the box's python3 has torch; here (no GPU) .venv's: a rehearsal
  PY=python3
  if ! python3 -c 'import torch' >/dev/null 2>&1 && [ -x "$ROOT/.venv/bin/python" ]; then
    PY=$ROOT/.venv/bin/python
  fi
fi
VENV=${GPU_CHECK_VENV:-.venv-gpu}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac
OUT=${GPU_CHECK_OUT:-gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-${GPU_CHECK_BUDGET_S:-480}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu-check.log

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

SET=()  # setup facts for the summary: --set key=value
fact() {
  SET+=(--set "$1=$2")
  echo "gpu-check: $1: $2"
}

main() {
  echo "gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT, output $OUT"
  command -v nvidia-smi >/dev/null 2>&1 && timeout 60 nvidia-smi
  if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu-check: no Python '$PY' (set GPU_CHECK_PYTHON)"
    printf '{"run": "none", "error": "no Python %s"}\n' "$PY" > "$OUT/gpu-check.json"
    return 1
  fi
  fact python "$(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

  # 1. the venv, on top of the Python that has torch
  local vpy="$VENV/bin/python" vsite
  if [ -x "$vpy" ]; then
    fact venv "reused $VENV"
  elif "$PY" -m venv --system-site-packages "$VENV"; then
    fact venv "created $VENV"
  elif rm -rf "$VENV" && "$PY" -m venv --system-site-packages --without-pip "$VENV"; then
    fact venv "created $VENV without pip (this Python has no ensurepip)"
  else
    rm -rf "$VENV"
    fact venv "failed: running on $PY itself, packages unpacked into $VENV/site"
    vpy=$PY
  fi
  if [ "$vpy" = "$PY" ]; then
    vsite=$VENV/site
    mkdir -p "$vsite"
    export PYTHONPATH=$vsite:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  else
    vsite=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # the site-packages of $PY (a venv's are not the new venv's "system" packages)
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()
      + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])))' > "$OUT/.outer-sites"
    "$vpy" - "$vsite" "$OUT/.outer-sites" <<'EOF'
import pathlib, sys
vsite = pathlib.Path(sys.argv[1]).resolve()
dirs = [d for d in pathlib.Path(sys.argv[2]).read_text().split("\n") if d]
dirs = [d for d in dirs if pathlib.Path(d).is_dir() and pathlib.Path(d).resolve() != vsite]
lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
(vsite / "_gpu_check_outer_site.pth").write_text("\n".join(lines) + "\n")
print("gpu-check: outer site-packages:", ", ".join(dirs) or "none")
EOF
    rm -f "$OUT/.outer-sites"
  fi
  local probe='import torch as t; print(t.__version__, "cuda", t.version.cuda, t.__file__)'
  fact torch "$("$vpy" -c "$probe" 2>&1 | tail -1)"

  # pip: the venv's, the one it sees through the outer site-packages, or the wheelhouse's
  local pip=()
  if "$vpy" -m pip --version >/dev/null 2>&1; then
    pip=("$vpy" -m pip)
  else
    local pw
    pw=$(compgen -G 'wheelhouse/pip-*.whl' | head -1)
    if [ -n "$pw" ] && [ "$vpy" != "$PY" ] \
        && "$vpy" "$pw/pip" install --no-index --no-deps "$pw"; then
      pip=("$vpy" -m pip)
    fi
  fi
  fact pip "$( ((${#pip[@]})) && "${pip[@]}" --version | cut -d' ' -f1-2 || echo none)"

  # 2. the wheelhouse
  shopt -s nullglob
  local wheels=(wheelhouse/*.whl)
  shopt -u nullglob
  if ((${#wheels[@]} == 0)); then
    fact wheelhouse "none (run make gpu-wheels where the registry is reachable)"
  elif ((${#pip[@]})); then
    local failed=()
    if ! "${pip[@]}" install --no-index --no-deps "${wheels[@]}"; then
      for w in "${wheels[@]}"; do  # one by one: a wheel for another Python fails alone
        "${pip[@]}" install --no-index --no-deps "$w" || failed+=("$(basename "$w")")
      done
    fi
    local names note=""
    names=$(cd wheelhouse && echo *.whl)
    ((${#failed[@]})) && note="; failed: ${failed[*]}"
    fact wheelhouse "installed $(( ${#wheels[@]} - ${#failed[@]} )) of ${#wheels[@]}: $names$note"
  else
    "$vpy" - "$vsite" "${wheels[@]}" <<'EOF'
import sys, zipfile
for w in sys.argv[2:]:  # a wheel is its site-packages layout: unpack it (scripts aside)
    with zipfile.ZipFile(w) as z:
        names = [n for n in z.namelist() if not n.split("/")[0].endswith(".data")]
        z.extractall(sys.argv[1], names)
EOF
    fact wheelhouse "unpacked ${#wheels[@]} wheels into $vsite (no pip)"
  fi

  # 3. the project
  if [ "$vpy" = "$PY" ]; then
    fact install "$ROOT on PYTHONPATH (no venv)"
  elif ((${#pip[@]})) && "${pip[@]}" install --no-index --no-deps --no-build-isolation -e .; then
    fact install "pip install --no-deps --no-build-isolation -e ."
  else
    echo "$ROOT" > "$vsite/_gpu_check_zfctl.pth"
    fact install "fallback: $ROOT on sys.path ($vsite/_gpu_check_zfctl.pth)"
  fi
  if ! "$vpy" -c 'import zenflow, zfctl' ; then
    fact install_check "failed: zenflow/zfctl do not import"
  fi

  # 4. the native host ops, built once (the host section, the engines and the tier use them)
  export ZENFLOW_BUILD_DIR=${ZENFLOW_BUILD_DIR:-$VENV/zenflow-build}
  local kernel=native build_s=$(( BUDGET / 3 ))
  ((build_s < 60)) && build_s=60
  if timeout "$build_s" "$vpy" -c 'from zenflow.ops.loader import load_native; load_native()'
  then
    fact native_build "ok ($ZENFLOW_BUILD_DIR)"
  else
    export ZENFLOW_OPS=reference
    kernel=reference
    fact native_build "failed (log above): ZENFLOW_OPS=reference for this run"
  fi

  fact setup_s "$SECONDS"

  # 5. the sections, with what is left of the budget; 6. the JSON
  local args=(--out "$OUT" --budget "$BUDGET" --spent "$SECONDS" --host-kernel "$kernel"
              --scale "${GPU_CHECK_SCALE:-auto}")
  [ -n "${GPU_CHECK_ONLY:-}" ] && args+=(--only "$GPU_CHECK_ONLY")
  "$vpy" bench/gpu_check.py "${args[@]}" "${SET[@]}"
  local rc=$?
  echo "gpu-check: log $LOG"
  if ((rc != 0)); then
    echo "gpu-check: FAILED (bench/gpu_check.py exit $rc; the JSON says which section)"
    return 1
  fi
  echo "gpu-check: ok"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
