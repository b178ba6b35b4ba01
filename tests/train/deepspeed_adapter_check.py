"""Child process of tests/train/test_deepspeed_engine.py: DeepSpeedAdapter on a saved model.

Run as ``python deepspeed_adapter_check.py MODE MODEL_DIR DEADLINE_S`` (MODE: zenflow or
offload). Loads a tiny GPT-2 written by ``save_pretrained`` (seeded weights, a stand-in for
a pretrained checkpoint), runs the adapter's ``deepspeed.initialize``, and asserts that every
parameter still equals the saved one bit for bit; then trains 4 steps through the adapter
(the forward through DeepSpeed's engine, as the trainer does) and checks what the steps
report. Prints one JSON line starting with ``result:``. A separate process keeps DeepSpeed's
global state out of the test session; ``faulthandler`` ends a run that passes its deadline
with every thread's stack printed.
"""

from __future__ import annotations

import faulthandler
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main(mode: str, model_dir: str, deadline_s: float) -> None:
    faulthandler.dump_traceback_later(deadline_s, exit=True)
    import torch.distributed as dist
    from transformers import GPT2ForSequenceClassification

    from zenflow.config import load_config
    from zenflow.train.deepspeed_engine import DeepSpeedAdapter

    model = GPT2ForSequenceClassification.from_pretrained(model_dir).float().train()
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert sum(p.dim() == 2 for p in saved.values()) >= 8, "too few 2-D weights to mean much"
    template = ROOT / "templates" / f"{mode}.json"
    # overlap_step false: 4 steps take seconds, not a minute (the pin test initialises the
    # shipped overlap setting); the rest is the shipped template.
    overrides: dict = {"train_micro_batch_size_per_gpu": 4}
    if mode == "zenflow":
        overrides["zero_optimization.zenflow.overlap_step"] = False
    config = load_config(template, overrides=overrides)

    adapter = DeepSpeedAdapter(model, config, steps_per_epoch=100)
    assert adapter.model_engine.module is model
    assert dist.is_initialized() and dist.get_world_size() == 1
    optimizer = type(adapter.optimizer).__name__
    assert ("ZenFlow" in optimizer) == (mode == "zenflow"), optimizer
    after = dict(model.named_parameters())
    assert set(after) == set(saved)
    for name, before in saved.items():
        now = after[name].detach()
        assert now.dtype == before.dtype and now.shape == before.shape, name
        assert torch.equal(now, before), (
            f"{name} {tuple(before.shape)} changed at deepspeed.initialize: "
            f"max |diff| {(now.float() - before.float()).abs().max().item():.3e}"
        )
    unchanged = len(saved)

    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(4):
        ids = torch.randint(0, 50256, (4, 16), generator=gen)
        labels = torch.randint(0, 2, (4,), generator=gen)
        loss = adapter.train_module(input_ids=ids, labels=labels).loss
        adapter.backward(loss)
        stats = adapter.step(loss)
        adapter.zero_grad()
        fields = ("step", "loss", "host_update", "window_len", "step_ms", "mode")
        steps.append({f: getattr(stats, f) for f in fields})
    changed = sum(not torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters())
    adapter.flush()
    contiguous = all(p.is_contiguous() for p in model.parameters())
    resolved = adapter.resolved
    adapter.close()
    result = {
        "unchanged_at_initialize": unchanged,
        "params": len(saved),
        "changed_after_steps": changed,
        "finite": all(math.isfinite(s["loss"]) for s in steps),
        "steps": steps,
        "contiguous_after_flush": contiguous,
        "group_destroyed": not dist.is_initialized(),
        "optimizer": optimizer,
        "resolved": {k: v for k, v in resolved.items() if k != "zenflow"},
    }
    faulthandler.cancel_dump_traceback_later()
    print("result: " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
