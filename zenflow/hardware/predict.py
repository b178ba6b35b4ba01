"""Predict a step before running it: each engine's step time for the run's tokens per step,
what bounds it (device compute, the link or the host), and ZenFlow's break-even tokens.

``predict(census, settings, box, host_bw)`` models one optimizer step of every engine from
three rates: a GPU box (``box_of``: a named profile of ``zenflow.engine.accelerator.
profiles``, its datasheet bf16 peak at a stated MFU, its PCIe link and HBM), and the host's
memory bandwidth (``tune-hw`` measures it; ``zfctl estimate --host-bw``). Per step, with T
tokens (micro-batch x sequence x gradient accumulation x ranks), P params, N non-selected
elements, dt the training dtype's bytes, S the update interval:

- compute = 6 P T (x 4/3 recomputing activations) / (peak x MFU), on each rank's T/ranks,
  a third of it forward (a quarter recomputing), the rest backward;
- **device** (plain AdamW): compute + one device AdamW pass (``DEVICE_ADAM_BYTES`` x P / HBM);
- **offload** (ZeRO-Offload): forward, then backward beside the whole gradient going down
  (it streams as backward produces it), then the CPU Adam over everything
  (``offload_host_bytes`` x P / host) and the weights back over the link, serial;
- **zenflow**: forward, then backward (with the device's own update and gathers) beside the
  non-selected share going down (N x dt), the host's work beside the whole step
  (``zenflow_host_bytes`` per non-selected element; without ``overlap_step`` the window's
  CPU Adam, / S per step, runs after the window: added), and once per window the fp32
  master's return (N x 4 / S per step), waited for at the window end: added.

The link's two directions have engines of their own (a GPU's copy engines, the sim's): each
is timed apart, bytes / bandwidth plus one latency per copy (the pieces of a bucket each;
``Box.latency_s``). The sim's profiles stretch the latency by their time dilation, so it
counts there.

ZenFlow's host work does not grow with T, so there is a break-even T where compute equals
it: ``break_even_tokens``. Below it the step is host-bound at any model size.

The byte counts live here, each with its derivation (``HOST_BYTES``). Must not measure
anything (``zenflow.hardware.measure`` and ``profiles.calibrate`` do) nor lay out memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from zenflow.hardware.census import EstimateError, ParamCensus
from zenflow.hardware.layout import Settings
from zenflow.ops import I8_BLOCK

DEFAULT_GPU = "h100-sxm"
DEFAULT_MFU = 0.45  # a realistic share of the bf16 peak for a 1-13B transformer's fwd+bwd
# A desktop's dual-channel DDR5 reads + writes ~60-80 GB/s at best; a server's 8-12
# channels 200-400. `zfctl tune-hw` measures this machine's (its copy figure).
DEFAULT_HOST_BW = 50e9
RECOMPUTE_FACTOR = 4 / 3  # gradient checkpointing: one more forward per backward

# Bytes the device's AdamW moves per element (HBM): read the gradient (dt), read and write
# the fp32 master or weight (8), both fp32 moments (16); bf16 also writes the bf16 weight
# (2): 24 + dt + (2 if bf16) = 28 either way.
DEVICE_ADAM_BYTES = 28

# The host's bytes per non-selected element (ZenFlow), by zfctl.host_state:
HOST_BYTES = {
    # each piece: the DMA writes it into its place in the step store (link dtype), where its
    # add waits for the step's clipping coefficient; the accumulator reads it there (link
    # dtype, zenflow.engine.accumulator.land) and reads + writes the window sum (fp32 4 + 4,
    # bf16 2 + 2), except the window's first add, which only writes it (``overwrite``):
    # per step sum_rmw x (1 - 1 / 2S)
    "sum_rmw": {"exact": 8, "compact": 4},
    # once per window (/S), the CPU Adam: read the window sum (4; bf16 2), read + write the
    # fp32 master (8), the fp32 moments (16) or their 8-bit codes (2 + 2) and two fp32
    # scales per 256 elements (2 x 4 x 2 / 256 = 0.0625): exact 28, compact 14.06
    "adam": {"exact": 28.0, "compact": 14.0625},
    # once per window (/S), the host->device return reads the fp32 master
    "return": {"exact": 4, "compact": 4},
    # micro-batches summed on the host: each piece goes straight into their fp32 sum (read +
    # write 8, no store; the step's first micro-batch writes it only: 4); once per step the
    # sum is folded into the window sum (read 4 + the window sum's part, as sum_rmw)
    "micro_rmw": {"exact": 8, "compact": 8},
    "fold": {"exact": 4, "compact": 4},
}

# zfctl.step_store "q8" with clipping: a piece's 8-bit copy, its int8 code and its share of
# the block's fp32 scale, written by the add that keeps it and read by the correction
Q8_COPY_BYTES = 1 + 4 / I8_BLOCK


def q8_store_bytes(s: Settings) -> float:
    """Per step, what zfctl.step_store "q8" adds to the host's bytes per non-selected
    element (``zenflow.engine.zenflow.step_q8``), with clipping that bites at every step
    (the coefficient differs from its prediction): an upper bound, since where it does not
    bite nothing is corrected and only the copies are written.

    A window of S steps: its first write keeps no copy (its multiplier goes into the next
    add, which reads and writes the sum anyway); each later add writes its piece's copy
    (S - 1) and reads the copy before it for the correction it folds in (S - 2); the last
    step's correction reads the last copy inside the window's CPU Adam as it reads the sum
    (``adamw_step_`` / ``adamw_q8_step_``'s ``corr_*``). At S = 1 the window's only
    correction is its first write's multiplier: a pass over the sum."""
    if not s.store_q8:
        return 0.0
    S = max(1, s.update_interval)
    if S == 1:
        return HOST_BYTES["sum_rmw"][s.host_state]
    return (2 * S - 2) * Q8_COPY_BYTES / S


def window_sum_bytes(state: str, update_interval: int) -> float:
    """Per step, the window sum's bytes: read + write, but only a write at the window's
    first add (``accumulate_``'s ``overwrite``)."""
    return HOST_BYTES["sum_rmw"][state] * (1 - 0.5 / max(1, update_interval))


def zenflow_host_bytes(s: Settings) -> float:
    """Host bytes per non-selected element per optimizer step (ZenFlow, ``s.host_state``)."""
    st, lb, S = s.host_state, s.link_bytes, max(1, s.update_interval)
    window = (HOST_BYTES["adam"][st] + HOST_BYTES["return"][st]) / S
    acc = window_sum_bytes(st, S)
    if s.host_sums:  # DMA write + read, then the fp32 micro-batch sum; one fold per step
        micro = s.gradient_accumulation_steps
        first = HOST_BYTES["micro_rmw"][st] / 2  # the step's first micro-batch: a write
        steps = micro * (2 * lb + HOST_BYTES["micro_rmw"][st]) - first
        return steps + HOST_BYTES["fold"][st] + acc + window
    # store (or the ring where pieces are added as they arrive): DMA write, accumulator read
    return 2 * lb + acc + window + q8_store_bytes(s)


def offload_host_bytes(s: Settings) -> float:
    """Host bytes per param per step (ZeRO-Offload): the DMA writes the gradient (dt), the
    CPU Adam reads it (dt) and reads + writes master and moments (24); the weights go back:
    bf16 writes an image and the DMA reads it (2 + 2), fp32 the DMA reads the master (4).
    Micro-batches summed on the host land and are added in fp32 each (dt + dt + 8)."""
    dt = s.dtype_bytes
    micro = s.gradient_accumulation_steps if s.host_sums else 1
    land = micro * (dt + dt + (8 if s.host_sums else 0))
    return land + 24 + 4


@dataclass(frozen=True)
class Box:
    """A GPU box: its bf16 peak, the share of it a step achieves, its link and HBM."""

    name: str
    title: str
    peak_flops: float
    mfu: float
    link_bytes: float  # host<->device, pinned, per direction
    hbm_bytes: float
    latency_s: float = 2e-6  # per copy on a copy engine

    @property
    def flops(self) -> float:
        return self.peak_flops * self.mfu


def box_of(name: str, mfu: float = DEFAULT_MFU) -> Box:
    """The named GPU profile (``zenflow.engine.accelerator.profiles``) at ``mfu``."""
    from zenflow.engine.accelerator.profiles import PROFILES

    p = PROFILES.get(name)
    if p is None:
        raise EstimateError(f"--gpu {name!r} is not a known GPU: use one of {', '.join(PROFILES)}.")
    if not 0 < mfu <= 1:
        raise EstimateError(f"--mfu {mfu:g} must be in (0, 1], e.g. 0.45.")
    return Box(p.name, p.title, p.peak_flops or p.matmul_flops, mfu, p.link_bytes, p.hbm_bytes,
               p.latency_s)  # fmt: skip


def box_names() -> list[str]:
    from zenflow.engine.accelerator.profiles import PROFILES

    return list(PROFILES)


@dataclass(frozen=True)
class EnginePrediction:
    """One engine's predicted step: its time, what bounds it (the largest of compute, the
    link's two directions together, the host) and the terms in seconds: compute, device
    (its own elementwise work), d2h, h2d, host, window (the host Adam after a window)."""

    row: str
    step_s: float
    bound: str  # "device compute", "link" or "host"
    terms: dict[str, float]
    serial: bool  # the engine's work follows its compute (device, offload) or overlaps it

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "bound": self.bound, "terms_s": dict(self.terms),
                "serial": self.serial}  # fmt: skip


def tokens_per_step(s: Settings) -> int:
    return s.micro_batch * s.seq_len * s.gradient_accumulation_steps * max(1, s.world_size)


def compute_s(census: ParamCensus, s: Settings, box: Box) -> float:
    """Forward + backward of one rank's tokens: 6 P T flops (x 4/3 recomputing) at box.flops."""
    f = RECOMPUTE_FACTOR if s.gradient_checkpointing else 1.0
    return 6 * census.params * tokens_per_step(s) / max(1, s.world_size) * f / box.flops


def forward_share(s: Settings) -> float:
    """The share of compute that is forward: 1/3 (backward is twice the forward), 1/4 when
    backward recomputes the forward."""
    return 0.25 if s.gradient_checkpointing else 1 / 3


def pieces(census: ParamCensus, s: Settings, bucket: int | None = None) -> int:
    """Copies a step's non-selected share takes: each weight's compact block in pieces of at
    most one bucket (the engine's rule, or ``bucket`` elements)."""
    B = max(1, bucket or census.bucket_elements)
    return sum(-(-n // B) for n in census.nonselected(s.topk_ratio) if n)


def predict_engine(census: ParamCensus, mode: str, s: Settings, box: Box, host_bw: float,
                   row: str | None = None) -> EnginePrediction:  # fmt: skip
    """``mode``'s predicted step (``s.host_state`` for ZenFlow)."""
    P, dt = census.params, s.dtype_bytes
    comp = compute_s(census, s, box)
    fwd = comp * forward_share(s)
    micro = s.gradient_accumulation_steps if s.host_sums else 1
    if mode == "device":
        terms = {"compute": comp, "device": DEVICE_ADAM_BYTES * P / box.hbm_bytes}
        return EnginePrediction(row or mode, sum(terms.values()), "device compute", terms, True)
    if mode == "offload":
        B = max(1, census.bucket_elements_all)
        chunks = sum(-(-r * c // B) for r, c in census.zenflow_weights) + census.dense_tensors
        d2h = micro * (P * dt / box.link_bytes + chunks * box.latency_s)
        h2d = P * (2 if s.bf16 else 4) / box.link_bytes + chunks * box.latency_s
        host = offload_host_bytes(s) * P / host_bw
        terms = {"compute": comp, "d2h": d2h, "h2d": h2d, "host": host}
        step = fwd + max(comp - fwd, d2h) + host + h2d
        return EnginePrediction(row or mode, step, _bound(comp, d2h + h2d, host), terms, True)
    if mode != "zenflow":
        raise EstimateError(f"no step-time model for the {mode} engine")
    return _zenflow(census, s, box, host_bw, row or mode, comp, fwd, micro)


def _zenflow(census: ParamCensus, s: Settings, box: Box, host_bw: float, row: str,
             comp: float, fwd: float, micro: int) -> EnginePrediction:  # fmt: skip
    Pd, dt, lb, Si = census.dense_params, s.dtype_bytes, s.link_bytes, max(1, s.update_interval)
    S_sel, _ = census.selected(s.topk_ratio)
    N = census.zenflow_params - S_sel
    n_pieces = pieces(census, s)
    # the device's own work beside compute: AdamW of the selected columns and dense params,
    # the gathers of the pieces (read dt, write lb) and, per window, the return's scatter
    device = (DEVICE_ADAM_BYTES * (S_sel + Pd) + micro * (dt + lb) * N
              + (4 + dt) * N / Si) / box.hbm_bytes  # fmt: skip
    d2h = micro * (N * lb / box.link_bytes + n_pieces * box.latency_s)
    h2d = (N * 4 / box.link_bytes + n_pieces * box.latency_s) / Si
    host = zenflow_host_bytes(s) * N / host_bw
    window = 0.0 if s.overlap_step else HOST_BYTES["adam"][s.host_state] / Si * N / host_bw
    terms = {"compute": comp, "device": device, "d2h": d2h, "h2d": h2d, "host": host - window,
             "window": window}  # fmt: skip
    stream = fwd + max(comp - fwd + device, d2h)  # gradients leave during backward
    step = max(stream, host - window) + h2d + window
    return EnginePrediction(row, step, _bound(comp + device, d2h + h2d, host), terms, False)


def _bound(compute: float, link: float, host: float) -> str:
    parts = {"device compute": compute, "link": link, "host": host}
    return max(parts, key=parts.get)


def break_even_tokens(census: ParamCensus, s: Settings, box: Box, host_bw: float) -> int:
    """Tokens per optimizer step at which ZenFlow's compute equals its host time: fewer and
    the step waits for the host. host_bytes x N / host_bw = 6 P T f / (peak x MFU)."""
    S_sel, _ = census.selected(s.topk_ratio)
    N = census.zenflow_params - S_sel
    host = zenflow_host_bytes(s) * N / host_bw
    f = RECOMPUTE_FACTOR if s.gradient_checkpointing else 1.0
    return int(host * box.flops / (6 * census.params * f) * max(1, s.world_size))


def predict(census: ParamCensus, s: Settings, box: Box, host_bw: float,
            stores: dict[str, str] | None = None) -> dict:  # fmt: skip
    """Every engine's predicted step (rows as the estimate names them: "zenflow" in the run's
    host state, the other state beside it), and ZenFlow's break-even tokens per step for
    this host with ``box`` and with every named GPU: the plain dict the CLI shows.
    ``stores``: each host state's ``zfctl.step_store`` as the memory check took it (the
    estimate's ``fallbacks``: "q8" where only the 8-bit copies fit), else ``s``'s."""
    from dataclasses import replace

    def state(st: str) -> Settings:
        return replace(s, host_state=st, step_store=(stores or {}).get(st, s.step_store))

    other = "compact" if s.host_state == "exact" else "exact"
    rows = {"device": ("device", s), "offload": ("offload", s),
            "zenflow": ("zenflow", state(s.host_state)),
            f"zenflow ({other})": ("zenflow", state(other))}  # fmt: skip
    engines = {row: predict_engine(census, mode, st, box, host_bw, row).to_json()
               for row, (mode, st) in rows.items()}  # fmt: skip
    states = ("exact", "compact")

    def even(b: Box) -> dict[str, int]:
        return {st: break_even_tokens(census, state(st), b, host_bw) for st in states}

    return {
        "tokens_per_step": tokens_per_step(s),
        "gpu": box.name,
        "gpu_title": box.title,
        "peak_tflops": box.peak_flops / 1e12,
        "mfu": box.mfu,
        "link_gbs": box.link_bytes / 1e9,
        "host_bw_gbs": host_bw / 1e9,
        "update_interval": s.update_interval,
        "host_bytes_per_element": {st: zenflow_host_bytes(state(st)) for st in states},
        "engines": engines,
        "break_even_tokens": even(box),
        "break_even_by_gpu": {name: even(box_of(name, box.mfu)) for name in box_names()},
    }
