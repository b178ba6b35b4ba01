"""``zfctl.step_store`` "q8": per-step clipping of the host's pieces without holding a step's
pieces whole, from an 8-bit copy of each.

With clipping, a step's non-selected pieces reach the host before the step's coefficient
``c`` exists (the global norm needs the whole backward). The store ("on") holds them whole
until it does (2 bytes per non-selected parameter in bf16, 4 in fp32); "off" adds them
unclipped and clips each window by its smallest coefficient. Here each piece is added into
the window sum as it arrives, scaled by a prediction ``p`` (the previous step's
coefficient), and in the same pass kept in 8 bits (``zenflow.ops.accumulate_keep_i8_``:
linear codes, one fp32 scale per 256 elements). Once ``c`` is known the sum gets
``(c - p)`` times the decoded copy, on the accumulator thread, in order with the adds: in
the weight's next add, block by block from the copy that add replaces, or, for a window's
last step (its sum is about to be read): inside the window's CPU Adam as it reads the sum
(``adamw_step_`` / ``adamw_q8_step_``'s ``corr_*``), or, before a flush or a checkpoint, as
a pass of its own (``add_dequantized_i8_``); the same sum, and the same step, bit for
bit. The first write of a window (overwrite) needs no copy: the piece goes in unscaled and
the sum is multiplied by ``c`` (one rounding, the store's arithmetic), likewise in the next
add or a pass.

So the window sum is per-step clipping's: exactly where ``c == p`` (clipping that never
bites: both 1) and in a window's first step, and elsewhere within ``|c - p|`` times the
copy's rounding (at most half a code, absmax / 254 of the piece's block). A skipped step
(not finite) subtracts ``p`` times the copy: ``p`` times the rounding stays in the sum, as
its non-finite pieces were zeroed before they crossed.

Without clipping it is "off": nothing to correct, no copy. Held with clipping: 1 byte per
non-selected parameter plus 4 per 256, not pinned, not the store's 2 or 4: one pair of
arrays for every weight, made by a window's second step after a selection and dropped
before a re-selection (``release``), which lays out new pieces.
Host work: the copy is written by the add's own pass (1 byte an element more), the
correction read from the copy there (1 more), and at a window's end the last copy read once
more, by the window's CPU Adam as it reads the sum.

Owns the 8-bit copies, the prediction (checkpointed: ``pred``) and the corrections; must
not touch the window's host step or the device.
"""

from __future__ import annotations

import torch

from zenflow.engine.host import FixedGate
from zenflow.ops import i8_num_blocks


class Q8StepStore:
    """The q8 step store of one engine's ZenFlow weights (see the module docstring).
    ``mode``: the ZenFlowMode (its weights, kernels, transport and the step's plan).

    A step's corrections wait as ``pending`` (per weight: the sum's multiplier, or the
    coefficient's change times the copy) and go into the weight's next add, block by block
    from the copy that add replaces (``accumulate_keep_i8_``'s ``prev_mul`` /
    ``prev_delta``): no pass of their own over the sum. ``flush`` queues the ones still
    pending as passes of their own: before anything reads a window sum (a window's end, a
    flush, a checkpoint's drain); at a window's end the host step takes them in itself
    (``fold``). Either way the sum it reads is the same, bit for bit."""

    def __init__(self, mode):
        self.m = mode
        self.pred = 1.0  # the previous step's coefficient: what this step's adds predict
        self.touched: dict = {}  # weight position -> (weight, slot, fresh) routed this step
        self.pending: dict = {}  # weight position -> (weight, slot, mul, delta) to apply
        self.applying: dict = {}  # the pending ones this step's adds take in
        self.corrected = 0  # corrections applied, in adds or passes (tests, figures)
        self.passes = 0  # of those, the passes of their own
        self.folded = 0  # ... and those a window's CPU Adam took in (``flush``'s ``fold``)

    def start_step(self) -> None:
        self.touched = {}
        self.applying, self.pending = self.pending, {}

    def copies(self, w) -> dict:
        """Each piece's (codes, scales) in ``w``'s 8-bit store, by the piece's offset (made
        once per piece plan: every piece's blocks start at its first element)."""
        if not self._current(w):
            self._make([v for v in self.m.zweights
                        if v is w or (v.owned and not self._current(v))])  # fmt: skip
        return w.q8_plan[1]

    @staticmethod
    def _current(w) -> bool:
        """``w`` has copies for its pieces (none yet, or its pieces laid out again: not)."""
        plan = getattr(w, "q8_plan", None)
        return plan is not None and plan[0] is w.pieces

    def _make(self, weights: list) -> None:
        """The copies of ``weights`` (those without copies for their pieces: after a
        selection, every weight this rank owns) in one pair of arrays, codes and scales,
        each weight's a slice: one allocation, so at a model's size it is mapped on its own
        and goes back to the system whole when ``release`` drops it (per-weight arrays
        below glibc's mmap threshold stayed in its heap as free bytes: docs/BENCHMARKS.md,
        "The q8 copies dropped before a re-selection")."""
        accel = self.m.e.accel
        blocks = [[i8_num_blocks(pc.numel) for pc in w.pieces] for w in weights]
        codes = accel.host_empty((sum(w.compact_numel for w in weights),), torch.int8, False,
                                 "step_pieces")  # fmt: skip
        scales = accel.host_empty((sum(map(sum, blocks)),), torch.float32, False, "step_pieces")
        c0 = b0 = 0
        for w, nbs in zip(weights, blocks, strict=True):
            c1, b1 = c0 + w.compact_numel, b0 + sum(nbs)
            w_codes, w_scales = codes[c0:c1], scales[b0:b1]
            c0, b0 = c1, b1
            views, b = {}, 0
            for pc, nb in zip(w.pieces, nbs, strict=True):
                views[pc.offset] = (w_codes[pc.offset : pc.offset + pc.numel],
                                    w_scales[b : b + nb])  # fmt: skip
                b += nb
            # the whole copy for a window's CPU Adam (``_whole_copy``): the pieces' starts,
            # then the compact length, where the pieces tile the compact columns in order
            offsets = [pc.offset for pc in w.pieces] + [w.compact_numel]
            tiles = all(z - a == pc.numel for a, z, pc in
                        zip(offsets[:-1], offsets[1:], w.pieces, strict=True))  # fmt: skip
            whole = None
            if tiles:
                whole = (w_codes, w_scales, torch.tensor(offsets, dtype=torch.int64))
            w.q8_plan = (w.pieces, views, whole)

    def send(self, w, pc, i: int, bucket: torch.Tensor, dst, fresh: bool, wait) -> None:
        """Piece ``pc`` of ``w`` (gathered in bucket ``i``) to the host: added into ``dst``
        unscaled where it starts the window (``fresh``), else scaled by the prediction and
        kept in 8 bits by the same add, which first applies ``w``'s pending correction."""
        tr = self.m.transport
        clip = bool(self.m.e.clip)  # without clipping: no coefficient, as with "off"
        if clip:
            self.touched.setdefault(w.position, (w, self.m.plan.slot, fresh))
        if fresh or not clip:  # (fresh: a window's end flushed its corrections, then read it)
            tr.send_piece(i, bucket, dst, None, fresh, wait=wait)
            return
        entry = self.applying.get(w.position)
        mul, delta = (1.0, 0.0) if entry is None else entry[2:]
        if entry is not None and pc is w.pieces[-1]:
            self.corrected += 1
        keep = (*self.copies(w)[pc.offset], mul, delta)
        tr.send_piece(i, bucket, dst, FixedGate(self.pred), False, wait=wait, keep=keep)

    def gate_set(self, coef: float, skipped: bool) -> None:
        """The step's coefficient is known: each routed weight's correction waits for its
        next add (``pending``); the next step's coefficient is predicted from this one (a
        skipped step keeps the prediction)."""
        for pos, entry in self.applying.items():  # not routed this step: still pending
            if pos not in self.touched:
                self.pending[pos] = entry
        self.applying = {}
        delta = (0.0 if skipped else coef) - self.pred
        for w, slot, first in self.touched.values():
            if first:  # the window's first write: nothing before it in the sum
                if not skipped and coef != 1.0:  # (skipped: the slot stays fresh)
                    self.pending[w.position] = (w, slot, coef, 0.0)
            elif delta != 0.0:
                self.pending[w.position] = (w, slot, 1.0, delta)
        self.touched = {}
        if not skipped:
            self.pred = coef

    def flush(self, fold: bool = False) -> dict:
        """Queue the pending corrections as passes of their own (in order after the adds):
        before a window's sum is read. ``fold`` (a window's end, whose host step is the only
        reader of its sums): a weight's correction from its copy is returned instead, as the
        arguments of the host state's CPU Adam, which takes it in as it reads the sum
        (``zenflow.ops.adamw_step_`` / ``adamw_q8_step_``'s ``corr_*``: bit for bit the
        pass, then the step; ``can_fold``); returns {weight position: those arguments}."""
        entries = list(self.pending.values()) + list(self.applying.values())
        self.pending, self.applying = {}, {}
        work, folded = [], {}
        fold = fold and bool(entries) and self.can_fold
        for w, slot, mul, delta in entries:
            whole = self._whole_copy(w) if delta != 0.0 and fold else None
            if whole is not None:
                codes, scales, starts = whole
                folded[w.position] = {"corr_codes": codes, "corr_scales": scales,
                                      "corr_starts": starts, "corr_delta": delta}  # fmt: skip
            elif delta != 0.0:
                held, views = self.copies(w), w.views(w.acc[slot])
                work += [(dst.view(-1), *held[pc.offset], 1.0, delta)
                         for pc, dst in zip(w.pieces, views, strict=True)]  # fmt: skip
            else:
                work.append((w.acc[slot], None, None, mul, 0.0))
        self.corrected += len(entries)
        self.folded += len(folded)
        self.passes += len(entries) - len(folded)
        if work:
            acc = self.m.transport.accumulator
            acc.call(lambda: self._correct(work, acc))
        return folded

    @property
    def can_fold(self) -> bool:
        """The window's CPU Adam can take a correction in: the engine's own kernels, native
        or reference, of the host state (exact: ``adamw_step_``, an fp32 sum; compact:
        ``adamw_q8_step_``, a bf16 sum); a test's custom kernel cannot."""
        from zenflow import ops

        k = self.m.kernels
        if self.m.host_state == "compact":
            return k.q8 in (ops.adamw_q8_step_, ops.adamw_q8_step_reference_)
        return k.full in (ops.adamw_step_, ops.adamw_step_reference_)

    def release(self) -> None:
        """Drop every weight's 8-bit copies: a re-selection is next. It follows a
        synchronous window end, whose host step took the last corrections in (nothing is
        pending), and it lays out new pieces, so the copies would be made again by the next
        window's second step anyway; dropped now, the re-selection's own transients do not
        stand beside them (1 byte per non-selected element)."""
        if self.pending or self.applying:
            raise RuntimeError("zenflow: the q8 store's copies released with corrections "
                               "pending (a re-selection must follow a window end)")  # fmt: skip
        for w in self.m.zweights:
            w.q8_plan = None

    def _whole_copy(self, w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``w``'s 8-bit copy whole: its codes, its scales (piece after piece, as ``copies``
        lays them out) and the pieces' starts (then the compact length); None where its
        pieces do not tile its compact columns in order (then the pass)."""
        self.copies(w)  # (made by the window's adds already)
        return w.q8_plan[2]

    def _correct(self, work: list, acc) -> None:
        """On the accumulator: each sum times its multiplier, or plus its change times its
        pieces' copies."""
        threads = acc.cores.accumulate_threads
        add = self.m.kernels.add_i8
        for dst, codes, scales, mul, delta in work:
            if delta != 0.0:
                add(dst, codes, scales, delta, threads)
            else:
                dst.mul_(mul)
