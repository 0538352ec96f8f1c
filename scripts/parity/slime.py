"""slime's figures from its own loss code (see common.py).

slime logs its mismatch figures from ``policy_loss_function`` (``slime/backends/megatron_utils/
loss.py``): ``train_rollout_logprob_abs_diff`` always, the vanilla TIS function's ``tis*`` with
``--use-tis``, and with ``--custom-tis-function-path`` set to the mismatch helper (``examples/
train_infer_mismatch_helper/mis.py: compute_mis_weights_with_cp``) its ``mis_*`` figures. This script
runs, per process, the snapshot's own ``loss_function`` (which calls ``policy_loss_function``, the
TIS function, ``get_sum_of_sample_mean`` and builds the ``[count, metric...]`` vector) on one
micro-batch, with the model forward (``get_log_probs_and_entropy``) standing in to return the
trainer's logprobs (the first step on-policy: current = old = trainer). The processes' vectors are
summed (the ``all_reduce`` over the data-parallel group) and divided as slime's ``train_one_step``
does: from 0.3.0 the snapshot's own ``reduce_train_step_metrics`` (with ``all_reduce`` a no-op on
the pre-summed vector, as slime's tests run it); before, ``model.py: train_one_step``'s inline
``value * cp_size / values[0]`` (values[0] = the summed sample or token count), which this glue
repeats. Context parallel size 1; every sample is its own rollout (slime's default rollout ids).

python scripts/parity/slime.py [--commit REF --label LABEL --version VERSION]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "THUDM/slime"
MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"


def mis_yaml(commit: str) -> dict[str, Any]:
    """The mismatch helper's settings as its shipped config at ``commit``
    (examples/train_infer_mismatch_helper/mis.yaml; ``use_tis`` is slime's own argument)."""
    import yaml

    text = common.git(REPOSITORY, "show", f"{commit}:examples/train_infer_mismatch_helper/mis.yaml")
    return {k: v for k, v in yaml.safe_load(text).items() if k != "use_tis"}


#: slime's argparse defaults for the settings the figures read (slime/utils/arguments.py)
ARG_DEFAULTS: dict[str, Any] = {
    "use_tis": False,
    "get_mismatch_metrics": False,
    "custom_tis_function_path": None,
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "calculate_per_token_loss": False,
    "use_rollout_logprobs": False,
}
#: the figures (keys of policy_loss_function's report) that compare trainer and rollout
NOT_MISMATCH = {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "ois", "kl_loss", "opsm_clipfrac"}

CONFIGS: list[dict[str, Any]] = [
    {},
    {"use_tis": True, "tis_clip": 1.5, "tis_clip_low": 0.5},
    {"use_tis": True, "custom_tis_function_path": MIS},
    {
        "use_tis": True,
        "custom_tis_function_path": MIS,
        "tis_mode": "mask",
        "tis_level": "geometric",
        "tis_lower_bound": 0.9,
        "tis_upper_bound": 1.1,
        "use_rs": False,
        "tis_batch_normalize": False,
    },
    {
        "use_tis": True,
        "custom_tis_function_path": MIS,
        "tis_mode": "clip",
        "tis_level": "sequence",
        "tis_upper_bound": 3.0,
        "tis_lower_bound": None,
        "rs_level": "geometric",
        "rs_lower_bound": 0.8,
        "rs_upper_bound": 1.25,
        "rs_veto_threshold": 0.01,
        "calculate_per_token_loss": True,
    },
    {"get_mismatch_metrics": True, "custom_tis_function_path": MIS},
    {"use_rollout_logprobs": True},
    {"calculate_per_token_loss": True, "use_tis": True},
    {
        "use_tis": True,
        "custom_tis_function_path": ICEPOP,
        "tis_clip": 1.2,
        "tis_clip_low": 0.8,
    },
    {
        "use_tis": True,
        "custom_tis_function_path": MIS,
        "tis_mode": "clip",
        "use_rs": False,
        "tis_batch_normalize": False,
    },
    {
        "use_tis": True,
        "custom_tis_function_path": MIS,
        "tis_mode": "mask",
        "use_rs": False,
        "tis_batch_normalize": False,
    },
]
#: mask-mode TIS with rejection sampling: slime 0.2.1 appends both to "mask_fraction_*" and fails
CONFIGS_FROM_022: list[dict[str, Any]] = [
    {
        "use_tis": True,
        "custom_tis_function_path": MIS,
        "tis_mode": "mask",
        "rs_level": "sequence",
        "rs_lower_bound": 0.05,
        "rs_upper_bound": 20.0,
        "rs_veto_threshold": None,
        "tis_batch_normalize": False,
    },
]

#: label: (ref, version, isoaudit era)
RELEASES: dict[str, tuple[str, str | None, str]] = {
    "0.2.1": ("v0.2.1", "0.2.1", "0.2.1"),
    "0.2.2": ("v0.2.2", "0.2.2", "0.2.2"),
    "0.2.4": ("v0.2.4", "0.2.4", "0.2.2"),
    "0.3.0": ("v0.3.0", "0.3.0", "0.3.0"),
    "0.3.1": ("v0.3.1", "0.3.1", "0.3.1"),
    "head": ("HEAD", None, "0.3.1"),
}


class _Args(types.SimpleNamespace):
    """slime's args: the ones given; None for any other (flags off)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Forward(dict):
    """get_log_probs_and_entropy's result as each release unpacks it: the dict (0.2.x) or (_, dict)."""

    def __iter__(self) -> Any:
        return iter((None, self))


def _import(tree: Path) -> dict[str, Any]:
    """The snapshot's loss module and reducer, megatron's parallel state standing in at size 1."""
    import torch

    common.stub_modules(["megatron.core", "slime.utils.http_utils", "ray", "sglang"], tree)
    mpu = types.ModuleType("megatron.core.mpu")
    mpu.get_context_parallel_world_size = lambda *a, **k: 1  # type: ignore[attr-defined]
    mpu.get_context_parallel_rank = lambda *a, **k: 0  # type: ignore[attr-defined]
    mpu.get_data_parallel_world_size = lambda *a, **k: 1  # type: ignore[attr-defined]
    mpu.get_context_parallel_group = lambda *a, **k: None  # type: ignore[attr-defined]
    sys.modules["megatron.core"].mpu = mpu  # type: ignore[attr-defined]
    sys.modules["megatron.core.mpu"] = mpu
    # the packages' __init__ files set up accelerators and kernels the loss never uses
    for package in (
        "slime",
        "slime.backends",
        "slime.backends.megatron_utils",
        "slime.utils",
        "slime.observability",
    ):
        module = types.ModuleType(package)
        module.__path__ = [str(tree / package.replace(".", "/"))]
        sys.modules[package] = module
    loss = common.load_module(tree, "slime/backends/megatron_utils/loss.py")
    reducer = None
    for relative in (
        "slime/observability/train_metric_utils.py",
        "slime/backends/megatron_utils/cp_utils.py",
    ):
        if (tree / relative).exists():
            module = common.load_module(tree, relative)
            if hasattr(module, "reduce_train_step_metrics"):
                reducer = module
                break
    torch.set_default_dtype(torch.float64)
    return {"loss": loss, "reducer": reducer}


def _batch(samples: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    trainer = [torch.tensor(s["trainer"], dtype=torch.float64) for s in samples]
    rollout = [torch.tensor(s["rollout"], dtype=torch.float64) for s in samples]
    masks = [torch.tensor(s["mask"], dtype=torch.float64) for s in samples]
    lengths = [len(s["trainer"]) for s in samples]
    mask_sums = torch.tensor([float(m.sum()) for m in masks], dtype=torch.float64)
    return {
        "advantages": [
            torch.full((n,), float(s["advantage"])) for s, n in zip(samples, lengths, strict=True)
        ],
        "log_probs": trainer,
        "rollout_log_probs": rollout,
        "loss_masks": masks,
        "response_lengths": lengths,
        "total_lengths": [n + 3 for n in lengths],
        "unconcat_tokens": [torch.zeros(n + 3, dtype=torch.long) for n in lengths],
        "rollout_mask_sums": mask_sums,
        "group_mask_sums": mask_sums,
    }


def run_release(ref: str, label: str, version: str | None, era: str) -> None:
    commit, _ = common.resolve_commit(REPOSITORY, ref)
    tree = common.checkout(REPOSITORY, commit)
    shipped = mis_yaml(commit)
    mods = _import(tree)
    import torch

    loss = mods["loss"]
    reducer = mods["reducer"]
    if reducer is not None:
        reducer.dist = types.SimpleNamespace(all_reduce=lambda *a, **k: None)

    current: dict[str, Any] = {}

    def forward(logits: Any, *, args: Any, unconcat_tokens: Any, response_lengths: Any, **kwargs: Any) -> Any:
        trainer = [t.clone() for t in current["log_probs"]]
        return _Forward(log_probs=trainer, entropy=[torch.zeros_like(t) for t in trainer])

    loss.get_log_probs_and_entropy = forward
    if hasattr(loss, "get_rollout_top_p_logprob_kwargs"):
        loss.get_rollout_top_p_logprob_kwargs = lambda *a, **k: {}
    if hasattr(loss, "_maybe_capture_log_probs"):
        loss._maybe_capture_log_probs = lambda *a, **k: None
    takes_step_size = "step_global_batch_size" in inspect.signature(loss.loss_function).parameters

    configs = CONFIGS + (CONFIGS_FROM_022 if era != "0.2.1" else [])
    for index, declared in enumerate(configs):
        settings = {**ARG_DEFAULTS, **shipped, **declared}

        def figures(samples: list[dict[str, Any]], settings: dict[str, Any] = settings) -> dict[str, Any]:
            n_total = len(samples)
            args = _Args(
                **settings,
                loss_type="policy_loss",
                advantage_estimator="grpo",
                eps_clip=0.2,
                eps_clip_high=0.28,
                entropy_coef=0.0,
                use_kl_loss=False,
                recompute_loss_function=False,
                allgather_cp=False,
                global_batch_size=n_total,
                qkv_format="thd",
            )
            keys: list[str] | None = None
            summed = None
            for rank in sorted({s["rank"] for s in samples}):
                batch = _batch([s for s in samples if s["rank"] == rank])
                current["log_probs"] = batch["log_probs"]
                logits = torch.zeros(1, 1, 1, dtype=torch.float64)
                if takes_step_size:
                    _, _, log = loss.loss_function(args, batch, 1, n_total, logits)
                else:
                    _, _, log = loss.loss_function(args, batch, 1, logits)
                keys = log["keys"]
                values = log["values"].to(torch.float64)
                summed = values if summed is None else summed + values  # the data-parallel all_reduce
            assert keys is not None and summed is not None
            if reducer is not None:
                reduced = reducer.reduce_train_step_metrics(
                    [{"keys": keys, "values": summed}],
                    calculate_per_token_loss=bool(settings["calculate_per_token_loss"]),
                    step_global_batch_size=n_total,
                    cp_size=1,
                    dp_with_cp_group=None,
                )
            else:  # model.py: train_one_step, inline
                flat = summed.tolist()
                reduced = {key: value * 1 / flat[0] for key, value in zip(keys, flat[1:], strict=False)}
            return {key: value for key, value in reduced.items() if key not in NOT_MISMATCH}

        suffix = "" if index == 0 else f"+{index}"
        common.write_fixture(
            "slime",
            f"{label}{suffix}",
            repository=REPOSITORY,
            commit=commit,
            functions=[
                "slime/backends/megatron_utils/loss.py:loss_function",
                "slime/backends/megatron_utils/loss.py:policy_loss_function",
                "slime/backends/megatron_utils/loss.py:vanilla_tis_function",
                "slime/backends/megatron_utils/loss.py:icepop_function",
                "slime/backends/megatron_utils/cp_utils.py:get_sum_of_sample_mean",
                "examples/train_infer_mismatch_helper/mis.py:compute_mis_weights_with_cp",
                *(["reduce_train_step_metrics"] if reducer is not None else []),
            ],
            settings=declared,
            values=common.run_steps(figures),
            version=version,
            era=era,
            script="scripts/parity/slime.py",
            notes=(
                "per process (rank): the snapshot's loss_function -> policy_loss_function on one micro-batch "
                "(context parallel 1, float64), the model forward standing in to return the trainer's logprobs "
                "(on-policy first step); the processes' [count, metric...] vectors summed (the DP all_reduce) "
                "and divided by slime's reduce_train_step_metrics (0.3.0 on) or train_one_step's inline "
                "value / values[0] (before); settings beyond those declared are slime's argparse defaults and "
                "the mismatch helper's shipped mis.yaml: " + json.dumps({**ARG_DEFAULTS, **shipped})
            ),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit")
    parser.add_argument("--label", default="head")
    parser.add_argument("--version")
    args = parser.parse_args()
    if args.commit:
        era = RELEASES.get(args.label, RELEASES["head"])[2]
        run_release(args.commit, args.label, args.version, era)
        return
    common.run_each_release(
        __file__, [(label, ref, version) for label, (ref, version, _) in RELEASES.items()]
    )


if __name__ == "__main__":
    main()
