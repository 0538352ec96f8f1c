"""What the service tests send, and the reconciliation every fault test ends with: the store holds
exactly the records sent, each once, bit for bit (a digest per record)."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

import numpy as np
from isoaudit.audit.db import Store
from isoaudit.audit.records import SampleLogprobs

from tests import factories

#: One alert rule that fires at the first breaching step (kl_k3 of ``delta`` 0.2 is 0.0187).
KL_HIGH_RULES = """
rules:
  - name: kl_high
    metric: kl_k3
    comparison: ">"
    threshold: 1.0e-3
    severity: critical
"""


def step_records(
    step: int = 0, delta: float = 0.0, *, run_id: str = "run-1", n: int = 4, n_completion: int = 32
) -> list[SampleLogprobs]:
    """``n`` samples on both sides; the trainer's logprobs are the rollout's minus ``delta`` (so
    kl_k3 = e^-delta + delta - 1 per token)."""
    out = []
    for i in range(n):
        seed = 1000 * step + i
        rollout = factories.sample("rollout", run_id=run_id, step=step, seed=seed, n_completion=n_completion)
        trainer = factories.sample(
            "trainer",
            run_id=run_id,
            step=step,
            seed=seed,
            n_completion=n_completion,
            logprobs=rollout.logprobs - np.float32(delta),
        )
        out += [trainer, rollout]
    return out


def digest(record: SampleLogprobs) -> tuple[str, int, str, str, str]:
    """A sample's identity and a SHA-256 of its arrays' bytes."""
    body = hashlib.sha256(record.token_ids.astype("<i4").tobytes() + record.logprobs.astype("<f4").tobytes())
    return (record.run_id, record.step, record.side, str(record.sample_key), body.hexdigest())


def reconcile(store: Store, sent: Iterable[SampleLogprobs]) -> dict[str, int]:
    """Compare the samples stored with those sent: ``lost`` (sent, not stored), ``extra`` (stored, never
    sent or altered) and ``doubled`` (sent once, stored more than once; the schema forbids it, checked
    anyway). All three are 0 when the store is right."""
    want = Counter(digest(r) for r in sent)
    got: Counter[tuple[str, int, str, str, str]] = Counter()
    for run_id in {key[0] for key in want}:
        for step in store.steps(run_id):
            got.update(digest(r) for r in store.samples(run_id, step.step))
    distinct = set(want)
    return {
        "sent": len(distinct),
        "stored": sum(got.values()),
        "lost": len(distinct - set(got)),
        "extra": len(set(got) - distinct),
        "doubled": sum(n - 1 for n in got.values() if n > 1),
    }
