"""How a causal LM is scored on record rows: the training loss of a micro-batch, and its
evaluation (eval loss, perplexity, completion log-likelihoods, choice accuracy).

Contract:

- Labels are shifted inside the model as Hugging Face does: the logits at ``t`` predict
  ``labels[t + 1]``; ``IGNORE`` (-100) carries no loss.
- The loss of one rank's micro-batch is ``lm_loss``: the summed next-token cross-entropy of
  its rows divided by the loss tokens of the whole global micro-batch (every rank's rows),
  times the world size. The engines average gradients over ranks, so a step's gradient is
  that of the global micro-batch's token mean whatever the number of ranks: 2 ranks train
  what one process trains. With gradient accumulation each micro-batch is a token mean and
  the step takes the mean of those.
- Evaluation: ``score_completions`` sums the log-likelihood of each completion given its
  prompt; ``token_loss_sum`` gives the summed next-token loss and token count of a batch,
  and ``lm_eval_metrics`` turns the totals into eval loss and perplexity.
- ``evaluate_lm``: ``eval_loss`` (mean next-token loss per predicted token over the eval
  rows), ``perplexity`` (its exp), ``eval_tokens`` and ``eval_samples``. When the eval
  records are prompt/completion records whose completions come from a small set
  (``choice_set``: 2..16 distinct completions and at least 4 times as many records, so
  a classification dataset written as completions), it also reports
  ``choice_accuracy``: the share of records whose own completion is the likeliest of the
  set given the prompt (``score_completions``, summed log-likelihood, no end token).

Owns: the loss and the scores. Must not: read or tokenise records (``sft``,
``record_encoding``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from zenflow.errors import DataError
from zenflow.train.data.record_encoding import (
    IGNORE,
    Tokenised,
    eos_ids,
    pad_token_id,
    special_prefix,
    token_ids,
)

if TYPE_CHECKING:
    from zenflow.train.data.packing import SFTData
    from zenflow.train.data.sft import LMTask


def lm_loss(logits, labels, global_tokens: int, world: int = 1):
    """This rank's share of the global micro-batch's token-mean next-token loss: the summed
    cross-entropy of its rows x world / ``global_tokens`` (see the module docstring)."""
    import torch.nn.functional as F

    # Every position, -100 ignored: no data-dependent indexing, which would make a CUDA
    # step wait for the device (nonzero() syncs) in the middle of the micro-batch.
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    total = F.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum")
    return total * (world / max(int(global_tokens), 1))


def loss_tokens(labels) -> int:
    """The predicted tokens of a batch (labels after the shift that are not -100)."""
    return int((labels[:, 1:] != IGNORE).sum())


def token_loss_sum(logits, labels) -> tuple[float, int]:
    """(summed next-token cross-entropy, number of predicted tokens) of a batch, as Hugging
    Face shifts it: logits [B, L, V] at t predict labels[t + 1]; -100 is skipped."""
    rows, targets, _ = predicted_positions(logits, labels)
    return float(token_nll(rows, targets).sum()), int(targets.numel())


def predicted_positions(logits, labels):
    """The logits that predict a label (``[K, V]``, at t for labels[t + 1] != -100), their
    targets ``[K]`` and each one's row ``[K]``: the loss needs the softmax of these
    positions only, not of the prompt's and the padding's."""
    target = labels[:, 1:]
    keep = target != IGNORE
    where = keep.nonzero()
    return logits[:, :-1][where[:, 0], where[:, 1]], target[keep], where[:, 0]


def token_nll(rows, targets):
    """Per-position negative log-likelihood, in fp32, of ``targets`` under ``rows``."""
    import torch.nn.functional as F

    return F.cross_entropy(rows.float(), targets, reduction="none")


def lm_eval_metrics(total_loss: float, total_tokens: int) -> dict[str, float]:
    """{"eval_loss": mean loss per predicted token, "perplexity": exp of it (inf if it
    overflows)}."""
    if total_tokens <= 0:
        raise ValueError(f"no tokens were evaluated (total_tokens={total_tokens})")
    loss = total_loss / total_tokens
    try:
        ppl = math.exp(loss)
    except OverflowError:
        ppl = math.inf
    return {"eval_loss": loss, "perplexity": ppl}


def score_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    batch_size: int = 8,
    add_eos: bool = False,
) -> list[float]:
    """The summed log-likelihood (natural log) of each completion given its prompt, encoded
    as ``encode_prompt_completion`` does for training. An empty prompt (with no start
    token) is preceded by the tokenizer's bos or eos token so the first completion token
    has context. The model runs in eval mode (its mode is restored) without gradients."""
    import torch

    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    prefix = special_prefix(tokenizer)
    eos = eos_ids(tokenizer) if add_eos else []
    encoded = []
    for prompt, completion in zip(prompts, completions, strict=True):
        p = prefix + token_ids(tokenizer, prompt)
        if not p:
            start = tokenizer.bos_token_id
            start = tokenizer.eos_token_id if start is None else start
            if start is None:
                raise DataError(
                    "An empty prompt cannot be scored with a tokenizer that has neither a "
                    "start nor an end token: the first completion token has no context."
                )
            p = [int(start)]
        c = token_ids(tokenizer, completion) + eos
        encoded.append(Tokenised(p + c, [IGNORE] * len(p) + c))
    device = next(model.parameters()).device
    pad = pad_token_id(tokenizer)
    was_training = model.training
    model.eval()
    scores: list[float] = []
    try:
        with torch.no_grad():
            for b in range(0, len(encoded), batch_size):
                chunk = encoded[b : b + batch_size]
                width = max(len(ex.input_ids) for ex in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                labels = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, ex in enumerate(chunk):
                    k = len(ex.input_ids)
                    ids[r, :k] = torch.tensor(ex.input_ids)
                    labels[r, :k] = torch.tensor(ex.labels)
                    mask[r, :k] = 1
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                rows, targets, row_of = predicted_positions(logits, labels.to(device))
                picked = -token_nll(rows, targets)
                per_row = torch.zeros(len(chunk), dtype=picked.dtype, device=picked.device)
                scores.extend(per_row.index_add_(0, row_of, picked).tolist())
    finally:
        model.train(was_training)
    return scores


def completion_logprob(model, tokenizer, prompt: str, completion: str) -> float:
    """The summed log-likelihood of ``completion`` given ``prompt`` (``score_completions``)."""
    return score_completions(model, tokenizer, [prompt], [completion])[0]


def evaluate_lm(
    model,
    data: SFTData,
    task: LMTask,
    *,
    batch_size: int,
    limit: int | None = None,
    device=None,
    tokenizer=None,
    pairs: Sequence[tuple[str, str]] = (),
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    keep_scores: bool = False,
) -> tuple[dict, list]:
    """Metrics of ``model`` on the first ``limit`` rows of ``data`` (all when None), in
    eval mode (restored after): ``(metrics, per_record)``. With ``keep_scores``,
    ``per_record`` holds each eval row's loss and tokens or, when the task has choices, each
    scored record's prompt, completion, choice and every choice's log-likelihood.
    ``choice_accuracy`` scores the first ``limit`` eval records (``pairs``)."""
    import torch

    n = len(data) if limit is None else min(limit, len(data))
    was_training = model.training
    model.eval()
    total, tokens, per = 0.0, 0, []
    mask_dtype = next(model.parameters()).dtype
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                rows = range(start, min(start + batch_size, n))
                batch = data.take(rows, mask_dtype)
                labels = batch.pop("labels")
                if device is not None:
                    batch = {k: v.to(device) for k, v in batch.items()}
                with autocast():
                    logits = model(**batch).logits
                if keep_scores:
                    for r in range(logits.shape[0]):
                        one = labels[r : r + 1].to(logits.device)
                        s, t = token_loss_sum(logits[r : r + 1], one)
                        per.append({"row": start + r, "loss": s / max(t, 1), "tokens": t})
                s, t = token_loss_sum(logits, labels.to(logits.device))
                total += s
                tokens += t
        metrics = lm_eval_metrics(total, tokens)
        metrics["eval_tokens"] = tokens
        metrics["eval_samples"] = n
        if task.choices:
            if tokenizer is None:
                raise ValueError("choice_accuracy needs the tokenizer")
            scored = list(pairs)[: len(pairs) if limit is None else limit]
            chosen = _choose(model, tokenizer, scored, task.choices, batch_size, autocast)
            right = [ch == c for (ch, _), (_, c) in zip(chosen, scored, strict=True)]
            metrics["choice_accuracy"] = sum(right) / len(right)
            if keep_scores:  # one line per scored record instead
                per = [
                    {"prompt": p, "completion": c, "choice": ch, "scores": scores}
                    for (p, c), (ch, scores) in zip(scored, chosen, strict=True)
                ]
    finally:
        model.train(was_training)
    return metrics, per


def _choose(model, tokenizer, pairs, choices, batch_size, autocast):
    """Per (prompt, completion): the likeliest choice and every choice's log-likelihood."""
    prompts = [p for p, _ in pairs for _ in choices]
    options = [c for _ in pairs for c in choices]
    with autocast():
        scores = score_completions(model, tokenizer, prompts, options, batch_size=batch_size)
    out = []
    for i in range(len(pairs)):
        mine = scores[i * len(choices) : (i + 1) * len(choices)]
        best = max(range(len(choices)), key=lambda j: mine[j])
        out.append((choices[best], dict(zip(choices, mine, strict=True))))
    return out
