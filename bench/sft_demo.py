"""SFT on real data, offline: SST-2 as instruction records for a causal LM (issue 16).

    .venv/bin/python bench/sft_demo.py prepare runs/sft-demo --glue-dir ../shared/data/glue

writes, from GLUE's SST-2 files (train.tsv, dev.tsv):

- ``train.jsonl`` and ``dev.jsonl``: one prompt/completion record per sentence, the prompt
  ``"Review: <sentence>\\nSentiment:"`` and the completion ``" positive"`` or
  ``" negative"``; ``zfctl finetune --objective causal-lm`` puts the loss on the
  completion and its end token only, and ``zfctl eval`` scores dev accuracy by which of the
  two completions the model finds likelier (``choice_accuracy``);
- ``decoder/``: a small GPT-2-shaped decoder's config (``--layers``, ``--width``, 128
  positions) and GPT-2's real tokenizer (the packaged BPE). No pretrained decoder installs
  offline, so the model is trained from random weights (``--init random``);
- ``before/``: the weights that run starts from (the same seeded initialisation the trainer
  makes), so ``zfctl eval runs/sft-demo/before --data runs/sft-demo/dev.jsonl`` is the
  "before" figure.

Then (the commands ``prepare`` prints):

    zfctl finetune runs/sft-demo/decoder --init random --objective causal-lm \\
        --data runs/sft-demo/train.jsonl --eval-data runs/sft-demo/dev.jsonl ...

With a real pretrained decoder on a connected machine, pass its hub id (or local folder)
instead of ``decoder`` and drop ``--init random``: the data and commands are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Review: {sentence}\nSentiment:"
COMPLETIONS = (" negative", " positive")  # SST-2 label 0, 1


def write_records(rows, path: Path) -> int:
    """One prompt/completion record per (sentence, label) row; the count written."""
    with open(path, "w", encoding="utf-8") as f:
        for ex in rows:
            rec = {"prompt": PROMPT.format(sentence=ex.texts[0].strip()),
                   "completion": COMPLETIONS[int(ex.label)]}  # fmt: skip
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return len(rows)


def prepare(args) -> int:
    from transformers import GPT2Config

    from zenflow.train.data import load_task
    from zenflow.train.models import packaged_gpt2_tokenizer, resolve_model, save_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_task("sst2", args.glue_dir)
    n_train = write_records(data.train, out / "train.jsonl")
    n_dev = write_records(data.dev, out / "dev.jsonl")
    decoder = out / "decoder"
    decoder.mkdir(exist_ok=True)
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    eos = tok.eos_token_id
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                        n_positions=128, vocab_size=len(tok), bos_token_id=eos,
                        eos_token_id=eos, pad_token_id=eos,
                        architectures=["GPT2LMHeadModel"])  # fmt: skip
    config.save_pretrained(decoder)
    tok.save_pretrained(decoder)
    # The run's own starting point: resolve_model is what the trainer calls.
    resolved = resolve_model(str(decoder), task_num_labels=0, init="random", seed=args.seed,
                             head="causal-lm")  # fmt: skip
    save_model(resolved.model, resolved.tokenizer, out / "before")
    params = sum(p.numel() for p in resolved.model.parameters())
    print(f"{out}: train.jsonl ({n_train} records), dev.jsonl ({n_dev} records), decoder/ "
          f"({args.layers} layers x {args.width}, {params / 1e6:.1f}M parameters, "
          f"random init), before/ (seed {args.seed})")  # fmt: skip
    print("next:")
    print(f"  zfctl eval {out}/before --data {out}/dev.jsonl")
    print(f"  zfctl finetune {decoder} --init random --objective causal-lm --data "
          f"{out}/train.jsonl --eval-data {out}/dev.jsonl --seed {args.seed} "
          "--max-steps 600 --micro-batch 16 --seq-len 64 --lr 1e-3 --eval-every 200")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare", help="write the records, the decoder and its start")
    pr.add_argument("out", help="folder to write into")
    pr.add_argument("--glue-dir", default=os.environ.get("GLUE_DIR"),
                    help="GLUE folder holding sst2/ (default: $GLUE_DIR)")  # fmt: skip
    pr.add_argument("--layers", type=int, default=4)
    pr.add_argument("--width", type=int, default=256)
    pr.add_argument("--heads", type=int, default=4)
    pr.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    if args.glue_dir is None:
        p.error("pass --glue-dir DIR (a GLUE folder holding sst2/train.tsv) or set GLUE_DIR")
    return prepare(args)


if __name__ == "__main__":
    raise SystemExit(main())
