"""One benchmark round of one engine, as run inside a ``zfctl bench`` child process.

``run_contender(job)`` builds the model (seeded: every engine and every round starts from the
same weights and trains on the same batch), builds the engine, runs the unmeasured warm-up
steps, then times each measured step: forward, backward, the engine's step and
``zero_grad``, i.e. everything the engine does in a step, window-end host steps included.
It returns plain data (per-step records) for ``zenflow.hardware.bench`` to summarise.

``child_main`` is the child process's entry: its own session (the parent kills the whole
group at the deadline, DeepSpeed's optimizer process included), stdout and stderr into a log
file, a faulthandler deadline that prints every thread's stack, and the result or the error
sent back over a pipe.
"""

from __future__ import annotations

import faulthandler
import os
import re
import time
import traceback

from zenflow.errors import UserInputError

# GPT-2 architecture presets, random init: "gpt2" is GPT-2 small; "LxW" is L layers of width
# W (heads = W / 64), GPT-2's vocabulary and 1024 positions: "4x512" is ZENFLOW.md section 7's
# 38.4M-parameter model.
GPT2_SMALL = (12, 768)
PRESET_RE = re.compile(r"^(\d+)x(\d+)$")
GPT2_VOCAB = 50257
GPT2_EOS = 50256
ENGINE_MODES = {"device": "device", "lora": "device", "offload": "offload",
                "zenflow-sync": "zenflow", "zenflow-overlap": "zenflow"}  # fmt: skip


def preset_shape(name: str) -> tuple[int, int] | None:
    """(layers, width) of an architecture name (``gpt2``, ``LxW``), else None."""
    if name == "gpt2":
        return GPT2_SMALL
    m = PRESET_RE.match(name)
    if m is None:
        return None
    layers, width = int(m.group(1)), int(m.group(2))
    if layers < 1 or width < 1 or (width > 64 and width % 64):
        raise UserInputError(
            f"--model {name}: an LxW preset needs at least 1 layer and a width that is a "
            "multiple of 64 (or at most 64), e.g. 4x512 or 2x64."
        )
    return layers, width


def build_model(name: str, seed: int):
    """(model, source in words): a preset architecture with seeded random weights, or a model
    id / directory through ``zenflow.train.models`` (its weights when available; timing does
    not depend on them, so a missing checkpoint falls back to random init, said)."""
    import torch

    shape = preset_shape(name)
    if shape is not None:
        from transformers import GPT2Config, GPT2ForSequenceClassification

        layers, width = shape
        cfg = GPT2Config(
            n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=GPT2_VOCAB,
            n_positions=1024, num_labels=2, pad_token_id=GPT2_EOS, bos_token_id=GPT2_EOS,
            eos_token_id=GPT2_EOS,
        )  # fmt: skip
        torch.manual_seed(seed)
        label = "GPT-2 small" if name == "gpt2" else f"GPT-2 {layers} layers x {width}"
        source = f"{label} architecture, random init (seed {seed})"
        return GPT2ForSequenceClassification(cfg), source
    from zenflow.errors import ModelSourceError
    from zenflow.train.models import resolve_model

    try:
        resolved = resolve_model(name, task_num_labels=2, init="pretrained", seed=seed)
        return resolved.model, resolved.sources.get("model", "pretrained weights")
    except ModelSourceError as exc:
        resolved = resolve_model(name, task_num_labels=2, init="random", seed=seed)
        first = str(exc).split(". ")[0]
        return resolved.model, f"random init, seed {seed} (weights not available: {first})"


def make_batch(model, micro_batch: int, seq_len: int, seed: int, device) -> dict:
    """A seeded random token batch (no pad tokens) with 2-class labels."""
    from zenflow.hardware.probe_model import random_batch

    return random_batch(model, micro_batch, seq_len, device, seed=seed + 1)


def _make_engine(job: dict, model):
    """The engine of ``job["engine"]`` (None for ``floor``)."""
    from zenflow.config import load_config

    name = job["engine"]
    if name == "floor":
        return None
    config = load_config(job["ds_config"])
    if name.startswith("deepspeed-"):
        from zenflow.train.deepspeed_engine import DeepSpeedAdapter

        return DeepSpeedAdapter(model, config)
    from zenflow.engine.schedule import ZenFlowEngine

    if name == "lora":  # adapters injected into ``model`` in place: its forward runs them
        from zenflow.train.lora import lora_resolved, wrap_lora

        wrapped = wrap_lora(model, config.engine.lora, "classification", job["seed"])
        engine = ZenFlowEngine(wrapped, config, mode="device", accelerator=job["device"])
        engine.resolved.update(lora_resolved(wrapped))
        return engine
    return ZenFlowEngine(model, config, mode=ENGINE_MODES[name], accelerator=job["device"])


def run_contender(job: dict) -> dict:
    """Warm up, then time ``job["measured"]`` steps of one engine; per-step records back."""
    import torch

    device = torch.device("cuda" if job["device"] == "cuda" else "cpu")
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    model, source = build_model(job["model"], job["seed"])
    model.to(device).train()
    batch = make_batch(model, job["micro_batch"], job["seq_len"], job["seed"], device)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    engine = _make_engine(job, model)
    if engine is None and job["device"] == "sim":
        _floor_on_sim_share()
    if engine is not None:  # in the training dtype (bf16 weights are cast by the engine)
        model_bytes = engine.model_bytes
    threads = torch.get_num_threads()  # the training thread's share (close() restores it)
    forward = getattr(engine, "train_module", model)
    try:
        records = _timed_steps(job, engine, model, forward, batch, device)
        resolved = dict(engine.resolved) if engine is not None else {"mode": "floor"}
    finally:
        if engine is not None:
            engine.close()
    return {
        "records": records,
        "params": n_params,
        "model_bytes": model_bytes,
        "model_source": source,
        "threads": threads,
        "resolved": {k: v for k, v in resolved.items() if _plain(v)},
    }


def _floor_on_sim_share() -> None:
    """The floor's forward+backward runs where the engines' does: on the simulated device's
    reserved share of the cores."""
    import torch

    from zenflow.engine.accelerator import SimAccelerator

    sim = SimAccelerator()
    torch.set_num_threads(sim.compute_threads(0.5, False)[0])
    sim.close()


def _timed_steps(job: dict, engine, model, forward, batch: dict, device) -> list[dict]:
    """``job["warmup"]`` unmeasured steps, then a record of each measured one: forward,
    backward, the engine's step and ``zero_grad`` (floor: backward and ``zero_grad`` only)."""
    from zenflow.engine.accelerator import device_synchronize

    records = []
    for i in range(job["warmup"] + job["measured"]):
        t0 = time.perf_counter()
        ctx = engine.autocast() if engine is not None else _null()
        with ctx:
            loss = forward(**batch).loss
        if engine is None:
            loss.backward()
            model.zero_grad(set_to_none=True)
            float(loss)  # the one read a training loop does per step (the engines' too)
            stats = None
        else:
            engine.backward(loss)
            stats = engine.step(loss)
            engine.zero_grad()
        # No full sync per step: it would drain the engine's copy streams and remove the
        # overlap being measured. The device work still queued at the end of the
        # measured steps is waited for once and counted in the last step.
        last = i == job["warmup"] + job["measured"] - 1
        if last:
            device_synchronize(device)
        ms = (time.perf_counter() - t0) * 1e3
        if i >= job["warmup"]:
            records.append(_record(ms, stats, engine))
    return records


def _record(ms: float, stats, engine) -> dict:
    """One measured step. Fields the engine cannot observe are None, not 0."""
    if stats is None:  # floor: no optimizer, so no stall and no traffic
        return {"ms": ms, "stall_ms": 0.0, "bytes": 0, "device_bytes": None,
                "host_update": False, "window_len": 0}  # fmt: skip
    missing = set((engine.resolved or {}).get("unavailable_fields") or ())
    return {
        "ms": ms,
        "stall_ms": None if "stall_ms" in missing else float(stats.stall_ms),
        "bytes": None if "d2h_bytes" in missing else int(stats.d2h_bytes + stats.h2d_bytes),
        "device_bytes": getattr(stats, "device_bytes", None),
        "host_update": bool(stats.host_update),
        "window_len": int(stats.window_len),
    }


def _plain(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool, list, dict))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def child_main(conn, job: dict) -> None:
    """Entry of a benchmark child: run ``job`` and send ``{"ok": ...}`` over ``conn``."""
    os.setsid()  # its own process group: the parent's deadline kill takes every descendant
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.dump_traceback_later(job["deadline_s"], exit=True)
    for key, value in job.get("env", {}).items():
        os.environ[key] = value
    try:
        if job["engine"] == "prepare-deepspeed":
            from zenflow.ops.loader import load_deepspeed_op

            for builder in job["builders"]:
                load_deepspeed_op(builder)
            result: dict = {}
        else:
            result = run_contender(job)
        conn.send({"ok": True, **result})
    except UserInputError as exc:
        conn.send({"ok": False, "user_error": True, "message": str(exc)})
    except BaseException as exc:
        traceback.print_exc()
        conn.send({"ok": False, "message": f"{type(exc).__name__}: {exc}"})
    finally:
        faulthandler.cancel_dump_traceback_later()
        conn.close()
