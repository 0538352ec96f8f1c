"""verl's figures from verl's own rollout-correction and debug-metric functions (see common.py).

python scripts/parity/verl.py [--era LABEL] [--commit REF]

For each era (the release that first ships it, ``head`` for the newest code) and each of its
settings sets, the driver-side functions the PPO trainer calls run on the shared input steps:
``calculate_debug_metrics`` (``training/rollout_probs_diff_*``) on the batch before rollout
correction, then ``compute_rollout_correction_and_add_to_batch`` with the ``algorithm.
rollout_correction`` settings (``rollout_corr/*``), as ``RayPPOTrainer.fit`` does in decoupled mode
(``bypass_mode: false``, verl's default). Both run once on the whole batch in the single-controller
driver, so the step's ranks play no part. ``--commit`` reruns an era's settings at another commit.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "verl-project/verl"
HELPER = "verl/trainer/ppo/rollout_corr_helper.py"
DEBUG = "verl/utils/debug/metrics.py"
ACTOR = f"{HELPER}:compute_rollout_corr_metrics_from_logprobs (verl/utils/metric/utils.py:reduce_metrics over ranks)"
FUNCTIONS = [
    f"{HELPER}:compute_rollout_correction_and_add_to_batch",
    f"{DEBUG}:calculate_debug_metrics",
]

#: Every rejection-sampling option of the divergence-based filters (0.7.1 on).
RS_ALL = (
    "token_k1,token_k2,token_k3,seq_sum_k1,seq_sum_k2,seq_sum_k3,"
    "seq_mean_k1,seq_mean_k2,seq_mean_k3,seq_max_k2,seq_max_k3"
)
#: Per-option bounds: isoaudit's former default bounds for these options (k1 ratio bounds 0.5_2.0,
#: k2/k3 0.01, a per-sequence sum 1.0).
RS_ALL_THRESHOLDS = "0.5_2.0,0.01,0.01,0.5_2.0,1.0,1.0,0.5_2.0,0.01,0.01,0.01,0.01"
#: Looser bounds, so that before 0.8.0 (where each process's actor needs a kept token) most steps
#: keep some of every process's tokens.
RS_LOOSE_THRESHOLDS = "0.2_5.0,2.0,3.0,0.05_20,50,100,0.5_2.0,0.5,0.5,300,1e9"

_OLD_RS: dict[str, dict[str, Any]] = {
    "token": {
        "rollout_is": "token",
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token",
        "rollout_rs_threshold": 2.0,
        "rollout_token_veto_threshold": 1e-4,
    },
    "sequence": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "sequence",
        "rollout_rs_threshold": 1e9,
        "rollout_rs_threshold_lower": 0.1,
    },
    "geometric": {
        "rollout_is": "token",
        "rollout_is_threshold": 1.5,
        "rollout_rs": "geometric",
        "rollout_rs_threshold": 8.0,
        "rollout_rs_threshold_lower": 0.9,
        "rollout_token_veto_threshold": 0.01,
    },
}
_RS_LOOSE: dict[str, Any] = {
    "rollout_is": "token",
    "rollout_rs": RS_ALL,
    "rollout_rs_threshold": RS_LOOSE_THRESHOLDS,
}
_NEW_RS: dict[str, dict[str, Any]] = {
    "rs": {
        "rollout_is": "token",
        "rollout_rs": RS_ALL,
        "rollout_rs_threshold": RS_ALL_THRESHOLDS,
    },
    "rs_loose": _RS_LOOSE,
    "sequence": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "seq_mean_k1,token_k3,seq_max_k2",
        "rollout_rs_threshold": "0.9_1.1,0.05,2.0",
    },
    "shared": {
        "rollout_is": "token",
        "rollout_is_threshold": 1.5,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1,seq_sum_k2,seq_mean_k3",
        "rollout_rs_threshold": 1.5,
    },
}
_ICEPOP: dict[str, dict[str, Any]] = {
    "icepop": {
        "rollout_is": "token",
        "rollout_is_threshold": "0.5_5.0",
        "rollout_is_batch_normalize": True,
    },
    "icepop_sequence": {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.05_1e9",
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.1_10",
    },
}

#: label: (ref, version the era is selected by, era since, {fixture suffix: settings})
ERAS: dict[str, tuple[str, str | None, str, dict[str, dict[str, Any]]]] = {
    "0.6.1": ("v0.6.1", "0.6.1", "0.6.1", {"": {}, **_OLD_RS}),
    "0.7.0": ("v0.7.0", "0.7.0", "0.7.0", {"": {}, **_OLD_RS}),
    "0.7.1": ("v0.7.1", "0.7.1", "0.7.1", {"": {}, **_NEW_RS}),
    "0.8.0": ("v0.8.0", "0.8.0", "0.8.0", {"": {}, **_NEW_RS, **_ICEPOP}),
    "0.9.0": ("v0.9.0", "0.9.0", "0.9.0", {"": {}, **_NEW_RS, **_ICEPOP}),
    "head": ("HEAD", None, "0.9.0", {"": {}, **_NEW_RS, **_ICEPOP}),
}

_PACKAGES = (
    "verl",
    "verl.utils",
    "verl.utils.debug",
    "verl.utils.metric",
    "verl.trainer",
    "verl.trainer.ppo",
    "verl.trainer.config",
    "verl.workers",
    "verl.workers.config",
)
_STUBS = [
    "tensordict",
    "transformers",
    "verl.utils.device",
    "verl.protocol",
    "verl.trainer.config.algorithm",
    "verl.workers.config.actor",
]


def _import_verl(tree: Path) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """verl's helper and debug-metric modules from ``tree``, without ``verl/__init__`` (which pulls
    in the whole stack): its packages as bare shells over the tree's folders, heavy imports stubbed."""
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]
    for name in _PACKAGES:
        shell = types.ModuleType(name)
        shell.__path__ = [str(tree / name.replace(".", "/"))]
        sys.modules[name] = shell
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, shell)
    common.stub_modules(_STUBS, tree)
    sys.modules["verl.protocol"].DataProto = _DataProto  # type: ignore[attr-defined]
    import importlib

    helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
    debug = importlib.import_module("verl.utils.debug.metrics")
    reduce = importlib.import_module("verl.utils.metric.utils")
    return helper, debug, reduce


def _actor_logs_offpolicy(tree: Path) -> bool:
    """Whether the actor's update (legacy workers, the default before 0.8.0) logs the off-policy
    figures itself, per micro-batch, from compute_rollout_corr_metrics_from_logprobs."""
    actor = tree / "verl/workers/actor/dp_actor.py"
    return actor.exists() and "compute_rollout_corr_metrics_from_logprobs(" in actor.read_text()


class _DataProto:
    """verl's DataProto where the helper wraps its weights (``from_dict``); the weights are not figures."""

    @staticmethod
    def from_dict(tensors: dict[str, Any]) -> _DataProto:
        return _DataProto()


class _Batch:
    """verl's DataProto as the two functions use it: ``.batch`` (name to tensor) and ``union``."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.batch = tensors

    def union(self, other: Any) -> _Batch:
        return self


def _yaml_defaults(tree: Path) -> dict[str, Any]:
    """verl's ``algorithm.rollout_correction`` defaults at this commit (its Hydra yaml)."""
    import yaml

    return dict(yaml.safe_load((tree / "verl/trainer/config/algorithm/rollout_correction.yaml").read_text()))


def _figures_of(
    helper: types.ModuleType,
    debug: types.ModuleType,
    reduce: types.ModuleType | None,
    config: dict[str, Any],
) -> Any:
    """One step's logged figures. With ``reduce`` (releases whose actor logs the off-policy figures),
    the actor's values replace the driver's, as RayPPOTrainer.fit updates its metrics with the
    actor's after the driver's: each process (rank) calls compute_rollout_corr_metrics_from_logprobs
    on its micro-batch (its samples, the response mask after rejection sampling; its current log
    probs are old_log_probs with one micro-batch per step); DataProto.concat gathers each worker's
    per-micro-batch lists and ray_trainer reduces them with verl's reduce_metrics."""

    def figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
        step = common.padded(samples)
        tensors = {
            "old_log_probs": step["trainer"],
            "rollout_log_probs": step["rollout"],
            "response_mask": step["mask"],
            "responses": step["mask"],  # only its width is read
        }
        out = dict(debug.calculate_debug_metrics(_Batch(dict(tensors))))
        batch, metrics = helper.compute_rollout_correction_and_add_to_batch(
            _Batch(dict(tensors)), dict(config)
        )
        out.update(metrics)
        if reduce is not None:
            mask = batch.batch["response_mask"]
            per_worker: list[dict[str, list[float]]] = []
            for rank in sorted(set(step["ranks"])):
                rows = [i for i, r in enumerate(step["ranks"]) if r == rank]
                actor = helper.compute_rollout_corr_metrics_from_logprobs(
                    log_prob=step["trainer"][rows],
                    rollout_log_prob=step["rollout"][rows],
                    response_mask=mask[rows],
                )
                per_worker.append({k: [v] for k, v in actor.items()})
            gathered = {k: [w[k] for w in per_worker] for k in per_worker[0]}
            out.update(reduce.reduce_metrics(gathered))
        return out

    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--era", choices=sorted(ERAS), action="append", help="default: every era")
    parser.add_argument("--commit", help="run the era's settings at this commit instead")
    args = parser.parse_args()
    for label in args.era or list(ERAS):
        ref, version, since, runs = ERAS[label]
        commit, _ = common.resolve_commit(REPOSITORY, args.commit or ref)
        tree = common.checkout(REPOSITORY, commit)
        helper, debug, reduce = _import_verl(tree)
        defaults = _yaml_defaults(tree)
        actor = reduce if _actor_logs_offpolicy(tree) else None
        for suffix, settings in runs.items():
            figures_of = _figures_of(helper, debug, actor, {**defaults, **settings})
            values: dict[str, dict[str, Any]] = {}
            refused: list[str] = []
            for step, samples in common.load_inputs().items():
                try:
                    values[step] = figures_of(samples)
                except AssertionError:  # verl's actor asserts a kept token on every process
                    refused.append(step)
            common.write_fixture(
                "verl",
                f"{label}-{suffix}" if suffix else label,
                repository=REPOSITORY,
                commit=commit,
                functions=FUNCTIONS + ([ACTOR] if actor is not None else []),
                settings=settings,
                values=values,
                version=version,
                era=since,
                script="scripts/parity/verl.py",
                notes=(
                    "decoupled mode (bypass_mode false): calculate_debug_metrics on the batch, then "
                    "compute_rollout_correction_and_add_to_batch with these algorithm.rollout_correction "
                    "settings over verl's yaml defaults, on the whole batch in the driver"
                    + (
                        "; the off-policy figures are the actor's (legacy workers): "
                        "compute_rollout_corr_metrics_from_logprobs per rank on its samples with the "
                        "response mask after rejection, one micro-batch each, reduced by verl's reduce_metrics"
                        if actor is not None
                        else ""
                    )
                    + (
                        f"; left out, where verl raises (a process keeps no token after rejection): "
                        f"{', '.join(refused)}"
                        if refused
                        else ""
                    )
                ),
            )


if __name__ == "__main__":
    main()
