"""Data parallel on CUDA devices: two ranks equal one rank over the same global batch.

What one machine allows:

- two GPUs or more: NCCL, one rank per GPU (what ``zfctl finetune --nproc 2 --device cuda``
  starts), in every engine mode, streamed and not;
- one GPU: NCCL refuses two ranks on one device ("Duplicate GPU detected"), and gloo
  implements only broadcast / all_reduce for CUDA tensors, while ZenFlow's and the offload
  engine's gradient reductions use reduce and reduce_scatter. So on one GPU only the device
  mode (all_reduce of whole gradients) runs two ranks, over gloo.

Each rank is a real process (``dp_cuda_worker.py``) in a group on a file store (no network).
Tolerance: one rank computes the whole batch's gradient where two average two halves, and
clipping (1.0, active) sees norms summed in another order: 2e-6 + 1e-5 relative, as the CPU
tier; the two replicas stay bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cudahelp import CUDA_TIER, MLP, REAL_CUDA, diff, record

pytestmark = CUDA_TIER

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "dp_cuda_worker.py"
ZF = {"topk_ratio": 0.2, "update_interval": 2, "select_strategy": "step", "select_interval": 3,
      "overlap_step": True}  # fmt: skip
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TWO_GPUS = pytest.mark.skipif(
    GPUS < 2,
    reason=f"needs 2 CUDA devices, this machine has {GPUS}: NCCL refuses two ranks on one "
    "GPU ('Duplicate GPU detected') and gloo has no reduce / reduce_scatter for CUDA tensors "
    "(ZenFlow's and offload's gradient reductions); one GPU runs the device mode over gloo "
    "(test_two_ranks_on_one_gpu_device_mode_over_gloo)",
)


def _run(tmp_path: Path, world: int, spec: dict, tag: str) -> list[dict]:
    store = tmp_path / f"store-{tag}"
    store.unlink(missing_ok=True)
    outs = [tmp_path / f"{tag}-{r}.pt" for r in range(world)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="4")  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(r),
                str(world),
                str(store),
                str(outs[r]),
                json.dumps(spec),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
    assert not errors, "\n".join(errors)
    return [torch.load(o, weights_only=True) for o in outs]


def _check(tmp_path, spec: dict, label: str) -> None:
    one = _run(tmp_path, 1, spec, "one")[0]
    r0, r1 = _run(tmp_path, 2, spec, "two")
    assert r0["world_size"] == r1["world_size"] == 2 and r0["backend"] == spec["backend"]
    d = diff(r0["params"], one["params"])
    record(f"two_ranks[{label}]", **d, devices=[r0["device"], r1["device"]])
    for n in r0["params"]:
        torch.testing.assert_close(r0["params"][n], one["params"][n], atol=2e-6, rtol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")  # fmt: skip
        assert torch.equal(r0["params"][n], r1["params"][n]), f"{n}: the replicas differ"
    torch.manual_seed(0)
    init = dict(MLP().named_parameters())
    assert all(not torch.equal(one["params"][n], init[n].detach()) for n in init)
    if spec["mode"] == "zenflow":
        assert r0["selected"] == r1["selected"] == one["selected"]
        assert r0["window_lengths"] == r1["window_lengths"] == one["window_lengths"]
        assert len({str(s) for s in r0["selected"]}) > 1, "a re-selection moved columns"


@REAL_CUDA
@TWO_GPUS
@pytest.mark.parametrize(
    "mode,stream", [("zenflow", True), ("zenflow", False), ("offload", True), ("device", False)],
    ids=["zenflow-streamed", "zenflow-whole", "offload-streamed", "device"],
)  # fmt: skip
def test_two_ranks_on_two_gpus_equal_one_rank(tmp_path, mode, stream):
    spec = {"backend": "nccl", "mode": mode, "zenflow": ZF if mode == "zenflow" else None,
            "steps": 8, "stream_grads": stream}  # fmt: skip
    _check(tmp_path, spec, f"nccl-{mode}-{'streamed' if stream else 'whole'}")


def test_two_ranks_on_one_gpu_device_mode_over_gloo(tmp_path):
    """Both ranks on the same GPU, gloo moving CUDA tensors (all_reduce of the gradients,
    the step's scalars on the CPU): the engine's data-parallel path on a CUDA device."""
    spec = {"backend": "gloo", "mode": "device", "zenflow": None, "steps": 8,
            "stream_grads": False}  # fmt: skip
    _check(tmp_path, spec, "gloo-one-gpu-device")
