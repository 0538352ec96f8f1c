"""Runs whose environments differ, stored through the one ingest door (the browser test, the CLI
test and the worker test share them).

Each side's environment is this process's, read for real (``collectors.environment``); the planted
changes are what a wheel bump or a backend switch between two jobs would record: vLLM's version and
the rollout's attention backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
from isoaudit.audit.db import Store
from isoaudit.audit.records import Environment, Manifest, RuntimeFacts, utcnow
from isoaudit.collectors.environment import process_environment, with_runtime

from tests import factories

#: What run B's rollout records differently from run A's.
PLANTED_VLLM = "0.33.1"
PLANTED_ATTENTION = "FLASHINFER"
BASE_ATTENTION = "CPU_ATTN"


def environment_of(side: str, *, attention: str, vllm: str | None = None) -> Environment:
    """This process's environment as ``side`` would record it, with the given attention backend (and
    vLLM version, planted)."""
    runtime = RuntimeFacts(attention_backend=attention, remediation="native")
    env = with_runtime(process_environment(batch_invariant=False if side == "rollout" else None), runtime)
    if vllm is not None:
        env = env.model_copy(update={"versions": {**env.versions, "vllm": vllm}})
    return env


def _manifest(run_id: str, side: str, env: Environment, at_offset_s: float = 0.0) -> Manifest:
    case = "trainer_fwd" if side == "trainer" else "engine_decode"
    framework = "transformers" if side == "trainer" else "vllm"
    return factories.manifest(
        side,
        case,
        run_id,
        runtime=RuntimeFacts(
            framework=framework,
            dtype="bfloat16",
            attention_backend=env.backends.get("attention"),
            remediation="native",
        ),
        environment=env,
        created_at=utcnow() + timedelta(seconds=at_offset_s),
    )


def _step(
    store: Store, run_id: str, step: int, *, differ: bool, n: int = 3, project: str = "default"
) -> None:
    records = []
    for i in range(n):
        trainer = factories.sample("trainer", run_id=run_id, step=step, seed=100 * step + i)
        logprobs = trainer.logprobs.copy()
        if differ:
            logprobs[-1] = np.float32(logprobs[-1] - 0.01)
        records += [
            trainer,
            factories.sample("rollout", run_id=run_id, step=step, seed=100 * step + i, logprobs=logprobs),
        ]
    store.ingest(records, project=project)


def planted_runs(store: Store, a: str = "env-a", b: str = "env-b", project: str = "default") -> None:
    """Runs ``a`` and ``b``: the same trainer, rollouts that differ in vLLM's version and the attention
    backend (one compared step each), in ``project``."""
    trainer_env = environment_of("trainer", attention="sdpa")
    for run_id, vllm, attention in ((a, None, BASE_ATTENTION), (b, PLANTED_VLLM, PLANTED_ATTENTION)):
        store.ingest([factories.run(run_id, name=f"environment {run_id}")], project=project)
        rollout_env = environment_of("rollout", attention=attention, vllm=vllm)
        store.ingest(
            [_manifest(run_id, "trainer", trainer_env), _manifest(run_id, "rollout", rollout_env)],
            project=project,
        )
        time.sleep(0.01)
        _step(store, run_id, 0, differ=False, project=project)


def drifting_run(
    store: Store,
    run_id: str = "env-drift",
    change_at: int = 3,
    steps: int = 5,
    after_step: Callable[[int], object] | None = None,
) -> None:
    """Steps agree bit for bit until ``change_at``, where the rollout restarts on another attention
    backend and vLLM version (a new manifest, recorded before that step's records) and every later
    step differs in its last token. ``after_step(step)`` runs once each step is stored."""
    store.ingest([factories.run(run_id, name="environment drift")])
    trainer_env = environment_of("trainer", attention="sdpa")
    store.ingest(
        [
            _manifest(run_id, "trainer", trainer_env),
            _manifest(run_id, "rollout", environment_of("rollout", attention=BASE_ATTENTION)),
        ]
    )
    for step in range(steps):
        time.sleep(0.01)
        if step == change_at:
            changed = environment_of("rollout", attention=PLANTED_ATTENTION, vllm=PLANTED_VLLM)
            store.ingest([_manifest(run_id, "rollout", changed)])
            time.sleep(0.01)
        _step(store, run_id, step, differ=step >= change_at)
        if after_step is not None:
            after_step(step)
