"""The simulated device's memory pool (``csrc/sim_pool.cpp``, ``zenflow.ops.sim_pool``).

On sim the device's tensors come from a pool of their own, so that the device's churn never
fragments glibc's heap, and a host-memory measurement subtracts what the pool held. These
tests check that the pool serves what it is asked (routing by the thread's mode, classes,
reuse, nothing cached once no device is open), that what it calls resident is what the
process's RSS holds, and, in a ZenFlow run with the trainer's scopes, that no host memory
lands in it: every op whose inputs are host memory writes host memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback

import pytest
import torch
from conftest import NATIVE_SKIP, gpt2_batches, loss_of, make_config, tiny_gpt2
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zenflow import ZenFlowEngine
from zenflow.engine.accelerator import SimAccelerator
from zenflow.ops import sim_pool

pytestmark = pytest.mark.skipif(bool(NATIVE_SKIP), reason=str(NATIVE_SKIP))


@pytest.fixture
def pool():
    if not sim_pool.install():
        pytest.skip("the device pool is off here (ZENFLOW_OPS=reference or ZENFLOW_SIM_POOL)")
    sim_pool.open_device()
    yield
    sim_pool.close_device()


def test_the_threads_mode_decides_where_a_tensor_comes_from(pool):
    with sim_pool.mode(sim_pool.DEVICE):
        dev = torch.empty(1000)
        with sim_pool.mode(sim_pool.HOST):
            host = torch.empty(1000)
        seen = {}
        other = threading.Thread(target=lambda: seen.setdefault("t", torch.empty(1000)))
        other.start()
        other.join()
    assert sim_pool.owns(dev)
    assert not sim_pool.owns(host)
    assert not sim_pool.owns(seen["t"]), "another thread is in host mode until it asks"
    assert not sim_pool.owns(torch.empty(1000)), "the mode is restored after the scope"


def test_a_freed_block_serves_the_next_request_of_its_class(pool):
    with sim_pool.mode(sim_pool.DEVICE):
        a = torch.empty(1_000_000)  # 4 MB: class 4 MiB + 0 (4 * 2^20 >= 4e6)
        ptr = a.data_ptr()
        before = sim_pool.stats()
        del a
        b = torch.empty(990_000)  # the same class
        after = sim_pool.stats()
    assert b.data_ptr() == ptr
    assert after["reserved"] == before["reserved"], "no new mapping"
    assert after["served"] == before["served"] + 1
    assert after["in_use"] == before["in_use"] - 4_000_000 + 3_960_000


def test_pool_tensors_compute_as_heap_tensors_do(pool):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 300, generator=g), torch.randn(300, 200, generator=g)
    want = torch.nn.functional.gelu(x @ w).sum(0)
    with sim_pool.mode(sim_pool.DEVICE):
        xd, wd = x.clone(), w.clone()
        got = torch.nn.functional.gelu(xd @ wd).sum(0)
        xd.resize_(128, 300)  # a resize goes through the allocator too
    assert sim_pool.owns(got) and sim_pool.owns(xd)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


NO_DEVICE_CHILD = r"""
import json, torch
from zenflow.ops import sim_pool
assert sim_pool.install()
seen = [sim_pool.stats()]
with sim_pool.mode(sim_pool.DEVICE):
    big, small = torch.empty(2_000_000), torch.empty(100)
seen.append(sim_pool.stats())
del big
seen.append(sim_pool.stats())
del small
seen.append(sim_pool.stats())
print(json.dumps(seen))
"""


def test_nothing_is_cached_once_no_device_is_open():
    """In a process of its own (no other test's device open): a freed mapping goes back
    at once, and the small blocks' chunk once none of them is in use."""
    base, made, big_freed, all_freed = _child(NO_DEVICE_CHILD)
    assert base["opened"] == 0 and base["reserved"] == 0
    assert made["mappings"] == 2 and made["reserved"] > 8_000_000
    assert big_freed["mappings"] == 1, "the mapping went back"
    assert all_freed["reserved"] == 0 and all_freed["resident"] == 0, "and the chunk"


def _child(code: str, **env):
    """Run ``code`` in a fresh interpreter -> the JSON of its last line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


RSS_CHILD = r"""
import json, sys, torch
from zenflow.ops import sim_pool
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
assert sim_pool.install()
sim_pool.open_device()
r0 = rss()
keep = []
with sim_pool.mode(sim_pool.DEVICE):
    for i, n in enumerate([3_000_000, 700_000, 50_000, 9_000, 123, 2_500_000] * 4):
        t = torch.empty(n).fill_(1.0)
        if i % 3 == 0:
            keep.append(t)
    for n in [2_900_000, 650_000, 40_000]:
        keep.append(torch.empty(n).fill_(2.0))  # served from the cache
print(json.dumps({"rss": rss() - r0, "stats": sim_pool.stats()}))
"""


def test_what_the_pool_calls_resident_is_in_the_rss():
    """The figure a host measurement subtracts: the pool's resident bytes, against the RSS
    growth of a process that made and freed device tensors of several sizes."""
    got = _child(RSS_CHILD)
    resident = got["stats"]["resident"]
    assert resident > 20e6
    # the RSS also holds the interpreter's own growth: a few MB at most beside ~40 MB
    assert resident <= got["rss"] <= resident + 6e6, got


def test_the_accelerator_puts_device_tensors_in_the_pool_and_host_ones_in_the_heap():
    accel = SimAccelerator()
    if not accel.pool:
        pytest.skip("the device pool is off here")
    try:
        dev = accel.empty((1000,), torch.float32, "buckets")
        with accel.device_scope():
            host = accel.host_empty((1000,), torch.float32, False, "host_state")
            act = torch.empty(5000)
        assert sim_pool.owns(dev) and sim_pool.owns(act) and not sim_pool.owns(host)
        weights = [torch.empty(25_000), torch.empty(50)]
        accel.note_device_tensors([*weights, weights[0][:10], dev])
        peak = accel.memory_peak_bytes()
        assert peak >= sim_pool.stats()["resident_peak"] + 100_200
        assert peak == sim_pool.stats()["resident_peak"] + 100_200, "a storage counts once"
    finally:
        accel.close()


def test_the_bytes_in_use_and_their_peak_are_what_live_tensors_asked_for():
    """``in_use`` is what live device tensors asked for (not their classes), its peak the
    most at once (CUDA's max_memory_allocated): what a device budget must hold, which the
    accelerator reports with the weights made outside the pool."""
    accel = SimAccelerator()
    if not accel.pool:
        pytest.skip("the device pool is off here")
    try:
        base = sim_pool.stats()["in_use"]
        sim_pool.reset_peak()
        with accel.device_scope():
            a = torch.empty(300_001, dtype=torch.uint8)  # class 320 KiB: asked 300,001
            b = torch.empty(70_000, dtype=torch.uint8)
            assert sim_pool.stats()["in_use"] == base + 370_001
            del a
            c = torch.empty(10_000, dtype=torch.uint8)
        st = sim_pool.stats()
        assert st["in_use"] == base + 80_000
        assert st["in_use_peak"] == base + 370_001, "the peak stays after a free"
        accel.note_device_tensors([torch.empty(25_000)])
        assert accel.memory_allocated_peak_bytes() == base + 370_001 + 100_000
        sim_pool.reset_peak()
        assert sim_pool.stats()["in_use_peak"] == base + 80_000
        del b, c
    finally:
        accel.close()


class _Attribution(TorchDispatchMode):
    """Every op on this thread whose output is in the device pool although none of its
    inputs is device memory (the pool's, or the model's weights made before the engine),
    and every op that mixes pool tensors with other heap tensors: host memory misfiled as
    the device's (factory ops without inputs are left out: their scope decides)."""

    def __init__(self, device_ptrs: set[int]):
        super().__init__()
        self.device_ptrs = device_ptrs
        self.found: list[str] = []

    def _is_device(self, t: torch.Tensor) -> bool:
        return sim_pool.owns(t) or t.untyped_storage().data_ptr() in self.device_ptrs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [
            t
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= 4096
        ]
        if ins:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            device_in = [self._is_device(t) for t in ins]
            if any(sim_pool.owns(o) for o in outs) and not any(device_in):
                self.found.append(f"{func}: host inputs, output in the pool, at {_where()}")
            if any(sim_pool.owns(t) for t in ins) and not all(device_in):
                self.found.append(f"{func}: pool and host inputs, at {_where()}")
        return out


def _where() -> str:
    """The innermost zenflow frames of the current stack."""
    frames = [f for f in traceback.extract_stack() if "/zenflow/" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/zenflow/', 1)[1]}:{f.lineno}"
                       for f in frames[::-1][:3])  # fmt: skip


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state", ["exact", "compact"])
def test_a_zenflow_run_files_no_host_memory_as_the_devices(state, bf16, clip):
    """The trainer's scopes (forward, backward and the step in ``device_scope``) over warm-up,
    the first selection, window ends, re-selections and a checkpoint, with clipping (the
    step store) and without: the host's tensors stay in the heap, the device's go to the
    pool."""
    model = tiny_gpt2()
    cfg = make_config({"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
                       "select_strategy": "step", "select_interval": 2,
                       "full_warm_up_rounds": 1}, bf16={"enabled": bf16}, clip=clip,
                      zfctl={"host_state": state})  # fmt: skip
    with ZenFlowEngine(model, cfg, accelerator="sim", sim_strict=True) as engine:
        if not engine.accel.pool:
            pytest.skip("the device pool is off here")
        device_ptrs = {t.untyped_storage().data_ptr()
                       for t in [*model.parameters(), *model.buffers()]}  # fmt: skip
        grads = []  # autograd's gradients, made in the scope: the device's
        with _Attribution(device_ptrs) as seen:
            for batch in gpt2_batches(7, seq=16):
                with engine.accel.device_scope():
                    loss = loss_of(model, batch)
                    loss.backward()
                    grads.append(sim_pool.owns(model.transformer.ln_f.weight.grad))
                    engine.step(loss)
                engine.zero_grad()
            engine.state_dict()
        for w in engine.zweights:
            assert not sim_pool.owns(w.host.master), w.spec.name
            for t in [*w.acc, *getattr(w.host, "moment_tensors", lambda: {})().values()]:
                assert not sim_pool.owns(t), w.spec.name
        assert sim_pool.owns(engine.zweights[0].grad_sel)
        assert grads and all(grads)
    assert not seen.found, sorted(set(seen.found))


def test_the_pool_can_be_turned_off_for_a_comparison():
    """``ZENFLOW_SIM_POOL=off``: the memory model before the pool (device tensors in the
    heap, no pool figure), in a process of its own (the pool is installed once a process)."""
    child = (
        "import json, torch\n"
        "from zenflow.engine.accelerator import SimAccelerator\n"
        "from zenflow.ops import sim_pool\n"
        "a = SimAccelerator()\n"
        "t = a.empty((100_000,), torch.float32, 'buckets')\n"
        "print(json.dumps([a.pool, sim_pool.owns(t), a.memory_peak_bytes(), a.describe()]))\n"
    )
    for value, want in (("off", [False, False, None]), ("", [True, True])):
        got = _child(child, ZENFLOW_SIM_POOL=value)
        assert got[: len(want)] == want, (value, got)
        assert ("no device pool: ZENFLOW_SIM_POOL=off" in got[3]) == (value == "off"), got[3]
    assert got[2] >= 400_000


def test_without_a_native_library_sim_runs_on_the_heap_and_says_so():
    """A machine without a compiler: the simulated device still works, its memory in the
    host's heap, and its description (the run header's device line) says why."""
    child = (
        "import json\n"
        "from zenflow.ops import sim_pool\n"
        "from zenflow.ops.loader import NativeBuildError\n"
        "def fail():\n"
        "    raise NativeBuildError('no C++ compiler found\\nmore')\n"
        "sim_pool.load_native = fail\n"
        "from zenflow.engine.accelerator import SimAccelerator\n"
        "a = SimAccelerator()\n"
        "print(json.dumps([a.pool, a.describe()]))\n"
    )
    pool, text = _child(child)
    assert pool is False
    assert "no device pool: the native library is not built (no C++ compiler found)" in text
