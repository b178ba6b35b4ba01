"""Data parallelism for the engine, on torch.distributed (no home-made communication).

The engine owns data parallelism as DeepSpeed's engine does (no DDP wrapper). With a
process group of N > 1 ranks initialised by the caller (``torchrun`` / ``zfctl finetune
--nproc``; gloo on cpu and sim, nccl on cuda):

- **Ownership.** Host state is partitioned by parameter: each offloaded weight has one
  owner rank (greedy balance by size, largest first), which alone holds its fp32 master,
  moments and window sums, runs its host Adam step and sends the result to the others. Host
  memory per rank falls about as 1/N.
- **Gradients** are averaged in the training dtype, in buckets: what every rank needs (the
  always-important params and the selected columns, which all ranks update identically on
  their devices) by all-reduce; the offloaded part (non-selected columns, or whole params in
  offload mode) by reduce-scatter, so each owner receives only the average of what it owns.
- **Agreement.** Every decision that changes the schedule is taken from all-reduced numbers,
  so step counts cannot diverge: the global gradient norm (each rank adds the squares it is
  the single holder of), the non-finite skip (any rank's loss or gradient), the auto-window
  vote (selected mass from the shared part, non-selected mass from the owners) and the
  column scores of a re-selection (each owner scores its weights' averaged gradient, the
  others add zeros: one float per column instead of the gradient itself).

Collectives time out (the process group's timeout, set by the caller), so a rank that dies
brings the others down instead of hanging them.
"""

from __future__ import annotations

import torch

BUCKET_BYTES = 25 * 2**20  # per collective, like DDP's default bucket


def _dist():
    return torch.distributed


def leave_process_group(drain: bool = True) -> None:
    """Destroy the default process group (if there is one).

    ``drain``: every rank got here together (a clean finish), so a barrier comes first. A
    gloo worker thread frees a finished collective's tensors just after the caller has been
    told it is done. Freeing a tensor that Python created takes the GIL, and a thread that
    asks for the GIL once the interpreter is finalizing is ended by Python inside a C++
    destructor: ``std::terminate``, SIGABRT, exit 134 after all the work has been written
    (torch 2.13; 7 of 80 ranks on a 2-core box, none with the barrier). Waiting in the
    barrier releases the GIL while the other ranks arrive, so the worker threads finish
    with the earlier collectives first. After a failure (a rank may be gone) there is no
    barrier: it would only wait for the timeout. A barrier that fails (a rank ended after
    its own failure) is let go: the group is destroyed all the same.
    """
    d = _dist()
    if not (d.is_available() and d.is_initialized()):
        return
    if drain:
        try:
            d.barrier()
        except RuntimeError:  # DistBackendError and friends: a peer is gone
            pass
    d.destroy_process_group()


def sum_of_squares(tensors) -> float:
    """Sum of squares of ``tensors`` (one fused norm per tensor, ``torch._foreach_norm``,
    fp32; summed in float64 after ONE device-to-host read): a rank's share of the squared
    global gradient norm."""
    tensors = [t for t in tensors if t is not None and t.numel()]
    if not tensors:
        return 0.0
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return float(torch.stack([n.double() for n in norms]).square().sum())


def norms_of(tensors) -> list[torch.Tensor]:
    """Per-tensor L2 norms (fp32 0-d device tensors, one fused call): terms of the global
    norm that stay on the device until the step's one read. Accumulated in fp32 whatever
    the gradients' dtype: a bf16 norm keeps 8 significant bits, and the streamed pieces'
    norms are fp32 (``grad_norm``)."""
    tensors = [t for t in tensors if t is not None and t.numel()]
    if not tensors:
        return []
    if tensors[0].device.type == "cuda":
        return list(torch._foreach_norm(tensors, 2.0, dtype=torch.float32))
    # off CUDA: one norm per tensor, what clip_grad_norm_ computes there
    return [grad_norm(t) for t in tensors]


# Off CUDA, torch takes a bf16/fp16 tensor's fp32 norm by converting the whole tensor into a
# new fp32 one first. For a large gradient that is a fresh mapping, paid in page faults: a
# 16M-element bf16 gradient took 34 ms on the project's CPU box (the conversion alone 31,
# into a reused buffer 3), 8 ms in chunks of this many elements (1 MiB of fp32 each, reused
# from the heap), and 8-12% of a sim step of a bf16 GPT-2 went to its norms
# (docs/BENCHMARKS.md). Chunks also accumulate in a shorter chain: closer to the float64
# norm, not further.
NORM_CHUNK = 1 << 18
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def grad_norm(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The L2 norm of one gradient (or piece), accumulated in fp32: a 0-d fp32 tensor
    (written into ``out``, a 0-d fp32 tensor, where given). On a CPU-memory device (cpu,
    sim) a low-precision tensor of more than ``NORM_CHUNK`` elements is taken in chunks: the
    norm of the chunks' fp32 norms (one call on CUDA, whatever the size)."""
    # the cheapest test first: every gradient hook calls this
    if t.numel() > NORM_CHUNK and t.dtype in _LOW_PRECISION and t.is_cpu and t.is_contiguous():
        flat = t.view(-1)
        parts = [torch.linalg.vector_norm(flat[i : i + NORM_CHUNK], 2.0, dtype=torch.float32)
                 for i in range(0, flat.numel(), NORM_CHUNK)]  # fmt: skip
        t = torch.stack(parts)
    if out is not None:
        return torch.linalg.vector_norm(t, 2.0, dtype=torch.float32, out=out)
    return torch.linalg.vector_norm(t, 2.0, dtype=torch.float32)


class DataParallel:
    """The engine's view of the process group (a no-op with one rank)."""

    def __init__(self) -> None:
        d = _dist()
        on = d.is_available() and d.is_initialized() and d.get_world_size() > 1
        self.enabled = bool(on)
        self.world = d.get_world_size() if on else 1
        self.rank = d.get_rank() if on else 0
        self.backend = d.get_backend() if on else None
        self.bytes_sent = 0  # payload bytes this rank put into collectives (stats, logs)
        self.score_floats = 0  # floats all-reduced for column scores
        self.score_grad_equivalent = 0  # floats the gradients would have been instead

    # ------------------------------------------------------------------ ownership
    def owners(self, sizes: list[int]) -> list[int]:
        """Owner rank of each item: largest first to the least-loaded rank (ties: lowest
        rank), so every rank computes the same assignment."""
        load = [0] * self.world
        out = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            out[i] = r
            load[r] += sizes[i]
        return out

    def owns(self, owner: int) -> bool:
        return owner == self.rank

    # ------------------------------------------------------------------ collectives
    def _buckets(self, tensors: list[torch.Tensor]):
        group, size = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if group and (size + n > BUCKET_BYTES or t.dtype != group[0].dtype):
                yield group
                group, size = [], 0
            group.append(t)
            size += n
        if group:
            yield group

    def allreduce_mean_(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` in place across ranks (bucketed, in their own dtype)."""
        d = _dist()
        for group in self._buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in group])
            d.all_reduce(flat, op=d.ReduceOp.SUM)
            flat.mul_(1.0 / self.world)
            self.bytes_sent += flat.numel() * flat.element_size()
            off = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[off : off + n].view_as(t))
                off += n

    def reduce_mean_to_owners_(self, items: list[tuple[torch.Tensor, int]]) -> None:
        """For (tensor, owner) pairs: the owner's tensor becomes the average over ranks; the
        others' are left as they are (not to be used). ``reduce_scatter_tensor`` over
        buckets: each bucket's flat input holds rank r's items at chunk r (padded to the
        bucket's longest chunk), so the temporaries stay within two buckets whatever the
        model size."""
        d = _dist()
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, int]]] = {}
        for t, owner in items:
            by_dtype.setdefault(t.dtype, []).append((t, owner))
        for dtype, group in by_dtype.items():
            per_rank_limit = max(1, BUCKET_BYTES // (self.world * group[0][0].element_size()))
            bucket: list[tuple[torch.Tensor, int]] = []
            load = [0] * self.world
            for t, owner in group:
                if bucket and load[owner] + t.numel() > per_rank_limit:
                    self._reduce_scatter_bucket(bucket, load, dtype, d)
                    bucket, load = [], [0] * self.world
                bucket.append((t, owner))
                load[owner] += t.numel()
            if bucket:
                self._reduce_scatter_bucket(bucket, load, dtype, d)

    def _reduce_scatter_bucket(self, bucket, load, dtype, d) -> None:
        longest = max(load)
        if longest == 0:
            return
        device = bucket[0][0].device
        flat = torch.zeros(self.world * longest, dtype=dtype, device=device)
        offsets = [r * longest for r in range(self.world)]
        for t, owner in bucket:
            n = t.numel()
            flat[offsets[owner] : offsets[owner] + n].copy_(t.reshape(-1))
            offsets[owner] += n
        mine = torch.empty(longest, dtype=dtype, device=device)
        # reduce_scatter_single where torch has it: reduce_scatter_tensor (the same op) is
        # deprecated there and warns on every rank's stderr (--json included)
        getattr(d, "reduce_scatter_single", d.reduce_scatter_tensor)(mine, flat, op=d.ReduceOp.SUM)
        self.bytes_sent += flat.numel() * flat.element_size()
        mine.mul_(1.0 / self.world)
        off = 0
        for t, owner in bucket:
            if owner != self.rank:
                continue
            n = t.numel()
            t.copy_(mine[off : off + n].view_as(t))
            off += n

    # ------------------------------------------------------------------ in the backward
    def reduce_async(self, tensor: torch.Tensor, owner: int):
        """Start summing ``tensor`` into ``owner``'s copy (in place); returns the work. The
        caller scales by 1/world on the owner once the work is done."""
        d = _dist()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return d.reduce(tensor, dst=owner, op=d.ReduceOp.SUM, async_op=True)

    def allreduce_async(self, tensor: torch.Tensor):
        """Start summing ``tensor`` over ranks (in place); returns the work."""
        d = _dist()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return d.all_reduce(tensor, op=d.ReduceOp.SUM, async_op=True)

    def allreduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few numbers over ranks (float64 on the CPU with gloo, else on the device)."""
        d = _dist()
        dev = "cpu" if self.backend == "gloo" else torch.cuda.current_device()
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        d.all_reduce(t, op=d.ReduceOp.SUM)
        return t.tolist()

    def allreduce_scores_(self, scores: torch.Tensor, grad_numel: int) -> torch.Tensor:
        """Sum per-column score partials over ranks (in place); log the cost next to what
        gathering the gradient would have cost."""
        d = _dist()
        d.all_reduce(scores, op=d.ReduceOp.SUM)
        self.score_floats += scores.numel()
        self.score_grad_equivalent += grad_numel
        return scores

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        _dist().broadcast(tensor, src=src)
        self.bytes_sent += tensor.numel() * tensor.element_size() if src == self.rank else 0
        return tensor
