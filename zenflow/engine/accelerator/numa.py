"""NUMA binding: the process's threads on the cores of its GPU's NUMA node.

On a box with more than one NUMA node each GPU hangs off one of them (``nvidia-smi topo -m``'s
"NUMA Affinity"; the kernel's ``/sys/bus/pci/devices/<address>/numa_node``). The host's
work for that GPU (the accumulate, the window's CPU Adam, the DMA's pinned buffers) is
cheapest on that node's cores and memory. Binding every thread of the process to those
cores before the host state is allocated also places that state on the node: Linux puts a
page on the node of the core that first touches it.

``zfctl.numa_binding`` decides (``plan``):
- ``"auto"`` (default): bind when several ranks share the box (``--nproc``): each rank on
  its own GPU's node, as ``torchrun --numa-binding node`` does. One rank stays unbound: on a
  two-socket box binding would halve the cores and memory channels its host kernels have,
  and those bound the step.
- ``"node"``: bind one rank too.
- ``"off"``: never.

A box with one node, a GPU whose node the kernel does not know, or a node none of whose
cores this process may use is left as it is, and the reason is said (``Binding.reason``,
the run header's ``numa_binding``). The engine unbinds at close (``Binding.undo``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

SYS = Path("/sys")
MODES = ("auto", "node", "off")


def parse_cpulist(text: str) -> set[int]:
    """The kernel's cpulist format ("0-3,8,10-11") as a set of CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpulist(cpus) -> str:
    """A set of CPU ids in the kernel's cpulist format (runs as ranges)."""
    runs: list[str] = []
    ids = sorted(cpus)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


def node_cpus(sys_root: Path = SYS) -> dict[int, set[int]]:
    """Each NUMA node's CPUs (``devices/system/node/nodeN/cpulist``); {} when unknown."""
    root = Path(sys_root) / "devices" / "system" / "node"
    nodes: dict[int, set[int]] = {}
    try:
        entries = list(root.iterdir())
    except OSError:
        return nodes
    for d in entries:
        m = re.fullmatch(r"node(\d+)", d.name)
        if m is None:
            continue
        try:
            nodes[int(m.group(1))] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def pci_numa_node(address: str, sys_root: Path = SYS) -> int | None:
    """The NUMA node of the PCI device at ``address`` ("0000:1b:00.0"); None when the
    kernel does not know it (-1, or no such file)."""
    path = Path(sys_root) / "bus" / "pci" / "devices" / address.lower() / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


@dataclass
class Binding:
    """What was decided (``node`` and ``cpus`` when bound) and why, and each thread's
    affinity before it, to undo at close."""

    reason: str
    node: int | None = None
    cpus: frozenset[int] = frozenset()
    before: dict[int, set[int]] = field(default_factory=dict)

    @property
    def bound(self) -> bool:
        return self.node is not None

    def undo(self) -> None:
        """Every thread bound here back to its affinity before (threads gone since: none)."""
        for tid, cpus in self.before.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # the thread has exited
                pass
        self.before = {}


def plan(
    mode: str,
    gpu_node: int | None,
    nodes: dict[int, set[int]],
    allowed: set[int],
    ranks_per_node: int,
) -> Binding:
    """Whether to bind, and where: the rules of ``zfctl.numa_binding`` (module doc)."""
    if mode not in MODES:
        raise ValueError(f"zfctl.numa_binding {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return Binding("off (zfctl.numa_binding)")
    if len(nodes) <= 1:
        return Binding("not bound: one NUMA node")
    if gpu_node is None or gpu_node not in nodes:
        return Binding(f"not bound: the device's NUMA node is unknown ({len(nodes)} nodes)")
    if mode == "auto" and ranks_per_node <= 1:
        return Binding(
            f"not bound: one rank uses all {len(nodes)} NUMA nodes' cores and memory "
            f'(the device is on node {gpu_node}; zfctl.numa_binding "node" binds it)'
        )
    cpus = nodes[gpu_node] & allowed
    if not cpus:
        return Binding(f"not bound: none of NUMA node {gpu_node}'s cores is allowed here")
    return Binding(f"node {gpu_node}: cpus {cpulist(cpus)}", gpu_node, frozenset(cpus))


def thread_ids() -> list[int]:
    """This process's threads (``/proc/self/task``); [0] (the caller) off Linux."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def bind(binding: Binding) -> Binding:
    """Every thread of the process on ``binding.cpus`` (threads started later inherit it
    from the thread that starts them); their affinity before is kept to undo."""
    if not binding.bound:
        return binding
    for tid in thread_ids():
        try:
            before = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, binding.cpus)
        except OSError:  # the thread has exited meanwhile
            continue
        binding.before[tid] = before
    return binding
