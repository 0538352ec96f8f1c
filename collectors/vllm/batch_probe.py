"""vLLM's batch-composition probe (:mod:`isoaudit.collectors.batch_probe` holds the policy): on a
probe step the collector scores a few of the step's sampled sequences (prompt ‖ completion) with
``prompt_logprobs`` through the engine, each alone and then together with some of their
batch-mates, and records per probed sample the largest |Δlogprob| over its completion between the
two in ``SampleLogprobs.path["batch_probe_max_abs_diff"]``.

Both scorings take the same path — one prefill of the whole sequence, no prefix cache read
(``skip_reading_prefix_cache``), one token generated and thrown away — so only the batch
composition differs. (With chunked prefill on, a long sequence may be chunked differently in the
two batches; the path facts of the step's own samples say whether chunking was taken.) What the
engine's workers recorded for the probe's requests is drained and dropped: the probe leaves no
records of its own. Cost: ``samples`` + ``samples + mates`` sequences prefilled, counted in the
collector's ``batch_probe_*`` counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from isoaudit.audit.quantization import BATCH_PROBE, runtime_quantization
from isoaudit.audit.records import SampleLogprobs
from isoaudit.collectors.batch_probe import ProbeCost, guarded_probe
from isoaudit.collectors.vllm.engine_state import drain_facts
from isoaudit.collectors.vllm.messages import Drain, to_wire


def probe_step(collector: Any, step: int, records: Sequence[Any]) -> None:
    """Probe this step's samples among ``records`` (in place: their path facts) when the
    collector's policy asks for it (every recorded step is one the engine fingerprints, so every
    ``every``-th step is eligible); never raises (unless the collector is strict)."""
    samples = [r for r in records if isinstance(r, SampleLogprobs) and r.token_ids.size > r.prompt_len]
    quantizes = bool(runtime_quantization(collector.facts)["activations"])
    if not collector.batch_probe.due(step, bool(samples), quantizes):
        return
    guarded_probe(collector, lambda: _probe(collector, samples), None)


def _probe(collector: Any, samples: list[SampleLogprobs]) -> None:
    policy = collector.batch_probe
    cost = ProbeCost(collector.counters)
    chosen = policy.chosen(len(samples))
    others = [i for i in range(len(samples)) if i not in chosen][: policy.mates]
    alone = [_score(collector, [samples[i]], cost)[0] for i in chosen]
    together = _score(collector, [samples[i] for i in chosen + others], cost)
    for i, by_itself, in_batch in zip(chosen, alone, together, strict=False):
        samples[i].path = {**samples[i].path, BATCH_PROBE: float(np.abs(by_itself - in_batch).max())}
    cost.done(len(chosen))


def _score(collector: Any, samples: Sequence[SampleLogprobs], cost: ProbeCost) -> list[np.ndarray]:
    """Each sample's completion logprobs from one ``generate`` of all of them with ``prompt_logprobs``
    (one batch); the workers' records of these requests are dropped."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=0,
        skip_reading_prefix_cache=True,
        detokenize=False,
    )
    prompts = [{"prompt_token_ids": [int(t) for t in s.token_ids]} for s in samples]
    outputs = collector.link.llm.generate(prompts, params, use_tqdm=False)
    ids = [str(o.request_id) for o in outputs]
    collector.link.call("drain", to_wire(Drain(request_ids=ids)))  # the probe records nothing
    drain_facts(collector.link, ids)
    cost.forward(sum(len(p["prompt_token_ids"]) for p in prompts))
    out = []
    for sample, output in zip(samples, outputs, strict=True):
        tokens = sample.token_ids.tolist()
        found = output.prompt_logprobs
        if found is None or len(found) != len(tokens):
            raise RuntimeError(
                f"prompt_logprobs: the engine returned {0 if found is None else len(found)} rows for "
                f"{len(tokens)} tokens"
            )
        out.append(
            np.array(
                [found[j][tokens[j]].logprob for j in range(sample.prompt_len, len(tokens))], dtype=np.float64
            )
        )
    return out
