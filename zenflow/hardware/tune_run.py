"""The whole tune-hw run: probe, measure, lay out the memory, choose -> the hw.json dict.

``run_tune(TuneSettings)`` tunes for one device: "cuda" (measured PCIe, the GPU's memory),
"sim" (the simulated accelerator's modelled bandwidth and its reserved-core split, its
tensors in RAM unless ``device_mem`` models a GPU's memory) or "cpu" (the device is the CPU:
said plainly, choices marked CPU-only). It wires the probes (``zenflow.hardware.probes``),
the timed measurements (``zenflow.hardware.measure``) and the memory estimate
(``zenflow.hardware.layout``, via ``zenflow.hardware.topk``) into the pure
``zenflow.hardware.tuning.choose``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from zenflow.errors import UserInputError
from zenflow.hardware import topk as topk_bounds
from zenflow.hardware.measure import (
    OverlapProbe,
    measure_accumulate,
    measure_cpu_adam,
    measure_device_adam,
    measure_engine,
    measure_fwd_bwd,
    measure_overlap,
    resolve_adam,
)
from zenflow.hardware.probe_model import load_probe_model
from zenflow.hardware.probes import probe_accelerator, probe_cpu, probe_memory
from zenflow.hardware.topk import MemoryBudget
from zenflow.hardware.tuning import Choices, TuneInputs, choose, memory_verdict

DEVICES = ("cpu", "sim", "cuda")
CPU_ONLY_NOTE = (
    "CPU-only: the device is the CPU, so 'device' and 'host' are the same memory and the "
    "same cores. Offloading has nothing to win here: there is no device memory to save, "
    "and copies between the two sides cost memory bandwidth, not PCIe. Train with `zfctl "
    "finetune --engine device`, or rehearse a GPU box with `zfctl tune-hw --device sim`. "
    "The choices are still valid ZenFlow settings for this machine (overlap on and off and "
    "the core split were measured, the faster one chosen), marked CPU-only."
)


@dataclass
class TuneSettings:
    model: str = "gpt2"
    micro_batch: int = 8
    seq_len: int = 128
    quick: bool = False
    topk_ratio: float | None = None
    device: str | None = None  # "cpu", "sim" or "cuda"; None: cuda when available, else cpu
    bf16: bool = True  # the run's training dtype (forward+backward, copies, the estimate)
    device_mem: int | None = None  # bytes; None: CUDA's memory, or RAM on cpu and sim
    engine_check: bool = True  # also time real ZenFlowEngine steps each way (not deciding)
    gradient_checkpointing: bool = False  # activations recomputed in backward (transformers')
    # the config's layout settings for topk's memory bound (estimate Settings fields:
    # gradient_accumulation_steps, grad_accumulation, stream_grads, copy_buckets)
    layout: dict = field(default_factory=dict)
    gpu: str = "h100-sxm"  # the GPU profile the step time is predicted for (predict.box_of)
    mfu: float = 0.45  # the share of its bf16 peak a step gets
    progress: Callable[[str], None] | None = field(default=None, repr=False)


SIM_NOTE = (
    "Rehearsal on the simulated device: copies run at its modelled bandwidth and its "
    "compute is this CPU's training share of the cores, so forward+backward and the device "
    "update are far slower than on a GPU and topk_ratio comes out differently there. Rerun "
    "`zfctl tune-hw` on the GPU box for its own figures."
)


def resolve_device(device: str | None, device_mem: int | None = None) -> str:
    """The device to tune for; refuses what cannot work before anything is measured."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in DEVICES:
        raise UserInputError(f"--device {device!r} is not one of {', '.join(DEVICES)}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserInputError(
            f"--device cuda: torch {torch.__version__} sees no CUDA device here. Use --device "
            "sim to rehearse a GPU box on this CPU, or --device cpu."
        )
    if device == "cpu" and device_mem is not None:
        raise UserInputError(
            "--device-mem applies to --device sim or cuda: with --device cpu the device is "
            "the CPU and its memory is the host's RAM. Drop --device-mem, or use --device sim "
            "--device-mem SIZE to rehearse a GPU of that size."
        )
    return device


def memory_budget(device: str, device_mem: int | None, acc, mem) -> MemoryBudget:
    """The memory topk's memory bound fits into: the given or detected device memory, or,
    where the device's tensors live in RAM (cpu; sim without --device-mem), the RAM shared
    by both sides."""
    host = mem.available_bytes
    if device_mem is not None:
        return MemoryBudget(device_mem, host, False, "--device-mem")
    if device == "cuda":  # what is free now: another process may hold part of the GPU
        free = acc.free_bytes if acc.free_bytes is not None else acc.memory_bytes
        return MemoryBudget(int(free), host, False, f"CUDA: {acc.name}, free memory")
    what = "the device is the CPU"
    if device == "sim":
        what = "where the simulated device's tensors live; --device-mem models a GPU"
    return MemoryBudget(host, host, True, f"MemAvailable RAM, {what}")


def link_rates(acc, mem) -> tuple[float, float, str]:
    """(device->host, host->device bytes/s, source in words): PCIe measured with pinned
    buffers on CUDA, the modelled bandwidth on sim, memory copy bandwidth on the CPU (a copy
    of B bytes reads B and writes B: half the probe's read+write figure)."""
    if acc.kind == "cpu":
        rate = mem.copy_gbs * 1e9 / 2
        return rate, rate, f"memory copy {rate / 1e9:.1f} GB/s, the device is the CPU"
    d2h, h2d = acc.d2h_pinned_gbs * 1e9, acc.h2d_pinned_gbs * 1e9
    how = "modelled by the simulated device" if acc.modelled else "PCIe measured, pinned"
    return d2h, h2d, f"d2h {d2h / 1e9:.1f} / h2d {h2d / 1e9:.1f} GB/s, {how}"


def arch_shape(model, num_labels: int = 2):
    """The activation estimate's shape of a transformers classification model, or None."""
    from zenflow.hardware.census import arch_of

    cfg = getattr(model, "config", None)
    return arch_of(cfg, num_labels, False) if cfg is not None else None


def run_tune(settings: TuneSettings) -> dict:
    """Probe, measure and choose; returns the hw.json content (plain JSON-able dict)."""
    run = _TuneRun(settings)
    run.probe()
    run.measure_host()
    run.measure_model()
    run.lay_out()
    run.choose()
    run.cross_check()
    run.predict()
    return run.hw_json()


class _TuneRun:
    """One tune-hw run, step by step; each step keeps what it measured for the next ones
    and for hw.json, and adds its notes in the order they are shown."""

    def __init__(self, settings: TuneSettings) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device, settings.device_mem)
        self.say = settings.progress or (lambda _msg: None)
        self.quick = settings.quick
        # forward+backward and overlap windows; the rest is cheap
        self.repeats = 3 if self.quick else 5
        self.notes: list[str] = []

    def probe(self) -> None:
        """CPU, memory and the device; the training shares of the cores to measure."""
        import torch

        device, quick = self.device, self.quick
        self.say(f"probing CPU, memory and the device ({device})")
        self.load_1min = os.getloadavg()[0]  # before this run adds its own load
        self.cpu = cpu = probe_cpu()
        self.mem = probe_memory(buffer_mb=64 if quick else 256, repeats=5)
        self.acc = probe_accelerator(buffer_mb=64 if quick else 256, repeats=5, kind=device)
        self.cores = cores = max(
            1, min(cpu.usable_cores, torch.get_num_threads() or cpu.usable_cores)
        )
        if device == "cpu":
            self.notes.append(CPU_ONLY_NOTE)
        elif device == "sim":
            self.notes.append(SIM_NOTE)
        if self.load_1min > 0.5:
            self.notes.append(
                f"Other processes were using the CPU (1-minute load {self.load_1min:.1f} on "
                f"{cores} cores) when measuring started: the figures are noisy; rerun on an "
                "idle machine for firm numbers."
            )
        # Training share candidates: half the cores; without --quick also three quarters. On
        # sim a share t is the engine's split for pt_reserved_cores_perc = t / cores (t device
        # threads, cores - t host threads).
        shares = sorted({max(1, cores // 2)} | (set() if quick else {max(1, 3 * cores // 4)}))
        self.shares = [t for t in shares if t < cores] or [cores]
        if device == "cuda":  # the engine's CUDA split: the training thread keeps at most 2
            from zenflow.engine.accelerator.cuda import cuda_core_split

            self.shares = sorted({cuda_core_split(t, cores - t)[0] for t in self.shares})

    def measure_host(self) -> None:
        """The host's CPU Adam on all cores and on each worker share, and (a separate device
        only) its accumulation of the streamed pieces."""
        cores, quick = self.cores, self.quick
        self.say("resolving the native CPU Adam" + ("" if quick else " (builds on first use)"))
        self.adam = adam = resolve_adam(allow_build=not quick)
        if adam[2]:
            self.notes.append(f"CPU Adam measured with the plain PyTorch reference: {adam[2]}.")
        adam_numel = (8 if quick else 16) * 2**20
        self.say(f"measuring CPU Adam ({adam[1]}) on {adam_numel / 2**20:.0f}M params")
        self.adam_all = measure_cpu_adam(adam_numel, cores, 5, adam)
        self.adam_by_threads = {cores: self.adam_all}
        for t in self.shares:
            w = cores - t
            if w >= 1 and w not in self.adam_by_threads:
                self.adam_by_threads[w] = measure_cpu_adam(adam_numel, w, 5, adam)

        # The host's accumulation of the streamed pieces (a separate device only: a CPU device
        # sums where autograd writes), on the cores the worker has beside the training thread
        self.acc_by_threads = {}
        if self.device != "cpu":
            self.say(
                f"measuring the host's gradient accumulation on {adam_numel / 2**20:.0f}M elements"
            )
            for t in self.shares:
                w = cores - t
                if w >= 1 and w not in self.acc_by_threads:
                    self.acc_by_threads[w] = measure_accumulate(adam_numel, w, self.settings.bf16)

    def measure_model(self) -> None:
        """The probe model's forward+backward on all cores and each training share, and the
        device's AdamW with the threads its forward+backward has (sim: each share)."""
        settings, device, cores = self.settings, self.device, self.cores
        self.dtype = "bf16" if settings.bf16 else "fp32"
        mb, seq = settings.micro_batch, settings.seq_len
        self.say(f"building {settings.model} (micro-batch {mb}, seq {seq}, {self.dtype})")
        compute = "cuda" if device == "cuda" else "cpu"  # the simulated device computes on the CPU
        self.pm = pm = load_probe_model(
            settings.model, mb, seq, device=compute, bf16=settings.bf16,
            gradient_checkpointing=settings.gradient_checkpointing,
        )  # fmt: skip
        if "random" in pm.source.lower():
            self.notes.append(
                f"Model {pm.name}: {pm.source}; timings do not depend on the weights."
            )
        self.say("measuring forward+backward")
        self.fb_by_threads = {cores: measure_fwd_bwd(pm, cores, self.repeats)}
        for t in self.shares:
            if t not in self.fb_by_threads:
                self.fb_by_threads[t] = measure_fwd_bwd(pm, t, self.repeats)

        dev_threads = self.shares if device == "sim" else [cores]
        cap = (256 if device == "cuda" else 4 if self.quick else 16) * 2**20
        self.say(f"measuring the device's AdamW (the engine's update at topk 1.0) on {device}")
        self.dev_adam = {t: measure_device_adam(pm, t, 3, cap) for t in dev_threads}

    def lay_out(self) -> None:
        """The zenflow engine's memory at every topk (topk's memory bound), the budget it
        must fit and the link's rates."""
        from zenflow.hardware.census import census_of
        from zenflow.hardware.layout import Settings

        settings, device, pm = self.settings, self.device, self.pm
        self.say("laying out the zenflow engine's memory at topk 0.01..1.00 (zfctl estimate)")
        self.census = census_of(pm.model, name=pm.name, source=pm.source,
                                arch=arch_shape(pm.model))  # fmt: skip
        self.layout_settings = Settings(
            bf16=settings.bf16, overlap_step=True, pin_memory=device == "cuda",
            micro_batch=settings.micro_batch, seq_len=settings.seq_len,
            gradient_checkpointing=settings.gradient_checkpointing,
            copies_on_save=device == "cuda", **settings.layout)  # fmt: skip
        self.table = topk_bounds.memory_table(self.census, self.layout_settings)
        self.budget = memory_budget(device, settings.device_mem, self.acc, self.mem)
        self.d2h, self.h2d, self.link = link_rates(self.acc, self.mem)

    def inputs(self, train: int, overlap: OverlapProbe | None = None) -> TuneInputs:
        """``choose``'s inputs with ``train`` training threads (and a measured window)."""
        cores, device = self.cores, self.device
        worker = cores - train
        return TuneInputs(
            cores=cores,
            params_total=self.census.params,
            params_2d=self.census.zenflow_params,
            fb_all_ms=self.fb_by_threads[cores],
            fb_split_ms=self.fb_by_threads[train],
            train_threads=train,
            adam_rate_worker=self.adam_by_threads[worker if worker >= 1 else cores].params_per_s,
            adam_rate_all=self.adam_all.params_per_s,
            mem_available_bytes=self.mem.available_bytes,
            memlock_bytes=self.mem.memlock_bytes,
            accelerator=device,
            accelerator_memory_bytes=self.budget.device_bytes,
            topk_ratio=self.settings.topk_ratio,
            overlap=overlap,
            memory_table=self.table,
            memory_budget=self.budget,
            device_adam_rate=self.dev_adam[train if device == "sim" else cores].params_per_s,
            dtype_bytes=2 if self.settings.bf16 else 4,
            d2h_bytes_per_s=self.d2h,
            h2d_bytes_per_s=self.h2d,
            link=self.link,
            host_accumulate_rate=(self.acc_by_threads[worker].elements_per_s
                                  if worker in self.acc_by_threads else None),
        )  # fmt: skip

    def choose(self) -> None:
        """The training share with the shortest modelled per-step time, then its window
        measured each way until S and topk stop moving (2 tries with --quick, else 3)."""
        cores, quick = self.cores, self.quick

        def per_step(c: Choices) -> float:
            return min(c.windows["on_ms"], c.windows["off_ms"]) / c.update_interval

        self.train = train = min(self.shares, key=lambda t: per_step(choose(self.inputs(t))))
        self.choices = choices = choose(self.inputs(train))
        self.overlaps: list[OverlapProbe] = []
        if cores >= 2:
            for _ in range(2 if quick else 3):
                s, k = choices.update_interval, choices.topk_ratio
                host_numel = int(self.census.zenflow_params * (1 - k))
                self.say(
                    f"measuring one {s}-step window with overlap on ({train}+{cores - train}) "
                    "and off"
                )
                ov = measure_overlap(
                    self.pm,
                    update_interval=s,
                    train_threads=train,
                    worker_threads=cores - train,
                    all_threads=cores,
                    host_numel=host_numel,
                    adam=self.adam,
                    repeats=2 if quick else 3,
                    off_split=self.device != "cpu",
                )
                self.overlaps.append(ov)
                self.choices = choices = choose(self.inputs(train, ov))
                if (choices.update_interval, choices.topk_ratio) == (s, k):
                    break

    def cross_check(self) -> None:
        """The method in words, and real engine steps each way beside the choice (they do
        not decide; a failure is a note)."""
        choices, device = self.choices, self.device
        method = "components (forward+backward and host Adam, run concurrently on threads)"
        if self.overlaps and not choices.windows["measured"]:
            method += "; window at the final S modelled from the concurrent figures"
        self.engine_runs: list[dict] = []
        if self.cores >= 2 and self.settings.engine_check:
            self.say(f"cross-checking with real engine steps on {device}, overlap on and off")
            try:
                block = choices.zenflow_block()
                self.engine_runs = [
                    measure_engine(self.pm, block, on, accelerator=device) for on in (True, False)
                ]
            except Exception as exc:  # the engine is optional here: say why it was skipped
                self.notes.append(f"Engine cross-check skipped: {type(exc).__name__}: {exc}")
        if self.engine_runs:
            on_ms, off_ms = (r["ms_per_step"] for r in self.engine_runs)
            agree = (on_ms < off_ms) == choices.overlap_step
            method += (
                f"; engine cross-check (not used to decide): overlap on {on_ms:.0f} ms/step, "
                f"off {off_ms:.0f} ms/step, {'agrees' if agree else 'disagrees'}"
            )
        self.method = method

    def predict(self) -> None:
        """The step time of each engine at the chosen settings, for this host's measured
        memory bandwidth and the named GPU (zenflow.hardware.predict)."""
        from zenflow.hardware import predict

        c = self.choices
        block = c.zfctl_block()  # the host state and any step store it chose
        s = dataclasses.replace(self.layout_settings, topk_ratio=c.topk_ratio,
                                update_interval=c.update_interval, overlap_step=c.overlap_step,
                                host_state=block.get("host_state", "exact"),
                                step_store=block.get("step_store",
                                                     self.layout_settings.step_store))  # fmt: skip
        box = predict.box_of(self.settings.gpu, self.settings.mfu)
        self.step_time = predict.predict(self.census, s, box, self.mem.copy_gbs * 1e9)
        self.step_time["host_bw_source"] = "measured"

    def hw_json(self) -> dict:
        """The hw.json document: settings, what was probed and measured, the choices."""
        settings, choices, pm = self.settings, self.choices, self.pm
        return {
            "date": _now(),
            "versions": _versions(),
            "device": self.device,
            "cpu_only": choices.cpu_only,
            "settings": {
                "model": settings.model,
                "micro_batch": settings.micro_batch,
                "seq_len": settings.seq_len,
                "quick": self.quick,
                "device": self.device,
                "bf16": settings.bf16,
                "device_mem": settings.device_mem,
                "gradient_checkpointing": settings.gradient_checkpointing,
                **({"layout": settings.layout} if settings.layout else {}),
            },
            "method": self.method,
            "probes": {
                "load_1min_before": self.load_1min,
                "cpu": dataclasses.asdict(self.cpu),
                "memory": dataclasses.asdict(self.mem),
                "accelerator": dataclasses.asdict(self.acc),
                "link": {
                    "d2h_bytes_per_s": self.d2h,
                    "h2d_bytes_per_s": self.h2d,
                    "source": self.link,
                },  # fmt: skip
                "device_memory": dataclasses.asdict(self.budget),
                "cpu_adam": _by_threads(self.adam_by_threads),
                "device_adam": _by_threads(self.dev_adam),
                "host_accumulate": _by_threads(self.acc_by_threads),
                "model": {
                    "name": pm.name,
                    "source": pm.source,
                    "params_total": pm.params_total,
                    "params_2d": pm.params_2d,
                    "params_zenflow": self.census.zenflow_params,
                    "micro_batch": pm.micro_batch,
                    "seq_len": pm.seq_len,
                    "dtype": self.dtype,
                },
                "fwd_bwd_ms": {str(k): v for k, v in sorted(self.fb_by_threads.items())},
                "overlap": [dataclasses.asdict(o) for o in self.overlaps],
                "engine": self.engine_runs,
            },
            "choices": choices.zenflow_block(),
            "zfctl_choices": choices.zfctl_block(),
            "step_time": self.step_time,
            "reasons": choices.reasons,
            "topk": choices.topk,
            "windows": choices.windows,
            "memory_check": {**choices.memory, "verdict": memory_verdict(choices.memory)},
            "notes": self.notes,
        }


def _by_threads(probes: dict) -> dict:
    """Probe records keyed by their thread count (as a string), in thread order."""
    return {str(k): dataclasses.asdict(v) for k, v in sorted(probes.items())}


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "deepspeed", "zfctl"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out
