"""The help panels that `finetune`, `estimate`, `tune-hw` and `init` group their options in.

One name per concern, so each command's ``--help`` fits a terminal (issue 29): every option
names its panel with ``rich_help_panel=``; its one-line help says what it is, and README.md's
"Option reference" holds the details. Only names live here: no option, no rendering.
Typer prints the panels in the order of each panel's first option in the signature.
"""

from __future__ import annotations

DATA = "Data"  # what is trained on: task, tables, fields, objective
MODEL = "Model"  # which weights, and how they are initialised or recomputed
TRAINING = "Training"  # steps, batch, learning rate, evaluation, schedule
ENGINE = "Engine"  # the optimizer engine and its config (zenflow block, DeepSpeed JSON)
DEVICES = "Devices"  # where it runs: device kind, memory, processes
OUTPUT = "Output"  # files written and what is printed

PANELS = (DATA, MODEL, TRAINING, ENGINE, DEVICES, OUTPUT)
