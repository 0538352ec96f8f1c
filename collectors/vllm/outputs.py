"""The sampled tokens and their logprobs, read from what ``LLM.generate`` returned.

These are the logprobs the RL job itself uses (its importance ratios start from them), so the
collector records exactly them rather than recomputing anything. One :class:`Completion` per
sampled sequence: a request with ``n > 1`` has ``n``, which vLLM runs as child requests ``k_<id>``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Completion:
    engine_id: str  # the request id the engine ran it under (before vLLM's random suffix)
    request_id: str  # RequestOutput.request_id
    index: int
    prompt_ids: np.ndarray  # int32
    completion_ids: np.ndarray  # int32
    logprobs: np.ndarray | None  # float32, one per completion token; None when not requested
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, when vLLM says


def _sampled_logprobs(entries: Any, tokens: np.ndarray) -> np.ndarray | None:
    if entries is None:
        return None
    if len(entries) != tokens.size:
        raise ValueError(f"outputs: {len(entries)} logprob entries for {tokens.size} completion tokens")
    values = np.empty(tokens.size, np.float32)
    for i, (entry, token) in enumerate(zip(entries, tokens.tolist(), strict=True)):
        found = entry.get(token) if entry is not None else None
        if found is None:
            raise ValueError(f"outputs: no logprob for sampled token {token} at completion index {i}")
        values[i] = getattr(found, "logprob", found)
    return values


def read_completions(outputs: Iterable[Any]) -> list[Completion]:
    """Every sampled sequence of ``outputs`` (``vllm.RequestOutput`` objects)."""
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
            found.append(
                Completion(
                    engine_id=f"{index}_{output.request_id}" if many else str(output.request_id),
                    request_id=str(output.request_id),
                    index=index,
                    prompt_ids=prompt_ids,
                    completion_ids=tokens,
                    logprobs=_sampled_logprobs(completion.logprobs, tokens),
                    cached_tokens=_optional_int(getattr(output, "num_cached_tokens", None)),
                )
            )
    return found


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
