"""CPU Adam step throughput: zenflow's native op against torch and DeepSpeed, one process.

Every contender steps its own fp32 tensors (param, grad, exp_avg, exp_avg_sq) of
``--params`` elements. Runs are interleaved round-robin (one step of each contender per
round, ``--repeats`` rounds after one warm-up round) so that drifting machine load hits all
contenders alike; the table reports the median of each.

Contenders: the native op (``zenflow.ops.adamw_step_``), the same op with per-column step
counts (``col_steps``, every column a different count) in both layouts, an nn.Linear-style
``[N/K, K]`` weight (``col_inner=1``, K columns) and a Conv1D-style ``[N/K, K]`` weight whose
columns are dim 0 (``col_inner=K``, N/K columns), with K = ``--columns``,
``torch.optim.AdamW(fused=True)``, ``torch.optim.AdamW(foreach=True)`` and
``deepspeed.ops.adam.DeepSpeedCPUAdam`` (when its JIT build works; the first build takes
70-85 s, a failure is reported with its reason). ``--params`` is rounded down to a multiple
of ``--columns`` so that every contender steps the same number of elements.

Bytes per parameter: an Adam step reads param, grad, exp_avg, exp_avg_sq and writes back
param, exp_avg, exp_avg_sq: 7 x 4 = 28 bytes. The memory floor is measured with an in-place
``a.add_(b)`` over the same number of elements (reads 2, writes 1 back in place: 12 bytes per
element, the same read-then-write-back pattern as Adam, so no write-allocate traffic), and its
bandwidth is extrapolated to 28 bytes per parameter: the time a purely memory-bound Adam
would need.

    python bench/cpu_adam.py [--params N] [--repeats R] [--threads T] [--columns K] [--json]

``--host-state``: the compact host state's step instead, side by side in one run, at 1
thread and at ``--threads``: the exact fp32 kernel, as ``adamw_step_`` over contiguous
compact tensors and as ``adamw_compact_step_`` on the full-shape state (K columns, 90% of
them non-selected), both with fp32 moments, a bf16 gradient and a bf16 image, against
``adamw_q8_step_`` (bf16 gradient, 8-bit block-wise moments, bf16 image). Bytes moved per
stepped element: exact 28 (param read+write 8, bf16 grad 2, exp_avg and exp_avg_sq read+write
16, bf16 image 2); q8 16.06 (param 8, grad 2, m and u codes read+write 4, image 2, one fp32
scale per 256 elements per moment read+write 0.06).

    python bench/cpu_adam.py --host-state [--params N] [--repeats R] [--threads T] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v; 4 bytes each
FLOOR_BYTES_PER_ELEM = 12  # a.add_(b): read a, b; write a
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _param_with_grad(numel: int, seed: int) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    param.grad = torch.randn(numel, generator=gen) * 1e-2
    return param


def make_native(
    numel: int, threads: int, num_cols: int = 0, col_inner: int = 1
) -> Callable[[], None]:
    """The native op; with ``num_cols > 0``, per-column steps, all columns different."""
    from zenflow.ops import adamw_step_, load_native

    load_native()
    param = _param_with_grad(numel, seed=0).detach()
    grad = torch.randn(numel) * 1e-2
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    step = [0]
    beta1, beta2 = HYPER["betas"]
    # Column j is j steps ahead of column 0: num_cols distinct counts in every call.
    col_offsets = torch.arange(num_cols, dtype=torch.int64) if num_cols else None

    def run() -> None:
        step[0] += 1
        columns = {}
        if col_offsets is not None:
            columns = dict(col_steps=col_offsets + step[0], col_inner=col_inner)
        adamw_step_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step[0],
            lr=HYPER["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"],
            num_threads=threads,
            **columns,
        )

    return run


def make_torch(numel: int, **flags) -> Callable[[], None]:
    param = _param_with_grad(numel, seed=1)
    opt = torch.optim.AdamW([param], **HYPER, **flags)
    return opt.step


def make_deepspeed(numel: int) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from zenflow.ops.loader import load_deepspeed_op

    load_deepspeed_op("CPUAdamBuilder")  # guarded JIT build; DeepSpeedCPUAdam reuses it
    param = _param_with_grad(numel, seed=2)
    opt = DeepSpeedCPUAdam([param], adamw_mode=True, **HYPER)
    return opt.step


def make_floor(numel: int) -> Callable[[], None]:
    a, b = torch.randn(numel), torch.randn(numel) * 1e-6
    return lambda: a.add_(b)


# Bytes moved per stepped element (see the module docstring).
HOST_STATE_BYTES = {"exact": 28.0, "q8": 16.0 + 2 * 2 * 4 / 256}


def _bf16_grad(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * 1e-2).bfloat16()


def _host_hyper(settings: dict) -> Callable[[], dict]:
    """The keyword arguments of one host-state step (threads read at call time)."""
    beta1, beta2 = HYPER["betas"]
    fixed = dict(lr=HYPER["lr"], beta1=beta1, beta2=beta2, eps=HYPER["eps"])
    fixed["weight_decay"] = HYPER["weight_decay"]
    return lambda: dict(fixed, num_threads=settings["threads"])


def _exact_contender(numel: int, gen: torch.Generator, hyper) -> Callable[[], None]:
    from zenflow.ops import adamw_step_

    p, g = torch.randn(numel, generator=gen), _bf16_grad(gen, numel)
    m, v, image = torch.zeros(numel), torch.zeros(numel), torch.empty(numel, dtype=torch.bfloat16)
    steps = itertools.count(1)
    return lambda: adamw_step_(p, g, m, v, step=next(steps), param_bf16=image, **hyper())


def _compact_contender(numel: int, columns: int, gen: torch.Generator, hyper) -> tuple:
    """(stepped elements, step): a [rows, columns] weight, 90% of its columns non-selected."""
    from zenflow.ops import adamw_compact_step_

    n = max(1, round(columns * 0.9))
    rows = max(1, numel // n)
    param = torch.randn(rows, columns, generator=gen)
    m, v = torch.zeros(rows, columns), torch.zeros(rows, columns)
    index = torch.randperm(columns, generator=gen)[:n].sort().values
    g, image = _bf16_grad(gen, rows, n), torch.empty(rows, n, dtype=torch.bfloat16)
    steps = itertools.count(1)

    def run() -> None:
        adamw_compact_step_(param, g, m, v, index, 1, step=next(steps), image=image, **hyper())

    return rows * n, run


def _q8_contender(numel: int, gen: torch.Generator, hyper) -> Callable[[], None]:
    from zenflow.ops import adamw_q8_step_, q8_num_blocks

    p, g = torch.randn(numel, generator=gen), _bf16_grad(gen, numel)
    m_codes, u_codes = (torch.zeros(numel, dtype=torch.uint8) for _ in range(2))
    m_scales, u_scales = (torch.zeros(q8_num_blocks(numel)) for _ in range(2))
    image = torch.empty(numel, dtype=torch.bfloat16)
    steps = itertools.count(1)
    return lambda: adamw_q8_step_(
        p, g, m_codes, m_scales, u_codes, u_scales, step=next(steps), image=image, **hyper()
    )


def make_host_state(numel: int, columns: int, settings: dict) -> dict[str, tuple]:
    """name -> (stepped elements, bytes per element, step function) of the three host-state
    contenders; ``settings["threads"]`` is read at every call."""
    from zenflow.ops import load_native

    load_native()
    gen = torch.Generator().manual_seed(3)
    hyper = _host_hyper(settings)
    compact_elements, compact = _compact_contender(numel, columns, gen, hyper)
    return {
        "exact adamw_step_": (
            numel,
            HOST_STATE_BYTES["exact"],
            _exact_contender(numel, gen, hyper),
        ),
        "exact adamw_compact_step_": (compact_elements, HOST_STATE_BYTES["exact"], compact),
        "q8 adamw_q8_step_": (numel, HOST_STATE_BYTES["q8"], _q8_contender(numel, gen, hyper)),
    }


def host_state_main(args: argparse.Namespace) -> int:
    """The ``--host-state`` comparison: 1 thread and ``--threads``, interleaved rounds."""
    settings = {"threads": 1}
    contenders = make_host_state(args.params, args.columns, settings)
    rows = []
    for threads in sorted({1, args.threads}):
        settings["threads"] = threads
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for round_ in range(args.repeats + 1):  # round 0 warms up (first touch, JIT build)
            for name, (_, _, fn) in contenders.items():
                elapsed = _time_once(fn)
                if round_:
                    times[name].append(elapsed)
        exact = statistics.median(times["exact adamw_step_"])
        for name, (elements, nbytes, _) in contenders.items():
            median = statistics.median(times[name])
            rows.append({
                "threads": threads, "name": name, "elements": elements, "median_ms": median * 1e3,
                "min_ms": min(times[name]) * 1e3, "elements_per_s": elements / median,
                "bytes_per_element": nbytes, "gb_per_s": elements * nbytes / median / 1e9,
                "speedup_vs_exact": exact / median * elements / contenders["exact adamw_step_"][0],
            })  # fmt: skip
    result = {"params": args.params, "repeats": args.repeats, "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"\nHost-state step, ~{args.params:,} elements, median of {args.repeats} interleaved rounds"
    )
    header = f"{'threads':>7}  {'contender':<27}{'median ms':>10}{'min ms':>9}{'Melem/s':>9}"
    print(header + f"{'B/elem':>8}{'GB/s':>7}{'vs exact':>10}")
    print("-" * (len(header) + 25))
    for row in rows:
        print(
            f"{row['threads']:>7}  {row['name']:<27}{row['median_ms']:10.1f}{row['min_ms']:9.1f}"
            f"{row['elements_per_s'] / 1e6:9.0f}{row['bytes_per_element']:8.2f}"
            f"{row['gb_per_s']:7.1f}{row['speedup_vs_exact']:9.2f}x"
        )
    print("vs exact: elements per second relative to exact adamw_step_ at the same threads")
    return 0


def _time_once(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    return time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="elements per tensor")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median taken)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="threads for every contender"
    )
    parser.add_argument(
        "--columns",
        type=int,
        default=768,
        help="K of the per-column rows: K columns of N/K (col_inner=1), N/K of K (col_inner=K)",
    )
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument(
        "--host-state",
        action="store_true",
        help="the compact host state instead: exact fp32 kernels against adamw_q8_step_",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser.parse_args(argv)


def _ready_contenders(args, numel: int, log) -> tuple[dict, dict]:
    """(name -> step function, name -> why unavailable), each contender warmed up once."""
    cols = args.columns
    contenders: dict[str, Callable[[], None]] = {}
    unavailable: dict[str, str] = {}
    builders: list[tuple[str, Callable[[], Callable[[], None]]]] = [
        ("zenflow native", lambda: make_native(numel, args.threads)),
        ("native col_inner=1", lambda: make_native(numel, args.threads, cols, 1)),
        (
            f"native col_inner={cols}",
            lambda: make_native(numel, args.threads, numel // cols, cols),
        ),
        ("torch AdamW fused", lambda: make_torch(numel, fused=True)),
        ("torch AdamW foreach", lambda: make_torch(numel, foreach=True)),
    ]
    if not args.no_deepspeed:
        builders.append(("DeepSpeedCPUAdam", lambda: make_deepspeed(numel)))
    builders.append(("memory floor", lambda: make_floor(numel)))
    for name, build in builders:
        start = time.perf_counter()
        try:
            fn = build()
            _time_once(fn)  # warm-up: lazy state, JIT builds, first-touch page faults
        except Exception as exc:  # a contender that cannot run is reported, not fatal
            unavailable[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            print(f"{name}: unavailable ({unavailable[name]})", file=log)
            continue
        contenders[name] = fn
        print(f"{name}: ready ({time.perf_counter() - start:.1f} s incl. warm-up)", file=log)
    return contenders, unavailable


def _rows(times: dict[str, list[float]], numel: int) -> list[dict]:
    fused = statistics.median(times["torch AdamW fused"]) if "torch AdamW fused" in times else None
    rows = []
    for name, samples in times.items():
        median = statistics.median(samples)
        if name == "memory floor":
            gbps = numel * FLOOR_BYTES_PER_ELEM / median / 1e9
            median = numel * BYTES_PER_PARAM / (gbps * 1e9)  # memory-bound Adam at that rate
        else:
            gbps = numel * BYTES_PER_PARAM / median / 1e9
        rows.append(
            {
                "name": name,
                "median_ms": median * 1e3,
                "min_ms": min(samples) * 1e3 if name != "memory floor" else None,
                "params_per_s": numel / median,
                "gb_per_s": gbps,
                "vs_fused": fused / median if fused else None,
            }
        )
    return rows


def _print_table(args, numel: int, rows: list[dict], unavailable: dict[str, str]) -> None:
    cols = args.columns
    print(
        f"\nCPU Adam step, {numel:,} fp32 params, {args.threads} threads, "
        f"median of {args.repeats} interleaved rounds ({BYTES_PER_PARAM} bytes/param)"
    )
    header = f"{'contender':<22}{'median ms':>11}{'min ms':>9}{'Mparams/s':>11}{'GB/s':>8}"
    print(header + f"{'vs fused':>10}")
    print("-" * (len(header) + 10))
    for row in rows:
        min_ms = f"{row['min_ms']:9.1f}" if row["min_ms"] is not None else f"{'-':>9}"
        ratio = f"{row['vs_fused']:9.2f}x" if row["vs_fused"] else f"{'-':>10}"
        print(
            f"{row['name']:<22}{row['median_ms']:11.1f}{min_ms}"
            f"{row['params_per_s'] / 1e6:11.0f}{row['gb_per_s']:8.1f}{ratio}"
        )
    print(
        f"native col_inner=*: per-column step counts (col_steps), every column different: "
        f"{cols} columns of {numel // cols} (col_inner=1), {numel // cols} of {cols}"
    )
    print("memory floor: in-place a.add_(b) bandwidth (12 B/elem) applied to 28 B/param")
    for name, reason in unavailable.items():
        print(f"{name}: unavailable: {reason}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.host_state:
        return host_state_main(args)
    torch.set_num_threads(args.threads)
    cols = args.columns
    numel = args.params // cols * cols
    log = sys.stderr if args.json else sys.stdout
    if numel < 1:
        print(f"--params {args.params} is smaller than --columns {cols}", file=sys.stderr)
        return 2
    contenders, unavailable = _ready_contenders(args, numel, log)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            times[name].append(_time_once(fn))
    rows = _rows(times, numel)
    if args.json:
        result = {
            "params": numel,
            "threads": args.threads,
            "repeats": args.repeats,
            "columns": cols,
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rows": rows,
            "unavailable": unavailable,
        }
        print(json.dumps(result, indent=2))
        return 0
    _print_table(args, numel, rows, unavailable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
