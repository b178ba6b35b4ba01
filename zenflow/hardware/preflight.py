"""`zfctl finetune`'s memory check: refuse a run that cannot fit, before anything is loaded.

``preflight(MODEL, ...)`` reads only MODEL's config (the meta device: nothing is allocated)
and checks the run's engine with ``zenflow.hardware.estimate``: the device at the peak of a
step, the host at the whole run's peak (set-up, steps, checkpoints, re-selection, the final
save, the process's runtime). A refusal (``WillNotFitError``, exit 2) names the shortfall,
the largest holders and the changes that make the run fit, each one checked by the same
estimate: ``zfctl.host_state`` compact, another topk_ratio, bf16, a smaller micro-batch, fewer
``zfctl.copy_buckets``, the step store's 8-bit copies (``zfctl.step_store`` q8: with
clipping, each step's host part clipped from an 8-bit copy of its pieces) or no step store
(off: each window's host part clipped by its steps' smallest coefficient), another engine.
A lever the run already uses is never advised.

Must not hold a formula (``zenflow.hardware.layout`` / ``host_peak`` do) nor print anything.
"""

from __future__ import annotations

import dataclasses

from zenflow.errors import UserInputError
from zenflow.hardware.census import EstimateError, ParamCensus, resolve_census
from zenflow.hardware.estimate import (
    Budget,
    EngineEstimate,
    Estimate,
    Settings,
    check,
    detect_budget,
    estimate,
    human_bytes,
    parse_size,
    settings_from_config,
)

TOPK_LOWER = (0.05, 0.02, 0.01)  # lower topk_ratio values a device shortfall may take
TOPK_HIGHER = (0.2, 0.3, 0.5)  # higher ones shrink the host state (1 - k of each weight)
COMPACT_SET = "--set zfctl.host_state=compact"
# the Settings fields a Change may set (a combination applies each one's on top of the last)
CHANGED_FIELDS = ("topk_ratio", "bf16", "micro_batch", "host_state", "copy_buckets",
                  "step_store", "clipping")  # fmt: skip


class WillNotFitError(UserInputError):
    """The preflight check: the run cannot fit the device or host memory."""


@dataclasses.dataclass(frozen=True)
class Change:
    """One change a refusal may advise: its flags, the engine and settings it leads to."""

    flags: str
    mode: str
    settings: Settings
    lever: str  # the lever in words, for "none of ... fits"


def _changes(census: ParamCensus, s: Settings, budget: Budget, mode: str) -> list[Change]:
    """The single changes that apply to this run, mildest first; none that is already set."""

    def fits(m: str, st: Settings) -> bool:
        return check(census, m, st, budget).fits

    out: list[Change] = []
    rep = dataclasses.replace
    if mode == "zenflow" and s.host_state == "exact":
        out.append(Change(COMPACT_SET, mode, rep(s, host_state="compact"),
                          'zfctl.host_state "compact"'))  # fmt: skip
    if mode == "zenflow":
        # a lower k frees the device, a higher one the host (it holds 1 - k of each weight)
        for grid, word in ((TOPK_LOWER, "lower"), (TOPK_HIGHER, "higher")):
            cands = [k for k in grid if (k < s.topk_ratio if word == "lower" else k > s.topk_ratio)]
            k = next((k for k in cands if fits(mode, rep(s, topk_ratio=k))), None)
            if k is not None:
                out.append(Change(f"--set zero_optimization.zenflow.topk_ratio={k}", mode,
                                  rep(s, topk_ratio=k), f"a {word} topk_ratio"))  # fmt: skip
        device_short = bool({"device", "memory"} & set(check(census, mode, s, budget).short))
        if device_short and not any(c.lever.endswith("topk_ratio") for c in out):
            lower = [k for k in TOPK_LOWER if k < s.topk_ratio]
            if lower:  # none fits alone: the lowest still goes into the combination
                k = lower[-1]
                out.append(Change(f"--set zero_optimization.zenflow.topk_ratio={k}", mode,
                                  rep(s, topk_ratio=k), "a lower topk_ratio"))  # fmt: skip
    if not s.bf16:
        out.append(Change("--set bf16.enabled=true", mode, rep(s, bf16=True), "bf16"))
    smaller = [mb for mb in (s.micro_batch // 2**i for i in range(1, 12)) if mb >= 1]
    if smaller:
        mb = next((m for m in smaller if fits(mode, rep(s, micro_batch=m))), 1)
        out.append(Change(f"--micro-batch {mb}", mode, rep(s, micro_batch=mb),
                          "a smaller --micro-batch"))  # fmt: skip
    # the step store's 8-bit copies, or none, with clipping: each changes the host part's
    # clipping arithmetic, a fix to choose (without clipping ``check`` takes the store off
    # itself: the same arithmetic)
    if mode == "zenflow":
        out += _store_changes(s)
    n = copy_bucket_fix(census, mode, s, budget)
    if n is not None:
        out.append(Change(f"--set zfctl.copy_buckets={n}", mode, rep(s, copy_buckets=n),
                          f"fewer zfctl.copy_buckets (now {s.copy_buckets})"))  # fmt: skip
    for other in ("offload", "zenflow") if mode == "device" else ("offload",):
        if other != mode:
            out.append(Change(f"--engine {other}", other, s, f"--engine {other}"))
    return out


def _store_changes(s: Settings) -> list[Change]:
    """With clipping and a step store: its 8-bit copies (``zfctl.step_store`` "q8": each
    step's host part clipped by its own coefficient, from an 8-bit copy of its pieces where
    the coefficient changed), then none ("off": each window's host step scales its sum by
    the smallest clipping coefficient of its steps); with "q8" set, or "auto" (which took
    the copies already where they fit), "off": ``Settings.store_fixes``."""
    lever = {"q8": STORE_Q8_CLIPPED, "off": STORE_OFF_CLIPPED}
    rep = dataclasses.replace
    return [Change(f"--set zfctl.step_store={v}", "zenflow", rep(s, step_store=v), lever[v])
            for v in s.store_fixes]  # fmt: skip


STORE_Q8_CLIPPED = (
    'zfctl.step_store "q8" (each step\'s host part clipped by its own coefficient, from an '
    "8-bit copy of its pieces)"
)
STORE_OFF_CLIPPED = (
    'zfctl.step_store "off" (each window\'s host part clipped by the '
    "smallest coefficient of its steps)"
)


def copy_bucket_fix(census: ParamCensus, mode: str, s: Settings, budget: Budget) -> int | None:
    """The most ``zfctl.copy_buckets`` below the run's own count that fit (the run's count
    does not), or None: the count is "auto", or even the least does not fit."""
    if s.copy_buckets is None or mode not in ("zenflow", "offload"):
        return None
    least = 4 if s.world_size > 1 else 2

    def fits(n: int) -> bool:
        return check(census, mode, dataclasses.replace(s, copy_buckets=n), budget).fits

    if s.copy_buckets <= least or fits(s.copy_buckets) or not fits(least):
        return None
    lo, hi = least, s.copy_buckets - 1  # fits(lo); the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def fixes(census: ParamCensus, s: Settings, budget: Budget, mode: str) -> tuple[list[str], str]:
    """(the changes, as zfctl finetune flags with the sizes they lead to, that make the run
    fit; the levers tried, in words). Single changes first; when none suffices alone, the
    first combination of them that does."""

    def fitting(m: str, st: Settings) -> EngineEstimate | None:
        e = check(census, m, st, budget)
        return e if e.fits else None

    def sizes(e: EngineEstimate) -> str:
        return (f"device {human_bytes(e.device_bytes)}, host peak "
                f"{human_bytes(e.host_peak_bytes)}")  # fmt: skip

    changes = _changes(census, s, budget, mode)
    levers = _words([c.lever for c in changes])
    singles = [f"{c.flags} ({sizes(e)})" for c in changes if (e := fitting(c.mode, c.settings))]
    if singles:
        return singles, levers
    # None alone: accumulate them (in order, the engine last) until it fits.
    flags_all: list[str] = []
    m, st = mode, s
    for c in changes:
        flags_all.append(c.flags)
        m = c.mode
        # each change's own field on top of the ones before it
        changed = {f: getattr(c.settings, f) for f in CHANGED_FIELDS
                   if getattr(c.settings, f) != getattr(s, f)}  # fmt: skip
        st = dataclasses.replace(st, **changed)
        if e := fitting(m, st):
            return [f"together: {' '.join(flags_all)} ({sizes(e)})"], levers
    return [], levers


def _words(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " nor " + items[-1]


def refusal_message(result: Estimate, mode: str) -> str:
    """The shortfall of ``mode`` (ZenFlow: in the run's host state) and the fixes."""
    eng, b, c = result.engines[mode], result.budget, result.census
    parts = []
    for side, missing in eng.short.items():
        if side == "memory":
            need, have = eng.device_bytes + eng.host_peak_bytes, b.host_bytes
            where = f"in RAM ({b.device_source}: device and host share it; {b.host_source})"
        elif side == "device":
            need, have = eng.device_bytes, b.device_bytes
            where = f"on the device ({b.device_source})"
        else:
            need, have = eng.host_peak_bytes, b.host_bytes
            where = (f"on the host over the whole run (peak at {eng.host_peak_phase}, "
                     f"{human_bytes(eng.runtime_bytes)} of it the process's runtime; "
                     f"{b.host_source})")  # fmt: skip
        parts.append(f"needs {human_bytes(need)} {where} but has {human_bytes(have)}: short by "
                     f"{human_bytes(missing)}")  # fmt: skip
    side = "host" if set(eng.short) == {"host"} else "device"
    big = ", ".join(f"{i.what} {human_bytes(i.bytes)}" for i in eng.largest_items(3, side))
    found, levers = fixes(c, result.settings, b, mode)
    fix = ("Fix: " + "; or ".join(found) + "." if found else
           f"Neither {levers}, alone or together, makes it fit: use a machine with more "
           "memory or a smaller model.")  # fmt: skip
    what = f"the {mode} engine"
    if eng.host_state is not None:
        what += f" ({eng.settings_said})"
    return (
        f"{c.model} will not fit with {what}: it "
        + "; it ".join(parts)
        + f". Largest holders: {big}. {fix} `zfctl estimate {c.model}` shows the full layout; "
        "--force skips this check."
    )


def preflight(
    model: str,
    *,
    mode: str,
    config=None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    num_labels: int = 2,
    head: str = "classification",
    device_mem: str | int | None = None,
    host_mem: str | int | None = None,
    gradient_checkpointing: bool = False,
    separate_device: bool = True,
    device_kind: str | None = None,
) -> Estimate | None:
    """Refuse a run that cannot fit (``WillNotFitError``: the shortfall and the fix).

    Reads only MODEL's config (meta device): nothing is allocated. A model whose config cannot
    be resolved here returns None: the run then reports that problem with its own message.
    ``device_kind``: "cuda" (saving copies device tensors to the host), "sim" or "cpu".
    """
    dev = parse_size(device_mem, "--device-mem") if device_mem is not None else None
    hst = parse_size(host_mem, "--host-mem") if host_mem is not None else None
    try:
        census = resolve_census(model, head=head, num_labels=num_labels)
    except EstimateError:
        return None
    s = settings_from_config(config, micro_batch=micro_batch, seq_len=seq_len,
                             gradient_checkpointing=gradient_checkpointing)  # fmt: skip
    s = dataclasses.replace(s, copies_on_save=device_kind in (None, "cuda"))
    if not separate_device:  # the CPU device: bf16 "auto" is off, no streaming
        s = dataclasses.replace(
            s,
            bf16=config is not None and config.bf16 is True,
            stream_grads=False,
            cpu_device=True,
            copies_on_save=False,
        )
    result = estimate(census, s, detect_budget(dev, hst))
    if mode == "deepspeed":  # DeepSpeed's own ZenFlow or ZeRO-Offload: the same layouts
        mode = "zenflow" if config is not None and config.zenflow is not None else "offload"
    if mode in result.engines and not result.engines[mode].fits:
        raise WillNotFitError(refusal_message(result, mode))
    return result
