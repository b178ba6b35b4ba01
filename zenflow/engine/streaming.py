"""Gradients leave the device during backward (``zfctl.stream_grads``).

Each trainable parameter gets a post-accumulate-grad hook (torch calls it once per
backward, after the parameter's gradient for that backward is complete, as torchao's
CPUOffloadOptimizer does). The hook hands the gradient to the engine's mode, which routes
it (ZenFlow: the selected columns into a compact device buffer, the rest in pieces to the
host; offload: all of it to the host) and then frees it, so the device never holds a
whole-model gradient. What a hook did not route (streaming off, a parameter whose hook did
not fire, or micro-batches summed on the device) is routed at ``finish()``, at the start of
the optimizer step, by the same code: the streamed and the whole-gradient paths differ only
in WHEN a gradient is routed.

Micro-batches (``gradient_accumulation_steps`` > 1): with ``grad_accumulation: "host"``
every backward's gradient is routed (the host sums them in fp32); with ``"device"``
autograd sums them in the parameter's gradient and the gradient is routed when its hook
fires for the last micro-batch (the engine counts the backward passes of a step per
parameter).

The hooks also account every gradient's device bytes (the simulated device's peak during
backward) and time the waits inside them (a hook that waits for a free bucket or staging
buffer is the pipeline stalling the backward).
"""

from __future__ import annotations

import weakref

import torch

from zenflow.errors import EngineError


class GradStream:
    """Routes each parameter's gradient as it becomes final; see the module docstring.

    ``mode.routes(spec)``: whether the mode takes this parameter's gradient (ZenFlow keeps
    the always-important parameters' gradients on the device). ``mode.route(spec, grad,
    contribution, last)`` consumes a gradient (which is then freed); ``mode.plan_step()`` is
    called before the first gradient of a step is routed; ``mode.take_wait()`` returns the
    seconds the last route waited. ``streaming`` False keeps every gradient until
    ``finish``.
    """

    def __init__(self, engine, mode, *, streaming: bool, gas: int, on_device_accumulation: bool):
        self.e = engine
        self.mode = mode
        self.streaming = streaming
        self.gas = max(1, int(gas))
        self.device_accumulation = on_device_accumulation
        self.fired: dict[str, int] = {}  # backward passes seen per parameter this step
        self.routed: dict[str, int] = {}  # contributions routed per parameter this step
        self.wait_s = 0.0  # time hooks spent waiting (stall inside backward)
        self.planned = False
        self._tracked: dict[int, weakref.ref] = {}
        self._handles = []
        for spec in engine.specs:
            self._handles.append(
                spec.param.register_post_accumulate_grad_hook(self._hook_for(spec))
            )

    def _hook_for(self, spec):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(spec, param)

        return hook

    def _account(self, grad: torch.Tensor) -> None:
        """Account a gradient's device bytes once per tensor (autograd may sum into it)."""
        ref = self._tracked.get(id(grad))
        if ref is not None and ref() is grad:
            return
        self.e.accel.track(grad, "grads")
        self._tracked[id(grad)] = weakref.ref(grad)

    def _on_grad(self, spec, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        self._account(grad)
        count = self.fired.get(spec.name, 0) + 1
        self.fired[spec.name] = count
        if not self.streaming or not self.mode.routes(spec):
            return
        if self.device_accumulation and count < self.gas:
            return  # autograd sums the micro-batches in the gradient; routed at the last
        self._route(spec, grad, last=count >= self.gas)

    def _route(self, spec, grad: torch.Tensor, last: bool) -> None:
        if not self.planned:
            self.mode.plan_step()
            self.planned = True
        n = self.routed.get(spec.name, 0)
        single = self.gas == 1 or self.device_accumulation
        if n and single:
            raise EngineError(
                f"The gradient of {spec.name} became final twice in one step (a second "
                "backward through it before the optimizer step, or re-entrant activation "
                "checkpointing, which runs an inner backward). Use non-re-entrant "
                "checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False}; "
                "zfctl does), or set zfctl.stream_grads to false."
            )
        self.mode.route(spec, grad.detach(), n, last)
        self.wait_s += self.mode.take_wait()
        spec.param.grad = None
        self.routed[spec.name] = n + 1

    def finish(self) -> None:
        """Route what is still on the device (start of the optimizer step)."""
        for spec in self.e.specs:
            grad = spec.param.grad
            if grad is None or not self.mode.routes(spec):
                continue
            if self.streaming and not self.device_accumulation and self.routed.get(spec.name):
                # streamed already; a gradient left here was re-created after its hook ran
                raise EngineError(
                    f"{spec.name} has a gradient the stream did not see: a gradient written "
                    "outside backward after its hook ran. Set zfctl.stream_grads to false."
                )
            self._route(spec, grad, last=True)
        if not self.planned:
            self.mode.plan_step()
            self.planned = True

    def reset(self) -> None:
        """Forget the step (after the optimizer step, or when it was abandoned)."""
        self.fired.clear()
        self.routed.clear()
        self.planned = False
        self.wait_s = 0.0

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
