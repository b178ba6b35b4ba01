"""Activation memory of one micro-batch, measured on the simulated device's pool, against
``zfctl estimate``'s activation term (``zenflow.hardware.layout.activation_bytes``).

On sim every tensor made inside the accelerator's ``device_scope`` comes from its pool
(``zenflow.ops.sim_pool``), which counts the bytes live tensors asked for and their peak
(CUDA's ``max_memory_allocated``). Each case builds a model in bf16 (random init) and runs
forward and backward twice, each gradient dropped as soon as it is final (as the engine
streams them off the device), and keeps the second pass's peak over what was in use before
it: the activations, the saved tensors, the backward's temporaries and the gradient in
flight. The estimate is its activation term for the same micro-batch, sequence, dtype and
checkpointing, plus the largest gradient (the term its device layout counts for the
gradient in flight: a large vocabulary's embedding gradient can be the peak).

These are the CPU's kernels, not a GPU's: where they differ the figure says so in the
table's note (a CPU dropout keeps its mask in the activation dtype, CUDA's in one byte;
CPU ``sdpa`` with attention dropout runs the math path, which materialises the scores in
fp32, while CUDA's flash kernel supports dropout). Llama's attention has no dropout, so its
CPU ``sdpa`` is the flash kernel, as on a GPU.

    python bench/activations.py [--cases NAME ...] [--json] [--tiny]

Cases: gpt2 (124M, a classifier, the template's model) with and without dropout, eager
attention and checkpointing; a Llama-shaped causal LM (8 layers of 1024, vocab 32,000) with
``sdpa`` and eager attention, with and without checkpointing, at two shapes of 1,024
tokens; a Qwen2.5-0.5B-shaped classifier (6 of its layers: 14 heads, of them 2 for keys and
values) with and without checkpointing. ``--tiny`` shrinks every model (the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zenflow.engine.accelerator import SimAccelerator  # noqa: E402
from zenflow.hardware.census import arch_of  # noqa: E402
from zenflow.hardware.layout import Settings, activation_bytes  # noqa: E402
from zenflow.ops import sim_pool  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "gpt2" or "llama"
    micro_batch: int
    seq: int
    checkpointing: bool = False
    dropout: bool = True  # gpt2's default dropouts (llama has none)
    attention: str = "sdpa"


CASES = (
    Case("gpt2", "gpt2", 8, 128),
    Case("gpt2, no dropout", "gpt2", 8, 128, dropout=False),
    Case("gpt2, eager attention", "gpt2", 8, 128, attention="eager"),
    Case("gpt2, checkpointing", "gpt2", 8, 128, checkpointing=True),
    Case("gpt2, checkpointing, no dropout", "gpt2", 8, 128, checkpointing=True, dropout=False),
    Case("llama", "llama", 4, 256, dropout=False),
    Case("llama, eager attention", "llama", 4, 256, dropout=False, attention="eager"),
    Case("llama, checkpointing", "llama", 4, 256, checkpointing=True, dropout=False),
    Case("llama, checkpointing, 1 x 1024", "llama", 1, 1024, checkpointing=True, dropout=False),
    Case("qwen2 (GQA), classifier", "qwen2", 4, 256, dropout=False),
    Case(
        "qwen2 (GQA), classifier, checkpointing",
        "qwen2",
        4,
        256,
        checkpointing=True,
        dropout=False,
    ),  # fmt: skip
)


def build(case: Case, tiny: bool):
    """The case's model (bf16, training mode), its ArchShape and one batch's inputs."""
    from transformers import (
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    b, s = case.micro_batch, case.seq
    if case.model == "gpt2":
        size = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000) if tiny else {}
        drop = {} if case.dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg = GPT2Config(num_labels=2, pad_token_id=0, n_positions=max(1024, s), **size,
                         **drop)  # fmt: skip
        model = GPT2ForSequenceClassification(cfg)
        arch = arch_of(cfg, 2, False)
        ids = torch.randint(0, cfg.vocab_size, (b, s))
        inputs = dict(input_ids=ids, labels=torch.randint(0, 2, (b,)))
    elif case.model == "qwen2":  # Qwen2.5-0.5B's layer (14 heads, 2 of them for k and v)
        from transformers import Qwen2Config, Qwen2ForSequenceClassification

        size = (dict(hidden_size=64, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
                if tiny else
                dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=6,
                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151936))  # fmt: skip
        cfg = Qwen2Config(max_position_embeddings=max(2048, s), num_labels=2, pad_token_id=0,
                          **size)  # fmt: skip
        model = Qwen2ForSequenceClassification(cfg)
        arch = arch_of(cfg, 2, False)
        ids = torch.randint(1, cfg.vocab_size, (b, s))
        inputs = dict(input_ids=ids, labels=torch.randint(0, 2, (b,)))
    else:
        size = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
                if tiny else
                dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=16, vocab_size=32000))  # fmt: skip
        cfg = LlamaConfig(max_position_embeddings=max(2048, s), **size)
        model = LlamaForCausalLM(cfg)
        arch = arch_of(cfg, 2, True)
        ids = torch.randint(0, cfg.vocab_size, (b, s))
        inputs = dict(input_ids=ids, labels=ids)
    model.config._attn_implementation = case.attention
    model = model.to(torch.bfloat16).train()
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model, arch, inputs


def measure(case: Case, tiny: bool = False) -> dict:
    """One case: its measured activation peak and the estimate's term, in bytes."""
    model, arch, inputs = build(case, tiny)
    accel = SimAccelerator()
    if not accel.pool:
        accel.close()
        raise SystemExit(f"error: no device pool here ({sim_pool.why_not()}); this bench "
                         "measures the simulated device's pool. Build the native ops.")  # fmt: skip
    try:
        with accel.device_scope():
            # each gradient leaves as soon as it is final, as the engine streams them: the
            # largest in flight is the estimate's "grads" term, not an activation
            hooks = [p.register_post_accumulate_grad_hook(_drop_grad)
                     for p in model.parameters()]  # fmt: skip
            peak = 0
            for _ in range(2):  # the second pass: the pool's classes already made
                before = sim_pool.stats()["in_use"]
                sim_pool.reset_peak()
                loss = model(**inputs).loss
                loss.backward()
                del loss
                peak = sim_pool.stats()["in_use_peak"] - before
        for h in hooks:
            h.remove()
    finally:
        accel.close()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    settings = Settings(micro_batch=case.micro_batch, seq_len=case.seq, bf16=True,
                        gradient_checkpointing=case.checkpointing)  # fmt: skip
    activations, formula = activation_bytes(arch, settings)
    estimate = activations + largest
    return {**asdict(case), "measured_bytes": peak, "estimate_bytes": estimate,
            "activation_term_bytes": activations, "largest_gradient_bytes": largest,
            "measured_over_estimate": peak / estimate, "formula": formula}  # fmt: skip


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def table(rows: list[dict]) -> str:
    lines = ["| case | micro-batch x seq | measured peak (MiB) | activation term | largest "
             "gradient | estimate (their sum) | measured / estimate |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    mib = 2**20
    for r in rows:
        lines.append(f"| {r['name']} | {r['micro_batch']} x {r['seq']} | "
                     f"{r['measured_bytes'] / mib:.1f} | {r['activation_term_bytes'] / mib:.1f} | "
                     f"{r['largest_gradient_bytes'] / mib:.1f} | {r['estimate_bytes'] / mib:.1f} | "
                     f"{r['measured_over_estimate']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [c.name for c in CASES]
    ap.add_argument("--cases", nargs="+", default=names, metavar="NAME",
                    help=f"cases to run (default all): {names}")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="one JSON line per case")
    ap.add_argument("--tiny", action="store_true", help="tiny models (the tests)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.cases if n not in names]
    if unknown:
        print(f"error: unknown case(s) {unknown}; choose from {names}", file=sys.stderr)
        return 2
    rows = []
    for case in (c for c in CASES if c.name in args.cases):
        print(f"case: {case.name} ...", file=sys.stderr, flush=True)
        rows.append(measure(case, tiny=args.tiny))
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
