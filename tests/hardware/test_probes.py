"""zenflow.hardware.probes: /proc and /sys parsers on fixture text, and the real probes."""

from __future__ import annotations

from pathlib import Path

from zenflow.hardware import probes as hw

# Two physical cores, two hyper-threads each: processors 0..3, core ids 0, 1, 0, 1.
CPUINFO_2x2 = "\n\n".join(
    f"""processor\t: {i}
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Test CPU @ 2.00GHz
physical id\t: 0
siblings\t: 4
core id\t\t: {i % 2}
cpu cores\t: 2
flags\t\t: fpu sse sse2 avx avx2 fma avx512f amx_tile amx_bf16"""
    for i in range(4)
)

MEMINFO = """MemTotal:       16384000 kB
MemFree:         1000000 kB
MemAvailable:    8192000 kB
Buffers:            1234 kB
"""


def test_parse_cpuinfo_counts_physical_cores_and_flags():
    info = hw.parse_cpuinfo(CPUINFO_2x2)
    assert info["model"] == "Intel(R) Xeon(R) Test CPU @ 2.00GHz"
    assert info["logical"] == 4
    assert info["physical"] == 2
    simd = hw.simd_support(info["flags"])
    assert simd == {"avx2": True, "fma": True, "avx512f": True, "avx512_bf16": False, "amx": True}


def test_parse_cpuinfo_without_core_ids_counts_logical():
    text = "processor\t: 0\nmodel name\t: X\nflags\t: avx2\n\nprocessor\t: 1\nmodel name\t: X\n"
    info = hw.parse_cpuinfo(text)
    assert (info["logical"], info["physical"]) == (2, 2)
    assert hw.simd_support(info["flags"])["avx2"] is True
    assert hw.simd_support(info["flags"])["fma"] is False


def test_parse_meminfo_bytes():
    mem = hw.parse_meminfo(MEMINFO)
    assert mem == {"total_bytes": 16384000 * 1024, "available_bytes": 8192000 * 1024}
    # Old kernels without MemAvailable: fall back to MemFree.
    assert hw.parse_meminfo("MemTotal: 10 kB\nMemFree: 4 kB\n")["available_bytes"] == 4096


def test_sysfs_topology_and_numa(tmp_path):
    cpu_root, node_root = tmp_path / "cpu", tmp_path / "node"
    for i, core in enumerate([0, 1, 0, 1]):
        topo = cpu_root / f"cpu{i}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    (cpu_root / "cpufreq").mkdir()  # not a cpuN directory
    for n in ("node0", "node1"):
        (node_root / n).mkdir(parents=True)
    (node_root / "possible").write_text("0-1\n")
    assert hw.sys_physical_cores(cpu_root) == 2
    assert hw.count_numa_nodes(node_root) == 2
    assert hw.count_numa_nodes(tmp_path / "missing") == 1

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO_2x2)
    probe = hw.probe_cpu(cpuinfo, cpu_root, node_root)
    assert (probe.logical_cores, probe.physical_cores, probe.numa_nodes) == (4, 2, 2)


def test_probe_cpu_on_this_machine():
    probe = hw.probe_cpu()
    assert probe.logical_cores >= 1
    assert 1 <= probe.physical_cores <= probe.logical_cores
    assert 1 <= probe.usable_cores <= probe.logical_cores
    assert probe.simd["avx2"] is True  # every machine of this project has AVX2
    assert probe.numa_nodes >= 1
    assert probe.model != "unknown"


def test_probe_memory_and_accelerator_on_this_machine():
    mem = hw.probe_memory(buffer_mb=8, repeats=2)
    assert 0 < mem.available_bytes <= mem.total_bytes
    assert mem.copy_gbs > 0 and mem.add_gbs > 0
    assert mem.buffer_bytes == 8 * 2**20
    acc = hw.probe_accelerator()
    import torch

    assert acc.kind == ("cuda" if torch.cuda.is_available() else "cpu")
    if acc.kind == "cpu":
        assert acc.memory_bytes is None and acc.h2d_pinned_gbs is None


def test_process_rss_peak_is_the_processs_high_water_mark(tmp_path):
    """What summary.json's process_rss_peak_bytes is: the kernel's peak RSS of the process,
    in bytes; it rises by what the process touches, and getrusage agrees (within the
    kernel's lazily synchronised counters) once the program's own peak is the larger.
    Without /proc it is getrusage's."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from pathlib import Path\n"
        "from zenflow.hardware.probes import process_rss, process_rss_peak\n"
        "before = process_rss_peak()\n"
        "block = bytearray(256 * 2**20)\n"
        "block[::4096] = b'x' * len(block[::4096])\n"
        "after = process_rss_peak()\n"
        "usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "fallback = process_rss_peak(Path('/nonexistent/status'))\n"
        "now = process_rss()\n"
        "assert 256 * 2**20 < now <= process_rss_peak(), now\n"
        "assert process_rss(Path('/nonexistent/status')) is None\n"
        "print(before, after, usage, fallback)\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(code)
    # forked by a shell, not by this test's process: getrusage keeps the peak of the image
    # its program was exec'd from (this pytest process, gigabytes by now); VmHWM does not
    out = subprocess.run(["sh", "-c", f"'{sys.executable}' '{script}'; exit $?"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    before, after, usage, fallback = map(int, out.stdout.split())
    assert after - before >= 250 * 2**20
    assert abs(after - usage) < 2**20 and abs(fallback - usage) < 2**20
    # started straight from this (larger) process, getrusage reports at least its size
    direct = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert direct.returncode == 0, direct.stderr
    before, after, usage, _ = map(int, direct.stdout.split())
    assert after - before >= 250 * 2**20 and usage >= after - 2**20


def test_host_available_is_meminfos_available(tmp_path):
    """What each step line's host_available_bytes is: MemAvailable now, in bytes."""
    f = tmp_path / "meminfo"
    f.write_text(MEMINFO)
    assert hw.host_available(f) == hw.parse_meminfo(MEMINFO)["available_bytes"] > 0
    assert hw.host_available(tmp_path / "missing") is None
    now = hw.host_available()
    total = hw.parse_meminfo(Path("/proc/meminfo").read_text())["total_bytes"]
    assert now is not None and 0 < now <= total
