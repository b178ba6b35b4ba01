"""NUMA binding (zfctl.numa_binding, zenflow/engine/accelerator/numa.py): the topology read
from sysfs, the rules, the binding of every thread and its undo, and the engine's use of it
(a fake two-node topology: this machine has one node, so no test here binds for real)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import MLP, make_config, mlp_batches, train_engine

from zenflow import ZenFlowEngine
from zenflow.engine.accelerator import numa

TWO_NODES = {0: set(range(0, 8)), 1: set(range(8, 16))}
ALL = set(range(16))


def test_cpulists_parse_and_print():
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("") == set()
    assert numa.cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert numa.cpulist({5}) == "5"
    assert numa.parse_cpulist(numa.cpulist(set(range(0, 64, 2)))) == set(range(0, 64, 2))


def test_the_topology_is_read_from_sysfs(tmp_path):
    for n, cpus in (("node0", "0-7\n"), ("node1", "8-15\n")):
        d = tmp_path / "devices" / "system" / "node" / n
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus)
    (tmp_path / "devices" / "system" / "node" / "possible").write_text("0-1\n")  # not a node
    assert numa.node_cpus(tmp_path) == TWO_NODES
    assert numa.node_cpus(tmp_path / "nothing") == {}
    for address, value in (("0000:1b:00.0", "1\n"), ("0000:3d:00.0", "-1\n")):
        d = tmp_path / "bus" / "pci" / "devices" / address
        d.mkdir(parents=True)
        (d / "numa_node").write_text(value)
    assert numa.pci_numa_node("0000:1B:00.0", tmp_path) == 1  # nvidia-smi prints upper case
    assert numa.pci_numa_node("0000:3d:00.0", tmp_path) is None  # the kernel does not know
    assert numa.pci_numa_node("0000:99:00.0", tmp_path) is None


@pytest.mark.parametrize(
    ("mode", "gpu_node", "nodes", "ranks", "expect"),
    [
        ("off", 1, TWO_NODES, 2, "off"),
        ("auto", 0, {0: ALL}, 2, "one NUMA node"),
        ("node", None, TWO_NODES, 1, "unknown"),
        ("auto", 1, TWO_NODES, 1, "one rank uses all 2 NUMA nodes"),
        ("auto", 1, TWO_NODES, 2, "node 1: cpus 8-15"),
        ("node", 0, TWO_NODES, 1, "node 0: cpus 0-7"),
    ],
)
def test_the_rules(mode, gpu_node, nodes, ranks, expect):
    b = numa.plan(mode, gpu_node, nodes, ALL, ranks)
    assert expect in b.reason
    assert b.bound == expect.startswith("node ")
    if b.bound:
        assert b.cpus == frozenset(nodes[gpu_node]) and b.node == gpu_node


def test_only_allowed_cores_are_bound_and_a_bad_mode_is_refused():
    b = numa.plan("node", 1, TWO_NODES, {6, 7, 8, 9}, 1)
    assert b.cpus == {8, 9} and b.reason == "node 1: cpus 8-9"
    assert not numa.plan("node", 1, TWO_NODES, {0, 1}, 1).bound  # none of node 1's allowed
    with pytest.raises(ValueError, match="numa_binding 'socket'"):
        numa.plan("socket", 1, TWO_NODES, ALL, 2)


def _fake_affinity(monkeypatch, tids=(100, 101, 102)):
    """sched_{get,set}affinity on fake threads: what was set, per thread."""
    state = {tid: set(ALL) for tid in tids}
    monkeypatch.setattr(numa, "thread_ids", lambda: list(tids))
    monkeypatch.setattr(os, "sched_getaffinity", lambda tid: set(state.get(tid, ALL)))

    def setaffinity(tid, cpus):
        state[tid] = set(cpus)

    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    return state


def test_every_thread_is_bound_and_unbound(monkeypatch):
    state = _fake_affinity(monkeypatch)
    b = numa.bind(numa.plan("node", 1, TWO_NODES, ALL, 1))
    assert all(cpus == TWO_NODES[1] for cpus in state.values())
    b.undo()
    assert all(cpus == ALL for cpus in state.values())
    state[100] = {3}
    numa.bind(numa.plan("off", 1, TWO_NODES, ALL, 1)).undo()  # nothing bound, nothing undone
    assert state[100] == {3}


def test_the_engine_binds_before_its_host_state_and_unbinds_at_close(monkeypatch):
    """Two ranks on a two-node box, both devices on node 1: every thread on node 1's cores
    before the core split (which then shares node 1's 8 cores between the two ranks, not
    the box's 16); the run header says so; close() puts every thread back. The training is
    the unbound one's to float rounding (the thread counts differ: torch's reductions may
    split differently)."""
    import zenflow.engine.accelerator.base as accel_mod
    from zenflow.engine.accelerator import SimAccelerator

    def run(binding: str):
        state = _fake_affinity(monkeypatch)
        monkeypatch.setattr(numa, "node_cpus", lambda sys_root=numa.SYS: TWO_NODES)
        monkeypatch.setattr(SimAccelerator, "numa_node", lambda self, index=None: 1)
        # the cores the process may use, as bound
        monkeypatch.setattr(accel_mod, "cores", lambda: len(os.sched_getaffinity(100)))
        cfg = make_config(
            {"update_interval": 2, "overlap_step": True}, zfctl={"numa_binding": binding}
        )
        torch.manual_seed(0)
        model = MLP()
        with ZenFlowEngine(model, cfg, accelerator="sim", ranks_per_node=2) as e:
            during = {tid: set(c) for tid, c in state.items()}
            train_engine(e, model, mlp_batches(4))
            e.impl.drain()
            params = [p.detach().clone() for p in model.parameters()]
            resolved = dict(e.resolved)
            threads = (e.training_threads, e.host_threads)
        return during, dict(state), resolved, threads, params

    during, after, resolved, threads, bound = run("auto")
    assert resolved["numa_binding"] == "node 1: cpus 8-15"
    assert all(c == TWO_NODES[1] for c in during.values())
    assert all(c == ALL for c in after.values())
    assert threads == (2, 2)  # node 1's 8 cores for 2 ranks, half kept for training

    during, after, resolved, threads, plain = run("off")
    assert resolved["numa_binding"] == "off (zfctl.numa_binding)"
    assert all(c == ALL for c in during.values())
    assert threads == (4, 4)  # the box's 16 cores for 2 ranks
    for a, b in zip(bound, plain, strict=True):
        torch.testing.assert_close(a, b)


def test_ranks_share_the_cores_of_their_node():
    """Bound, a rank shares its node's cores with the ranks whose device is on the same
    node (local rank r drives device r); unbound, with every rank of the box."""
    from zenflow.engine.engine_setup import sharing_ranks

    class Box:  # devices 0, 2 on node 0; 1, 3 on node 1
        def numa_node(self, index=None):
            return index % 2

    on_1 = numa.plan("auto", 1, TWO_NODES, ALL, 4)
    assert sharing_ranks(Box(), on_1, 4) == 2
    assert sharing_ranks(Box(), on_1, 3) == 1  # devices 0, 1, 2: only 1 on node 1
    assert sharing_ranks(Box(), numa.Binding("off"), 4) == 4


def test_one_node_here_is_said_and_nothing_is_bound():
    with ZenFlowEngine(MLP(), make_config({"update_interval": 2}), accelerator="sim") as e:
        nodes = numa.node_cpus()
        if len(nodes) <= 1:
            assert e.resolved["numa_binding"] == "not bound: one NUMA node"
        else:  # a multi-node machine: sim's device has no node
            assert "unknown" in e.resolved["numa_binding"]
        assert not e.numa.bound


def test_a_failed_set_up_leaves_nothing_bound(monkeypatch):
    from zenflow.engine.accelerator import SimAccelerator
    from zenflow.engine.schedule import ZenFlowEngine as Engine

    state = _fake_affinity(monkeypatch)
    monkeypatch.setattr(numa, "node_cpus", lambda sys_root=numa.SYS: TWO_NODES)
    monkeypatch.setattr(SimAccelerator, "numa_node", lambda self, index=None: 1)

    def fail(self, masters):
        assert all(c == TWO_NODES[1] for c in state.values())  # bound by now
        raise RuntimeError("set-up failed")

    monkeypatch.setattr(Engine, "_make_mode", fail)
    cfg = make_config({"update_interval": 2}, zfctl={"numa_binding": "node"})
    with pytest.raises(RuntimeError, match="set-up failed"):
        ZenFlowEngine(MLP(), cfg, accelerator="sim")
    assert all(c == ALL for c in state.values())
