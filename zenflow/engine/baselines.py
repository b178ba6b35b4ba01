"""The two comparison engines, and the full synchronous host step they share with warm-up.

- ``DeviceMode`` is the baseline: the best plain AdamW on the device, torch's fused
  implementation where it has one for that device and dtype, foreach otherwise. With bf16
  weights it is standard mixed precision: fp32 master copies and moments on the device
  (16 bytes per parameter plus the gradient), cast into the bf16 weights after each step.
- ``OffloadMode`` is classic ZeRO-Offload: every step every gradient goes to the host in
  the training dtype (streamed during backward, like ZenFlow's, so the comparison is
  fair), the native CPU AdamW updates the fp32 master, and every weight comes back (2x
  the model's bytes of traffic per step). The training thread waits for all of it: that
  wait is the stall ZenFlow removes.
"""

from __future__ import annotations

import time

import torch

from zenflow.engine.copies import (
    bucket_count,
    chunk_bucket_elems,
    plan_chunks,
)
from zenflow.engine.distributed import grad_norm, norms_of
from zenflow.engine.host import HostState, HostTask, run_host_tasks
from zenflow.engine.transport import Transport


def host_full_step(e, items, hp, coef: float, in_place: bool = False) -> None:
    """One synchronous host AdamW step of whole parameters whose gradients are on the host
    already: ``items`` = [(param, HostState, col_inner, grad_host, image_host or None)].
    The kernel scales the gradient by ``coef`` (the step's clipping) in the same pass and
    writes a bf16 parameter's result into ``image_host``, which goes back to the device;
    an fp32 parameter's master does. All of it is stall. ``in_place``: the gradients are
    autograd's own on a CPU device (zero-copy): counted as device-to-host traffic here, as
    a copy would have been."""
    accel = e.accel
    t0 = time.perf_counter()
    tasks = []
    for param, st, inner, grad, image in items:
        if in_place:
            accel.traffic.d2h_bytes += grad.numel() * grad.element_size()
        if accel.shared_memory and image is None and param.dtype == torch.bfloat16:
            image = param.data if param.data.is_contiguous() else None
        tasks.append(HostTask(st, grad, coef, inner, image))
    run_host_tasks(tasks, e.kernels(), hp.lr, hp, e.host_threads)
    for (param, st, _, _, _), task in zip(items, tasks, strict=True):
        src = task.param_bf16 if task.param_bf16 is not None else st.master
        if src is param.data:  # written in place by the kernel
            accel.traffic.h2d_bytes += src.numel() * src.element_size()
        elif accel.shared_memory:
            param.data.copy_(src)
            accel.traffic.h2d_bytes += param.numel() * param.element_size()
        else:
            accel.compute_wait(accel.copy_h2d(param.data, src))
    e.rec.host_update = bool(items)
    e.rec.stall_s += time.perf_counter() - t0


class OffloadMode:
    """ZeRO-Offload: fp32 master and moments of every parameter on the host (data
    parallel: of the parameters this rank owns; each owner sends its updated weights).

    Gradients stream like ZenFlow's (``zenflow.engine.streaming``): each leaves the device
    as soon as it is final, in contiguous chunks copied straight into a pinned landing
    buffer (the owner's, after an asynchronous reduce with data parallelism), and is freed;
    micro-batches summed on the host go through pinned staging into an fp32 sum. The step
    then waits for every copy (the stall ZenFlow removes), runs the native CPU AdamW with
    the clipping coefficient folded in, and copies every weight back."""

    def __init__(self, engine, masters: dict[str, torch.Tensor]):
        self.e = engine
        accel = engine.accel
        dp = engine.dp
        sizes = [s.param.numel() for s in engine.specs]
        self.owners = dp.owners(sizes) if dp.enabled else [0] * len(sizes)
        self.owner_of = {s.name: o for s, o in zip(engine.specs, self.owners, strict=True)}
        self.zero_copy = accel.shared_memory and not engine.stream_grads
        self.host_gas = engine.gas > 1 and engine.grad_accumulation == "host" and \
            not self.zero_copy  # fmt: skip
        self.states = {}
        self.landing: dict[str, torch.Tensor] = {}
        self.images: dict[str, torch.Tensor | None] = {}
        self.chunks = {}
        pin = engine.pin_link
        bucket = chunk_bucket_elems(sum(sizes), max(sizes, default=1), engine.bucket_request)
        for s, owner in zip(engine.specs, self.owners, strict=True):
            self.chunks[s.name] = plan_chunks(s.param.numel(), bucket)
            if dp.enabled and not dp.owns(owner):
                continue
            p = s.param
            master = accel.host_empty(p.shape, torch.float32, False, "host_state")
            master.copy_(masters[s.name])  # init copy: not a step, not counted
            self.states[s.name] = HostState(
                master,
                accel.host_zeros(p.shape, torch.float32, False, "host_state"),
                accel.host_zeros(p.shape, torch.float32, False, "host_state"),
            )
            if not self.zero_copy:
                land_dtype = torch.float32 if self.host_gas else p.dtype
                self.landing[s.name] = accel.host_empty(
                    (p.numel(),), land_dtype, pin and not self.host_gas, "landing"
                )
                self.images[s.name] = None
                if p.dtype == torch.bfloat16:
                    self.images[s.name] = accel.host_empty(p.shape, p.dtype, pin, "image")
        self.transport = None
        self.staging = {}
        if not self.zero_copy:
            count = bucket_count(engine.copy_buckets, dp.enabled, sum(sizes), bucket)
            self.transport = Transport(engine, bucket, count, engine.kernels())
            if self.host_gas:
                for s in engine.specs:
                    if s.name in self.states:
                        self.staging[s.name] = self.transport.staging(
                            f"chunks:{s.name}", {c: (c[1] - c[0],) for c in self.chunks[s.name]}
                        )
        self.events: list = []
        self.norms: dict[str, torch.Tensor] = {}  # per gradient, summed in parameter order
        self.chunk_sq: list[torch.Tensor] = []
        self.got: set[str] = set()
        self.routed_last: set[str] = set()

    # -- streaming (zenflow.engine.streaming)
    def routes(self, spec) -> bool:
        return not self.zero_copy

    def take_wait(self) -> float:
        return self.transport.take_wait() if self.transport is not None else 0.0

    def plan_step(self) -> None:
        self.events, self.norms, self.chunk_sq = [], {}, []
        self.got, self.routed_last = set(), set()

    def route(self, spec, g: torch.Tensor, n: int, last: bool) -> None:
        dp = self.e.dp
        name = spec.name
        owner = self.owner_of[name]
        if dp.owns(owner) or not dp.enabled:
            self.got.add(name)
        if self.host_gas:
            if last:
                self.routed_last.add(name)
            self.transport.send_whole(
                g, self.chunks[name], owner, sums=self.landing.get(name),
                staging=self.staging.get(name), first=n == 0,
                stat=("sq", name) if last else None,
            )  # fmt: skip
            return
        if not dp.enabled:
            self.norms[name] = grad_norm(g)
        self.transport.send_whole(g, self.chunks[name], owner, landing=self.landing.get(name),
                                  sq_out=self.chunk_sq if dp.enabled else None,
                                  events=self.events)  # fmt: skip

    def collect(self) -> None:
        if self.transport is not None:
            self.transport.complete()

    def norm_terms(self) -> list[torch.Tensor]:
        # in parameter order, so the streamed and the whole-gradient paths sum alike
        norms = [self.norms[s.name] for s in self.e.specs if s.name in self.norms]
        if self.chunk_sq:
            return [*norms, torch.stack(self.chunk_sq).sum().sqrt()]
        return norms

    def host_sq(self) -> float:
        if not self.host_gas:
            return 0.0
        t0 = time.perf_counter()
        out = self.transport.accumulator.squares(
            {name: self.landing[name] for name in self.got - self.routed_last}
        )
        self.e.rec.stall_s += time.perf_counter() - t0
        return out

    def skip_step(self) -> None:
        self._wait()

    def _wait(self) -> None:
        t0 = time.perf_counter()
        for ev in self.events:
            ev.synchronize()
        self.events = []
        if self.host_gas:
            self.transport.accumulator.drain()
        self.e.rec.stall_s += time.perf_counter() - t0

    # -- the whole-gradient data-parallel path (CPU device without streaming)
    def sync_grads(self, dp) -> list[torch.Tensor]:
        """Each parameter's averaged gradient to its owner only (reduce-scatter)."""
        grads = [s.param.grad for s in self.e.specs]
        dp.reduce_mean_to_owners_(list(zip(grads, self.owners, strict=True)))
        return norms_of([g for g, o in zip(grads, self.owners, strict=True) if dp.owns(o)])

    def step(self, t: int, hp, coef: float, coef_t) -> None:
        e = self.e
        if self.zero_copy:
            items = [
                (s.param, self.states[s.name], 1, s.param.grad.detach(), None)
                for s in e.specs
                if s.name in self.states and s.param.grad is not None
            ]
            host_full_step(e, items, hp, 1.0, in_place=True)
        else:
            self._wait()
            items = []
            for s in e.specs:
                if s.name not in self.states:
                    continue
                if s.name in self.got:
                    grad = self.landing[s.name].view(s.param.shape)
                else:  # unused this step: a zero gradient (AdamW still decays and moves)
                    grad = torch.zeros(s.param.shape, dtype=torch.float32)
                items.append((s.param, self.states[s.name], 1, grad, self.images[s.name]))
            host_full_step(e, items, hp, coef)
        dp = e.dp
        if dp.enabled:  # every owner's updated weights to every rank
            for s, owner in zip(e.specs, self.owners, strict=True):
                dp.broadcast_(s.param.data, owner)

    def resolved(self) -> dict:
        if self.zero_copy:
            return {"grad_path": "summed where autograd writes it (CPU device: no copy)"}
        return {"grad_path": ("streamed during backward" if self.e.stream_grads else
                              "at the optimizer step") + ": whole gradients in chunks to "
                "pinned host landing buffers"}  # fmt: skip

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            if self.transport.accumulator.error is not None:
                return self.transport.accumulator.error
        return None


def _chunks(numels: list[int]) -> list[list[int]]:
    """Consecutive parameter indices in groups of at most the largest one's elements."""
    cap, chunks, total = max(numels, default=0), [], 0
    for i, n in enumerate(numels):
        if not chunks or total + n > cap:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks


def _adamw_class(hp):
    return torch.optim.AdamW if hp.adamw_mode else torch.optim.Adam


class DeviceMode:
    """Plain AdamW on the device: fused where torch has it, foreach otherwise."""

    def __init__(self, engine, masters: dict[str, torch.Tensor]):
        self.e = engine
        hp = engine.hp_base
        self.params = [s.param for s in engine.specs]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.mixed:  # fp32 master copies on the device (mixed precision)
            self.masters = []
            for s in engine.specs:
                with engine.accel.device_scope():  # device memory (sim: its pool)
                    master = torch.nn.Parameter(masters[s.name].to(engine.device).clone())
                self.masters.append(engine.accel.track(master, "optimizer"))
        else:
            self.masters = self.params
        self.chunks = _chunks([p.numel() for p in self.params])
        cls = _adamw_class(hp)
        kw = dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        try:
            self.optimizer = cls(self.masters, fused=True, **kw)
            self.impl = "fused"
        except (RuntimeError, ValueError):  # no fused kernel for this device / dtype
            self.optimizer = cls(self.masters, foreach=True, **kw)
            self.impl = "foreach"

    def routes(self, spec) -> bool:
        return False  # the gradients stay on the device: the optimizer is there

    def plan_step(self) -> None:
        return None

    def take_wait(self) -> float:
        return 0.0

    def sync_grads(self, dp) -> list[torch.Tensor]:
        """Every rank updates every parameter: all gradients averaged everywhere."""
        grads = [s.param.grad for s in self.e.specs]
        dp.allreduce_mean_(grads)
        return norms_of(grads) if dp.rank == 0 else []

    def step(self, t: int, hp, coef: float, coef_t) -> None:
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = hp.lr
        if self.mixed:
            self._mixed_step()
        else:
            self.optimizer.step()
        state = sum(
            v.numel() * v.element_size()
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.device == self.e.device
        )
        self.e.accel.set_held("optimizer_state", state)
        self.e.rec.devopt_s += time.perf_counter() - t0

    def _mixed_step(self) -> None:
        """The fused step reads fp32 gradients. They are made one chunk of parameters at a
        time (at most the largest parameter's elements), each half-precision gradient freed
        as soon as it is converted, and the optimizer stepped on that chunk alone (torch
        skips a parameter without a gradient): the step holds one chunk of fp32 gradients
        (4 B x the largest parameter), never a second, fp32 copy of every gradient. Per
        element the same update as one step over all of them."""
        track = self.e.accel.track
        for chunk in self.chunks:
            for i in chunk:
                g = self.params[i].grad
                self.masters[i].grad = None if g is None else track(g.detach().float(), "grads")
                self.params[i].grad = None
                del g
            self.optimizer.step()
            for i in chunk:
                self.masters[i].grad = None
                self.params[i].data.copy_(self.masters[i].data)

    def resolved(self) -> dict:
        return {"device_adamw": f"torch.optim.{type(self.optimizer).__name__} ({self.impl})"}

    def close(self) -> None:
        return None
