"""Will it fit? The bytes each engine holds for a model, checked before anything is allocated.

``zenflow.hardware.layout`` turns a ``ParamCensus`` (``zenflow.hardware.census``: the trainable
params counted on the meta device, as the engine classifies them) into itemised bytes on the
device and on the host for one engine mode (the formulas, one line per buffer). Here
``estimate`` checks every mode against a ``Budget`` (given or detected memory), and
``preflight`` is that check as ``zfctl finetune`` runs it: a refusal names the shortfall, the
largest holders and the changes that make the run fit. The layout's and the census's public
names are re-exported, so ``zenflow.hardware.estimate`` is the one import for callers.

Must not hold a formula of its own: every byte comes from ``layout``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zenflow.errors import UserInputError
from zenflow.hardware.census import (
    ArchShape,
    EstimateError,
    ParamCensus,
    census_of,
    preset_names,
    resolve_census,
)
from zenflow.hardware.layout import (
    DEVICE_CATEGORIES,
    ENGINE_MODES,
    HOST_CATEGORIES,
    Item,
    Settings,
    activation_bytes,
    layout,
    settings_from_config,
)

__all__ = [
    "ArchShape", "Budget", "EngineEstimate", "Estimate", "EstimateError", "Item", "ParamCensus",
    "Settings", "WillNotFitError", "activation_bytes", "census_of", "detect_budget", "estimate",
    "layout", "parse_size", "preflight", "preset_names", "resolve_census", "settings_from_config",
]  # fmt: skip

ENGINE_TITLES = {
    "device": "plain AdamW on the device",
    "offload": "ZeRO-Offload: optimizer on the host",
    "zenflow": "ZenFlow: selected columns on the device, the rest on the host",
}


class WillNotFitError(UserInputError):
    """The preflight check: the run cannot fit the device or host memory."""


# --------------------------------------------------------------------------- sizes

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
# More memory than any machine holds (1 EiB): a size past it is a typo or a pasted exponent.
MAX_SIZE = 2**60


def parse_size(text: str | int, flag: str = "size") -> int:
    """Bytes from "24GiB", "80GB", "512MiB", "1.5TiB" or a plain number of bytes."""
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise EstimateError(
                f"{flag} {text!r} is not a size; write it like 24GiB, 80GB, 512MiB or a plain "
                "number of bytes (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."
            )
        value = float(m.group(1))
    value *= _UNITS[unit]
    if not value <= MAX_SIZE:  # also inf ("1e400")
        raise EstimateError(
            f"{flag} {text!r} is more memory than any machine has (at most 1 EiB = {MAX_SIZE} "
            "bytes); check the number and its unit, e.g. 24GiB."
        )
    n = int(value)
    if n <= 0:
        raise EstimateError(f"{flag} {text!r} must be more than 0 bytes.")
    return n


# --------------------------------------------------------------------------- the budget


@dataclass(frozen=True)
class Budget:
    """Memory to fit into. ``device_is_host``: no separate accelerator, the "device" side
    lives in host RAM too, so device + host must fit ``host_bytes`` together."""

    device_bytes: int
    host_bytes: int
    device_is_host: bool
    device_source: str
    host_source: str


def detect_budget(device_mem: int | None = None, host_mem: int | None = None) -> Budget:
    """Given sizes win; otherwise CUDA device 0's total memory (or: the device is the CPU)
    and the host's MemAvailable from /proc/meminfo."""
    if host_mem is None:
        from zenflow.hardware.probes import parse_meminfo

        try:
            host_mem = parse_meminfo(Path("/proc/meminfo").read_text())["available_bytes"]
        except OSError:
            host_mem = 0
        if not host_mem:
            raise EstimateError("Cannot read MemAvailable from /proc/meminfo; pass --host-mem.")
        host_source = "MemAvailable"
    else:
        host_source = "--host-mem"
    if device_mem is not None:
        return Budget(device_mem, host_mem, False, "--device-mem", host_source)
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Budget(int(props.total_memory), host_mem, False, f"CUDA 0: {props.name}",
                      host_source)  # fmt: skip
    return Budget(host_mem, host_mem, True, "the device is the CPU (no CUDA)", host_source)


# --------------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class EngineEstimate:
    mode: str
    items: tuple[Item, ...]
    pinned_bytes: int
    short: dict[str, int]  # side ("device", "host" or "memory") -> bytes missing
    params: int
    spare: dict[str, int] = dataclasses.field(default_factory=dict)  # side -> bytes left

    @property
    def fits(self) -> bool:
        return not self.short

    def side_bytes(self, side: str) -> int:
        return sum(i.bytes for i in self.items if i.side == side)

    @property
    def device_bytes(self) -> int:
        return self.side_bytes("device")

    @property
    def host_bytes(self) -> int:
        return self.side_bytes("host")

    @property
    def device_state_bytes(self) -> int:
        """Device bytes without activations: weights, grads, optimizer state, staging."""
        return self.device_bytes - self.holders()["device"]["activations"]

    @property
    def bytes_per_param(self) -> float:
        """Device state bytes per trainable param (16 plain AdamW bf16, ~4 ZeRO-Offload)."""
        return self.device_state_bytes / self.params if self.params else 0.0

    def holders(self) -> dict[str, dict[str, int]]:
        """Bytes per category, per side (the categories the engine accounts)."""
        out = {"device": dict.fromkeys(DEVICE_CATEGORIES, 0),
               "host": dict.fromkeys(HOST_CATEGORIES, 0)}  # fmt: skip
        for i in self.items:
            out[i.side][i.category] += i.bytes
        return out

    def largest_items(self, n: int = 3, side: str | None = None) -> list[Item]:
        pool = [i for i in self.items if side is None or i.side == side]
        return sorted(pool, key=lambda i: -i.bytes)[:n]

    def largest_holders(self, n: int = 3) -> list[tuple[str, str, int]]:
        """The ``n`` largest (side, category, bytes) of ``holders()``."""
        flat = [(side, cat, b) for side, cats in self.holders().items() for cat, b in cats.items()]
        return sorted(flat, key=lambda h: -h[2])[:n]

    def to_json(self) -> dict[str, Any]:
        return {
            "title": ENGINE_TITLES[self.mode],
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "pinned_bytes": self.pinned_bytes,
            "fits": self.fits,
            "short_bytes": dict(self.short),
            "spare_bytes": dict(self.spare),
            "device_state_bytes": self.device_state_bytes,
            "bytes_per_param": self.bytes_per_param,
            "holders": self.holders(),
            "largest_holders": [
                {"side": side, "category": cat, "bytes": b}
                for side, cat, b in self.largest_holders()
            ],
            "items": [_item_json(i) for i in self.items],
        }


def _item_json(i: Item) -> dict[str, Any]:
    return dataclasses.asdict(i)


def check(items: list[Item], s: Settings, budget: Budget, mode: str, params: int):
    """Pinned bytes and shortfall of one engine's items against the budget."""
    dev = sum(i.bytes for i in items if i.side == "device")
    host = sum(i.bytes for i in items if i.side == "host")
    # Pinned: the buffers that cross the link, when pin_memory is on and there is a separate
    # device to copy to by DMA (on the CPU there is nothing to pin for).
    pinned = 0
    if s.pin_memory and not budget.device_is_host:
        pinned = sum(i.bytes for i in items if i.side == "host" and i.pinned)
    short: dict[str, int] = {}
    if budget.device_is_host:  # one memory: both sides must fit the available RAM together
        left = {"memory": budget.host_bytes - dev - host}
    else:
        left = {"device": budget.device_bytes - dev, "host": budget.host_bytes - host}
    short = {k: -v for k, v in left.items() if v < 0}
    spare = {k: v for k, v in left.items() if v >= 0}
    return EngineEstimate(mode, tuple(items), pinned, short, params, spare)


@dataclass(frozen=True)
class Estimate:
    census: ParamCensus
    settings: Settings
    budget: Budget
    engines: dict[str, EngineEstimate]
    head: str = "classification"

    def to_json(self) -> dict[str, Any]:
        c, s, b = self.census, self.settings, self.budget
        S, K = c.selected(s.topk_ratio)
        act, formula = activation_bytes(c.arch, s)
        return {
            "model": c.model,
            "source": c.source,
            "head": self.head,
            "params": c.params,
            "zenflow_params": c.zenflow_params,
            "dense_params": c.dense_params,
            "zenflow_weights": len(c.zenflow_weights),
            "selected_elements": S,
            "selected_columns": K,
            "bucket_elements": c.bucket_elements,
            "engines": {m: e.to_json() for m, e in self.engines.items()},
            "device_mem": b.device_bytes,
            "host_mem": b.host_bytes,
            "device_is_host": b.device_is_host,
            "device_source": b.device_source,
            "host_source": b.host_source,
            "dtype": s.dtype,
            "topk_ratio": s.topk_ratio,
            "overlap_step": s.overlap_step,
            "pin_memory": s.pin_memory,
            "micro_batch": s.micro_batch,
            "seq_len": s.seq_len,
            "stream_grads": s.stream_grads,
            "gradient_accumulation_steps": s.gradient_accumulation_steps,
            "grad_accumulation": s.grad_accumulation,
            "gradient_checkpointing": s.gradient_checkpointing,
            "activations": {"bytes": act, "formula": formula, "is_estimate": True},
            "warnings": self.warnings(),
        }

    def warnings(self) -> list[str]:
        """Settings the run would refuse although the memory fits (the estimate is still
        computed for them): a sequence past the model's positions."""
        positions = self.census.arch.positions if self.census.arch is not None else None
        if positions is not None and self.settings.seq_len > positions:
            return [
                f"--seq-len {self.settings.seq_len} is past the {positions} positions of "
                f"{self.census.model} (n_positions / max_position_embeddings): zfctl finetune "
                f"refuses it; pass --seq-len {positions} or less."
            ]
        return []


def estimate(
    census: ParamCensus, settings: Settings, budget: Budget, head: str = "classification"
) -> Estimate:
    """The layout of every engine mode, checked against ``budget``."""
    engines = {
        m: check(layout(census, m, settings), settings, budget, m, census.params)
        for m in ENGINE_MODES
    }
    return Estimate(census, settings, budget, engines, head)


# --------------------------------------------------------------------------- preflight


def fmt_gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


TOPK_FIXES = (0.05, 0.02, 0.01)  # lower topk_ratio values a refusal may suggest


def _fixes(census: ParamCensus, s: Settings, budget: Budget, mode: str) -> list[str]:
    """Changes (as zfctl finetune flags) that make the run fit, each checked by the layout:
    single changes first (a lower topk_ratio, bf16, a smaller micro-batch, another engine);
    when none suffices alone, the first combination of them that does."""

    def fitting(m: str, st: Settings) -> EngineEstimate | None:
        e = check(layout(census, m, st), st, budget, m, census.params)
        return e if e.fits else None

    def sizes(e: EngineEstimate) -> str:
        return f"device {fmt_gib(e.device_bytes)}, host {fmt_gib(e.host_bytes)}"

    # (flag text, engine mode, settings) for each single change, mildest first.
    changes: list[tuple[str, str, Settings]] = []
    if mode == "zenflow":
        lower = [k for k in TOPK_FIXES if k < s.topk_ratio]
        fit_k = next((k for k in lower if fitting(mode, dataclasses.replace(s, topk_ratio=k))),
                     lower[-1] if lower else None)  # fmt: skip
        if fit_k is not None:
            changes.append((f"--set zero_optimization.zenflow.topk_ratio={fit_k}", mode,
                            dataclasses.replace(s, topk_ratio=fit_k)))  # fmt: skip
    if not s.bf16:
        changes.append(("--set bf16.enabled=true", mode, dataclasses.replace(s, bf16=True)))
    smaller = [mb for mb in (s.micro_batch // 2**i for i in range(1, 12)) if mb >= 1]
    if smaller:
        mb = next((m for m in smaller if fitting(mode, dataclasses.replace(s, micro_batch=m))),
                  1)  # fmt: skip
        changes.append((f"--micro-batch {mb}", mode, dataclasses.replace(s, micro_batch=mb)))
    for other in ("offload", "zenflow") if mode == "device" else ("offload",):
        if other != mode:
            changes.append((f"--engine {other}", other, s))
    singles = [f"{flags} ({sizes(e)})" for flags, m, st in changes if (e := fitting(m, st))]
    if singles:
        return singles
    # None alone: accumulate them (topk, bf16, micro-batch, then the engine) until it fits.
    flags_all: list[str] = []
    m, st = mode, s
    for flags, m_change, st_change in changes:
        flags_all.append(flags)
        m = m_change
        st = dataclasses.replace(
            st, topk_ratio=min(st.topk_ratio, st_change.topk_ratio), bf16=st.bf16 or st_change.bf16,
            micro_batch=min(st.micro_batch, st_change.micro_batch),
        )  # fmt: skip
        if e := fitting(m, st):
            return [f"together: {' '.join(flags_all)} ({sizes(e)})"]
    return []


def refusal_message(result: Estimate, mode: str) -> str:
    """The shortfall of ``mode`` and the fixes that would make it fit."""
    eng, b, c = result.engines[mode], result.budget, result.census
    parts = []
    for side, missing in eng.short.items():
        if side == "memory":
            need, have = eng.device_bytes + eng.host_bytes, b.host_bytes
            where = f"in RAM ({b.device_source}: device and host share it; {b.host_source})"
        elif side == "device":
            need, have = eng.device_bytes, b.device_bytes
            where = f"on the device ({b.device_source})"
        else:
            need, have, where = eng.host_bytes, b.host_bytes, f"on the host ({b.host_source})"
        parts.append(f"needs {fmt_gib(need)} {where} but has {fmt_gib(have)}: short by "
                     f"{fmt_gib(missing)}")  # fmt: skip
    side = "host" if set(eng.short) == {"host"} else "device"
    big = ", ".join(f"{i.what} {fmt_gib(i.bytes)}" for i in eng.largest_items(3, side))
    fixes = _fixes(c, result.settings, b, mode)
    fix = ("Fix: " + "; or ".join(fixes) + "." if fixes else
           "Neither a lower topk_ratio, bf16, a smaller micro-batch nor --engine offload, "
           "alone or together, makes it fit: use a machine with more memory or a smaller "
           "model.")  # fmt: skip
    return (
        f"{c.model} will not fit with the {mode} engine: it "
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
) -> Estimate | None:
    """Refuse a run that cannot fit (``WillNotFitError``: the shortfall and the fix).

    Reads only MODEL's config (meta device): nothing is allocated. A model whose config cannot
    be resolved here returns None: the run then reports that problem with its own message.
    """
    dev = parse_size(device_mem, "--device-mem") if device_mem is not None else None
    hst = parse_size(host_mem, "--host-mem") if host_mem is not None else None
    try:
        census = resolve_census(model, head=head, num_labels=num_labels)
    except EstimateError:
        return None
    s = settings_from_config(config, micro_batch=micro_batch, seq_len=seq_len,
                             gradient_checkpointing=gradient_checkpointing)  # fmt: skip
    if not separate_device:  # the CPU device: bf16 "auto" is off, no streaming
        s = dataclasses.replace(
            s,
            bf16=config is not None and config.bf16 is True,
            stream_grads=False,
            cpu_device=True,
        )
    result = estimate(census, s, detect_budget(dev, hst))
    if mode == "deepspeed":  # DeepSpeed's own ZenFlow or ZeRO-Offload: the same layouts
        mode = "zenflow" if config is not None and config.zenflow is not None else "offload"
    if not result.engines[mode].fits:
        raise WillNotFitError(refusal_message(result, mode))
    return result
