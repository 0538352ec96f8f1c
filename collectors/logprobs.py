"""Per-token logprobs with the *processed* semantics: what vLLM's ``processed_logprobs`` mode returns.

vLLM's sampler, in order: fp32 logits, divided by the temperature; min-p masks tokens whose
probability is below ``min_p`` times the largest; top-k keeps the logits at or above the k-th
largest; top-p keeps the smallest set of most likely tokens whose probability reaches ``p`` (the
most likely always kept); the logprobs are a log-softmax over what is kept (renormalised, masked
tokens at -inf). :func:`processed_logprobs` applies exactly that, so a trainer that scores with the
engine's transforms measures the same distribution; one that applies only the temperature while
the engine truncated is named by the diagnosis (``semantics``, the parameter at fault).

Only the rows that predict a completion token are gathered before the softmax, so a long prompt
costs nothing here. When every sample shares one temperature the division is by that Python float,
exactly the ``log_softmax(logits / T)`` a trainer writes (on CUDA, dividing by a scalar and by a
tensor of the same value can round differently).

While the invariant kernels are on (remediation mode ``invariant``), the log-softmax is theirs, so the
trainer's logprobs are the same arithmetic as an engine running
:func:`isoaudit.kernels.dispatch.token_logprobs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np
import torch
from isoaudit.collectors.transfer import to_device

#: A sampler parameter for a step: one value for every sample, one per sample, or ``None`` (off).
SamplingArg = float | int | Sequence[float | int | None] | np.ndarray | None

#: The transforms after the temperature, in the order vLLM applies them.
TRUNCATIONS = ("min_p", "top_k", "top_p")


def sampling_values(value: SamplingArg, n: int, name: str) -> np.ndarray | None:
    """``value`` as float64 per sample, NaN where the transform is off (top_k <= 0, top_p 1,
    min_p 0, None); ``None`` when it is off for every sample."""
    if value is None:
        return None
    if np.isscalar(value):
        values = np.full(n, float(cast(float, value)))
    else:
        per_sample = cast(Sequence[float | int | None], value)
        values = np.array([np.nan if v is None else float(v) for v in per_sample], dtype=np.float64)
    if values.shape != (n,):
        raise ValueError(f"{name}: expected a number or {n} values, got {values.size}")
    known = values[~np.isnan(values)]
    if name == "top_k":
        if (known != np.round(known)).any():
            raise ValueError(f"top_k: must be integers, got {known.tolist()}")
        values[values <= 0] = np.nan
    elif name == "top_p":
        if ((known <= 0) | (known > 1)).any():
            raise ValueError(f"top_p: must be in (0, 1], got {known.tolist()}")
        values[values >= 1] = np.nan
    elif name == "min_p":
        if ((known < 0) | (known > 1)).any():
            raise ValueError(f"min_p: must be in [0, 1], got {known.tolist()}")
        values[values <= 0] = np.nan
    return None if np.isnan(values).all() else values


def applied_transforms(
    temperature: np.ndarray | None, transforms: Mapping[str, np.ndarray | None], *, given: bool = False
) -> tuple[str, ...]:
    """What the trainer's logprobs apply, for the manifest: ``given`` (the caller's own logprobs,
    stated to apply these), then each transform some sample applies."""
    applied = ["given"] if given else []
    if temperature is not None and bool(np.any((temperature != 1.0) & (temperature > 0))):
        applied.append("temperature")
    applied += [name for name in TRUNCATIONS if transforms.get(name) is not None]
    return tuple(applied) or ("none",)


def _per_token(values: np.ndarray, sample_of_token: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(values[sample_of_token].astype(np.float32)), device)[:, None]


def truncate(
    scaled: torch.Tensor,
    sample_of_token: np.ndarray,
    *,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
) -> torch.Tensor:
    """Mask (to -inf, in place) the logits vLLM's sampler masks: min-p, then top-k, then top-p.
    ``scaled``: fp32 logits already divided by the temperature, one row per token."""
    device = scaled.device
    vocab = scaled.shape[-1]
    if min_p is not None:
        rows = ~np.isnan(min_p[sample_of_token])
        probs = scaled.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _per_token(
            np.nan_to_num(min_p), sample_of_token, device
        )
        mask = (probs < threshold) & to_device(torch.from_numpy(rows), device)[:, None]
        scaled.masked_fill_(mask, -float("inf"))
    if top_k is not None:
        k = np.nan_to_num(top_k[sample_of_token], nan=vocab).astype(np.int64).clip(1, vocab)
        if (k < vocab).any():
            k_t = to_device(torch.from_numpy(k), device)
            kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k_t - 1)[:, None])
            kth.masked_fill_((k_t == vocab)[:, None], -float("inf"))
            scaled.masked_fill_(scaled < kth, -float("inf"))
    if top_p is not None:
        p = _per_token(np.nan_to_num(top_p, nan=1.0), sample_of_token, device)
        ordered, order = scaled.sort(dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - p
        drop[:, -1] = False  # the most likely token is always kept
        ordered.masked_fill_(drop, -float("inf"))
        scaled.scatter_(dim=-1, index=order, src=ordered)
    return scaled


def processed_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    predict_rows: np.ndarray,
    target_rows: np.ndarray,
    temperature: np.ndarray,
    sample_of_token: np.ndarray,
    *,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
) -> torch.Tensor:
    """Logprob of each target token under the logits of its predicting row, fp32, on logits' device
    (the arguments as :func:`processed_logprob_rows` takes them)."""
    rows, targets = processed_logprob_rows(
        logits,
        input_ids,
        predict_rows,
        target_rows,
        temperature,
        sample_of_token,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )
    return rows.gather(1, targets[:, None]).squeeze(1)


def processed_logprob_rows(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    predict_rows: np.ndarray,
    target_rows: np.ndarray,
    temperature: np.ndarray,
    sample_of_token: np.ndarray,
    *,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full log-probability row of each target token's predicting row (``[targets, vocab]``,
    fp32, on logits' device) and the target token ids: the distribution each logprob comes from.

    ``predict_rows``/``target_rows`` index the flattened ``[rows * cols]`` positions; ``temperature``
    has one value per sample and ``sample_of_token`` maps each target to its sample. A temperature of
    0 (greedy) is applied as 1. ``top_k``/``top_p``/``min_p``: per sample, NaN where off
    (:func:`sampling_values`). The target token itself is always kept: the engine sampled it, so
    it was in the engine's kept set, and a near tie at the boundary must not score -inf.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if flat.shape[0] != input_ids.numel():
        raise ValueError(f"logits: {flat.shape[0]} rows for {input_ids.numel()} tokens (logits_to_keep set?)")
    device = logits.device
    # the indices leave pinned memory without a sync: a plain ``.to(device)`` would wait for the
    # forward still queued on the device before the host goes on
    predict = to_device(torch.from_numpy(predict_rows), device)
    target_index = to_device(torch.from_numpy(target_rows), device)
    targets = to_device(input_ids.reshape(-1), device).index_select(0, target_index)
    # a fresh gather, scaled in place: a [targets, vocab] fp32 tensor less, one pass less over it
    scaled = flat.index_select(0, predict).float()
    temps = np.where(temperature > 0, temperature, 1.0)
    if temps.size == 0 or bool(np.all(temps == temps[0])):
        scale = float(temps[0]) if temps.size else 1.0
        if scale != 1.0:
            scaled.div_(scale)
    else:
        per_token = to_device(torch.from_numpy(temps[sample_of_token].astype(np.float32)), device)
        scaled.div_(per_token[:, None])
    if top_k is not None or top_p is not None or min_p is not None:
        sampled = scaled.gather(1, targets[:, None])
        scaled = truncate(  # a fresh gather: masking it in place touches no caller tensor
            scaled,
            np.asarray(sample_of_token),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
        )
        # The engine kept the token it sampled: where kernel noise puts it just past the trainer's
        # boundary (a near tie at the k-th logit), it stays in the kept set instead of scoring -inf.
        scaled.scatter_(1, targets[:, None], sampled)
    return _log_softmax(scaled), targets


def _log_softmax(rows: torch.Tensor) -> torch.Tensor:
    from isoaudit.kernels import dispatch

    return dispatch.log_softmax(rows)  # the invariant one while kernels are on (CPU or Triton), else torch's
