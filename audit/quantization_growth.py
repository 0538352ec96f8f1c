"""Growth over steps, a signature of ``quantization`` read across a run: per-tensor FP8 drift grows
from step to step while block or MX scales stay flat. For the steps whose samples are diagnosed
``quantization``, the step's mismatch (:data:`METRIC`, the token mean |Δlogprob|) over the last
:data:`WINDOW` such steps, its robust slope (Theil–Sen: the median of the pairwise slopes) and the
ratio of its latest third to its first (medians), named in each quantization verdict of the steps
compared now: ``signature.growth`` in its evidence and a clause of its sentence.

Earlier steps come from the batch being compared and from the stored step results before it
(:func:`audit.db.reads.quantization.quantized_steps_before`), as the changes since the last clean
step do (:mod:`audit.since_clean`).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
from isoaudit.audit.compare import StepOutcome
from isoaudit.audit.db import Store
from isoaudit.audit.db.reads.quantization import quantized_steps_before
from isoaudit.audit.diagnosis import Diagnosis

log = logging.getLogger(__name__)

#: The step figure whose trend is read.
METRIC = "logprob_abs_diff_mean"
#: How many of the latest quantization steps the trend covers.
WINDOW = 8
#: The fewest steps a trend is read from.
MIN_STEPS = 3
#: Latest-third over first-third ratio from which the mismatch counts as grown (or, inverted, shrunk).
GROWN = 1.5


def trend(steps: Sequence[int], values: Sequence[float]) -> dict[str, Any] | None:
    """The trend of ``values`` over ``steps`` (ascending): ``slope_per_step`` (Theil–Sen), ``ratio``
    (the median of the latest third over the median of the first), ``trend`` (``growing``, ``flat``
    or ``shrinking``); None for fewer than :data:`MIN_STEPS` points."""
    x, y = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if x.size < MIN_STEPS:
        return None
    i, j = np.triu_indices(x.size, k=1)
    apart = x[j] != x[i]
    slope = float(np.median((y[j] - y[i])[apart] / (x[j] - x[i])[apart])) if apart.any() else 0.0
    third = math.ceil(x.size / 3)
    first, latest = float(np.median(y[:third])), float(np.median(y[-third:]))
    ratio = latest / first if first > 0 else (math.inf if latest > 0 else 1.0)
    if ratio >= GROWN and slope > 0:
        word = "growing"
    elif ratio <= 1 / GROWN and slope < 0:
        word = "shrinking"
    else:
        word = "flat"
    return {
        "metric": METRIC,
        "steps": [int(s) for s in x],
        "values": [float(v) for v in y],
        "slope_per_step": slope,
        "ratio": ratio if math.isfinite(ratio) else None,
        "trend": word,
    }


def clause(growth: dict[str, Any]) -> str:
    """The sentence's words for a trend: grown ×k, shrunk ×k or flat over the last N steps."""
    n, steps = len(growth["steps"]), growth["steps"]
    span = f"the last {n} quantization steps ({steps[0]}–{steps[-1]})"
    ratio = growth["ratio"]
    factor = f"×{ratio:.3g}" if ratio is not None else "from zero"
    if growth["trend"] == "growing":
        return f"The mismatch (mean |Δlogprob|) has grown {factor} over {span}."
    if growth["trend"] == "shrinking":
        return f"The mismatch (mean |Δlogprob|) has shrunk {factor} over {span}."
    return f"The mismatch (mean |Δlogprob|) is flat over {span} ({factor})."


def with_growth(diagnosis: Diagnosis, growth: dict[str, Any]) -> Diagnosis:
    """``diagnosis`` (changed in place, and returned) with the trend in its signature and sentence."""
    diagnosis.evidence.setdefault("signature", {})["growth"] = growth
    diagnosis.sentence = f"{diagnosis.sentence.rstrip()} {clause(growth)}"
    return diagnosis


def _quantized(outcome: StepOutcome) -> bool:
    return any(c.diagnosis.kind == "quantization" for c in outcome.comparisons)


def note_growth(store: Store, outcomes: Sequence[StepOutcome]) -> int:
    """Name, in each ``quantization`` verdict of ``outcomes``, how the mismatch of the run's
    quantization steps moved up to its step (in place). Returns how many steps got a trend. Never
    raises: a failure is logged and the verdicts stand as they are (the comparison goes on)."""
    try:
        return _note_growth(store, outcomes)
    except Exception:
        log.exception("reading the quantization growth of %d steps failed", len(outcomes))
        return 0


def _note_growth(store: Store, outcomes: Sequence[StepOutcome]) -> int:
    by_run: dict[str, list[StepOutcome]] = defaultdict(list)
    for outcome in outcomes:
        by_run[outcome.run_id].append(outcome)
    noted = 0
    for run_id, mine in by_run.items():
        quantized = sorted((o for o in mine if _quantized(o)), key=lambda o: o.step)
        if not quantized:
            continue
        in_batch = {o.step for o in mine}
        stored = [
            (s, v)
            for s, v in quantized_steps_before(store, run_id, quantized[-1].step, METRIC)
            if s not in in_batch
        ]
        here = [(o.step, o.metrics.get(METRIC)) for o in quantized]
        series = sorted(stored + [(s, float(v)) for s, v in here if isinstance(v, int | float)])
        for outcome in quantized:
            upto = [(s, v) for s, v in series if s <= outcome.step][-WINDOW:]
            growth = trend([s for s, _ in upto], [v for _, v in upto])
            if growth is None:
                continue
            noted += 1
            for comparison in outcome.comparisons:
                if comparison.diagnosis.kind == "quantization":
                    with_growth(comparison.diagnosis, growth)
    return noted
