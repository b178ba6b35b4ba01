"""The user's-own-data shape of issue 30: a small JSONL of SST-2 rows with string labels, and
the 872 dev rows in the same form, for ``zfctl finetune --data ... --eval-data ...``.

    .venv/bin/python bench/own_data.py OUT_DIR [--rows 3000] [--seed 0]

writes OUT_DIR/train.jsonl (``--rows`` training rows of GLUE SST-2, a seeded shuffle of the
67,349) and OUT_DIR/dev.jsonl (all 872 dev rows), each line {"text": ..., "label":
"negative" | "positive"}. GLUE is read from $GLUE_DIR (default ../shared/data/glue); the
files are written outside the repository (the data set is never copied into it).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
from pathlib import Path

NAMES = {"0": "negative", "1": "positive"}


def read_tsv(path: Path) -> list[tuple[str, str]]:
    """GLUE SST-2's rows (sentence, label), its quotes read as text."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(rows)
        return [(r[0], r[1]) for r in rows]


def write_jsonl(path: Path, rows: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text, label in rows:
            f.write(json.dumps({"text": text, "label": NAMES[label]}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    glue = Path(os.environ.get("GLUE_DIR", Path(__file__).resolve().parents[2] / "shared" /
                               "data" / "glue")) / "sst2"  # fmt: skip
    if not (glue / "train.tsv").is_file():
        print(f"no GLUE SST-2 at {glue}: set GLUE_DIR to the folder holding sst2/", file=sys.stderr)
        return 2
    train = read_tsv(glue / "train.tsv")
    random.Random(args.seed).shuffle(train)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train[: args.rows])
    write_jsonl(args.out / "dev.jsonl", read_tsv(glue / "dev.tsv"))
    print(f"{args.out}: train.jsonl {min(args.rows, len(train))} rows, dev.jsonl 872 rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
