"""A real collector run that fills the dashboard's database (the browser suite's data).

As the GRPO demo does (``collectors/rl``): a tiny Qwen3 plays both sides; the rollout side is isoaudit's
reference engine (batched prefill + decode with a KV cache, regions fingerprinted inside it), the
trainer side recomputes the same tokens through the trainer collector. Both are attached through the
public session API (``isoaudit.session`` with direct writes into the store) and read the run's
control record at each step boundary, so flipping the dashboard's toggle reaches a collector that
is still running. A comparison worker (with the alert engine) runs beside them, as the service would.

This module is the one place the browser suite gets its data from.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from isoaudit.audit.alerts import AlertEngine, AlertRule, DatabaseChannel, default_rules, install_rules
from isoaudit.audit.db import Store
from isoaudit.audit.records import Run
from isoaudit.audit.worker import ComparisonWorker

import isoaudit

os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")

#: What the run is called: user text that must show as these characters and run nothing.
XSS_NAME = "<img src=x onerror=alert(1)>"

#: Fires while any token mismatches (so the run has an alert with a fired interval).
MISMATCH_RULE = AlertRule.model_validate(
    {"name": "any_mismatch", "metric": "exact_match_fraction", "comparison": "<", "threshold": 1.0, "for": 1}
)


@dataclass
class CollectorRun:
    """Runs steps in a background thread until :meth:`stop`; ``steps_done`` counts finished steps."""

    url: str
    model_dir: Path
    run_id: str = "dash-e2e"
    samples: int = 3
    pause_s: float = 0.5
    steps_done: int = 0
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> CollectorRun:
        from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model, tiny_corpus
        from isoaudit.kernels.adapters import HFCausalLM
        from isoaudit.kernels.engine import RolloutEngine

        if not (self.model_dir / "config.json").exists():
            make_tiny_model(
                "qwen3", self.model_dir, num_layers=2, hidden=64, vocab=512, seed=0, dtype="float32"
            )
        self.model, tokenizer = load_tiny_model(self.model_dir, dtype=torch.float32)
        self.store = Store(self.url)
        install_rules(self.store, [*default_rules(), MISMATCH_RULE], "yaml", replace=True)
        self.worker = ComparisonWorker(
            self.store, on_step=AlertEngine(self.store, channels=[DatabaseChannel()]).evaluate, interval=0.1
        ).start()
        run = Run(
            run_id=self.run_id, name=XSS_NAME, config={"tokenizer": str(self.model_dir), "dtype": "float32"}
        )
        self.engine = RolloutEngine(HFCausalLM(self.model), max_len=256)
        # Direct writes; the control record is read at every step boundary, at most every 0.2 s.
        self.audit = isoaudit.session(
            run, database_url=self.url, control_interval=0.2, report=False, compare="none"
        )  # the worker above compares, as the service would
        self.trainer = self.audit.watch_trainer(self.model, sample_every=1)
        self.rollout = self.audit.watch_engine(self.engine)
        self.audit.weights_changed(0)  # both sides start from the same checkpoint
        self.prompts = [
            tokenizer(line)["input_ids"][:16] for line in tiny_corpus(n_lines=self.samples, seed=1)
        ]
        self._thread = threading.Thread(target=self._loop, name="collector-run", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        from isoaudit import kernels

        self._stop.set()
        if self._thread is not None:
            self._thread.join(600)
        self.audit.close()
        kernels.disable()
        self.worker.stop()
        self.store.dispose()

    def wait_for_steps(self, n: int, timeout: float = 300.0) -> None:
        """Until ``n`` steps are compared (stored by the worker)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.errors:
                raise self.errors[0]
            if len(self.store.step_results(self.run_id)) >= n:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{n} steps of {self.run_id} not compared within {timeout}s")

    # ------------------------------------------------------------------ one step

    def _step(self, step: int) -> None:
        from isoaudit.collectors.layout import StepBatch

        self.trainer.begin_step(step)  # a step boundary: the trainer applies the desired mode here
        rng = np.random.default_rng(step)
        max_new = rng.integers(6, 14, len(self.prompts)).tolist()
        started = time.perf_counter()
        completions = self.engine.generate(self.prompts, max_new, seed=step)  # the engine switches here
        generation_s = time.perf_counter() - started
        self.rollout.record_step(step, completions)
        started = time.perf_counter()
        with torch.no_grad():
            self.trainer.record_step(step, StepBatch.padded(self.prompts, [c.tokens for c in completions]))
        # This loop trains nothing; its "reward" is the share of even token ids, a stand-in that
        # varies per step, so the run page's loop figure has something real to draw.
        rewards = [float(np.mean([t % 2 == 0 for t in c.tokens])) for c in completions]
        self.audit.record_stats(
            step,
            reward_mean=float(np.mean(rewards)),
            reward_std=float(np.std(rewards)),
            generation_s=generation_s,
            training_s=time.perf_counter() - started,
        )
        self.audit.flush()

    def _loop(self) -> None:
        step = 0
        while not self._stop.is_set():
            try:
                self._step(step)
            except BaseException as exc:  # surfaced by wait_for_steps
                self.errors.append(exc)
                return
            step += 1
            self.steps_done = step
            self._stop.wait(self.pause_s)
