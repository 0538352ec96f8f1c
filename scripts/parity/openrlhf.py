"""OpenRLHF's ``vllm_kl`` from its own ``PolicyLoss`` (openrlhf/models/loss.py), one call per process
(each process's samples are its micro-batch), reduced over processes as its ``ppo_train`` does at
that release (see ``reduce``).

python scripts/parity/openrlhf.py [--commit REF] [--version X.Y.Z] [--label NAME] [--settings JSON]
"""

from __future__ import annotations

import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "OpenRLHF/OpenRLHF"
FUNCTION = "openrlhf/models/loss.py:PolicyLoss.forward"
REDUCTION = "openrlhf/trainer/ray/ppo_actor.py:PPOActor.ppo_train"


def packages(tree: Path) -> None:
    """``openrlhf`` and ``openrlhf.models`` as bare packages of the snapshot's folders, so that
    ``loss.py`` and its ``.utils`` import without the package ``__init__`` (models, deepspeed)."""
    for name in ("openrlhf", "openrlhf.models"):
        module = types.ModuleType(name)
        module.__path__ = [str(tree / name.replace(".", "/"))]
        sys.modules[name] = module


def main() -> None:
    args = common.release_arguments(
        __doc__,
        lambda parser: parser.add_argument(
            "--reduce", choices=["rank-mean", "token-weighted"], required=True, help="ppo_train's reduction"
        ),
    )
    settings: dict[str, Any] = json.loads(args.settings)
    commit, _ = common.resolve_commit(REPOSITORY, args.commit)
    tree = common.checkout(REPOSITORY, commit)
    common.stub_modules(["deepspeed"], tree)
    packages(tree)

    loss = common.load_module(tree, "openrlhf/models/loss.py")

    # the CLI's defaults where the fixture declares nothing (train_ppo_ray.py: store_true, "ppo")
    enable = settings.get(
        "algo.advantage.is_correction_enable", settings.get("enable_vllm_is_correction", False)
    )
    policy_loss_type = settings.get("actor.policy_loss_type", settings.get("policy_loss_type", "ppo"))
    # the thresholds are a float (a cap) before the correction types came, [low, high] after
    typed = "vllm_is_correction_type" in inspect.signature(loss.PolicyLoss).parameters
    policy_loss = loss.PolicyLoss(
        policy_loss_type=policy_loss_type,
        enable_vllm_is_correction=enable,
        vllm_is_truncated_threshold=[0.5, 5.0] if typed else 2.0,
    )

    def one_rank(samples: list[dict]) -> tuple[Any, float]:
        step = common.padded(samples)
        # log_probs (the update's forward) = old_log_probs: vllm_kl reads neither the update nor advantages
        _, _, _, vllm_kl = policy_loss(
            step["trainer"].clone(),
            step["trainer"],
            step["token_advantages"],
            action_mask=step["mask"],
            rollout_log_probs=step["rollout"],
        )
        return vllm_kl, float(step["mask"].sum().item())

    def reduce(results: list[tuple[Any, float]]) -> float:
        """ppo_train: rank-mean (to v0.9.7) all-reduces each process's ``v.float().mean().item()``
        with op="mean"; token-weighted (v0.9.8 on) all-reduces value × action tokens and the tokens,
        then divides."""
        if args.reduce == "rank-mean":
            return sum(v.float().mean().item() for v, _ in results) / len(results)
        total = sum(n for _, n in results)
        return sum(v.float().mean().item() * n for v, n in results) / total

    def figures(samples: list[dict]) -> dict:
        ranks = sorted({s["rank"] for s in samples})
        results = [one_rank([s for s in samples if s["rank"] == r]) for r in ranks]
        if any(v is None for v, _ in results):
            return {}
        return {"vllm_kl": reduce(results)}

    common.write_fixture(
        "openrlhf",
        args.label or args.version or "head",
        repository=REPOSITORY,
        commit=commit,
        functions=[FUNCTION, REDUCTION],
        settings=settings,
        values=common.run_steps(figures),
        version=args.version,
        era=args.era,
        script="scripts/parity/openrlhf.py",
        notes=(
            "one PolicyLoss call per process on its samples (padded with garbage, mask 0), the update's "
            f"logprobs equal to the old ones; processes reduced as ppo_train does ({args.reduce}); the "
            "correction's type and thresholds left at their defaults (vllm_kl reads neither)"
        ),
    )


if __name__ == "__main__":
    main()
