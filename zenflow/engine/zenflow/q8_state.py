"""The compact host state (``zfctl.host_state: "compact"``): one ZenFlow weight's
non-selected columns with 8-bit Adam moments.

Per weight, in the compact layout of its non-selected columns (``host_layout``): the fp32
master (pinned where the backend pins), ``exp_avg`` in 8 bits (format "m": sign, 4-bit
exponent, 3-bit mantissa) and ``u = sqrt(exp_avg_sq)`` in 8 bits (format "u": 4-bit
exponent, 4-bit mantissa), each with one fp32 scale per block of 256 elements of the flat
tensor (``zenflow.ops``: ``Q8_BLOCK``; block absmax / the format's largest value), and the
per-column counts. 2 bytes per element for both moments plus 8/256 for the scales, where
the exact state holds 8.

Why these formats: Adam's moments span many orders of magnitude inside a block (a column
that barely moves beside one that moves a lot); a logarithmic code keeps ~2-3 significant
bits at every magnitude where a linear code would flush the small ones to zero. Storing
``sqrt(exp_avg_sq)`` halves the exponent range the "u" code must span. 256 elements per
scale: small enough that a block's absmax tracks its neighbourhood, large enough that the
scales cost 1/64 of a byte per moment (bitsandbytes uses 256 or 2048).

The host step is the native ``adamw_q8_step_`` (dequantise, the exact fp32 AdamW element
arithmetic, requantise, in one pass). Whenever the moments are re-laid (a hand-over, the
first selection) they are dequantised (``v = u * u``), moved as fp32 and quantised again
(``u = sqrt(v)`` correctly rounded), exactly as the reference schedule states it
(``zenflow.engine.reference_schedule``). Must not touch the device state or the window.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from zenflow.engine.host import ColumnSteps
from zenflow.ops import q8_num_blocks
from zenflow.ops.q8_reference import SQRT_CHUNK, sqrt_rounded_

MOMENT_KEYS = ("m_codes", "m_scales", "u_codes", "u_scales")


class Q8HostState:
    """The compact host state of one weight with 8-bit moments (see the module docstring).
    ``kernels``: the ``HostKernels`` whose (de)quantisation it uses; ``accel``: the
    accelerator that accounts its fp32 temporaries (``fp32_array``), if any."""

    def __init__(
        self, master: torch.Tensor, moments: dict, steps: ColumnSteps, kernels, accel=None
    ):
        self.master = master
        self.m_codes = moments["m_codes"]
        self.m_scales = moments["m_scales"]
        self.u_codes = moments["u_codes"]
        self.u_scales = moments["u_scales"]
        self.steps = steps
        self.kernels = kernels
        self.accel = accel

    @classmethod
    def empty(cls, accel, shape, n_cols: int, pin: bool, kernels) -> Q8HostState:
        numel = 1
        for s in shape:
            numel *= s
        blocks = q8_num_blocks(numel)
        moments = {
            "m_codes": accel.host_empty((numel,), torch.uint8, False, "host_state"),
            "m_scales": accel.host_empty((blocks,), torch.float32, False, "host_state"),
            "u_codes": accel.host_empty((numel,), torch.uint8, False, "host_state"),
            "u_scales": accel.host_empty((blocks,), torch.float32, False, "host_state"),
        }
        master = accel.host_empty(shape, torch.float32, pin, "host_state")
        steps = ColumnSteps(accel.host_empty((n_cols,), torch.int64, False, "host_state"), None)
        return cls(master, moments, steps, kernels, accel)

    def moment_tensors(self) -> dict[str, torch.Tensor]:
        """The moments as named tensors (what a checkpoint saves)."""
        return {k: getattr(self, k) for k in MOMENT_KEYS}

    def load_moments(self, saved: dict) -> None:
        for k in MOMENT_KEYS:
            getattr(self, k).copy_(saved[k])

    def zero_moments(self) -> None:
        """Both moments zero (what quantising zeros gives: code 0, scale 0)."""
        for k in MOMENT_KEYS:
            getattr(self, k).zero_()

    def fp32_array(self, shape) -> torch.Tensor:
        """An uninitialised fp32 array for the moments on their way through fp32 (a
        re-layout's, the first selection's), accounted as ``moments_fp32`` by the
        accelerator while it lives, so that the run's host peak counts it."""
        if self.accel is None:
            return torch.empty(shape, dtype=torch.float32)
        return self.accel.host_empty(shape, torch.float32, False, "moments_fp32")

    def fp32_pair(self, shape, scratch: MomentScratch | None = None):
        """Two uninitialised fp32 arrays of ``shape`` for the moments on their way through
        fp32: views of ``scratch``'s arrays while it holds them (a selection's), else
        two new ones (``fp32_array``)."""
        pair = scratch.pair(shape) if scratch is not None else None
        return pair if pair is not None else (self.fp32_array(shape), self.fp32_array(shape))

    def moments_fp32(self, scratch: MomentScratch | None = None):
        """(exp_avg, exp_avg_sq) dequantised, fp32, in the master's shape (``v = u * u``,
        squared in place: two fp32 arrays at the peak, 8 bytes per element), in
        ``scratch``'s arrays where it holds them (``fp32_pair``)."""
        m, v = self.fp32_pair(self.master.shape, scratch)
        with self._on_host():
            self.kernels.dequantize(self.m_codes, self.m_scales, m, fmt="m")
            self.kernels.dequantize(self.u_codes, self.u_scales, v, fmt="u")
        return m, v.mul_(v)

    def set_moments(
        self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, scratch: MomentScratch | None = None
    ) -> None:
        """Quantise fp32 moments (the master's layout) into the codes and scales.
        Consumes ``exp_avg_sq``: its square root is taken in place (``sqrt_rounded_``, a
        chunk at a time, in ``scratch``'s float64 chunk while it holds one), so nothing
        beside the two arrays is allocated."""
        wide = scratch.wide() if scratch is not None else None
        with self._on_host():
            self.kernels.quantize(exp_avg.contiguous(), self.m_codes, self.m_scales, fmt="m")
            u = sqrt_rounded_(exp_avg_sq.contiguous(), buf=wide)  # in place when contiguous
            self.kernels.quantize(u, self.u_codes, self.u_scales, fmt="u")

    def _on_host(self):
        """New tensors in host memory (sim: the heap, not the device pool) inside."""
        return self.accel.host_scope() if self.accel is not None else contextlib.nullcontext()

    def step(self, grad: torch.Tensor, **kw) -> None:
        """One host AdamW step (``adamw_q8_step_``'s keywords)."""
        self.kernels.q8(self.master.view(-1), grad.reshape(-1), self.m_codes, self.m_scales,
                        self.u_codes, self.u_scales, **kw)  # fmt: skip


class MomentScratch:
    """The two fp32 arrays that 8-bit moments pass through at a selection (dequantised,
    merged or gathered, quantised again), one pair for every weight of the selection.

    Each weight used to take two arrays of its own size and give them back. Those came from
    the C heap where smaller than glibc's mmap threshold (up to 32 MiB), and the holes they
    left, of every weight's size, stayed resident: the RSS of a compact run rose by a few
    hundred MB at gpt2-medium's first selection and again at each re-selection
    (docs/BENCHMARKS.md, "The selection's fp32 moments in one pair of arrays"). Here the
    hand-over takes one pair of the largest weight's size for the whole selection
    (``held``), what the estimate already counts (8 bytes per element of the largest
    weight), and each weight uses its front (``pair``); the square root's float64 chunk
    (``set_moments``) is held the same way. A pair is valid until the next ``pair``: the
    hand-over uses one weight's moments at a time. Outside ``held`` there is no pair, and
    callers take arrays of their own."""

    def __init__(self, accel):
        self.accel = accel
        self._arrays: tuple[torch.Tensor, torch.Tensor] | None = None
        self._wide: torch.Tensor | None = None

    @contextlib.contextmanager
    def held(self, numel: int):
        """Hold two fp32 arrays of ``numel`` elements and the square root's float64 chunk
        (``sqrt_rounded_``'s, at most ``SQRT_CHUNK``; all accounted as ``moments_fp32``)
        inside; nothing where ``numel`` is 0 (no 8-bit moments to re-lay)."""
        if numel <= 0 or self._arrays is not None:
            yield
            return
        make = functools.partial(self.accel.host_empty, (numel,), torch.float32, False,
                                 "moments_fp32")  # fmt: skip
        self._arrays = (make(), make())
        self._wide = self.accel.host_empty((min(numel, SQRT_CHUNK),), torch.float64, False,
                                           "moments_fp32")  # fmt: skip
        try:
            yield
        finally:
            self._arrays = self._wide = None

    def wide(self) -> torch.Tensor | None:
        """The held float64 chunk of the square root, or None outside ``held``."""
        return self._wide

    def pair(self, shape) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Two contiguous views of ``shape`` at the front of the held arrays, or None where
        none are held or they are too small."""
        n = math.prod(int(d) for d in shape)
        if self._arrays is None or n > self._arrays[0].numel():
            return None
        return tuple(a[:n].view(tuple(shape)) for a in self._arrays)
