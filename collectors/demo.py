"""``make demo``: one small RL-style job, end to end, on the embedded SQLite store.

A tiny Qwen3 (random weights, a locally trained tokenizer) plays both parts of on-policy RL:

* the **rollout engine** (isoaudit's reference engine: batched requests of different lengths, prefill,
  then incremental decode with a KV cache) samples completions and their logprobs, with its regions
  fingerprinted inside the engine;
* the **trainer** recomputes the same tokens as whole sequences through the trainer collector.

Both are attached through one ``collectors.session`` and send records over real HTTP to the isoaudit
service, started in this process. The service's worker compares each step; an alert rule fires
while any token mismatches. Half way through, the demo sets the run's remediation mode to
``invariant`` through the control API, as the dashboard's toggle does; both sides learn it through
the session's control channel at their next step boundary, switch onto :mod:`kernels`, say so in
their manifests, and the mismatch vanishes: mean |Δ logprob| exactly 0, the alert resolves.

The model runs in float32 on the CPU, where the invariant kernels run under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

# The invariant kernels run on the CPU only under Triton's interpreter; set it before any kernel launches.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter evaluates whole tiles in numpy, padding rows included; their NaNs are discarded by
# the kernels' masks, but numpy warns about them. They say nothing about the demo's results.
warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")

import collectors  # noqa: E402
from audit.api import ApiSettings, create_app  # noqa: E402
from audit.api.live import LiveServer  # noqa: E402
from audit.auth import create_token  # noqa: E402
from audit.config import database_url  # noqa: E402
from audit.records import Run  # noqa: E402
from audit.store import Store  # noqa: E402
from collectors import StepBatch  # noqa: E402
from collectors.tiny_models import load_tiny_model, make_tiny_model, tiny_corpus  # noqa: E402

console = Console(width=None if sys.stdout.isatty() else 140)

#: Fires while any sampled token's logprob differs between the sides; resolves after one clean step.
MISMATCH_RULE = {
    "name": "demo_any_mismatch",
    "metric": "exact_match_fraction",
    "comparison": "<",
    "threshold": 1.0,
    "for": 2,
    "keep_firing_for": 1,
    "severity": "warning",
    "labels": {"demo": "true"},
}


def prepare_model(directory: Path) -> tuple[torch.nn.Module, object]:
    if not (directory / "config.json").exists():
        make_tiny_model("qwen3", directory, num_layers=2, hidden=64, vocab=512, seed=0, dtype="float32")
    model, tokenizer = load_tiny_model(directory, dtype=torch.float32)
    return model, tokenizer


def wait_for_step(client: httpx.Client, run_id: str, step: int, timeout: float = 60.0) -> dict:
    """Poll the API until the service's worker has compared ``step``; return its metrics row."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = client.get(f"/v1/runs/{run_id}/metrics", params={"from_step": step, "to_step": step}).json()
        if rows:
            return rows[0]
        time.sleep(0.1)
    raise TimeoutError(f"step {step} of run {run_id} was not compared within {timeout}s")


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the demo; return one row per step (mode, step metrics, diagnoses, first divergences)."""
    parser = argparse.ArgumentParser(description="isoaudit demo: a tiny RL job, audited end to end.")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--switch-at", type=int, default=3, help="step at which remediation is switched on")
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--model-dir", default=".isoaudit/demo-model")
    args = parser.parse_args(argv)

    url = database_url(args.database_url)
    store = Store(url)
    model, tokenizer = prepare_model(Path(args.model_dir))
    from kernels.adapters import HFCausalLM
    from kernels.engine import RolloutEngine

    settings = ApiSettings(database_url=url, worker_interval_s=0.05, default_alert_rules=True)
    server = LiveServer(create_app(store, settings))
    base = server.start()
    token = create_token(store, "demo", name="make demo")
    client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    client.post("/v1/alert-rules", json=MISMATCH_RULE)  # 409 on a second demo: the rule is already there

    run_id = "demo-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    run = Run(
        run_id=run_id, name="demo: tiny Qwen3, reference engine vs HF trainer", config={"dtype": "float32"}
    )
    spool = Path(tempfile.mkdtemp(prefix="isoaudit-demo-spool-"))
    engine = RolloutEngine(HFCausalLM(model), max_len=256)
    lines = tiny_corpus(n_lines=args.samples, seed=1)
    prompts = [tokenizer(line)["input_ids"][:24] for line in lines]
    rng = np.random.default_rng(0)
    console.print(f"[bold]isoaudit demo[/bold]: run [cyan]{run_id}[/cyan], service at {base}, store {url}")
    table = Table(
        "step", "mode", "kl_k3", "mean |Δ logprob|", "exact tokens", "first divergence", "diagnoses"
    )
    results: list[dict] = []
    # control_interval=0: ask the service at every step boundary (it is local; a real job keeps the
    # default and mostly learns the mode from ingest replies).
    audit = collectors.session(run, url=base, token=token, spool_dir=spool, control_interval=0.0)
    try:
        trainer = audit.watch_trainer(model, sample_every=1)
        rollout = audit.watch_engine(engine)
        audit.weights_changed(0)  # both sides start from the same checkpoint
        for step in range(args.steps):
            if step == args.switch_at:
                current = client.get(f"/v1/runs/{run_id}/control").json()
                client.put(
                    f"/v1/runs/{run_id}/control", json={"mode": "invariant", "version": current["version"]}
                )
                console.print(
                    f"step {step}: remediation set to [bold]invariant[/bold] through the control API"
                )
            trainer.begin_step(step)  # a step boundary: the trainer switches here
            max_new = rng.integers(8, 20, len(prompts)).tolist()
            completions = engine.generate(prompts, max_new, seed=step)  # the engine switches here
            rollout.record_step(step, completions)
            batch = StepBatch.padded(prompts, [c.tokens for c in completions])
            with torch.no_grad():
                trainer.record_step(step, batch)
            audit.flush()
            row = wait_for_step(client, run_id, step)
            metrics = row["metrics"]
            steps = client.get(f"/v1/runs/{run_id}/steps/{step}/samples").json()
            firsts = sorted({s["first_divergence_region"] for s in steps if s.get("first_divergence_region")})
            kinds = sorted({s["diagnosis"] for s in steps})
            mode = f"{trainer.mode}/{rollout.mode}"
            results.append(
                {"step": step, "mode": trainer.mode, "metrics": metrics, "diagnoses": kinds, "first": firsts}
            )
            table.add_row(
                str(step),
                mode,
                f"{metrics['kl_k3']:.3g}",
                f"{metrics['logprob_abs_diff_mean']:.3g}",
                f"{metrics['exact_match_fraction']:.1%}",
                ", ".join(firsts) or "—",
                ", ".join(kinds),
            )
        console.print(table)
        alerts = client.get(f"/v1/runs/{run_id}/alerts").json()
        for alert in alerts:
            console.print(
                f"alert [bold]{alert['rule']}[/bold] ({alert['severity']}): {alert['state']}, "
                f"fired at step {alert['fired_step']}, resolved at step {alert['resolved_step']}"
            )
        console.print(
            f"\nExplore: [bold]isoaudit compare {run_id}[/bold]   "
            f"(store: {url}; serve it with `isoaudit serve`)"
        )
        return results
    finally:
        audit.close()  # detaches both sides, flushes, prints what was sent
        import kernels

        kernels.disable()
        client.close()
        server.stop()
        store.dispose()


if __name__ == "__main__":
    main()
