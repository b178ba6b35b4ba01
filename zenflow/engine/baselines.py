"""The two comparison engines, and the full synchronous host step they share with warm-up.

- ``DeviceMode`` is the baseline: the best plain AdamW on the device, torch's fused
  implementation where it has one for that device and dtype, foreach otherwise. With bf16
  weights it is standard mixed precision: fp32 master copies and moments on the device
  (16 bytes per parameter plus the gradient), cast into the bf16 weights after each step.
- ``OffloadMode`` is classic ZeRO-Offload: every step every gradient goes to the host in
  the training dtype, the native CPU AdamW updates the fp32 master, and every weight comes
  back (2x the model's bytes of traffic per step). The training thread waits for all of it:
  that wait is the stall ZenFlow removes.
"""

from __future__ import annotations

import time

import torch

from zenflow.engine.distributed import sum_of_squares
from zenflow.engine.host import HostState, HostTask, run_host_tasks


def full_host_step(e, items, hp, landing=None, images=None) -> None:
    """One synchronous host AdamW step for ``items`` = [(param, HostState, col_inner)]:
    gradients to the host, the native kernel on the host cores, weights back to the device.
    All of it is stall. ``landing`` / ``images``: persistent host buffers per item (the
    gradient in the training dtype; the bf16 image of the result), else temporaries."""
    accel = e.accel
    t0 = time.perf_counter()
    tasks = []
    events = []
    for i, (param, st, inner) in enumerate(items):
        g = param.grad
        g = torch.zeros_like(param) if g is None else g.detach()
        bf16 = param.dtype == torch.bfloat16
        if accel.shared_memory:
            # The gradient already is host memory: counted as traffic, not copied again; a
            # bf16 weight receives the result straight from the kernel's bf16 output.
            accel.traffic.d2h_bytes += g.numel() * g.element_size()
            grad = g if g.is_contiguous() else g.contiguous()
            image = param.data if bf16 and param.data.is_contiguous() else None
        else:
            grad = landing[i] if landing is not None else accel.host_empty(g.shape, g.dtype)
            events.append(accel.copy_d2h(grad, g))
            image = None
            if bf16:
                image = images[i] if images is not None else accel.host_empty(g.shape, g.dtype)
        tasks.append(HostTask(st, grad, 1.0, inner, image))
    for ev in events:
        ev.synchronize()
    run_host_tasks(tasks, e.kernel(), hp.lr, hp, e.host_threads)
    for (param, st, _), task in zip(items, tasks, strict=True):
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
    parallel: of the parameters this rank owns; each owner sends its updated weights)."""

    def __init__(self, engine, masters: dict[str, torch.Tensor]):
        self.e = engine
        accel = engine.accel
        dp = engine.dp
        sizes = [s.param.numel() for s in engine.specs]
        self.owners = dp.owners(sizes) if dp.enabled else [0] * len(sizes)
        self.items = []
        self.landing = []
        self.images = []
        self.states = {}
        for s, owner in zip(engine.specs, self.owners, strict=True):
            if dp.enabled and not dp.owns(owner):
                continue
            p = s.param
            master = accel.host_empty(p.shape, torch.float32, engine.pin)
            master.copy_(masters[s.name])  # init copy: not a step, not counted
            st = HostState(
                master,
                accel.host_zeros(p.shape, torch.float32, engine.pin),
                accel.host_zeros(p.shape, torch.float32, engine.pin),
            )
            self.items.append((p, st, 1))
            self.states[s.name] = st
            if not accel.shared_memory:
                self.landing.append(accel.host_empty(p.shape, p.dtype, engine.pin))
                if p.dtype == torch.bfloat16:
                    self.images.append(accel.host_empty(p.shape, p.dtype, engine.pin))
                else:
                    self.images.append(None)

    def sync_grads(self, dp) -> float:
        """Each parameter's averaged gradient to its owner only (reduce-scatter)."""
        grads = [s.param.grad for s in self.e.specs]
        dp.reduce_mean_to_owners_(list(zip(grads, self.owners, strict=True)))
        return sum_of_squares([g for g, o in zip(grads, self.owners, strict=True) if dp.owns(o)])

    def step(self, t: int, hp) -> None:
        items = [it for it in self.items if it[0].grad is not None]
        idx = [i for i, it in enumerate(self.items) if it[0].grad is not None]
        landing = [self.landing[i] for i in idx] if self.landing else None
        images = [self.images[i] for i in idx] if self.images else None
        full_host_step(self.e, items, hp, landing, images)
        dp = self.e.dp
        if dp.enabled:  # every owner's updated weights to every rank
            for s, owner in zip(self.e.specs, self.owners, strict=True):
                dp.broadcast_(s.param.data, owner)

    def resolved(self) -> dict:
        return {}

    def close(self) -> None:
        return None


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
                master = torch.nn.Parameter(masters[s.name].to(engine.device).clone())
                self.masters.append(engine.accel.track(master, "optimizer"))
        else:
            self.masters = self.params
        cls = _adamw_class(hp)
        kw = dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        try:
            self.optimizer = cls(self.masters, fused=True, **kw)
            self.impl = "fused"
        except (RuntimeError, ValueError):  # no fused kernel for this device / dtype
            self.optimizer = cls(self.masters, foreach=True, **kw)
            self.impl = "foreach"

    def sync_grads(self, dp) -> float:
        """Every rank updates every parameter: all gradients averaged everywhere."""
        grads = [s.param.grad for s in self.e.specs]
        dp.allreduce_mean_(grads)
        return sum_of_squares(grads) if dp.rank == 0 else 0.0

    def step(self, t: int, hp) -> None:
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = hp.lr
        if self.mixed:
            for m, p in zip(self.masters, self.params, strict=True):
                m.grad = None if p.grad is None else p.grad.detach().float()
        self.optimizer.step()
        if self.mixed:
            for m, p in zip(self.masters, self.params, strict=True):
                m.grad = None
                p.data.copy_(m.data)
        state = sum(
            v.numel() * v.element_size()
            for st in self.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.device == self.e.device
        )
        self.e.accel.set_held("optimizer_state", state)
        self.e.rec.devopt_s += time.perf_counter() - t0

    def resolved(self) -> dict:
        return {"device_adamw": f"torch.optim.{type(self.optimizer).__name__} ({self.impl})"}

    def close(self) -> None:
        return None
