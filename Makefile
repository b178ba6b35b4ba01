# Two entry points (the README's two commands): `make demo` and `make test`.
# Both set up .venv/ first (scripts/setup.sh: idempotent, quick when already done).
SHELL := /bin/bash
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
# GLUE data: GLUE_DIR if set, else the project's shared copy beside the clone.
GLUE_DIR ?= $(abspath $(wildcard ../shared/data/glue))
export GLUE_DIR
DEMO_STEPS ?= 30
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench-cpu-adam bench-engine

setup:
	@bash scripts/setup.sh

# The main job: fine-tune GPT-2 on SST-2 with the ZenFlow engine. Offline there are no
# GPT-2 weights, so the architecture is trained from random weights, on purpose.
demo: setup
	@if [ -n "$(GLUE_DIR)" ] && [ -f "$(GLUE_DIR)/sst2/train.tsv" ]; then \
	  data="--data-dir $(GLUE_DIR)"; else data="--sample-data"; fi; \
	.venv/bin/zfctl finetune gpt2 --task sst2 --init random $$data \
	  --max-steps $(DEMO_STEPS) --micro-batch 8 --seq-len 32 --eval-every 15 --max-eval-samples 256 && \
	.venv/bin/zfctl report

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

test: lint
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

bench-cpu-adam: setup
	.venv/bin/python bench/cpu_adam.py

bench-engine: setup
	.venv/bin/python bench/engine.py
