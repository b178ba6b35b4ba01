"""Which parameters get ZenFlow treatment, their column scores and the top-k selection.

A ZenFlow weight is a 2-D trainable tensor with at least ``min_numel`` elements. Its
*columns* are its input features (ZENFLOW.md section 2): ``W[:, j]`` for ``nn.Linear``
(weight ``[out, in]``, ``column_dim=1``), but ``W[j, :]`` for transformers' ``Conv1D``
(GPT-2 stores ``[in, out]``: ``column_dim=0``). ``nn.Embedding`` weights ``[num, dim]`` are
scored by rows (tokens, ``column_dim=0``: a lookup is a Linear on a one-hot token; see
``column_axis``). Everything else
(1-D params, small tensors) is "always important": updated fully on the device every step.

Importance of column j = squared L2 norm of the gradient column, ``sum_i G[i, j]**2``. It is
cheap (one fused pass), never negative, and its per-column values can be summed across
data-parallel ranks before top-k, so every rank selects the same columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_MIN_NUMEL = 4096  # below this a matrix is cheaper to update fully on the device


@dataclass(frozen=True)
class ParamSpec:
    """A trainable parameter as the engine sees it. ``column_dim`` is None for params
    updated fully on the device (1-D or small)."""

    name: str
    param: torch.nn.Parameter
    column_dim: int | None

    @property
    def is_zenflow(self) -> bool:
        return self.column_dim is not None

    @property
    def n_cols(self) -> int:
        assert self.column_dim is not None
        return self.param.shape[self.column_dim]


def classify_params(model: torch.nn.Module, min_numel: int = DEFAULT_MIN_NUMEL) -> list[ParamSpec]:
    """Trainable params of ``model`` (deduplicated, e.g. tied embeddings once), in
    ``named_parameters`` order, each with the axis its columns are scored along
    (``column_axis``)."""
    uses: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            uses.setdefault(id(p), []).append((module, pname))
    specs = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        column_dim = None
        if p.dim() == 2 and p.numel() >= min_numel:
            column_dim = column_axis(uses.get(id(p), []))
        specs.append(ParamSpec(name, p, column_dim))
    return specs


def column_axis(uses: list[tuple[torch.nn.Module, str]]) -> int:
    """The axis of a 2-D weight's input features, its ZenFlow "columns" (W[:, j] of a
    weight written [out, in]), from the modules that use it (``(module, attribute)``):

    - ``nn.Linear`` stores [out, in]: axis 1.
    - transformers' ``Conv1D`` (GPT-2's blocks) stores [in, out]: axis 0.
    - ``nn.Embedding`` stores [num_embeddings, dim]: a lookup is a Linear applied to a
      one-hot token, so its input features are the tokens, the rows: axis 0. (Scored this
      way, a batch's gradient lands on the rows of the tokens it saw, and moving a column
      is a contiguous row copy.)
    - A weight shared by an embedding and an output projection (GPT-2's tied LM head)
      follows the projection, its matmul use: axis 1.
    - Anything else is taken as [out, in]: axis 1.
    """
    kinds = {type(m).__name__ for m, attr in uses if attr == "weight"}
    linear = any(isinstance(m, torch.nn.Linear) for m, attr in uses if attr == "weight")
    if linear:
        return 1
    if "Conv1D" in kinds:
        return 0
    if uses and all(isinstance(m, torch.nn.Embedding) for m, _ in uses):
        return 0
    return 1


def num_selected(n_cols: int, topk_ratio: float) -> int:
    """ceil(k * n_cols), at least 1, at most n_cols."""
    return max(1, min(n_cols, math.ceil(topk_ratio * n_cols - 1e-9)))


SCORE_CHUNK = 1 << 20  # elements widened to fp32 at a time when scoring a large gradient


def column_scores(grad: torch.Tensor, column_dim: int) -> torch.Tensor:
    """Squared L2 norm of every gradient column, fp32, shape ``[n_cols]``.

    A gradient larger than ``SCORE_CHUNK`` elements is scored in chunks of rows, so the fp32
    temporaries stay small whatever the weight's size (an 8B model's embedding would need
    two 4 GB ones at once)."""
    if grad.numel() <= SCORE_CHUNK:
        g = grad.float()
        return (g * g).sum(dim=1 - column_dim)
    rows = max(1, SCORE_CHUNK // grad.shape[1])
    if column_dim == 1:  # columns along dim 1: sum the chunks' partial column sums
        out = torch.zeros(grad.shape[1], dtype=torch.float32, device=grad.device)
        for r0 in range(0, grad.shape[0], rows):
            g = grad[r0 : r0 + rows].float()
            out += (g * g).sum(dim=0)
        return out
    out = torch.empty(grad.shape[0], dtype=torch.float32, device=grad.device)
    for r0 in range(0, grad.shape[0], rows):  # columns along dim 0: each is a row
        g = grad[r0 : r0 + rows].float()
        out[r0 : r0 + rows] = (g * g).sum(dim=1)
    return out


def allreduce_scores_(scores: torch.Tensor) -> torch.Tensor:
    """Sum the score vector over data-parallel ranks (in place) so all ranks agree."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(scores, op=dist.ReduceOp.SUM)
    return scores


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores, sorted ascending (int64, on the scores' device).

    Ties are broken toward the lower index (stable sort), so the choice is deterministic.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def complement(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Sorted indices in ``range(n)`` that are not in the sorted ``idx``."""
    mask = torch.ones(n, dtype=torch.bool, device=idx.device)
    mask[idx] = False
    return mask.nonzero().flatten()


def split_handover(old: torch.Tensor, new: torch.Tensor):
    """For sorted index sets ``old`` and ``new``: (stay_pos_old, stay_pos_new, in_pos_new,
    in_cols, out_pos_old, out_cols). ``*_pos_*`` index into the compact [k] layouts."""
    in_old = torch.isin(new, old)
    in_new = torch.isin(old, new)
    stay_pos_new = in_old.nonzero().flatten()
    stay_pos_old = in_new.nonzero().flatten()
    in_pos_new = (~in_old).nonzero().flatten()
    out_pos_old = (~in_new).nonzero().flatten()
    return stay_pos_old, stay_pos_new, in_pos_new, new[in_pos_new], out_pos_old, old[out_pos_old]
