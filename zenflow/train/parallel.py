"""The run's place in a data-parallel job: process group, rank, device, agreement helpers.

A run is data parallel when it was started by ``torch.distributed.run`` (torchrun, or
``zfctl finetune --nproc N`` which starts it): torchrun sets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Then ``init_parallel`` joins the process
group (gloo on cpu and sim, nccl on cuda; collectives time out after
``COLLECTIVE_TIMEOUT_S``), each rank takes its device from LOCAL_RANK (cuda:LOCAL_RANK), and
the engine averages gradients and partitions the host state (``zenflow.engine.distributed``).

Rank 0 writes the run directory (config, metrics, summary, the model, checkpoint manifests)
and reports events; every rank writes its own checkpoint shard. Decisions that stop or
branch the loop (a stop signal, and which signal it was: ``agree_stop``) are agreed here so
no rank waits in a collective alone.

A collective that fails because another rank's process is gone (killed, crashed, or ended
on its own error) is not a bug of this rank: ``peer_lost`` recognises it and the trainer
raises ``RankLost``, a message naming the last complete checkpoint (docs/RELIABILITY.md,
"Data parallelism: stops and crashes").

Must not touch: the engine's collectives (``zenflow.engine.distributed``), the signals
themselves (``zenflow.train.signals``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
from dataclasses import dataclass

from zenflow.errors import UserInputError

COLLECTIVE_TIMEOUT_S = 600  # a collective blocked this long fails instead of hanging
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# A stop, by rank: agreed as the largest, so a SIGTERM on any rank gives every rank the
# exit status 143, as one process's status is 143 when any SIGTERM was among its signals.
STOP_KINDS = (None, "SIGINT", "SIGTERM")
# What a collective's error says when the process at the other end is gone: gloo's
# "Connection closed by peer" / "Connection reset by peer" (torch 2.13), the store's
# refused connection (rank 0 hosts it), NCCL's aborted communicator and remote error.
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)


class RankLost(UserInputError):
    """This rank stops because another rank of the job ended (a collective with it failed):
    the cause is that rank's (the launcher, or torchrun, names it), not this one's."""


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
        with _ctrl_c_ends_the_rendezvous():
            dist.init_process_group(
                backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
            )
    return Parallel(rank, world, local_rank, local_world, backend)


@contextlib.contextmanager
def _ctrl_c_ends_the_rendezvous():
    """SIGINT ends the process at once while it waits for the other ranks to join: that wait
    is in C++ (the store), where Python's KeyboardInterrupt is never raised, so a Ctrl-C
    would otherwise wait for the timeout (10 min) when another rank ended before joining.
    (SIGTERM's default action already ends it.) Before the first step there is nothing to
    save: a single run ends there at once too."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield  # a handler of someone else's, or ignored (a background job): left as it is
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


def agree_stop(requested: str | None, par: Parallel) -> str | None:
    """The stop every rank takes at this step boundary: None, or the signal any rank was
    asked to stop by ("SIGTERM" over "SIGINT", ``STOP_KINDS``)."""
    if not par.enabled:
        return requested
    return STOP_KINDS[round(_reduce([float(STOP_KINDS.index(requested))], par, "max")[0])]


def peer_lost(exc: BaseException | None) -> bool:
    """True when ``exc`` (or what caused it) is a collective that failed because the
    process of another rank is gone."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and any(mark in text for mark in _PEER_GONE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def rank_lost(par: Parallel, recovery: str) -> RankLost:
    """The error of a rank whose peer is gone; ``recovery`` names the last complete
    checkpoint and the command that continues from it."""
    return RankLost(
        f"rank {par.rank} of {par.world}: another rank of this data-parallel job ended "
        "(a collective with it failed), so this rank stops too; the line below (or "
        f"torchrun's report) says which rank and why. "
        + (recovery or "Checkpoints written before are whole (temporary file, then rename).")
    )


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
