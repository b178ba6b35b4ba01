#!/usr/bin/env bash
# make gpu-check: the CUDA tier (tests/cuda) and the engine benchmark on a GPU box with no
# network (docs/GPU.md). Steps:
#   1. .venv-gpu: `python3 -m venv --system-site-packages`, so the box's own torch (CUDA) is
#      used, never a pip torch; when python3 is itself a venv (its packages are not the
#      "system" ones of the new venv) a .pth file adds that venv's site-packages too;
#   2. wheelhouse/*.whl (make gpu-wheels) with `pip install --no-index --no-deps`;
#   3. this project: `pip install --no-deps --no-build-isolation -e .` (or, failing that,
#      the repository on sys.path through a .pth file);
#   4. the native CPU Adam built once; if it cannot be, ZENFLOW_OPS=reference for the run;
#   5. `pytest -m cuda tests/cuda`, then bench/engine.py on cuda (--json);
#   6. ONE JSON summary (gpu-check.json) and ONE log (gpu-check.log) in ${GPU_CHECK_OUT}.
# Every step says what it did; a failing step is recorded and the rest still runs.
# Exit: 0 when the tests and the bench passed (without CUDA: the tests skip, saying why,
# the bench is skipped, and the JSON says cuda_available false), else 1.
#
# GPU_CHECK_OUT (default gpu-check), GPU_CHECK_PYTHON (default python3: the GPU box's
# Python with torch; a dry run elsewhere may point it at .venv/bin/python),
# GPU_CHECK_VENV (default .venv-gpu), GPU_CHECK_BUDGET_S (default 570: the whole run's
# seconds; pytest and the bench are cut short so that the summary is written in time).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${GPU_CHECK_PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-.venv-gpu}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac
OUT=${GPU_CHECK_OUT:-gpu-check}
BUDGET=${GPU_CHECK_BUDGET_S:-570}
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
    printf '{"cuda_available": false, "error": "no Python %s"}\n' "$PY" > "$OUT/gpu-check.json"
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

  # 4. the native CPU Adam, built once (the CLI test and the bench use it)
  export ZENFLOW_BUILD_DIR=${ZENFLOW_BUILD_DIR:-$VENV/zenflow-build}
  local kernel=native
  if timeout 300 "$vpy" -c 'from zenflow.ops.loader import load_native; load_native()'; then
    fact native_build "ok ($ZENFLOW_BUILD_DIR)"
  else
    export ZENFLOW_OPS=reference
    kernel=reference
    fact native_build "failed (log above): ZENFLOW_OPS=reference for this run"
  fi

  local cuda=0
  "$vpy" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' && cuda=1
  fact cuda_available "$cuda"

  # 5. the tier, then the bench
  local record=$OUT/records.jsonl junit=$OUT/junit.xml bench=$OUT/bench.json
  rm -f "$record" "$junit" "$bench"
  local topt=()
  "$vpy" -c 'import pytest_timeout' 2>/dev/null && topt=(--timeout=240)
  # what is left of the budget, less 2 minutes for the bench and the summary
  local left=$(( BUDGET - SECONDS - 120 ))
  ((left < 60)) && left=60
  GPU_CHECK_RECORD=$record timeout -k 10 "$left" "$vpy" -m pytest -m cuda tests/cuda -rA \
    -p no:cacheprovider --junitxml="$junit" -o junit_logging=system-out "${topt[@]}"
  local rc_tests=$?
  fact pytest_exit "$rc_tests$( ((rc_tests == 124)) && echo " (cut at ${left} s: the budget)")"

  local rc_bench=0
  left=$(( BUDGET - SECONDS - 20 ))
  ((left > 300)) && left=300
  if ((cuda && left >= 30)); then
    # bench/engine.py's default GPT-2 shape (4 x 512, GPT-2's vocabulary: 38M parameters),
    # bf16, every mode, 2 rounds of 8 steps: a minute or two on one GPU
    local bargs=(--device cuda --bf16 --rounds 2 --steps 8 --warmup 8 --host-kernel "$kernel")
    timeout -k 10 "$left" "$vpy" bench/engine.py "${bargs[@]}" --json > "$bench"
    rc_bench=$?
    fact bench "exit $rc_bench: bench/engine.py ${bargs[*]} --json"
  elif ((cuda)); then
    rc_bench=124
    fact bench "not run: ${left} s left of the ${BUDGET} s budget"
  else
    fact bench "skipped: no CUDA device (torch.cuda.is_available() is False)"
  fi

  # 6. the summary
  "$vpy" tests/cuda/gpu_report.py "$OUT/gpu-check.json" --junit "$junit" \
    --records "$record" --bench "$bench" "${SET[@]}" \
    || echo "gpu-check: the summary could not be written (log above)"
  echo "gpu-check: log $LOG"
  if ((rc_tests != 0 || rc_bench != 0)); then
    echo "gpu-check: FAILED (pytest exit $rc_tests, bench exit $rc_bench)"
    return 1
  fi
  echo "gpu-check: ok"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
