"""vLLM's canary: the canary prompt through ``LLM.generate``, the path every rollout takes
(scheduler, model runner, the compiled graph or CUDA graphs where the engine runs them, the
sampler's log-softmax), one token at temperature 1 with the top-k log-probabilities of the last
position (:mod:`isoaudit.collectors.canary` defines what is digested).

vLLM has no second path that reads its held weights without its derived state (vLLM-CPU packs
and removes the linear weights), so it gives no reference of its own: its canary is compared with
the trainer's where both compute under one numerical policy, and with its own previous canary
across a weight change (:mod:`isoaudit.audit.stale_state`). The canary runs under a request id of its
own, only while no other request is in flight (an in-flight update's canary waits for the next step
boundary), and is drained from the workers' bookkeeping at once, so it is never recorded as a sample.
"""

from __future__ import annotations

import uuid
from typing import Any

from isoaudit.audit.records import CANARY_TOP_K, CanaryOutput
from isoaudit.collectors.canary import canary_tokens, output_from_top
from isoaudit.collectors.vllm.engine_state import drain_facts
from isoaudit.collectors.vllm.messages import CANARY_REQUEST_PREFIX, Drain, to_wire


def vocab_of_llm(llm: Any) -> int:
    """The engine's vocabulary size (the model's, not the padded one)."""
    return int(llm.llm_engine.vllm_config.model_config.get_vocab_size())


def path_of(llm: Any) -> str:
    """The forward ``LLM.generate`` runs, in words."""
    config = llm.llm_engine.vllm_config
    eager = bool(getattr(config.model_config, "enforce_eager", False))
    how = "eager" if eager else "compiled, CUDA graphs where the platform has them"
    return f"vLLM's LLM.generate ({how})"


#: Engine steps the canary may take (one prefill, one sampled token; the rest is slack).
MAX_STEPS = 64


def engine_idle(llm: Any) -> bool:
    """Whether no request is in flight (the canary must not step anybody else's requests)."""
    return not llm.llm_engine.has_unfinished_requests()


def vllm_canary(llm: Any, link: Any, tokens: list[int]) -> tuple[CanaryOutput, None]:
    """The canary through the engine ``LLM.generate`` drives, under a request id of its own (the
    job's request counter is not touched); its request is then dropped from the workers' records."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, max_tokens=1, logprobs=CANARY_TOP_K, seed=0)
    request_id = f"{CANARY_REQUEST_PREFIX}{uuid.uuid4().hex}"
    # a fresh cache salt: the canary never reads prefix-cache blocks of an earlier canary
    prompt = {"prompt_token_ids": list(tokens), "cache_salt": request_id}
    engine.add_request(request_id, prompt, params)
    output = None
    try:
        for _ in range(MAX_STEPS):
            for out in engine.step():
                if getattr(out, "request_id", None) == request_id and out.finished:
                    output = out
            if output is not None:
                break
    finally:
        if output is None:
            engine.abort_request([request_id])
        ids = [request_id]
        link.call("drain", to_wire(Drain(request_ids=ids)))
        drain_facts(link, ids)
    if output is None:
        raise TimeoutError(f"the canary request did not finish within {MAX_STEPS} engine steps")
    first = output.outputs[0].logprobs[0]
    top = {
        int(t): float(lp.logprob)
        for t, lp in first.items()
        if lp.rank is not None and lp.rank <= CANARY_TOP_K
    }
    if len(top) != CANARY_TOP_K:
        raise ValueError(
            f"the engine returned {len(top)} of the canary's {CANARY_TOP_K} top log-probabilities"
        )
    return output_from_top(path_of(llm), tokens, top), None


def take_canary(collector: Any, version: str | None) -> None:
    """Run vLLM's canary for ``collector`` (after its held digests were refreshed); with requests in
    flight (an in-flight weight update) it waits for the collector's next step boundary
    (:func:`take_pending_canary`). Never raises."""
    if not collector.canary_enabled:
        return
    llm = collector.link.llm
    if not engine_idle(llm):
        collector.canary_pending = (version,)
        return
    collector.canary_pending = None
    tokens = collector.guarded("canary", lambda: canary_tokens(vocab_of_llm(llm)))
    if tokens is not None:
        collector._take_canary(version, tokens, lambda: vllm_canary(llm, collector.link, tokens))


def take_pending_canary(collector: Any) -> None:
    """The canary a weight change left for later, once the engine is idle (at a step boundary)."""
    pending = getattr(collector, "canary_pending", None)
    if pending is not None and pending[0] == collector.weight_version:
        take_canary(collector, pending[0])
