"""The run's place in a data-parallel job: process group, rank, device, agreement helpers.

A run is data parallel when it was started by ``torch.distributed.run`` (torchrun, or
``zfctl finetune --nproc N`` which starts it): torchrun sets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Then ``init_parallel`` joins the process
group (gloo on cpu and sim, nccl on cuda; collectives time out after
``COLLECTIVE_TIMEOUT_S``), each rank takes its device from LOCAL_RANK (cuda:LOCAL_RANK), and
the engine averages gradients and partitions the host state (``zenflow.engine.distributed``).

Rank 0 writes the run directory (config, metrics, summary, the model, checkpoint manifests)
and reports events; every rank writes its own checkpoint shard. Decisions that stop or
branch the loop (a stop signal) are agreed here so no rank waits in a collective alone.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from zenflow.errors import UserInputError

COLLECTIVE_TIMEOUT_S = 600  # a collective blocked this long fails instead of hanging
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Parallel:
    """This process's rank in the job (rank 0 of 1 when not data parallel)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserInputError(
            f"environment variable {name}={raw!r} is not an integer (torchrun sets it); "
            "start data-parallel runs with `zfctl finetune --nproc N` or torchrun."
        ) from None


def init_parallel(device_kind: str) -> Parallel:
    """Join the process group torchrun described in the environment (if any)."""
    world = _int_env("WORLD_SIZE", 1)
    if world <= 1:
        return Parallel()
    import torch
    import torch.distributed as dist

    rank = _int_env("RANK", 0)
    local_rank = _int_env("LOCAL_RANK", 0)
    local_world = _int_env("LOCAL_WORLD_SIZE", world)
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserInputError(
                f"rank {rank} has LOCAL_RANK {local_rank} but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s): start at most one process per "
                "GPU (--nproc / --nproc-per-node)."
            )
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Parallel(rank, world, local_rank, local_world, backend)


def device_for(kind: str, par: Parallel):
    """The torch device this rank's model lives on for accelerator ``kind``."""
    import torch

    if kind == "cuda":
        return torch.device("cuda", par.local_rank)
    return torch.device("cpu")  # cpu, and sim (a simulated device whose memory is the CPU's)


def _reduce(values: list[float], par: Parallel, op: str) -> list[float]:
    import torch
    import torch.distributed as dist

    dev = "cuda" if par.backend == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def mean_over_ranks(value: float, par: Parallel) -> float:
    """The mean of ``value`` over ranks (each rank's loss -> the global batch's loss)."""
    if not par.enabled:
        return value
    return _reduce([value], par, "sum")[0] / par.world


def any_rank(flag: bool, par: Parallel) -> bool:
    """True on every rank when it is True on any (a stop request)."""
    if not par.enabled:
        return flag
    return _reduce([float(flag)], par, "max")[0] > 0


def broadcast_object(obj, par: Parallel):
    """Rank 0's ``obj`` on every rank (a path, a decision)."""
    if not par.enabled:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(par: Parallel) -> None:
    if par.enabled:
        import torch.distributed as dist

        dist.barrier()


def shutdown(par: Parallel, drain: bool = True) -> None:
    """Leave the process group: ``drain`` after a clean finish (every rank is here), not
    after a failure (``zenflow.engine.distributed.leave_process_group`` says why)."""
    if par.enabled:
        from zenflow.engine.distributed import leave_process_group

        leave_process_group(drain)
