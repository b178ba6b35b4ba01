"""The host accumulator: a thread adding gradient pieces, as they arrive from the device,
into fp32 (or, for the compact host state, bf16) sums, and the step gate its adds wait on.

A step's pieces arrive during backward, before the step's clipping coefficient and skip
decision are known (the global norm needs the whole step). A streamed piece of a window
sum lands straight in its place in its weight's step store (pinned, one step's non-selected
gradient in the link's dtype; ``land``), and its add waits there, in order, until the
step's gate is set (``StepGate.set`` pokes the thread, which is woken once for the step's
pieces, not once a piece). The training thread waits only before it lands a weight's first
piece of a step, for the adds of that weight's previous step still reading its store
(``wait_free``): the accumulator has the next step's whole forward and the backward up to
that weight to finish them, and the host never copies a piece from one buffer into
another. Other transfers (whole gradients, micro-batches summed on the host) land in a
slot of the link's bounded pinned staging ring (``copies.StagingRing``) and are added from
there, in order (``add``). A deferred add into a sum a host step still reads waits for that
step (``wait``), without holding up the pieces behind it.

The accumulator and the window's host step (the CPU Adam on the worker) share the host's
threads through ``CoreShare``: where the host has the cores the training thread does not need
(CUDA), the accumulator takes all of them while no window step runs and yields half to the
window's Adam while one does, so the two OpenMP teams never ask for more cores than there
are; elsewhere (sim, cpu) each takes all of them, as before.

Owns ``StepGate``, ``CoreShare``, ``Accumulator`` and ``reraise``; must not touch the host
state, the window's job or the copies themselves (``transport``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch


def reraise(exc: BaseException):
    """Re-raise a worker's exception in the caller: same type and message, chained to the
    original (which carries the worker's traceback)."""
    try:
        again = type(exc)(*exc.args)
    except Exception:  # exotic constructor: re-raise the original object
        raise exc from None
    raise again from exc


POKE_S = 0.05  # how often ``wait_free`` wakes the thread while it waits


class StepGate:
    """One step's clipping coefficient and skip decision, set by the training thread once
    the step's norm is known. The accumulator waits on it before it adds that step's
    pieces into a window sum (they arrive during backward, before the norm exists);
    ``on_set`` (the accumulator's ``poke``) wakes it for its deferred adds."""

    __slots__ = ("_set", "coef", "skip", "_on_set")

    def __init__(self, on_set: Callable[[], None] | None = None) -> None:
        self._set = threading.Event()
        self.coef = 1.0
        self.skip = False
        self._on_set = on_set

    def set(self, coef: float, skip: bool) -> None:
        self.coef = float(coef)
        self.skip = bool(skip)
        self._set.set()
        if self._on_set is not None:
            self._on_set()

    def wait(self) -> None:
        self._set.wait()

    def is_set(self) -> bool:
        return self._set.is_set()


class CoreShare:
    """The host threads (``threads``) of the accumulator and the window's Adam.

    ``yielding`` False: both take all ``threads`` (a separate share each: sim and cpu,
    whose training threads run the device's compute). ``yielding`` True (CUDA: the host
    also has the cores the training thread does not need): the window's Adam takes half
    (``adam_threads``), and the accumulator all of them while no window step runs, the
    other half while one does (``accumulate_threads``, read before each add). The thread
    count changes no result: both kernels are bit-identical for any count."""

    def __init__(self, threads: int, yielding: bool = False) -> None:
        self.threads = max(1, int(threads))
        self.yielding = bool(yielding) and self.threads > 1
        self._running = 0
        self._lock = threading.Lock()

    @property
    def adam_threads(self) -> int:
        return self.threads // 2 if self.yielding else self.threads

    @property
    def beside_adam(self) -> int:
        """The accumulator's threads while a window's Adam runs."""
        return self.threads - self.adam_threads if self.yielding else self.threads

    @property
    def accumulate_threads(self) -> int:
        return self.beside_adam if self._running else self.threads

    @contextlib.contextmanager
    def adam(self) -> Iterator[int]:
        """While a window's Adam runs (on the worker): yields its thread count."""
        with self._lock:
            self._running += 1
        try:
            yield self.adam_threads
        finally:
            with self._lock:
                self._running -= 1

    def describe(self) -> str:
        if not self.yielding:
            return f"{self.threads} (accumulate and window Adam each)"
        return (f"{self.threads} (accumulate; {self.beside_adam} while a window's Adam "
                f"runs on the other {self.adam_threads})")  # fmt: skip


class FixedGate:
    """A gate that is set from the start with a known coefficient (the q8 step store's
    prediction, ``zenflow.engine.zenflow.step_q8``): its add runs as soon as it arrives."""

    __slots__ = ("coef",)
    skip = False

    def __init__(self, coef: float) -> None:
        self.coef = coef

    def wait(self) -> None:
        pass

    def is_set(self) -> bool:
        return True


def _ready(gate, wait) -> bool:
    return (gate is None or gate.is_set()) and (wait is None or wait.is_set())


class Accumulator:
    """A thread adding gradient pieces into sums (compact layout), in order.

    ``add(event, src, dst, gate, overwrite, release, stat, wait)``: wait for the copy
    ``event``; then, once ``wait`` (the host step reading ``dst``) and ``gate`` (None: no
    coefficient, e.g. a micro-batch into its step's sum) are set and the adds queued before
    it ran, ``dst = coef * src`` (``overwrite``) or ``dst += coef * src`` on ``threads``
    host threads, and ``release()`` (the staging slot back to its ring); with ``keep``
    (codes, scales, prev_mul, prev_delta), the add first applies the previous step's
    correction from the copy held there and makes ``src``'s 8-bit copy in its place, in the
    same pass (``keep_i8``: the q8 step store, ``zenflow.engine.zenflow.step_q8``).
    ``land(event, store, dst, gate, overwrite, key, stat, wait)``: the same add of a piece
    the device copies into ``store`` (its place in its weight's step store) itself, waiting
    there for its gate without holding up the thread (no ring slot, no host copy);
    ``wait_free(key)`` blocks until no queued add of ``key`` (a weight) reads its store. A
    step's lands are held on the caller's side and queued together (one wake-up of the
    thread, not one a piece): before anything else is queued (a gate's poke among them), and
    when ``wait_free`` has to wait. A skipped step's pieces are dropped. ``stat``: a
    key under which the sum of squares of ``dst`` after the add is totalled (``sums``: a
    step's host-side share of the global norm). ``call(fn)`` runs ``fn`` in order;
    ``fence()`` returns an event set once everything queued before it has run (deferred
    adds included). A failure is kept and re-raised by ``check()`` / the fence's waiters.
    ``threads``: a count, or the ``CoreShare`` whose ``accumulate_threads`` each add takes.
    """

    def __init__(self, accumulate, threads: int | CoreShare = 1,
                 bind: Callable[[], None] | None = None, keep_i8=None):  # fmt: skip
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        # lands not queued yet (``land``), and the lock that keeps them in order with
        # everything else queued, whichever thread queues it (the worker pokes too)
        self._held: list = []
        self._put_lock = threading.Lock()
        self._accumulate = accumulate
        self._keep_i8 = keep_i8
        self.cores = threads if isinstance(threads, CoreShare) else CoreShare(threads)
        self.threads = self.cores.threads
        self._bind = bind
        self.error: BaseException | None = None
        self.sums: dict = {}
        self.busy_s = 0.0  # time spent adding (throughput figures)
        self.elements = 0
        self.deferred_max = 0  # most adds waiting for their gate at once (tests, figures)
        # landed pieces waiting for their gates: (store, dst, gate, overwrite, stat, wait,
        # event, key)
        self._deferred: deque = deque()
        self._lock = threading.Lock()
        self._reading: dict = {}  # key -> landed adds queued that still read its store
        self._free: dict = {}  # key -> threading.Event, set while none does
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zenflow-accum", daemon=True)
        self._thread.start()

    def _put(self, *items) -> None:
        """Queue the lands held so far (one item), then ``items``, in that order."""
        with self._put_lock:
            if self._held:
                self._q.put(("lands", self._held))
                self._held = []
            for item in items:
                self._q.put(item)

    def add(self, event, src, dst, gate, overwrite, release, stat=None, wait=None,
            keep=None) -> None:  # fmt: skip
        """Queue an add; ``wait``: an event to wait for before ``dst`` is written (the host
        step still reading the window sum); ``keep``: (codes, scales, prev_mul,
        prev_delta) of ``src``'s 8-bit copy, made by the add (see the class)."""
        self._put(("add", event, src, dst, gate, overwrite, release, stat, wait, keep))

    def land(self, event, store, dst, gate, overwrite, key, stat=None, wait=None) -> None:
        """Queue the add of a piece the device copies (``event``) straight into ``store``,
        its place in the step store of ``key`` (its weight): once ``wait`` and ``gate`` are
        set, ``dst (+)= coef * store``, in order with the other adds. The caller lands a
        key's pieces only after ``wait_free(key)``: nothing of an earlier step still reads
        that store. Held until something else is queued (its gate's poke at the latest) or
        ``wait_free`` waits: an add cannot run before its step's gate is set, so waking the
        thread for each piece of a backward would only cost the training thread."""
        with self._lock:
            n = self._reading.get(key, 0)
            if n == 0:
                free = self._free.get(key)
                if free is None:  # made once per key, not once per step
                    free = self._free[key] = threading.Event()
                free.clear()
            self._reading[key] = n + 1
        with self._put_lock:
            self._held.append((event, store, dst, gate, overwrite, key, stat, wait))

    def wait_free(self, key) -> None:
        """Block until no queued add of ``key`` reads its store (the previous step's pieces
        of that weight are added, or dropped); then re-raise a failure of the thread."""
        free = self._free.get(key)
        if free is not None and not free.is_set():
            self._put()  # the lands held, so that they can run
            # an add waits for its gate and its sum (``wait``); whoever sets them pokes the
            # thread, and so does this wait now and then, so that no add that could run
            # sits in the queue while the training thread waits for it
            while not free.wait(POKE_S):
                self.check()
                self.poke()
        self.check()

    def _read(self, key) -> None:
        """One landed add of ``key`` is done with its store (run, skipped or dropped)."""
        with self._lock:
            n = self._reading.get(key, 0) - 1
            self._reading[key] = max(0, n)
            if n <= 0:
                self._free[key].set()

    def _release_all(self) -> None:
        """Nothing reads a store any more (the thread stops): every waiter goes on."""
        with self._lock:
            self._reading.clear()
            for free in self._free.values():
                free.set()

    def poke(self) -> None:
        """Wake the thread: a gate was set, deferred adds may run."""
        self._put(("poke",))

    def call(self, fn: Callable[[], None]) -> None:
        self._put(("call", fn))

    def fence(self) -> threading.Event:
        done = threading.Event()
        self._put(("fence", done))
        return done

    def _run(self) -> None:
        if self._bind is not None:
            self._bind()
        torch.set_num_threads(self.threads)
        while True:
            item = self._q.get()
            if item is None:
                self._progress(block=False)
                self._deferred.clear()
                self._release_all()
                return
            kind = item[0]
            try:
                if kind == "add":
                    self._add(*item[1:])
                elif kind == "lands":
                    self._lands(item[1])
                elif kind == "poke":
                    self._progress(block=False)
                else:
                    self._progress(block=True)
                    if kind == "call" and self.error is None:
                        item[1]()
            except BaseException as e:  # kept; the training thread re-raises it
                if self.error is None:
                    self.error = e
            finally:
                if kind == "fence":
                    item[1].set()

    def _add(self, event, src, dst, gate, overwrite, release, stat, wait, keep) -> None:
        try:
            if self.error is not None:
                return
            event.synchronize()
            self._progress(block=True)  # in order: the adds deferred before this one
            self._apply(src, dst, gate, overwrite, stat, wait, keep)
        finally:
            if release is not None:
                release()

    def _lands(self, lands: list) -> None:
        """Held lands, in order; one that fails does not lose the rest (each frees its store
        once it is added or dropped)."""
        for land in lands:
            try:
                self._land(*land)
            except BaseException as e:  # kept; the training thread re-raises it
                if self.error is None:
                    self.error = e

    def _land(self, event, store, dst, gate, overwrite, key, stat, wait) -> None:
        if self.error is not None:
            self._read(key)
            return
        self._deferred.append((store, dst, gate, overwrite, stat, wait, event, key))
        self.deferred_max = max(self.deferred_max, len(self._deferred))
        self._progress(block=False)  # an earlier step's adds whose gates are set

    def _progress(self, block: bool) -> None:
        """Run the deferred adds in order: all of them (``block``: waiting for their gates
        and host steps), or those that are ready now."""
        while self._deferred:
            head = self._deferred[0]
            if not block and not _ready(head[2], head[5]):
                return
            self._run_deferred()

    def _run_deferred(self) -> None:
        store, dst, gate, overwrite, stat, wait, event, key = self._deferred.popleft()
        try:
            if self.error is None:
                event.synchronize()  # the piece's copy into the store
                self._apply(store, dst, gate, overwrite, stat, wait)
        finally:
            self._read(key)

    def _apply(self, src, dst, gate, overwrite, stat, wait, keep=None) -> None:
        if wait is not None:
            wait.wait()
        scale = 1.0
        if gate is not None:
            gate.wait()
            scale = gate.coef
        if gate is not None and gate.skip:
            return
        t0 = time.perf_counter()
        threads = self.cores.accumulate_threads
        if keep is not None:  # the add (never an overwrite) and src's 8-bit copy, after
            codes, scales, prev_mul, prev_delta = keep  # the previous step's correction
            self._keep_i8(dst, src, scale, codes, scales, threads, prev_mul, prev_delta)
            sq = 0.0
        else:
            sq = self._accumulate(dst, src, scale, overwrite, stat is not None, threads)
        self.busy_s += time.perf_counter() - t0
        self.elements += dst.numel()
        if stat is not None:
            self.sums[stat] = self.sums.get(stat, 0.0) + sq

    def check(self) -> None:
        if self.error is not None:
            reraise(self.error)

    def squares(self, buffers: dict) -> float:
        """The step's host share of the squared norm: the squares totalled in-line by adds
        (``stat`` keys ("sq", name)) plus those of ``buffers`` (name -> fp32 tensor, totalled
        here, after the adds queued before), in float64. Waits for the accumulator; the
        in-line totals are consumed."""
        for name, buf in buffers.items():
            key = ("sq", name)

            def total(buf=buf, key=key):
                self.sums[key] = float(buf.double().square().sum())

            self.call(total)
        self.drain()
        keys = [k for k in self.sums if isinstance(k, tuple) and k[0] == "sq"]
        return sum(self.sums.pop(k) for k in keys)

    def drain(self) -> None:
        """Block until every queued item has run (then ``check``). After close() there is
        nothing left to add."""
        if not self._closed:
            self.fence().wait()
        self.check()

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._put(None)
            self._thread.join(timeout=60)
