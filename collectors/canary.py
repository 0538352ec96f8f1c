"""The canary forward: after every weight version change each side runs one fixed prompt through
the forward it really runs and puts the result in its manifest (``Manifest.canary``,
:mod:`isoaudit.audit.records.canary`), so the ``stale_engine_state`` diagnosis can tell held weights
from the weights a forward reads.

What runs, per side (the output is the next token's top-k fp32 log-probabilities after the whole
prompt, from the side's fp32 head and a full-vocabulary log-softmax, at temperature 1):

* the trainer: its model's own forward (the fp32 head of :mod:`isoaudit.kernels.dispatch`, as the
  trainer's logprobs are computed);
* the reference engine (:class:`isoaudit.kernels.engine.RolloutEngine`): the prompt but its last
  token through the engine's packed step, then the last token through the decode it runs: the
  CUDA graph it replays when it replays graphs, with a **reference**: the same decode function run
  eagerly over a fresh cache, straight from the parameters (same kernels, same shapes: the same
  bits unless the graph reads other storage); the packed step alone where it runs no graphs;
* vLLM: :mod:`isoaudit.collectors.vllm.canary`.

Cost: one forward over :data:`CANARY_LENGTH` tokens per side per weight version change. Never
raises: a failure becomes ``Canary.error`` and is counted by the collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from isoaudit.audit.records import CANARY_TOP_K, Canary, CanaryOutput, canary_digest, held_digest
from isoaudit.collectors.manifest import ContractArg, contract_fields

#: Tokens in the canary prompt.
CANARY_LENGTH = 16
#: The first token id the canary uses (below it: special tokens of most vocabularies' tiny models).
FIRST_ID = 3
_SEED = 0xCA9A27


def canary_tokens(vocab_size: int, length: int = CANARY_LENGTH) -> list[int]:
    """The canary prompt for a vocabulary of ``vocab_size``: fixed pseudo-random ids, the same on
    every side and in every process."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size: need more than {FIRST_ID} tokens, got {vocab_size}")
    rng = np.random.default_rng(_SEED)
    return [int(t) for t in rng.integers(FIRST_ID, vocab_size, length)]


def output_of(path: str, tokens: list[int], logp_row: torch.Tensor, k: int = CANARY_TOP_K) -> CanaryOutput:
    """A canary output from one full-vocabulary fp32 log-probability row."""
    values, ids = torch.topk(logp_row.detach().float().reshape(-1), k)
    top_ids = [int(i) for i in ids.cpu().tolist()]
    top = [float(v) for v in values.cpu().tolist()]
    return CanaryOutput(
        path=path, digest=canary_digest(tokens, top_ids, top), top_ids=top_ids, top_logprobs=top
    )


def output_from_top(path: str, tokens: list[int], top: dict[int, float]) -> CanaryOutput:
    """A canary output from a side that only returns the top log-probabilities (token id -> value)."""
    ids = [int(i) for i in top]
    values = [float(np.float32(v)) for v in top.values()]
    return CanaryOutput(
        path=path, digest=canary_digest(tokens, ids, values), top_ids=ids, top_logprobs=values
    )


def arithmetic_of(contract: ContractArg) -> str | None:
    """The identity of the arithmetic a side runs: its contract's numerical-policy identity."""
    identities, _ = contract_fields(contract)
    return identities.numerical_policy


def run_canary(
    compute: Callable[[], tuple[CanaryOutput, CanaryOutput | None]],
    *,
    tokens: list[int],
    weight_version: str | None,
    held: dict[str, str],
    arithmetic: str | None,
) -> Canary:
    """Run ``compute`` (the side's canary forward and its reference, if any) and describe it; an
    error becomes ``Canary.error`` (the job goes on)."""
    start = time.perf_counter()
    common: dict[str, Any] = {
        "weight_version": weight_version,
        "held_digest": held_digest(held),
        "tokens": tokens,
        "arithmetic": arithmetic,
    }
    try:
        output, reference = compute()
    except Exception as exc:
        return Canary(
            **common, error=f"{type(exc).__name__}: {exc}"[:1024], seconds=time.perf_counter() - start
        )
    return Canary(**common, output=output, reference=reference, seconds=time.perf_counter() - start)


# ---------------------------------------------------------------- the trainer


def _head_weight(model: torch.nn.Module) -> torch.Tensor | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    weight = getattr(head, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def vocab_of(model: torch.nn.Module) -> int | None:
    """The vocabulary size of an HF causal LM (its config, else its head's rows); ``None`` for a
    model that is no language model (it gets no canary)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    weight = _head_weight(model)
    return int(weight.shape[0]) if weight is not None else None


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    getter = getattr(model, "get_decoder", None)
    try:
        decoder = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None
    return decoder if isinstance(decoder, torch.nn.Module) and decoder is not model else None


@torch.no_grad()
def model_canary(model: torch.nn.Module, tokens: list[int]) -> CanaryOutput:
    """The trainer's canary: its model's own decoder (the final norm included), then the fp32 head
    the trainer's logprobs use (:func:`isoaudit.kernels.dispatch.logits_fp32`); a model without a
    decoder and head of its own: its logits. No ``output_hidden_states`` (transformers then leaves
    capture hooks on the layers)."""
    from isoaudit.kernels import dispatch

    param = next(model.parameters())
    ids = torch.tensor([tokens], device=param.device)
    weight, decoder = _head_weight(model), _decoder(model)
    if weight is not None and decoder is not None:
        out = decoder(input_ids=ids)
        hidden = getattr(out, "last_hidden_state", None)
        final = hidden if isinstance(hidden, torch.Tensor) else out[0]
        logits = dispatch.logits_fp32(final[0, -1:], weight)
        path = "the trainer's model forward, fp32 head"
    else:
        logits = model(input_ids=ids).logits[0, -1:].float()
        path = "the trainer's model forward"
    return output_of(path, tokens, dispatch.log_softmax(logits)[0])


# ---------------------------------------------------------------- the reference engine


@torch.no_grad()
def engine_canary(
    engine: Any, tokens: list[int], step: Callable[..., torch.Tensor] | None = None
) -> tuple[CanaryOutput, CanaryOutput | None]:
    """The reference engine's canary (see the module's docstring) and, when it replays CUDA graphs,
    its eager reference. ``step``: the adapter's step without a collector's wrapper (so the canary
    is not filed as a request)."""
    from isoaudit.kernels import engine as engine_module

    adapter = engine.model
    run_step = step if step is not None else adapter.step
    weight = adapter.lm_head_weight
    dev = weight.device
    n = len(tokens)
    if n + 1 > engine.max_len:
        raise ValueError(f"canary: {n} tokens do not fit the engine's max_len {engine.max_len}")
    inv_t = torch.ones((), dtype=torch.float32, device=dev)

    def prefill(cache: Any, count: int) -> torch.Tensor:
        ids = torch.tensor(tokens[:count], device=dev)
        cu = torch.tensor([0, count], device=dev, dtype=torch.int32)
        return run_step(ids, torch.arange(count, device=dev), cu, [0], cache)

    if not engine.graphed():
        cache = adapter.new_cache(1, engine.max_len)
        hidden = prefill(cache, n)
        logp, _ = engine_module._head(hidden[-1:], weight, inv_t)
        return output_of("the reference engine's packed step (eager)", tokens, logp[0]), None

    slots = engine_module.bucket(1, engine.buckets)
    cache = engine._cache(slots)
    prefill(cache, n - 1)
    graph = engine._graph(slots, cache)
    graph.inv_t.fill_(1.0)
    graph.pos.fill_(engine.max_len - 1)
    graph.ids.zero_()
    graph.ids[0] = tokens[-1]
    graph.pos[0] = n - 1
    logp, _ = graph()
    replayed = output_of(f"the reference engine's CUDA-graph decode (bucket {slots})", tokens, logp[0])

    fresh = adapter.new_cache(slots, engine.max_len)
    prefill(fresh, n - 1)
    ids = torch.zeros(slots, dtype=torch.long, device=dev)
    pos = torch.full((slots,), engine.max_len - 1, dtype=torch.long, device=dev)
    ids[0], pos[0] = tokens[-1], n - 1
    eager_logp, _ = engine._decode_fn(fresh)(ids, pos, inv_t)
    reference = output_of("the same decode run eagerly from the held parameters", tokens, eager_logp[0])
    return replayed, reference
