"""The sampled tokens and their logprobs, read from what ``LLM.generate`` returned.

These are the logprobs the RL job itself uses (its importance ratios start from them), so the
collector records exactly them rather than recomputing anything. One :class:`Completion` per
sampled sequence: a request with ``n > 1`` has ``n``, which vLLM runs as child requests ``k_<id>``.

A request made with ``SamplingParams(logprobs=k)`` also returns, per position, the engine's top-k
(ranked by vLLM's ``Logprob.rank``): kept as the sample's top-k for the full-distribution comparison
(:mod:`isoaudit.audit.distribution`). With ``logprobs=-1`` (engine started with ``max_logprobs=-1``)
every position carries the whole vocabulary: then the top-k is cut from it and the full-vocabulary
sketch computed from it here, on the host (vLLM gives no in-process hook to the logits of every
sampled position through ``generate``; the full vector per position is what its API exposes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from isoaudit.audit.distribution import sketch_projection


@dataclass(frozen=True)
class Completion:
    engine_id: str  # the request id the engine ran it under (before vLLM's random suffix)
    request_id: str  # RequestOutput.request_id
    index: int
    prompt_ids: np.ndarray  # int32
    completion_ids: np.ndarray  # int32
    logprobs: np.ndarray | None  # float32, one per completion token; None when not requested
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, when vLLM says
    topk_ids: np.ndarray | None = None  # int32 [n, k], rank order; None: logprobs=0 or not requested
    topk_logprobs: np.ndarray | None = None  # float32 [n, k]
    dist_sketch: np.ndarray | None = None  # float32 [n, 32], only from full-vocabulary logprobs


def _sampled_logprobs(entries: Any, tokens: np.ndarray) -> np.ndarray | None:
    if entries is None:
        return None
    if len(entries) != tokens.size:
        raise ValueError(f"outputs: {len(entries)} logprob entries for {tokens.size} completion tokens")
    flat = _flat_sampled(entries, tokens)
    if flat is not None:
        return flat
    try:  # vLLM's dicts of Logprob: one lookup per position
        return np.array(
            [entry[token].logprob for entry, token in zip(entries, tokens.tolist(), strict=True)], np.float32
        )
    except (KeyError, TypeError, AttributeError):
        pass  # a position without its token (an error, below), or plain floats
    found = [
        entry.get(token) if entry is not None else None
        for entry, token in zip(entries, tokens.tolist(), strict=True)
    ]
    if None in found:
        i = found.index(None)
        raise ValueError(f"outputs: no logprob for sampled token {int(tokens[i])} at completion index {i}")
    return np.array([getattr(f, "logprob", f) for f in found], dtype=np.float32)


def _flat_sampled(entries: Any, tokens: np.ndarray) -> np.ndarray | None:
    """The sampled logprobs of vLLM's ``FlatLogprobs`` (``SamplingParams(flat_logprobs=True)``)
    without a dict per position: each position's first entry is its sampled token. ``None``: not
    that container, or a position whose first entry is not the sampled token (read per position)."""
    starts = getattr(entries, "start_indices", None)
    if starts is None or not tokens.size:
        return None
    first = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(entries.end_indices, dtype=np.int64)
    if first.shape != tokens.shape or (ends <= first).any():
        return None
    ids = np.asarray(entries.token_ids, dtype=np.int64)[first]
    if not np.array_equal(ids, tokens):
        return None
    return np.asarray(entries.logprobs, dtype=np.float32)[first]


def _ranked_prefix(entry: Any, limit: int) -> list[tuple[int, float]]:
    """One position's entries in rank order, as long as they are a top-m (the i-th has rank <= i;
    the sampled token, when it ranks below the requested k, ends the prefix unless it is next),
    ``limit`` at most."""
    if len(entry) == 1:  # logprobs=0: the sampled token alone, a top-1 when it ranks first
        ((token, found),) = entry.items()
        rank = getattr(found, "rank", None)
        if rank is None or rank > 1 or limit < 1:
            return []
        return [(int(token), float(getattr(found, "logprob", found)))]
    items = sorted(
        (
            (int(token), getattr(found, "logprob", found), getattr(found, "rank", None))
            for token, found in entry.items()
        ),
        key=lambda item: (item[2] if item[2] is not None else 1 << 62, item[0]),
    )
    prefix = []
    for i, (token, logprob, rank) in enumerate(items[:limit], start=1):
        if rank is None or rank > i:
            break
        prefix.append((token, float(logprob)))
    return prefix


def _distribution(
    entries: Any, n_tokens: int, vocab: int | None, k: int
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The top-k (cut to the smallest prefix any position has, at most ``k``) and, when every
    position holds the whole vocabulary, the full-vocabulary sketch."""
    if entries is None or n_tokens == 0 or k < 1:
        return None, None, None
    full = vocab is not None and all(entry is not None and len(entry) >= vocab for entry in entries)
    if full:
        assert vocab is not None
        dense = np.full((n_tokens, vocab), -np.inf, dtype=np.float32)
        for i, entry in enumerate(entries):
            tokens = np.fromiter((int(t) for t in entry.keys()), dtype=np.int64, count=len(entry))
            values = np.fromiter(
                (getattr(v, "logprob", v) for v in entry.values()), dtype=np.float32, count=len(entry)
            )
            keep = tokens < vocab
            dense[i, tokens[keep]] = values[keep]
        width = min(k, vocab)
        order = np.lexsort(
            (np.broadcast_to(np.arange(vocab), dense.shape), -dense.astype(np.float64)), axis=-1
        )
        ids = order[:, :width].astype(np.int32)
        sketch = (
            np.exp(dense.astype(np.float64) * 0.5) @ sketch_projection(vocab).astype(np.float64)
        ).astype(np.float32)
        return ids, np.take_along_axis(dense, ids.astype(np.int64), axis=1), sketch
    if None in entries:
        return None, None, None
    # the top-k is as wide as the narrowest position's ranked prefix: stop once that is nothing
    width = min(k, min(map(len, entries)))
    prefixes = []
    for entry in entries:
        if width == 0:
            return None, None, None
        prefix = _ranked_prefix(entry, width)
        width = min(width, len(prefix))
        prefixes.append(prefix)
    if width == 0:
        return None, None, None
    ids = np.array([[t for t, _ in p[:width]] for p in prefixes], dtype=np.int32)
    values = np.array([[v for _, v in p[:width]] for p in prefixes], dtype=np.float32)
    return ids, values, None


def read_completions(outputs: Iterable[Any], *, vocab: int | None = None, k: int = 8) -> list[Completion]:
    """Every sampled sequence of ``outputs`` (``vllm.RequestOutput`` objects). ``vocab``: the
    model's vocabulary size (positions holding that many logprobs give the sketch); ``k``: the most
    top-k entries kept per position (0: none)."""
    found = []
    for j, output in enumerate(outputs):
        prompt = getattr(output, "prompt_token_ids", None)
        if prompt is None or not hasattr(output, "outputs"):
            raise TypeError(
                f"outputs[{j}]: expected a vllm.RequestOutput with prompt_token_ids, got {type(output).__name__}"
            )
        prompt_ids = np.asarray(prompt, dtype=np.int32)
        many = len(output.outputs) > 1
        for completion in output.outputs:
            tokens = np.asarray(completion.token_ids, dtype=np.int32)
            index = int(getattr(completion, "index", 0))
            top_ids, top_values, sketch = _distribution(completion.logprobs, tokens.size, vocab, k)
            found.append(
                Completion(
                    engine_id=f"{index}_{output.request_id}" if many else str(output.request_id),
                    request_id=str(output.request_id),
                    index=index,
                    prompt_ids=prompt_ids,
                    completion_ids=tokens,
                    logprobs=_sampled_logprobs(completion.logprobs, tokens),
                    cached_tokens=_optional_int(getattr(output, "num_cached_tokens", None)),
                    topk_ids=top_ids,
                    topk_logprobs=top_values,
                    dist_sketch=sketch,
                )
            )
    return found


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
