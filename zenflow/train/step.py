"""One optimizer step of a run: where it reads its data, its micro-batches (the objective's
forward and loss, backward), the engine's step, and the checks that stop a diverged run.

``DataCursor`` is the run's position in its epoch order; ``StepBoundary`` the consistent
state at a step boundary (what a checkpoint holds). ``OptimizerStep.run`` takes
``gradient_accumulation_steps`` micro-batches and one engine step and returns the step's
``StepStats``; from its first backward on, the step is protected from signals
(``zenflow.train.signals``: its gradient pieces are streaming into the engine's host
state), and ``in_engine_step`` says so to the stop. ``Diverging`` and
``check_finite_params`` are the two ways a run is found diverged
(``zenflow.train.divergence``).

Nothing here writes the run directory or reports events; the trainer does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from dataclasses import dataclass

from zenflow.engine.stats import StepStats
from zenflow.hardware.probes import host_available, process_rss
from zenflow.train.data import batches as data_batches
from zenflow.train.objective import Objective
from zenflow.train.parallel import any_rank, mean_over_ranks
from zenflow.train.signals import StopRequests


class Diverging(Exception):  # noqa: N818 - a stop, not an error
    """Raised in the step loop when the run has diverged (``zenflow.train.divergence``)."""

    def __init__(self, step: int, reason: str):
        super().__init__(reason)
        self.step = step
        self.reason = reason


def check_finite_params(torch, model, par, step: int) -> None:
    """Raise ``Diverging`` when a parameter holds NaN or inf: the weights about to be
    checkpointed or saved are those of a diverged run (one device read; every rank agrees).
    Per-tensor max-norms (NaN and inf carry through a max, and it cannot overflow as a sum
    of squares would): no parameter-sized temporary on the device."""
    params = [p.detach() for p in model.parameters()]
    norms = torch._foreach_norm(params, ord=math.inf) if params else []
    bad = bool(norms) and not bool(torch.stack([n.float() for n in norms]).isfinite().all())
    if any_rank(bad, par):
        raise Diverging(step, "the model's parameters hold NaN or inf values")


class DataCursor:
    """Where a run is in its epoch order: the epoch and the index of its next sample. The
    order is a function of (seed, epoch) only, so a resumed run reads the same batches."""

    def __init__(self, rows, global_micro: int, seed: int, epoch_samples: int, epoch: int,
                 index: int):  # fmt: skip
        self.rows = rows
        self.global_micro = global_micro  # samples of one micro-batch of every rank
        self.seed = seed
        self.epoch_samples = epoch_samples
        self.epoch = epoch
        self.index = index
        self._batches = None  # the epoch's batch iterator, from (epoch, index) on

    def next_batch(self) -> dict:
        """The next global micro-batch (every rank's rows), moving on to the next epoch once
        this one's steps have read their samples."""
        if self.index >= self.epoch_samples:
            self.epoch, self.index, self._batches = self.epoch + 1, 0, None
        if self._batches is None:
            self._batches = data_batches(
                self.rows, self.global_micro, self.seed, self.epoch, self.index
            )
        self.index, batch = next(self._batches)
        return batch

    @property
    def fractional_epoch(self) -> float:
        return self.epoch + self.index / self.epoch_samples


@dataclass(frozen=True)
class StepBoundary:
    """The consistent state at the last step boundary: what a checkpoint holds."""

    step: int
    epoch: int
    index: int
    rng: dict  # checkpointing.rng_state


def out_of_memory(engine, exc: BaseException):
    """The device ran out of memory in forward or backward: the user error it is."""
    out_of_memory = getattr(engine, "out_of_memory", None)
    if out_of_memory is not None:
        return out_of_memory("forward/backward", exc)
    from zenflow.engine.accelerator import OOM_FIX, DeviceOutOfMemory

    return DeviceOutOfMemory(f"device out of memory in forward/backward ({exc}). {OOM_FIX}")


def device_scope(engine):
    """The engine's device work inside: its accelerator's ``device_scope`` (sim: new
    tensors from the simulated device's pool, not the host's heap); a no-op without one."""
    accel = getattr(engine, "accel", None)
    return accel.device_scope() if accel is not None else contextlib.nullcontext()


class OptimizerStep:
    """One optimizer step: ``gas`` micro-batches through the objective's forward and loss
    and the engine's backward, then the engine's step."""

    def __init__(self, engine, forward, objective: Objective, cursor: DataCursor,
                 stops: StopRequests, *, gas: int, micro_batch: int, par, device):  # fmt: skip
        import torch

        self.torch = torch
        self.engine = engine
        self.forward = forward  # the training module (DeepSpeed's engine under --engine deepspeed)
        self.objective = objective
        self.cursor = cursor
        self.stops = stops
        self.gas = gas
        self.par = par
        # this rank's rows of each global micro-batch
        self.rank_rows = slice(par.rank * micro_batch, (par.rank + 1) * micro_batch)
        # Phase timing on the device's timeline (CUDA events; wall clock elsewhere): never a
        # full synchronize, which would drain the engine's copy streams every micro-batch.
        self.accel = accel = getattr(engine, "accel", None)
        self.mark = accel.mark if accel is not None else time.perf_counter
        self.to_device = accel.to_device_input if accel is not None else (
            lambda t, key="": t.to(device))  # fmt: skip
        # where the device's new tensors come from (sim: its device pool, not the heap)
        self.device_scope = functools.partial(device_scope, engine)
        # From the first backward on, the step changes engine state (gradient pieces stream
        # to the host accumulator): it is finished, not interrupted.
        self.in_engine_step = False

    def elapsed_ms(self, a, b) -> float:
        return self.accel.elapsed_ms(a, b) if self.accel is not None else (b - a) * 1e3

    def run(self, step: int, held: contextlib.ExitStack | None = None) -> tuple[StepStats, float]:
        """Optimizer step ``step + 1`` -> (its stats, numbered ``step + 1``, with the loss
        averaged over the ranks and the phase times; its wall milliseconds). The gradients
        are zeroed for the next step. ``held``: the caller's stack, which keeps the step's
        signal protection (from its first backward) until the caller has recorded the step's
        boundary, and then clears ``in_engine_step``; without it both end here."""
        t_step = time.perf_counter()
        marks = []
        losses = []
        with contextlib.ExitStack() as own:
            for i in range(self.gas):
                mark, loss = self._micro_batch(i, step, own if held is None else held)
                marks.append(mark)
                losses.append(loss)
            with self.device_scope():  # the step's device work (host work scopes itself)
                mean_loss = self.torch.stack(losses).mean()
                stats = self.engine.step(mean_loss)
        if held is None:
            self.in_engine_step = False
        # the step's one read waited for backward: the marks are complete
        fwd_ms = sum(self.elapsed_ms(a, b) for a, b, _ in marks)
        bwd_ms = sum(self.elapsed_ms(b, c) for _, b, c in marks)
        self.engine.zero_grad()
        wall_ms = (time.perf_counter() - t_step) * 1e3
        step_loss = stats.loss if stats.loss is not None else float(mean_loss)
        stats = dataclasses.replace(
            stats,
            step=step + 1,
            forward_ms=fwd_ms,
            backward_ms=bwd_ms,
            loss=mean_over_ranks(step_loss, self.par),
            process_rss_bytes=process_rss(),
            host_available_bytes=host_available(),
        )
        return stats, wall_ms

    def _micro_batch(self, i: int, step: int, held: contextlib.ExitStack):
        """Forward and backward of micro-batch ``i`` -> ((marks), its detached loss). The
        first one's backward puts the step under ``held``'s signal protection."""
        batch = self.cursor.next_batch()
        tokens = self.objective.batch_tokens(batch)
        batch = {k: self.to_device(v[self.rank_rows], k) for k, v in batch.items()}
        m0, w0 = self.mark(), time.perf_counter()
        try:
            with self.device_scope():  # the hooks scope their host work themselves
                loss = self.objective.loss(self.forward, batch, tokens, self.engine.autocast)
                m1 = self.mark()
                if i == 0:
                    what = f"step {step + 1}, then checkpoint {step + 1}"
                    held.enter_context(self.stops.protect(what))
                    self.in_engine_step = True
                self.engine.backward(loss / self.gas)
        except self.torch.OutOfMemoryError as exc:
            raise out_of_memory(self.engine, exc) from None
        m2, w2 = self.mark(), time.perf_counter()
        if self.accel is not None:  # the device computed (the overlap figure)
            self.accel.note_compute(w0, w2)
        return (m0, m1, m2), loss.detach()
