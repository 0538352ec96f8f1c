"""SkyRL's figures from its trainer's own code (see common.py).

SkyRL computes them inline in ``RayPPOTrainer.fwd_logprobs_values_reward`` (a Ray-driven method that
needs the workers' forward pass): this script locates in the snapshot's ``trainer.py`` (with ``ast``)
the ``if`` block of that method that computes ``logprobs_diff`` and executes exactly those source
lines with ``training_input`` (the batch's ``rollout_logprobs`` and ``loss_mask``, [batch, T]) and
``action_log_probs`` (the trainer's) bound, then reads ``self.all_metrics``. The trainer runs it on
the driver over the whole training batch, so there is no per-process reduction.

python scripts/parity/skyrl.py [--commit REF --label LABEL --version VERSION --path TRAINER_PY]
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "NovaSky-AI/SkyRL"
METHOD = "RayPPOTrainer.fwd_logprobs_values_reward"

#: label: (ref, trainer.py path, version, isoaudit era)
RELEASES: dict[str, tuple[str, str, str | None, str]] = {
    "train-0.3.0": ("skyrl_train-v0.3.0", "skyrl-train/skyrl_train/trainer.py", "0.3.0+train", "0.2.0+train"),
    "train-0.4.0": ("skyrl_train-v0.4.0", "skyrl-train/skyrl_train/trainer.py", "0.4.0+train", "0.4.0+train"),
    "0.1.0": ("skyrl-v0.1.0", "skyrl/train/trainer.py", "0.1.0", "0.1.0"),
    "0.2.0": ("skyrl-v0.2.0", "skyrl/train/trainer.py", "0.2.0", "0.1.0"),
    "0.3.0": ("skyrl-v0.3.0", "skyrl/train/trainer.py", "0.3.0", "0.3.0"),
    "head": ("HEAD", "skyrl/train/trainer.py", None, "0.3.0"),
}


def _block(source: str) -> str:
    """The exact source lines of the method's ``if`` block that computes ``logprobs_diff``."""
    tree = ast.parse(source)
    method = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "fwd_logprobs_values_reward"
    )
    for node in method.body:
        if isinstance(node, ast.If) and "logprobs_diff = (" in (ast.get_source_segment(source, node) or ""):
            lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
            return textwrap.dedent("\n".join(lines))
    raise SystemExit("no logprobs_diff block in this snapshot's fwd_logprobs_values_reward")


def run_release(ref: str, path: str, label: str, version: str | None, era: str) -> None:
    commit, _ = common.resolve_commit(REPOSITORY, ref)
    import torch

    # the file alone, from the snapshot (the full tree holds blobs the snapshot lacks)
    block = _block(common.git(REPOSITORY, "show", f"{commit}:{path}"))
    code = compile(block, path, "exec")

    def figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
        step = common.padded(samples)
        trainer = types.SimpleNamespace(
            all_metrics={},
            cfg=types.SimpleNamespace(
                generator=types.SimpleNamespace(sampling_params=types.SimpleNamespace(logprobs=0))
            ),
        )
        scope: dict[str, Any] = {
            "self": trainer,
            "torch": torch,
            "training_input": {"rollout_logprobs": step["rollout"], "loss_mask": step["mask"]},
            "action_log_probs": step["trainer"],
        }
        exec(code, scope)  # noqa: S102
        return dict(trainer.all_metrics)

    common.write_fixture(
        "skyrl",
        label,
        repository=REPOSITORY,
        commit=commit,
        functions=[f"{path}:{METHOD}"],
        settings={},
        values=common.run_steps(figures),
        version=version,
        era=era,
        script="scripts/parity/skyrl.py",
        notes=(
            "SkyRL computes these inline in RayPPOTrainer.fwd_logprobs_values_reward: the if-block computing "
            "logprobs_diff was located with ast in the snapshot's trainer.py and its exact source lines executed "
            "with training_input['rollout_logprobs'], training_input['loss_mask'] ([batch, T], garbage where the "
            "mask is 0) and action_log_probs (the trainer's) bound, float64; values read from self.all_metrics. "
            "skyrl-train releases are declared as X.Y.Z+train."
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit")
    parser.add_argument("--label", default="head")
    parser.add_argument("--version")
    parser.add_argument("--path", default="skyrl/train/trainer.py")
    args = parser.parse_args()
    if args.commit:
        era = RELEASES.get(args.label, RELEASES["head"])[3]
        run_release(args.commit, args.path, args.label, args.version, era)
        return
    for label, (ref, path, version, _) in RELEASES.items():
        command = [sys.executable, __file__, "--commit", ref, "--label", label, "--path", path]
        if version is not None:
            command += ["--version", version]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
