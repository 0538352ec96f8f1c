"""SkyRL's figures from its own code (see common.py).

- The trainer's ``policy/rollout_train_*``: computed inline in ``RayPPOTrainer.fwd_logprobs_values_reward``
  (a Ray-driven method): the ``if`` block of that method that computes ``logprobs_diff`` is located
  with ``ast`` in the snapshot's ``trainer.py`` and exactly those source lines are executed with
  ``training_input`` (``rollout_logprobs``, ``loss_mask``, [batch, T]) and ``action_log_probs`` (the
  trainer's) bound; values read from ``self.all_metrics``. It runs on the driver over the whole batch.
  From 0.3.0 the trainer skips that forward pass for losses on the rollout's logprobs: the snapshot's
  ``RayPPOTrainer._skip_policy_forward`` (with ``ppo_utils``' ``PolicyLossType`` and
  ``LOSSES_WITHOUT_OLD_LOGPROBS``, located with ``ast`` and executed as written) decides, and a
  skipped pass leaves ``action_log_probs`` None as the trainer does.
- The workers' ``policy/loss_metrics/*``: the snapshot's own ``compute_off_policy_correction``
  (``off_policy_correction_utils.py``, imported with its ``torch_utils``; ``omegaconf``/``jaxtyping``
  stood in) on each process's micro-batch, keys prefixed ``loss_metrics/`` as the worker does, then
  the snapshot's ``reduce_metrics`` (per process) and ``all_reduce_metrics`` (across processes; its
  ``strategy.all_reduce`` answered with the mean/min/max over the processes' values, as
  torch.distributed would), then ``policy/`` as the trainer prefixes them.
- From 0.3.0 the workers' ``minibatch_rollout_logprobs_abs_diff_*``: the snapshot's
  ``compute_minibatch_rollout_logprob_diff_metrics`` per process, the same reduction, then the
  trainer's ``finalize_minibatch_rollout_logprob_diff_std``. ``worker_utils.py`` and
  ``trainer_utils.py`` import the whole training stack, so their functions and constants are
  located with ``ast`` and exactly those source lines executed.

Files are read from the snapshot one by one (``git show``): its full tree holds blobs the snapshot
lacks.

python scripts/parity/skyrl.py [--commit REF | --label LABEL]
"""

from __future__ import annotations
import __future__

import argparse
import ast
import inspect
import math
import subprocess
import sys
import tempfile
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "NovaSky-AI/SkyRL"
METHOD = "RayPPOTrainer.fwd_logprobs_values_reward"
OC = "off_policy_correction."


#: settings of the fixtures (the off-policy correction's under its config path)
_BASIC: list[dict[str, Any]] = [
    {},
    {
        OC + "tis_ratio_type": "token",
        OC + "outlier_token_is_threshold_low": 1e-4,
        OC + "outlier_token_is_threshold_high": 100.0,
    },
    {
        OC + "tis_ratio_type": "sequence",
        OC + "sequence_tis_ratio_clip_high": 3.0,
        OC + "sequence_mask_metric": "geometric",
        OC + "geo_mask_high": 1.2,
        OC + "geo_mask_low": 0.8,
    },
    {
        OC + "sequence_mask_metric": "product",
        OC + "tis_ratio_type": "token",
        OC + "token_tis_ratio_clip_high": 1.5,
    },
    {OC + "outlier_token_is_threshold_high": 5.0},
]
_TOKEN_MASK: list[dict[str, Any]] = [
    {
        OC + "token_mask_is_threshold_low": 0.5,
        OC + "token_mask_is_threshold_high": 2.0,
        OC + "tis_ratio_type": "token",
        OC + "outlier_token_is_threshold_high": 50.0,
    },
    {
        OC + "token_mask_is_threshold_low": 0.8,
        OC + "token_mask_is_threshold_high": 1.25,
        OC + "sequence_mask_metric": "geometric",
    },
]
_SKIP: list[dict[str, Any]] = [
    {"policy_loss_type": "rollout_is"},
    {"policy_loss_type": "dppo", "use_kl_in_reward": True},
    {"policy_loss_type": "rollout_is", OC + "tis_ratio_type": "token"},
]
_CISPO: list[dict[str, Any]] = [
    {"policy_loss_type": "cispo", "cispo.cispo_anchor": "rollout"},
    {"policy_loss_type": "cispo"},
]
#: label: (ref, package root, version, isoaudit era, settings of its fixtures)
RELEASES: dict[str, tuple[str, str, str | None, str, list[dict[str, Any]]]] = {
    "train-0.3.0": ("skyrl_train-v0.3.0", "skyrl-train/skyrl_train", "0.3.0+train", "0.2.0+train", [{}]),
    "train-0.4.0": ("skyrl_train-v0.4.0", "skyrl-train/skyrl_train", "0.4.0+train", "0.4.0+train", _BASIC),
    "0.1.0": ("skyrl-v0.1.0", "skyrl", "0.1.0", "0.1.0", _BASIC + _TOKEN_MASK),
    "0.2.0": ("skyrl-v0.2.0", "skyrl", "0.2.0", "0.1.0", _BASIC[:2] + _TOKEN_MASK[:1]),
    "0.3.0": ("skyrl-v0.3.0", "skyrl", "0.3.0", "0.3.0", _BASIC + _TOKEN_MASK + _SKIP),
    "head": ("HEAD", "skyrl", None, "main@dda1cb3", _BASIC + _TOKEN_MASK + _SKIP + _CISPO),
}
#: where each file lives under a release's package root
_FILES = {
    "trainer": {"skyrl-train/skyrl_train": "trainer.py", "skyrl": "train/trainer.py"},
    "opc": {
        "skyrl-train/skyrl_train": "utils/off_policy_correction_utils.py",
        "skyrl": "backends/skyrl_train/utils/off_policy_correction_utils.py",
    },
    "torch_utils": {
        "skyrl-train/skyrl_train": "utils/torch_utils.py",
        "skyrl": "backends/skyrl_train/utils/torch_utils.py",
    },
    "worker_utils": {
        "skyrl-train/skyrl_train": "workers/worker_utils.py",
        "skyrl": "backends/skyrl_train/workers/worker_utils.py",
    },
    "trainer_utils": {
        "skyrl-train/skyrl_train": "utils/trainer_utils.py",
        "skyrl": "train/utils/trainer_utils.py",
    },
}


def _path(root: str, key: str) -> str:
    return f"{root}/{_FILES[key][root]}"


def _show(commit: str, path: str) -> str | None:
    try:
        return common.git(REPOSITORY, "show", f"{commit}:{path}")
    except subprocess.CalledProcessError:
        return None


def _segment(source: str, node: ast.AST) -> str:
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]  # type: ignore[attr-defined]
    return textwrap.dedent("\n".join(lines))


def _trainer_block(source: str) -> str:
    """The exact source lines of the method's ``if`` block that computes ``logprobs_diff``."""
    tree = ast.parse(source)
    method = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "fwd_logprobs_values_reward"
    )
    for node in method.body:
        if isinstance(node, ast.If) and "logprobs_diff = (" in (ast.get_source_segment(source, node) or ""):
            return _segment(source, node)
    raise SystemExit("no logprobs_diff block in this snapshot's fwd_logprobs_values_reward")


def _skip_forward(source: str, ppo_utils: str, opc: types.ModuleType | None) -> Any:
    """RayPPOTrainer._skip_policy_forward as written (None before it existed), with ppo_utils'
    PolicyLossType and LOSSES_WITHOUT_OLD_LOGPROBS as written."""
    tree = ast.parse(source)
    method = next(
        (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_skip_policy_forward"),
        None,
    )
    if method is None or opc is None:
        return None
    import enum

    scope: dict[str, Any] = {
        "StrEnum": enum.StrEnum,
        "Enum": enum.Enum,
        "off_policy_correction_enabled": opc.off_policy_correction_enabled,
    }
    for node in ast.parse(ppo_utils).body:
        if (isinstance(node, ast.ClassDef) and node.name == "PolicyLossType") or (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "LOSSES_WITHOUT_OLD_LOGPROBS" for t in node.targets)
        ):
            exec(compile(_segment(ppo_utils, node), "ppo_utils.py", "exec"), scope)  # noqa: S102
    exec(  # noqa: S102
        compile(
            _segment(source, method),
            "trainer.py",
            "exec",
            flags=__future__.annotations.compiler_flag,
            dont_inherit=True,
        ),
        scope,
    )
    return scope["_skip_policy_forward"]


def _exec_top_level(source: str, path: str, names: set[str], scope: dict[str, Any]) -> None:
    """Execute the module's top-level functions named ``names`` and its upper-case constants, exactly
    as written (annotations deferred: they name classes of the training stack)."""
    tree = ast.parse(source)
    for node in tree.body:
        keep = isinstance(node, ast.FunctionDef) and node.name in names
        keep |= isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.isupper() for t in node.targets
        )
        if keep:
            code = compile(
                _segment(source, node),
                path,
                "exec",
                flags=__future__.annotations.compiler_flag,
                dont_inherit=True,
            )
            exec(code, scope)  # noqa: S102


def _import_opc(commit: str, root: str) -> types.ModuleType:
    """The snapshot's off_policy_correction_utils with its torch_utils, written out file by file."""
    tree = Path(tempfile.mkdtemp(prefix="parity-skyrl-"))
    package = root.split("/")[-1]  # skyrl_train or skyrl
    base = tree
    for key in ("opc", "torch_utils"):
        text = _show(commit, _path(root, key))
        assert text is not None
        target = base / package / _FILES[key][root]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
    common.stub_modules(["omegaconf", "jaxtyping"])
    parts = Path(_FILES["opc"][root]).parent.parts
    for i in range(len(parts) + 1):
        name = ".".join((package, *parts[:i]))
        module = types.ModuleType(name)
        module.__path__ = [str(base / package / Path(*parts[:i]))]
        sys.modules[name] = module
    return common.load_module(base, f"{package}/{_FILES['opc'][root]}")


class _Strategy:
    """torch.distributed's all_reduce over the step's processes, for all_reduce_metrics."""

    def __init__(self, per_rank: list[dict[str, float]]) -> None:
        self.per_rank = per_rank

    def all_reduce(self, data: dict[str, float], op: str = "mean", group: Any = None) -> dict[str, float]:
        out = {}
        for key in data:
            values = [r[key] for r in self.per_rank]
            out[key] = {
                "mean": sum(values) / len(values),
                "min": min(values),
                "max": max(values),
                "sum": sum(values),
            }[op]
        return out


def run_release(label: str) -> None:
    ref, root, version, era, configs = RELEASES[label]
    commit, _ = common.resolve_commit(REPOSITORY, ref)
    import torch

    trainer_source = _show(commit, _path(root, "trainer")) or ""
    block = compile(_trainer_block(trainer_source), _path(root, "trainer"), "exec")
    opc = _import_opc(commit, root) if _show(commit, _path(root, "opc")) is not None else None
    ppo_utils = _show(commit, "skyrl/backends/skyrl_train/utils/ppo_utils.py") if root == "skyrl" else None
    skip_forward = _skip_forward(trainer_source, ppo_utils or "", opc)
    worker: dict[str, Any] = {"torch": torch, "math": math, "dist": None, **vars(typing)}
    functions = [f"{_path(root, 'trainer')}:{METHOD}"]
    if opc is not None:
        worker["masked_mean"] = opc.masked_mean  # the snapshot's torch_utils.masked_mean
        names = {"reduce_metrics", "all_reduce_metrics", "compute_minibatch_rollout_logprob_diff_metrics"}
        _exec_top_level(
            _show(commit, _path(root, "worker_utils")) or "", _path(root, "worker_utils"), names, worker
        )
        trainer_utils = _show(commit, _path(root, "trainer_utils")) or ""
        _exec_top_level(
            trainer_utils,
            _path(root, "trainer_utils"),
            {"finalize_minibatch_rollout_logprob_diff_std"},
            worker,
        )
        functions += [
            f"{_path(root, 'opc')}:compute_off_policy_correction",
            f"{_path(root, 'worker_utils')}:reduce_metrics",
            f"{_path(root, 'worker_utils')}:all_reduce_metrics",
        ]
        if "compute_minibatch_rollout_logprob_diff_metrics" in worker:
            functions += [
                f"{_path(root, 'worker_utils')}:compute_minibatch_rollout_logprob_diff_metrics",
                f"{_path(root, 'trainer_utils')}:finalize_minibatch_rollout_logprob_diff_std",
            ]

    for index, declared in enumerate(configs):
        opc_settings = {k.removeprefix(OC): v for k, v in declared.items() if k.startswith(OC)}
        config = types.SimpleNamespace(**{**_config_defaults(commit, root, opc), **opc_settings})
        algorithm = types.SimpleNamespace(
            policy_loss_type=declared.get("policy_loss_type", "regular"),
            use_kl_in_reward=declared.get("use_kl_in_reward", False),
            off_policy_correction=config,
            cispo=types.SimpleNamespace(cispo_anchor=declared.get("cispo.cispo_anchor", "old")),
        )

        def figures(
            samples: list[dict[str, Any]],
            config: types.SimpleNamespace = config,
            algorithm: types.SimpleNamespace = algorithm,
        ) -> dict[str, Any]:
            step = common.padded(samples)
            trainer = types.SimpleNamespace(
                all_metrics={},
                cfg=types.SimpleNamespace(
                    generator=types.SimpleNamespace(sampling_params=types.SimpleNamespace(logprobs=0)),
                    trainer=types.SimpleNamespace(algorithm=algorithm),
                ),
            )
            training_input = {"rollout_logprobs": step["rollout"], "loss_mask": step["mask"]}
            skipped = skip_forward is not None and skip_forward(trainer, training_input)
            scope: dict[str, Any] = {
                "self": trainer,
                "torch": torch,
                "training_input": training_input,
                "action_log_probs": None if skipped else step["trainer"],  # the trainer's forward pass
            }
            exec(block, scope)  # noqa: S102
            out = dict(trainer.all_metrics)
            if opc is None:
                return out
            per_rank = []
            for rank in sorted({s["rank"] for s in samples}):
                shard = common.padded([s for s in samples if s["rank"] == rank])
                _, metrics, _ = opc.compute_off_policy_correction(
                    shard["trainer"], shard["rollout"], shard["mask"], config
                )
                status = {"loss_metrics/" + k: v for k, v in metrics.items()}  # the worker's status keys
                if "compute_minibatch_rollout_logprob_diff_metrics" in worker:
                    status.update(
                        worker["compute_minibatch_rollout_logprob_diff_metrics"](
                            shard["trainer"], shard["rollout"], shard["mask"]
                        )
                    )
                per_rank.append(worker["reduce_metrics"]({k: [v] for k, v in status.items()}))
            strategy = _Strategy(per_rank)
            if "group" in inspect.signature(worker["all_reduce_metrics"]).parameters:
                reduced = worker["all_reduce_metrics"](per_rank[0], strategy, group=None)
            else:
                reduced = worker["all_reduce_metrics"](per_rank[0], strategy)
            reduced = worker["reduce_metrics"]({k: [v] for k, v in reduced.items()})  # over mini-batches
            if "finalize_minibatch_rollout_logprob_diff_std" in worker:
                worker["finalize_minibatch_rollout_logprob_diff_std"](reduced)
            for key, value in reduced.items():
                if key.endswith("_min") and key.startswith(("minibatch_", "loss_metrics/is_ratio")):
                    continue  # over the padded grid, masked positions included: not a figure of the tokens
                if key == "loss_metrics/is_ratio_std":
                    continue
                out["policy/" + key] = value
            return out

        suffix = "" if index == 0 else f"+{index}"
        common.write_fixture(
            "skyrl",
            f"{label}{suffix}",
            repository=REPOSITORY,
            commit=commit,
            functions=functions,
            settings=declared,
            values=common.run_steps(figures),
            version=version,
            era=era,
            script="scripts/parity/skyrl.py",
            notes=(
                "trainer figures: the if-block computing logprobs_diff in RayPPOTrainer.fwd_logprobs_values_reward, "
                "located with ast in the snapshot's trainer.py and executed as written with the batch's "
                "rollout_logprobs, loss_mask and action_log_probs ([batch, T], garbage where the mask is 0, float64); "
                "worker figures: the snapshot's compute_off_policy_correction per process (its safe_exp_delta "
                "takes exp in float32), prefixed loss_metrics/ as the worker does, reduced by the snapshot's "
                "reduce_metrics and all_reduce_metrics (all_reduce answered with the mean/min/max over processes), "
                "prefixed policy/ as the trainer does. Left out: loss_metrics/is_ratio_std, loss_metrics/is_ratio_min "
                "and minibatch_rollout_logprobs_abs_diff_min, which SkyRL takes over the padded [batch, T] grid with "
                "masked positions as 0. skyrl-train releases are declared as X.Y.Z+train."
            ),
        )


def _config_defaults(commit: str, root: str, opc: types.ModuleType | None) -> dict[str, Any]:
    """The off-policy correction config's defaults at the snapshot: ``OffPolicyCorrectionConfig``'s
    fields (skyrl) or the ``off_policy_correction`` block of ``ppo_base_config.yaml`` (skyrl-train)."""
    if opc is None:
        return {}
    if root == "skyrl":
        source = _show(commit, "skyrl/train/config/config.py") or ""
        cls = next(
            n
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ClassDef) and n.name == "OffPolicyCorrectionConfig"
        )
        return {
            n.target.id: ast.literal_eval(n.value)
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None
        }
    import yaml

    config = yaml.safe_load(_show(commit, f"{root}/config/ppo_base_config.yaml") or "")
    return dict(config["trainer"]["algorithm"]["off_policy_correction"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", choices=sorted(RELEASES), help="one release of the table")
    parser.add_argument("--commit", help="the newest code at REF, written as the head fixtures")
    args = parser.parse_args()
    if args.commit:
        RELEASES["head"] = (args.commit, *RELEASES["head"][1:])
        run_release("head")
        return
    if args.label:
        run_release(args.label)
        return
    for label in RELEASES:
        subprocess.run([sys.executable, __file__, "--label", label], check=True)


if __name__ == "__main__":
    main()
