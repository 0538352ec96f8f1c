"""The batch-composition probe: on a probe step a side recomputes a few of its samples in another
batch composition (each alone) through its real forward and records, per probed sample, the
largest |Δlogprob| over the completion between the two compositions in the sample's path fact
``batch_probe_max_abs_diff`` (:data:`isoaudit.audit.quantization.BATCH_PROBE`). A per-tensor
dynamic activation scale spans the whole batch, so there a sample's logprobs move with its
batch-mates; per-token or per-group scales (and every batch-invariant path) give exactly 0.

When (:class:`ProbePolicy`): ``"auto"`` (the default) probes on fingerprinted steps while this side
quantizes activations; ``"always"`` on every fingerprinted step; ``"off"`` never; ``every``: only on
every N-th step of those. ``samples`` bounds the cost: that many samples of the step, spread over
it, never the whole batch (and for vLLM ``mates``: how many of the step's other samples are scored
beside them).

This module holds the policy, the cost counters and the trainer's probe (the sample alone through
the model's own forward against the step's captured logits); the vLLM engine's probe is
:mod:`isoaudit.collectors.vllm.batch_probe`. A probe never raises into the job: a failure is
counted (``batch_probe_errors``) and logged once, and the step is recorded without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from isoaudit.audit.quantization import BATCH_PROBE
from isoaudit.collectors.layout import StepBatch

ProbeWhen = Literal["auto", "always", "off"]

#: The cost counters a collector that probes declares (``stats()`` reports them): samples probed,
#: extra forwards run, tokens those forwards computed, host time spent in microseconds, failures.
PROBE_COUNTERS = (
    "batch_probe_samples",
    "batch_probe_forwards",
    "batch_probe_tokens",
    "batch_probe_us",
    "batch_probe_errors",
)

#: Transfer keys of the trainer's probe (sample indices and their largest |Δ|), in the step's copy.
_INDEX, _VALUE = "bp_index", "bp_value"


@dataclass(frozen=True)
class ProbePolicy:
    """When a side probes (``when``: ``auto``, ``always``, ``off``; ``every``: on every N-th eligible
    step), how many of a probe step's samples (``samples``) and, where the side scores them again
    together (vLLM), how many of the step's other samples go beside them (``mates``)."""

    when: ProbeWhen = "auto"
    samples: int = 2
    every: int = 1
    mates: int = 6

    def __post_init__(self) -> None:
        if self.when not in ("auto", "always", "off"):
            raise ValueError(f"batch_probe: 'auto', 'always' or 'off', got {self.when!r}")
        for name, least in (("samples", 1), ("every", 1), ("mates", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"batch_probe {name}: an integer >= {least}, got {value!r}")

    @classmethod
    def parse(cls, value: ProbePolicy | str | None, *, every: int = 1) -> ProbePolicy:
        """A policy from a collector argument: a policy, one of its ``when`` words (probing every
        ``every``-th eligible step), or None (off)."""
        if isinstance(value, ProbePolicy):
            return value
        if value is None:
            return cls("off")
        if isinstance(value, str):
            return cls(value, every=every)  # type: ignore[arg-type]  # checked in __post_init__
        raise TypeError(f"batch_probe: a ProbePolicy or 'auto'/'always'/'off', got {type(value).__name__}")

    def due(self, step: int, eligible: bool, quantizes_activations: bool) -> bool:
        """Whether to probe at ``step``: an ``eligible`` (fingerprinted) step, every ``every``-th,
        and the policy asks for it on this side."""
        if not eligible or self.when == "off" or step % self.every:
            return False
        return self.when == "always" or quantizes_activations

    def chosen(self, n: int) -> list[int]:
        """Which of ``n`` samples to probe: ``samples`` of them spread evenly, first and last included."""
        if n <= 0:
            return []
        k = min(self.samples, n)
        return sorted({int(round(i)) for i in np.linspace(0, n - 1, k)})


#: A collector's ``batch_probe`` argument: a policy, one of its ``when`` words, or None (off).
ProbeArg = ProbePolicy | ProbeWhen | None


class ProbeCost:
    """Adds what one probe cost to a collector's counters (:data:`PROBE_COUNTERS`)."""

    def __init__(self, counters: Any) -> None:
        self.counters = counters
        self._start = time.perf_counter()

    def forward(self, tokens: int) -> None:
        self.counters.add("batch_probe_forwards")
        self.counters.add("batch_probe_tokens", int(tokens))

    def done(self, samples: int) -> None:
        self.counters.add("batch_probe_samples", samples)
        self.counters.add("batch_probe_us", int((time.perf_counter() - self._start) * 1e6))


def guarded_probe(collector: Any, fn: Callable[[], Any], default: Any) -> Any:
    """``fn()``; on a failure ``default``, counted in ``batch_probe_errors`` and logged once (raised
    only under the collector's ``strict``, for tests)."""
    try:
        return fn()
    except Exception as exc:
        collector.counters.add("batch_probe_errors")
        if collector.strict:
            raise
        collector._log_once(
            "batch probe",
            f"isoaudit {collector.side} collector: the batch probe failed ({type(exc).__name__}: {exc}); "
            "the step is recorded without it (counted in batch_probe_errors)",
        )
        return default


# ---------------------------------------------------------------- the trainer


@contextmanager
def hooks_aside(capture: Any) -> Iterator[None]:
    """The capture hooks neither fingerprint a forward run inside nor keep its capture."""
    force, last = capture.force, capture.last
    capture.force = False
    try:
        yield
    finally:
        capture.force, capture.last = force, last


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax of each row at its target token (the raw logprobs: the composition, not the
    sampler, is what the probe compares)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def trainer_probe(
    model: torch.nn.Module,
    capture: Any,
    batch: StepBatch,
    logits: torch.Tensor,
    policy: ProbePolicy,
    counters: Any,
) -> dict[str, torch.Tensor]:
    """The trainer's probe of one step: each chosen sample's tokens alone through ``model`` (its
    hooks aside), against the step's ``logits`` (one row per token of ``batch.input_ids``). Returns
    the tensors to transfer with the step (nothing is synchronised here), read back by
    :func:`attach_trainer_probe`."""
    cost = ProbeCost(counters)
    vocab = int(logits.shape[-1])
    flat = logits.detach().reshape(-1, vocab)
    param = next(model.parameters(), None)
    device = param.device if param is not None else flat.device
    chosen = [i for i in policy.chosen(batch.num_samples) if batch.spans[i].completion_len > 0]
    values = []
    for i in chosen:
        span = batch.spans[i]
        ids = batch.input_ids[span.row, span.start : span.start + span.length].to(device)
        if batch.position_ids is not None:
            positions = batch.position_ids[span.row, span.start : span.start + span.length].to(device)
        else:  # the positions the batch's forward gave these columns
            positions = torch.arange(span.start, span.start + span.length, device=device)
        inputs: dict[str, Any] = {"input_ids": ids[None], "position_ids": positions[None]}
        if getattr(getattr(model, "config", None), "use_cache", False):
            inputs["use_cache"] = False
        with torch.no_grad(), hooks_aside(capture):
            out = model(**inputs)
        alone = getattr(out, "logits", out)
        if not isinstance(alone, torch.Tensor):
            raise TypeError(f"model: its output holds no logits tensor ({type(out).__name__})")
        cost.forward(span.length)
        first = batch.flat_start(i) + span.prompt_len
        with torch.no_grad():
            targets = ids[span.prompt_len :]
            in_batch = _token_logprobs(flat[first - 1 : first - 1 + span.completion_len].to(device), targets)
            on_its_own = _token_logprobs(alone[0, span.prompt_len - 1 : span.length - 1], targets)
            values.append((on_its_own - in_batch).abs().max())
    cost.done(len(chosen))
    if not chosen:
        return {}
    return {
        _INDEX: torch.tensor(chosen, dtype=torch.int32),
        _VALUE: torch.stack(values).float(),
    }


def attach_trainer_probe(samples: Sequence[Any], host: Mapping[str, np.ndarray]) -> None:
    """Put the probe's largest |Δ| of each probed sample in its path facts (from the step's copy)."""
    if _INDEX not in host:
        return
    for index, value in zip(host[_INDEX].tolist(), host[_VALUE].tolist(), strict=True):
        samples[int(index)].path = {**samples[int(index)].path, BATCH_PROBE: float(value)}
