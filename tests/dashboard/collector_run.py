"""A real collector run that fills the dashboard's database (the browser suite's data).

As ``collectors/demo.py`` does: a tiny Qwen3 plays both sides; the rollout side is isoaudit's
reference engine (batched prefill + decode with a KV cache, regions fingerprinted inside it), the
trainer side recomputes the same tokens through the trainer collector. Both write through the public
collectors API (direct sinks into the store) and read the run's control record at each step
boundary, so flipping the dashboard's toggle reaches a collector that is still running. A
comparison worker (with the alert engine) runs beside them, as the service would.

This module is the one place the browser suite gets data from: switch it to the session API
(``collectors.session``) when that lands.
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

from audit.alerts import AlertEngine, AlertRule, DatabaseChannel, default_rules, install_rules
from audit.records import Manifest, Run, RuntimeFacts, SampleLogprobs
from audit.store import Store
from audit.worker import ComparisonWorker

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
        from collectors import trainer
        from collectors.control import StoreControl
        from collectors.engine_capture import EngineFingerprints
        from collectors.sinks.direct import DirectSink, SharedStore
        from collectors.tiny_models import load_tiny_model, make_tiny_model, tiny_corpus
        from kernels.adapters import HFCausalLM
        from kernels.engine import RolloutEngine

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
        self.shared = SharedStore(self.url)
        self.run = Run(
            run_id=self.run_id, name=XSS_NAME, config={"tokenizer": str(self.model_dir), "dtype": "float32"}
        )
        self.trainer_sink = DirectSink(self.shared)
        self.rollout_sink = DirectSink(self.shared)
        # The run is registered once before both sides write: two sinks registering one new run at
        # the same moment race in Store.ingest (reported to the store's owner).
        self.rollout_sink.send([self.run])
        self.rollout_sink.flush()
        self.handle = trainer.attach(
            self.model,
            run=self.run,
            sink=self.trainer_sink,
            sample_every=1,
            control=StoreControl(self.run_id, self.shared, interval=0.2),
        )
        self.rollout_control = StoreControl(self.run_id, self.shared, interval=0.2)
        adapter = HFCausalLM(self.model)
        self.capture = EngineFingerprints(adapter)
        self.engine = RolloutEngine(adapter, max_len=256)
        lines = tiny_corpus(n_lines=self.samples, seed=1)
        self.prompts = [tokenizer(line)["input_ids"][:16] for line in lines]
        self.rollout_mode: str | None = None
        self._thread = threading.Thread(target=self._loop, name="collector-run", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        from collectors.remediation import apply_kernels_mode

        self._stop.set()
        if self._thread is not None:
            self._thread.join(600)
        self.handle.detach()
        self.capture.detach()
        self.trainer_sink.close()
        self.rollout_sink.close()
        apply_kernels_mode(self.model, "native")
        self.worker.stop()
        self.shared.reset()
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

    def _rollout_manifest(self, mode: str) -> Manifest:
        return Manifest(
            run_id=self.run_id,
            side="rollout",
            case="engine_decode",
            process=f"reference-engine:{os.getpid()}",
            runtime=RuntimeFacts(
                framework="isoaudit.kernels.engine",
                torch_version=torch.__version__,
                device="cpu",
                dtype="float32",
                lm_head_dtype="float32",
                logprobs_mode="raw_logprobs",
                prefix_caching=False,
                chunked_prefill=False,
                remediation=mode,
            ),
            regions=[s.name for s in self.capture.specs if s.name not in self.capture.unobserved],
            unobserved=self.capture.unobserved,
            weight_version="0",
        )

    def _step(self, step: int) -> None:
        from collectors.layout import StepBatch
        from collectors.remediation import apply_kernels_mode

        control = self.rollout_control.desired()
        mode = control.mode if control is not None else "native"
        changed = mode != self.rollout_mode
        if changed:
            apply_kernels_mode(self.model, mode)
            self.rollout_mode = mode
        rng = np.random.default_rng(step)
        completions = self.engine.generate(
            self.prompts, rng.integers(6, 14, len(self.prompts)).tolist(), seed=step
        )
        if changed:  # after the forward: the capture knows then which regions the engine calls
            self.rollout_sink.send([self._rollout_manifest(mode)])
        tokens = [c.tokens for c in completions]
        samples = [
            SampleLogprobs(
                run_id=self.run_id,
                step=step,
                side="rollout",
                weight_version="0",
                prompt_len=len(p),
                token_ids=np.asarray(p + t, np.int32),
                logprobs=np.asarray(c.logprobs, np.float32),
            )
            for p, t, c in zip(self.prompts, tokens, completions, strict=True)
        ]
        self.rollout_sink.send([*samples, *self.capture.records(self.run_id, step, self.prompts, tokens)])
        with torch.no_grad():
            self.handle.record_step(step, StepBatch.padded(self.prompts, tokens), weight_version="0")
        self.trainer_sink.flush()
        self.rollout_sink.flush()

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
