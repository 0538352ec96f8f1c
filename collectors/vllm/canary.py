"""vLLM's canary: the canary prompt through ``LLM.generate``, the path every rollout takes
(scheduler, model runner, the compiled graph or CUDA graphs where the engine runs them, the
sampler's log-softmax), one token at temperature 1 with the top-k log-probabilities of the last
position (:mod:`isoaudit.collectors.canary` defines what is digested).

vLLM has no second path that reads its held weights without its derived state (vLLM-CPU packs
and removes the linear weights), so it gives no reference of its own: its canary is compared with
the trainer's where both compute under one numerical policy, and with its own previous canary
across a weight change (:mod:`isoaudit.audit.stale_state`). The canary request is drained from the
workers' bookkeeping at once, so it is never recorded as a sample.
"""

from __future__ import annotations

import uuid
from typing import Any

from isoaudit.audit.records import CANARY_TOP_K, CanaryOutput
from isoaudit.collectors.canary import canary_tokens, output_from_top
from isoaudit.collectors.vllm.engine_state import drain_facts
from isoaudit.collectors.vllm.messages import Drain, to_wire
from isoaudit.collectors.vllm.outputs import read_completions


def vocab_of_llm(llm: Any) -> int:
    """The engine's vocabulary size (the model's, not the padded one)."""
    return int(llm.llm_engine.vllm_config.model_config.get_vocab_size())


def path_of(llm: Any) -> str:
    """The forward ``LLM.generate`` runs, in words."""
    config = llm.llm_engine.vllm_config
    eager = bool(getattr(config.model_config, "enforce_eager", False))
    how = "eager" if eager else "compiled, CUDA graphs where the platform has them"
    return f"vLLM's LLM.generate ({how})"


def vllm_canary(llm: Any, link: Any, tokens: list[int]) -> tuple[CanaryOutput, None]:
    """The canary through ``llm.generate``; its request is then dropped from the workers' records."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, logprobs=CANARY_TOP_K, seed=0)
    # a fresh cache salt: the canary never reads prefix-cache blocks of an earlier canary
    prompt = {"prompt_token_ids": list(tokens), "cache_salt": f"isoaudit-canary-{uuid.uuid4().hex}"}
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    try:
        first = output.outputs[0].logprobs[0]
        top = {
            int(t): float(lp.logprob)
            for t, lp in first.items()
            if lp.rank is not None and lp.rank <= CANARY_TOP_K
        }
    finally:
        ids = [c.engine_id for c in read_completions([output])]
        link.call("drain", to_wire(Drain(request_ids=ids)))
        drain_facts(link, ids)
    if len(top) != CANARY_TOP_K:
        raise ValueError(
            f"the engine returned {len(top)} of the canary's {CANARY_TOP_K} top log-probabilities"
        )
    return output_from_top(path_of(llm), tokens, top), None


def take_canary(collector: Any, version: str | None) -> None:
    """Run vLLM's canary for ``collector`` (after its held digests were refreshed). Never raises."""
    if not collector.canary_enabled:
        return
    llm = collector.link.llm
    tokens = collector.guarded("canary", lambda: canary_tokens(vocab_of_llm(llm)))
    if tokens is not None:
        collector._take_canary(version, tokens, lambda: vllm_canary(llm, collector.link, tokens))
