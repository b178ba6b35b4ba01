"""Pieces that land in their weight's step store (Accumulator.land, wait_free): their adds
wait there for the step's gate and the host step's read of the sum, in order, and the
training thread learns when a store may be written again without ever waiting on an add
that could run but was not woken."""

from __future__ import annotations

import threading

import pytest
import torch

from zenflow.engine.accelerator import DONE
from zenflow.engine.accumulator import Accumulator, StepGate


def _add(dst, src, scale, overwrite, sumsq, num_threads):
    if overwrite:
        dst.copy_(src * scale)
    else:
        dst.add_(src, alpha=scale)
    return 0.0


def _waiter(acc, key):
    """wait_free(key) on another thread: an event set once it returned."""
    done = threading.Event()

    def run():
        acc.wait_free(key)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_landed_adds_wait_for_the_gate_and_free_the_store_after():
    acc = Accumulator(_add, 2)
    gate = StepGate(acc.poke)
    store = torch.tensor([1.0, 2.0, 3.0, 4.0])
    dst = torch.zeros(4)
    try:
        acc.land(DONE, store[:2], dst[:2], gate, True, "w")
        acc.land(DONE, store[2:], dst[2:], gate, True, "w")
        done = _waiter(acc, "w")
        assert not done.wait(0.2)  # the store is still read: the gate is not set
        assert torch.equal(dst, torch.zeros(4))
        gate.set(0.5, False)
        assert done.wait(10)
        assert torch.equal(dst, torch.tensor([0.5, 1.0, 1.5, 2.0]))
        acc.wait_free("other")  # a key never landed: free
    finally:
        acc.close()


def test_a_skipped_step_drops_its_pieces_and_frees_the_store():
    acc = Accumulator(_add, 1)
    gate = StepGate(acc.poke)
    dst = torch.ones(3)
    try:
        acc.land(DONE, torch.full((3,), 7.0), dst, gate, False, 0)
        gate.set(1.0, True)
        acc.wait_free(0)
        acc.drain()
        assert torch.equal(dst, torch.ones(3))
    finally:
        acc.close()


def test_an_add_waiting_for_its_sum_runs_once_the_sum_is_free_with_no_poke():
    """The add waits for the host step reading its sum (``wait``); that event is set by
    someone who does not wake the accumulator: wait_free still returns (it wakes the thread
    while it waits), so the training thread never waits forever on an add that could run."""
    acc = Accumulator(_add, 1)
    gate = StepGate(acc.poke)
    gate.set(2.0, False)
    sum_free = threading.Event()
    dst = torch.zeros(2)
    try:
        acc.land(DONE, torch.tensor([1.0, 1.0]), dst, gate, True, "w", wait=sum_free)
        done = _waiter(acc, "w")
        assert not done.wait(0.2)
        sum_free.set()  # no poke
        assert done.wait(10)
        assert torch.equal(dst, torch.tensor([2.0, 2.0]))
    finally:
        acc.close()


def test_a_failed_add_is_raised_by_the_wait_and_frees_the_store():
    def broken(*args):
        raise RuntimeError("kernel failed")

    acc = Accumulator(broken, 1)
    gate = StepGate(acc.poke)
    try:
        acc.land(DONE, torch.ones(2), torch.zeros(2), gate, True, "w")
        acc.land(DONE, torch.ones(2), torch.zeros(2), gate, True, "w")
        gate.set(1.0, False)
        with pytest.raises(RuntimeError, match="kernel failed"):
            acc.wait_free("w")
    finally:
        acc.close()


def test_close_frees_every_store():
    acc = Accumulator(_add, 1)
    gate = StepGate(acc.poke)  # never set: the add never runs
    acc.land(DONE, torch.ones(2), torch.zeros(2), gate, True, "w")
    acc.close()
    acc.wait_free("w")  # returns: nothing reads the store any more


def test_a_steps_lands_wake_the_thread_once_and_keep_their_order():
    """Lands are held until something else is queued (here the gate's poke): one queued
    item for the step's pieces, not one a piece, and their adds run in landing order, after
    an add queued before them and before one queued after."""
    acc = Accumulator(_add, 1)
    puts = []
    real = acc._q

    class Counting:
        def put(self, item):
            puts.append(None if item is None else item[0])
            real.put(item)

        def get(self):
            return real.get()

    acc._q = Counting()
    gate = StepGate(acc.poke)
    dst = torch.zeros(3)
    try:
        acc.add(DONE, torch.full((3,), 1.0), dst, None, True, None)  # dst = 1
        for k in range(3):  # piece k: dst[k] = 2 * (k + 2)
            acc.land(DONE, torch.tensor([float(k + 2)]), dst[k : k + 1], gate, True, "w")
        assert puts == ["add"]  # nothing queued for the lands yet
        gate.set(2.0, False)
        acc.add(DONE, torch.full((3,), 1.0), dst, None, False, None)  # then dst += 1
        acc.wait_free("w")
        acc.drain()
        assert puts == ["add", "lands", "poke", "add", "fence"]
        assert torch.equal(dst, torch.tensor([5.0, 7.0, 9.0]))
    finally:
        acc.close()


def test_wait_free_queues_the_held_lands_it_waits_for(monkeypatch):
    """A wait for a store whose lands are still held queues them (no one else might): at
    once, not at its periodic poke (made rarer than the test's patience here)."""
    monkeypatch.setattr("zenflow.engine.accumulator.POKE_S", 60.0)
    acc = Accumulator(_add, 1)
    gate = StepGate(None)  # a gate that wakes no one when set
    gate.set(1.0, False)
    dst = torch.zeros(2)
    try:
        acc.land(DONE, torch.tensor([3.0, 4.0]), dst, gate, True, "w")
        done = _waiter(acc, "w")
        assert done.wait(10)
        assert torch.equal(dst, torch.tensor([3.0, 4.0]))
    finally:
        acc.close()
