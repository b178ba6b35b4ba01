"""Will it fit? The bytes each engine holds for a model, checked before anything is allocated.

``zenflow.hardware.layout`` turns a ``ParamCensus`` (``zenflow.hardware.census``: the trainable
params counted on the meta device, as the engine classifies them) into itemised bytes on the
device and on the host for one engine mode (the formulas, one line per buffer), and
``zenflow.hardware.host_peak`` into the host bytes of each phase of a whole run. Here
``estimate`` checks every mode (ZenFlow in both ``zfctl.host_state``s) against a ``Budget``
(given or detected memory): the device at the peak of a step, the host at the whole run's
peak. ``zenflow.hardware.preflight`` is that check as ``zfctl finetune`` runs it. The layout's
and the census's public names are re-exported, so ``zenflow.hardware.estimate`` is the one
import for callers of the estimate.

Must not hold a formula of its own: every byte comes from ``layout`` and ``host_peak``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zenflow.hardware.census import (
    ArchShape,
    EstimateError,
    ParamCensus,
    census_of,
    preset_names,
    resolve_census,
)
from zenflow.hardware.host_peak import RUNTIME_BYTES, Phase, host_peak, host_phases
from zenflow.hardware.layout import (
    DEVICE_CATEGORIES,
    ENGINE_MODES,
    HOST_CATEGORIES,
    HOST_STATES,
    Item,
    Settings,
    activation_bytes,
    activation_source,
    layout,
    settings_from_config,
)

__all__ = [
    "ArchShape", "Budget", "EngineEstimate", "Estimate", "EstimateError", "HOST_STATES", "Item",
    "ParamCensus", "Settings", "activation_bytes", "activation_source", "census_of", "check",
    "detect_budget", "estimate", "human_bytes", "layout", "parse_size", "preset_names",
    "resolve_census", "settings_from_config",
]  # fmt: skip

# how the host's part of a clipped run is clipped with each step store that drops the
# store's whole pieces (the estimate's sentence)
STORE_CLIPPING = {
    "q8": "each step's host part clipped by its own coefficient, from an 8-bit copy of its pieces",
    "off": "each window's host part clipped by the smallest coefficient of its steps, not "
    "each step's by its own",
}

# Said where the estimate fits a ZenFlow run by another zfctl.step_store (``fallbacks``)
STORE_FITTED = {
    "off": "The step store does not fit beside it: without clipping zfctl finetune runs "
    'zfctl.step_store as "off" (the same weights; the backward may wait for the host\'s adds).',
    "q8": "The step store does not fit beside it: zfctl finetune runs zfctl.step_store as "
    f'"q8" ({STORE_CLIPPING["q8"]}; within the copies\' rounding of per-step clipping, more '
    "host work; --set zfctl.step_store=on refuses instead).",
}

ENGINE_TITLES = {
    "device": "plain AdamW on the device",
    "offload": "ZeRO-Offload: optimizer on the host",
    "zenflow": "ZenFlow: selected columns on the device, the rest on the host",
    "lora": "LoRA: the base frozen, adapters and head trained with AdamW on the device",
}


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


def human_bytes(n: int | float) -> str:
    """Binary units, 3 significant figures: "12.3 GiB", "512 MiB", "40 KiB", "0 B"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


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
        host_source = "this machine's MemAvailable; --host-mem plans for another"
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
    host_state: str | None = None  # ZenFlow's zfctl.host_state; None for the other engines
    phases: tuple[Phase, ...] = ()  # the host bytes of each phase of a run
    runtime_bytes: int = RUNTIME_BYTES
    # ZenFlow's zfctl.return_image as checked ("never" where the early phase's images do not
    # fit: ``check``); None for the other engines
    return_image: str | None = None
    # ZenFlow's zfctl.step_store as checked: the run's, or where it fits only without the
    # store, "off" (no clipping, "on" or "auto") or "q8" (clipping, "auto"): ``check``;
    # None for the other engines
    step_store: str | None = None

    @property
    def fits(self) -> bool:
        return not self.short

    @property
    def settings_said(self) -> str:
        """ZenFlow's host state, and the step store where it is not the store ("q8", "off":
        set, or what "auto" was checked with)."""
        said = f"zfctl.host_state {self.host_state}"
        if self.step_store in ("q8", "off"):
            said += f", zfctl.step_store {self.step_store}"
        return said

    def side_bytes(self, side: str) -> int:
        return sum(i.bytes for i in self.items if i.side == side)

    @property
    def device_bytes(self) -> int:
        return self.side_bytes("device")

    @property
    def host_bytes(self) -> int:
        """The host's steady state, between steps (the layout's host items)."""
        return self.side_bytes("host")

    @property
    def host_peak_bytes(self) -> int:
        """The whole run's host peak: its largest phase plus the process's runtime."""
        if not self.phases:
            return self.host_bytes + self.runtime_bytes
        return host_peak(list(self.phases), self.runtime_bytes)[0]

    @property
    def host_peak_phase(self) -> str:
        return host_peak(list(self.phases), self.runtime_bytes)[1] if self.phases else "steps"

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
        title = ENGINE_TITLES[self.mode]
        if self.host_state is not None:
            title += f" ({self.settings_said})"
        return {
            "title": title,
            "mode": self.mode,
            "host_state": self.host_state,
            "return_image": self.return_image,
            "step_store": self.step_store,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "host_peak_phase": self.host_peak_phase,
            "host_phases": {p.name: {"bytes": p.bytes, "terms": p.terms} for p in self.phases},
            "host_runtime_bytes": self.runtime_bytes,
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


def check(
    census: ParamCensus, mode: str, s: Settings, budget: Budget, runtime: int = RUNTIME_BYTES
) -> EngineEstimate:
    """``mode``'s layout and whole-run host phases, checked against the budget: the device at
    the peak of a step, the host at the whole run's peak (with one memory, both together).

    A ZenFlow run that does not fit is checked again with ``fallbacks``, the first that fits
    taken (else the one short by least): ``zfctl.return_image`` "early" as "never", and
    ``zfctl.step_store`` "auto" as "off" without clipping, as "q8" with it
    (``return_image`` and ``step_store`` of the result): ``zfctl finetune`` runs it so."""
    e = _check(census, mode, s, budget, runtime)
    if mode != "zenflow" or e.fits:
        return e
    tried = [e]
    for other in fallbacks(s):
        tried.append(_check(census, mode, other, budget, runtime))
        if tried[-1].fits:
            return tried[-1]
    return min(tried, key=lambda t: sum(t.short.values()))


def fallbacks(s: Settings) -> list[Settings]:
    """ZenFlow's settings that run in less host memory, mildest first: no early-phase return
    images (slower early steps, the same weights); no step store where nothing waits for a
    clipping coefficient ("on" or "auto": the same weights, the backward may wait for the
    host's adds); with clipping and ``zfctl.step_store`` "auto", the store's 8-bit copies
    ("q8": per-step clipping within the copies' rounding, more host work); each with the
    images too. An explicit "on" with clipping is never changed: the estimate and the
    preflight name "q8" as a fix instead."""
    rep = dataclasses.replace
    images = s.return_images(early=True)
    out = [rep(s, return_image="never")] if images else []
    store = "off" if s.store_optional else "q8" if s.store_auto_q8 else None
    if store is not None:
        out.append(rep(s, step_store=store))
        if images:
            out.append(rep(s, return_image="never", step_store=store))
    return out


def _check(census: ParamCensus, mode: str, s: Settings, budget: Budget,
           runtime: int) -> EngineEstimate:  # fmt: skip
    items = layout(census, mode, s)
    phases = tuple(host_phases(census, mode, s, items))
    dev = sum(i.bytes for i in items if i.side == "device")
    host = host_peak(list(phases), runtime)[0]
    # Pinned: the buffers that cross the link, when pin_memory is on and there is a separate
    # device to copy to by DMA (on the CPU there is nothing to pin for).
    pinned = 0
    if s.pin_memory and not budget.device_is_host:
        pinned = sum(i.bytes for i in items if i.side == "host" and i.pinned)
    if budget.device_is_host:  # one memory: both sides must fit the available RAM together
        left = {"memory": budget.host_bytes - dev - host}
    else:
        left = {"device": budget.device_bytes - dev, "host": budget.host_bytes - host}
    short = {k: -v for k, v in left.items() if v < 0}
    spare = {k: v for k, v in left.items() if v >= 0}
    zenflow = mode == "zenflow"
    return EngineEstimate(mode, tuple(items), pinned, short, census.params, spare,
                          s.host_state if zenflow else None, phases, runtime,
                          s.return_image if zenflow else None,
                          s.step_store if zenflow else None)  # fmt: skip


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
            "host_state": s.host_state,
            "host_states": self.host_state_verdict(),
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
            "update_interval": s.update_interval,
            "activations": {
                "bytes": act,
                "formula": formula,
                "is_estimate": True,
                "source": activation_source(c.arch),
            },
            "host_runtime_bytes": RUNTIME_BYTES,
            "warnings": self.warnings(),
        }

    def zenflow_states(self) -> dict[str, EngineEstimate]:
        """ZenFlow in each host state: the configured one (row "zenflow") and the other."""
        out = {}
        for e in self.engines.values():
            if e.mode == "zenflow" and e.host_state is not None:
                out[e.host_state] = e
        return out

    def host_state_verdict(self) -> dict[str, Any]:
        """Which ``zfctl.host_state`` ZenFlow fits with: exact when it fits, else compact
        when that does, each with its headroom or shortfall (host, or device + host on one
        memory), and one sentence saying so."""
        states = self.zenflow_states()
        figures: dict[str, Any] = {}
        for name in HOST_STATES:
            e = states.get(name)
            if e is not None:
                figures[name] = {
                    "fits": e.fits,
                    "host_peak_bytes": e.host_peak_bytes,
                    "spare_bytes": dict(e.spare),
                    "short_bytes": dict(e.short),
                }
        choice = next((n for n in HOST_STATES if n in states and states[n].fits), None)
        sentence = _state_sentence(states, choice)
        if choice is not None and states[choice].return_image != self.settings.return_image:
            sentence += (
                " The early phase's bf16 return images do not fit beside it: zfctl finetune "
                'runs zfctl.return_image as "never" (the same weights, slower early steps).'
            )
        ran = states[choice].step_store if choice is not None else None
        if ran is not None and ran != self.settings.step_store:
            sentence += " " + STORE_FITTED[ran]
        store = self._clipped_store_choice() if choice is None else None
        if store is not None:
            name, setting, e = store
            sentence += (
                f' With zfctl.step_store "{setting}" (--set zfctl.step_store={setting}: '
                f"{STORE_CLIPPING[setting]}) {name} fits: peak "
                f"{human_bytes(e.host_peak_bytes)}, {_margin(e)}."
            )
        # the state that fits with the step store's 8-bit copies or without the store, and
        # which of the two ("q8" first: per-step clipping still)
        figures["store_off_choice"] = None if store is None else store[0]
        figures["store_off_setting"] = None if store is None else store[1]
        return {**figures, "choice": choice, "sentence": sentence}

    def _clipped_store_choice(self) -> tuple[str, str, EngineEstimate] | None:
        """A clipped run that fits in neither host state with its step store: the first
        (state, ``zfctl.step_store``) that fits with the store's 8-bit copies ("q8"), else
        without the store ("off"), each a change of how the host's part is clipped, so
        named, never taken by itself; or None."""
        s = self.settings
        for setting in s.store_fixes:
            probe = dataclasses.replace(s, step_store=setting)
            for name in HOST_STATES:
                e = check(self.census, "zenflow", dataclasses.replace(probe, host_state=name),
                          self.budget)  # fmt: skip
                if e.fits:
                    return name, setting, e
        return None

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


def _margin(e: EngineEstimate) -> str:
    """The margin in words: "with 13.2 GiB of host to spare" or "short by 30.1 GiB of host"."""
    where = {"device": "device", "host": "host", "memory": "RAM"}
    if e.fits:
        side = "memory" if "memory" in e.spare else "host"
        return f"with {human_bytes(e.spare[side])} of {where[side]} to spare"
    return "short by " + " and ".join(f"{human_bytes(v)} of {where[k]}"
                                      for k, v in e.short.items())  # fmt: skip


def _state_sentence(states: dict[str, EngineEstimate], choice: str | None) -> str:
    if not states:
        return ""
    exact, compact = states.get("exact"), states.get("compact")
    peaks = {n: human_bytes(e.host_peak_bytes) for n, e in states.items()}
    if choice == "exact":
        return (f"zenflow fits with zfctl.host_state exact (the default): whole-run host peak "
                f"{peaks['exact']}, {_margin(exact)}.")  # fmt: skip
    if choice == "compact":
        return (
            f'zenflow fits with zfctl.host_state "compact" (8-bit moments, bf16 window sum): '
            f"whole-run host peak {peaks['compact']}, {_margin(compact)}; exact does not fit "
            f"(peak {peaks['exact']}, {_margin(exact)}). Set it with --set "
            'zfctl.host_state=compact or "zfctl": {"host_state": "compact"} in the config.'
        )
    return (
        "zenflow fits in neither host state: "
        + "; ".join(f"{n} peak {peaks[n]}, {_margin(e)}" for n, e in states.items())
        + "."
    )


def estimate(
    census: ParamCensus, settings: Settings, budget: Budget, head: str = "classification"
) -> Estimate:
    """The layout of every engine mode, checked against ``budget``; ZenFlow twice: in the
    configured ``zfctl.host_state`` (row "zenflow") and in the other one."""
    other = "compact" if settings.host_state == "exact" else "exact"
    alt = dataclasses.replace(settings, host_state=other)
    engines = {}
    for m in ENGINE_MODES:
        engines[m] = check(census, m, settings, budget)
        if m == "zenflow":  # the other host state right after it
            engines[f"zenflow ({other})"] = check(census, "zenflow", alt, budget)
    return Estimate(census, settings, budget, engines, head)
