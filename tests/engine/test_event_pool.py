"""The CUDA backend's pool of reused events (cuda; its bookkeeping checked here without a
device, on stand-in events): an event is reused only once no holder is left, a copy
stream's wait event at once, and the pool keeps at most ``EVENT_POOL_MAX``."""

from __future__ import annotations

import threading

from zenflow.engine.accelerator.cuda import EVENT_POOL_MAX, CudaEvent, EventPool


class Stand:
    """A stand-in for torch.cuda.Event: only its identity matters to the pool."""


def test_an_event_comes_back_only_when_its_last_holder_drops_it():
    pool = EventPool(make=Stand)
    a = pool.take()
    held = pool.holder(a)
    other = held  # a second holder: the event is still waited on
    del held
    assert pool.take() is not a  # not back: a holder is left
    assert pool.created == 2
    del other
    assert pool.take() is a  # back, and reused instead of a new one
    assert pool.created == 2


def test_an_event_given_back_at_once_is_reused_at_once():
    pool = EventPool(make=Stand)
    ready = pool.take()
    pool.give(ready)  # a copy stream's wait for it is queued: nobody reads it again
    assert pool.take() is ready and pool.created == 1


def test_a_steady_stream_of_copies_makes_as_many_events_as_are_held_at_once():
    pool = EventPool(make=Stand)
    busy: list[CudaEvent] = []  # four buckets, each holding its last copy's event
    for _ in range(1000):
        ready = pool.take()
        pool.give(ready)
        done = pool.holder(pool.take())
        if len(busy) == 4:
            busy.pop(0)  # a bucket's previous event is replaced (dropped)
        busy.append(done)
    assert pool.created <= 6  # four held, one being recorded, one wait event


def test_the_pool_keeps_at_most_its_cap_and_holders_may_drop_on_any_thread():
    pool = EventPool(make=Stand)
    holders = [pool.holder(pool.take()) for _ in range(EVENT_POOL_MAX + 50)]
    t = threading.Thread(target=holders.clear)  # dropped on another thread
    t.start()
    t.join()
    assert len(pool._free) == EVENT_POOL_MAX
    assert pool.created == EVENT_POOL_MAX + 50
