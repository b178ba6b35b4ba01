"""One rank of a data-parallel engine run (used by test_data_parallel.py).

    python dp_worker.py RANK WORLD STORE OUT SPEC_JSON

SPEC: mode, accelerator, zenflow block (or null), steps, optional "resume_from" (a state
file to load first) / "save_after" (write the state after that many steps and stop),
"fail_rank" / "fail_step" (raise there), "clip" (gradient_clipping, default 1.0),
"die_rank" / "die_step" (SIGKILL itself there, as the out-of-memory killer would: the
other ranks write what their failed collective raised, and whether
``zenflow.train.parallel.peer_lost`` knows it, instead of the results),
"stop_kinds" (one stop request per rank, None / "SIGINT" / "SIGTERM": every rank writes the
stop ``agree_stop`` agreed, then exits), "timeout_s" (the collectives' timeout, default
60), "stream_grads" / "grad_accumulation" / "host_state" / "step_store" (the
zfctl block's keys, left out: its defaults) and "gas" (gradient_accumulation_steps: the rank's
slice in that many micro-batches of loss / gas; default 1). Each rank trains on its slice of
the same global batches; WORLD=1 trains on whole batches. Writes the parameters, the
selected columns after every step, the window lengths and the engine's score-traffic
counters to OUT. With ZENFLOW_TEST_SIM_LAG set (conftest's docstring; importing conftest
applies it) the rank's sim runs in strict + lag mode.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import MLP, make_config, mlp_batches  # noqa: E402

from zenflow import ZenFlowEngine  # noqa: E402
from zenflow.engine.distributed import leave_process_group  # noqa: E402
from zenflow.train.parallel import Parallel, agree_stop, peer_lost  # noqa: E402

GLOBAL_BATCH = 8


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    spec = json.loads(sys.argv[5])
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=spec.get("timeout_s", 60)),
        )  # fmt: skip
    if "stop_kinds" in spec:
        agreed = agree_stop(spec["stop_kinds"][rank], Parallel(rank, world, backend="gloo"))
        torch.save({"agreed": agreed}, out)
        leave_process_group()
        return
    torch.manual_seed(0)  # the same model on every rank
    model = MLP()
    gas = spec.get("gas", 1)
    extra = {"gradient_accumulation_steps": gas} if gas > 1 else {}
    zfctl = {k: spec[k] for k in ("stream_grads", "grad_accumulation", "host_state",
                                  "step_store") if k in spec}  # fmt: skip
    if zfctl:
        extra["zfctl"] = zfctl
    cfg = make_config(spec["zenflow"], clip=spec.get("clip", 1.0), **extra)
    engine = ZenFlowEngine(
        model, cfg, mode=spec["mode"], accelerator=spec["accelerator"], sim_strict=True,
        host_kernel="reference", min_numel=1000,
    )  # fmt: skip
    start = 0
    if spec.get("resume_from"):
        state = torch.load(f"{spec['resume_from']}.{rank}", weights_only=True)
        model.load_state_dict(state["model"])
        engine.load_state_dict(state["engine"])
        start = state["step"]
    per_rank = GLOBAL_BATCH // world
    batches = mlp_batches(spec["steps"], bs=GLOBAL_BATCH)
    try:
        selected = _train(spec, rank, world, start, model, engine, batches, per_rank, gas)
    except Exception as exc:  # a collective failed: "die_rank" is gone
        if "die_rank" not in spec:
            raise
        torch.save({"error": f"{type(exc).__name__}: {exc}", "peer_lost": peer_lost(exc)}, out)
        os._exit(0)  # the group's peer is gone: no clean teardown to wait for
    result = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "selected": selected,
        "window_lengths": engine.window_lengths,
        "stream_grads": engine.stream_grads,
        "owned": [w.spec.name for w in engine.zweights if w.owned],
        "host_bytes": sum(
            t.numel() * t.element_size()
            for w in engine.zweights
            if w.owned
            for t in (w.host.master, *w.host.moment_tensors().values(), *w.acc)
        ),  # fmt: skip
        "score_floats": engine.dp.score_floats,
        "score_grad_equivalent": engine.dp.score_grad_equivalent,
    }
    engine.close()
    torch.save(result, out)
    leave_process_group()  # a barrier first: see its docstring


def _train(spec, rank, world, start, model, engine, batches, per_rank, gas) -> list:
    """Steps ``start`` .. ``steps`` on this rank's slice; the selected columns after each."""
    selected = []
    for i in range(start, spec["steps"]):
        if spec.get("fail_rank") == rank and spec.get("fail_step") == i:
            raise ValueError(f"rank {rank} broke at step {i}")
        if spec.get("die_rank") == rank and spec.get("die_step") == i:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches[i]
        n = per_rank // gas
        for m in range(gas):
            sl = slice(rank * per_rank + m * n, rank * per_rank + (m + 1) * n)
            loss = model(x[sl], y[sl])
            if gas > 1:
                loss = loss / gas
            engine.backward(loss)
        engine.step(loss)
        engine.zero_grad()
        selected.append({w.spec.name: w.sel_host.tolist() for w in engine.zweights
                         if w.sel_host is not None})  # fmt: skip
        if spec.get("save_after") == i + 1:
            torch.save({"model": model.state_dict(), "engine": engine.state_dict(),
                        "step": i + 1}, f"{spec['save_to']}.{rank}")  # fmt: skip
            break
    return selected


if __name__ == "__main__":
    main()
