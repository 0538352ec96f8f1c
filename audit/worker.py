"""The comparison worker: compares every sample whose two sides are stored, in the background of the
ingest path, and saves per-sample and per-step results. Idempotent: comparing again replaces the
results with identical ones, so a crash or a second worker costs time, never correctness.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from audit.compare import compare_samples, step_summary
from audit.records import SampleLogprobs, off_policy_of, utcnow
from audit.store import Store
from audit.summaries import SampleOutcome, missing_summaries, save_summary, summarize_step

log = logging.getLogger(__name__)

#: Called after a step's results are saved: (run_id, step, step metrics). Alert evaluation plugs in here.
StepCallback = Callable[[str, int, dict[str, Any]], None]


def pair_by_key(samples: list[SampleLogprobs]) -> dict[str, tuple[SampleLogprobs, SampleLogprobs]]:
    """(trainer, rollout) per sample_key, for keys stored on both sides."""
    sides: dict[str, dict[str, SampleLogprobs]] = defaultdict(dict)
    for sample in samples:
        assert sample.sample_key is not None
        sides[sample.sample_key][sample.side] = sample
    return {key: (s["trainer"], s["rollout"]) for key, s in sides.items() if len(s) == 2}


class ComparisonWorker:
    """Drains the store's comparison queue; ``run_once`` for a synchronous pass, ``start`` for a thread."""

    def __init__(
        self,
        store: Store,
        *,
        on_step: StepCallback | None = None,
        interval: float = 0.5,
        clip_eps: float = 0.2,
    ) -> None:
        self.store = store
        self.on_step = on_step
        self.interval = interval
        self.clip_eps = clip_eps
        self.compared = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, run_id: str | None = None) -> int:
        """Compare everything queued now (only ``run_id``'s samples if given); return how many samples."""
        queued_before = utcnow()
        by_step: dict[tuple[str, int], list[str]] = defaultdict(list)
        for run, step, key in self.store.pending():
            if run_id is None or run == run_id:
                by_step[(run, step)].append(key)
        done = 0
        for (run, step), keys in sorted(by_step.items()):
            try:
                done += self._compare_step(run, step, keys, queued_before)
            except Exception:  # one bad step must not stop the others; it stays queued for a later pass
                self.failures += 1
                log.exception("comparison of run %s step %s failed", run, step)
        self.compared += done
        return done

    def _compare_step(self, run: str, step: int, keys: list[str], queued_before: Any) -> int:
        step_samples = self.store.samples(run, step)
        pairs = pair_by_key(step_samples)
        todo = [pairs[k] for k in keys if k in pairs]
        prints: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
        for record in self.store.fingerprints(run, step, keys):
            prints[record.sample_key][0 if record.side == "trainer" else 1].append(record)
        manifests = (self.store.manifests(run, "trainer"), self.store.manifests(run, "rollout"))
        policy = off_policy_of(self.store.run_config(run) or {})  # a declared lag is off_policy, not weights
        comparisons = compare_samples(todo, dict(prints), manifests, clip_eps=self.clip_eps, policy=policy)

        # The step's figures cover every compared sample of the step, old and new.
        fresh = [
            SampleOutcome(
                c.sample_key, c.diagnosis.kind, c.first_divergence[0] if c.first_divergence else None
            )
            for c in comparisons
        ]
        all_pairs = [pairs[k] for k in sorted(pairs)]
        summary = step_summary(all_pairs, comparisons, clip_eps=self.clip_eps)
        # The dashboard's aggregates go first: a crash before the results are saved leaves the step
        # queued, and comparing it again rewrites both.
        with self.store.sessions.begin() as session:
            aggregates = summarize_step(session, run, step, all_pairs, fresh)
            save_summary(session, aggregates)
        summary["diagnoses"]["counts"] = aggregates["diagnoses"]
        self.store.save_comparison(
            [c.result_row() for c in comparisons],
            [{"run_id": run, "step": step, **summary}],
            [(run, step, k) for k in keys],
            queued_before=queued_before,
        )
        if self.on_step is not None:
            try:
                self.on_step(run, step, summary["metrics"])
            except Exception:  # alerting must never stop comparison
                log.exception("step callback failed for run %s step %s", run, step)
        return len(comparisons)

    def backfill(self, limit: int = 1) -> int:
        """Write the dashboard's summaries of up to ``limit`` steps compared before they existed (a
        database from before migration 0004), from the stored samples and verdicts. The background
        thread does one step per idle pass, so old runs fill in without holding up new records."""
        with self.store.sessions() as session:
            todo = missing_summaries(session, limit)
        for run, step in todo:
            pairs = pair_by_key(self.store.samples(run, step))
            with self.store.sessions.begin() as session:
                save_summary(
                    session, summarize_step(session, run, step, [pairs[k] for k in sorted(pairs)], [])
                )
        return len(todo)

    # ------------------------------------------------------------------ background thread

    def start(self) -> ComparisonWorker:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="isoaudit-compare", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.run_once() > 0 or self.backfill() > 0
            except Exception:
                log.exception("comparison pass failed")
                busy = False
            if not busy:
                self._stop.wait(self.interval)

    def __enter__(self) -> ComparisonWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
