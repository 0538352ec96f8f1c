"""NeMo-RL's mismatch figures from its own ``ClippedPGLossFn`` (one call per process: each process's
samples are its micro-batch, normalized by the step's global token and sequence counts as its
``process_global_batch`` computes them), summed over processes as ``grpo.py`` sums micro-batch
metrics (``np.sum``). The loss settings are the release's ``examples/configs/grpo_math_1B.yaml``
``loss_fn`` section (and, from 0.7.0, ``ClippedPGLossConfig``'s defaults) under the fixture's.

python scripts/parity/nemo_rl.py --commit REF --era X [--version X.Y.Z] [--label L] [--settings JSON]
"""

from __future__ import annotations

import ast
import json
import sys
import types
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "NVIDIA-NeMo/RL"
FIGURES = (
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "sampling_importance_ratio",
    "is_oob_ratio",
)
PACKAGES = (
    "nemo_rl",
    "nemo_rl.algorithms",
    "nemo_rl.algorithms.loss",
    "nemo_rl.algorithms.x_token",
    "nemo_rl.data",
    "nemo_rl.distributed",
    "nemo_rl.models",
    "nemo_rl.models.dtensor",
    "nemo_rl.utils",
)
STUBS = [
    "nemo_rl.data.chat_templates",
    "nemo_rl.models.policy",
    "nemo_rl.utils.fastokens",
    "nemo_rl.utils.logger",
    "nemo_rl.distributed.batched_data_dict",
    "nemo_rl.distributed.model_utils",
    "nemo_rl.models.dtensor.parallelize",
    "nemo_rl.algorithms.x_token.loss_utils",
]


def packages(tree: Path) -> None:
    """NeMo-RL's packages as bare folders of the snapshot, so the loss module and its utils import
    without the packages' ``__init__`` (ray, megatron, vllm)."""
    for name in PACKAGES:
        module = types.ModuleType(name)
        module.__path__ = [str(tree / name.replace(".", "/"))]
        sys.modules[name] = module


def grpo_function(tree: Path, name: str) -> Any:
    """One function of the snapshot's nemo_rl/algorithms/grpo.py, compiled from its source there
    (the module itself imports the whole training stack); None before it existed."""
    import torch

    path = tree / "nemo_rl/algorithms/grpo.py"
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            namespace: dict[str, Any] = {
                "torch": torch,
                "Optional": Optional,
                "Any": Any,
                "BatchedDataDict": dict,
            }
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
            return namespace[name]
    return None


def main() -> None:
    args = common.release_arguments(__doc__)
    settings: dict[str, Any] = json.loads(args.settings)
    commit, _ = common.resolve_commit(REPOSITORY, args.commit)
    tree = common.checkout(REPOSITORY, commit)
    import torch
    import yaml

    packages(tree)
    common.stub_modules(STUBS, tree)
    relative = "nemo_rl/algorithms/loss/loss_functions.py"
    if not (tree / relative).exists():
        relative = "nemo_rl/algorithms/loss_functions.py"
    losses = common.load_module(tree, relative)
    function = f"{relative}:ClippedPGLossFn.__call__"

    config = yaml.safe_load((tree / "examples/configs/grpo_math_1B.yaml").read_text())["loss_fn"]
    config.update({k: v for k, v in settings.items() if k != "seq_logprob_error_threshold"})
    config["reference_policy_kl_penalty"] = 0.0  # the reference-model KL term: not a mismatch figure
    threshold = settings.get("seq_logprob_error_threshold")
    seq_errors = grpo_function(tree, "compute_and_apply_seq_logprob_error_masking")
    takes_logits = "next_token_logits" in losses.ClippedPGLossFn.__call__.__code__.co_varnames
    if takes_logits:
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # CPU run

    def make_loss() -> Any:
        if hasattr(losses.ClippedPGLossConfig, "model_fields"):  # pydantic from 0.7.0
            return losses.ClippedPGLossFn(losses.ClippedPGLossConfig(**config))
        return losses.ClippedPGLossFn(config)

    def batch(samples: list[dict]) -> dict[str, Any]:
        """GRPO's train_data for ``samples``: every per-token field behind a leading prompt
        position (the loss and grpo.py read [:, 1:])."""
        step = common.padded(samples)

        def lead(t: Any, value: float | None = None) -> Any:
            first = t[:, :1] if value is None else torch.full_like(t[:, :1], value)
            return torch.cat([first, t], dim=1)

        return {
            "token_mask": lead(step["mask"], 0.0),
            "sample_mask": torch.ones(len(samples), dtype=torch.float64),
            "advantages": lead(step["token_advantages"]),
            "prev_logprobs": lead(step["trainer"]),
            "generation_logprobs": lead(step["rollout"]),
            "reference_policy_logprobs": lead(step["trainer"]),
            "input_ids": torch.zeros(len(samples), step["mask"].shape[1] + 1, dtype=torch.long),
        }

    def call(loss_fn: Any, data: dict[str, Any], valid_seqs: Any, valid_toks: Any) -> dict[str, float]:
        rows, width = data["token_mask"].shape
        if takes_logits:
            first = torch.zeros(rows, width, 4, dtype=torch.float64)
        else:
            first = data["prev_logprobs"][:, 1:].clone()
        _, metrics = loss_fn(first, data, global_valid_seqs=valid_seqs, global_valid_toks=valid_toks)
        return {k: float(v) for k, v in metrics.items() if k in FIGURES}

    def sequence_errors(data: dict[str, Any]) -> dict[str, float]:
        """grpo.py's sequence-level logprob errors on the whole step; with a threshold it rewrites
        data["sample_mask"], as grpo.py does before the loss."""
        if seq_errors is None:
            return {}
        result = seq_errors(
            train_data=data,
            rewards=torch.zeros(data["sample_mask"].shape[0], dtype=torch.float64),
            seq_logprob_error_threshold=threshold,
        )
        if isinstance(result, tuple):  # 0.6.0: (max, number masked, masked correct share)
            return {"max_seq_mult_prob_error": result[0], "num_masked_seqs_by_logprob_error": result[1]}
        out = {k: v for k, v in result.items() if k != "masked_correct_pct"}  # needs rewards
        if "num_masked_seqs" in out:  # grpo.py renames it
            out["num_masked_seqs_by_logprob_error"] = out.pop("num_masked_seqs")
        return {k: float(v) for k, v in out.items()}

    def figures(samples: list[dict]) -> dict:
        try:
            loss_fn = make_loss()
        except (AssertionError, ValueError) as refused:
            print(f"ClippedPGLossFn refuses {settings}: {refused}")
            return {}
        whole = batch(samples)
        summed: dict[str, float] = sequence_errors(whole)
        kept = whole["sample_mask"]
        valid_toks = (whole["token_mask"][:, 1:] * kept[:, None]).sum()
        valid_seqs = kept.sum()
        for rank in sorted({s["rank"] for s in samples}):
            rows = [i for i, s in enumerate(samples) if s["rank"] == rank]
            data = batch([samples[i] for i in rows])
            data["sample_mask"] = kept[rows].clone()
            if data["sample_mask"].sum() == 0:  # the worker keeps no metrics of such a micro-batch
                continue
            try:
                metrics = call(loss_fn, data, valid_seqs, valid_toks)
            except (AssertionError, ValueError, TypeError) as refused:
                print(f"ClippedPGLossFn fails on {settings}: {refused!r}")
                return {}
            for k, v in metrics.items():
                summed[k] = summed.get(k, 0.0) + v
        return summed

    common.write_fixture(
        "nemo-rl",
        args.label or args.version or "head",
        repository=REPOSITORY,
        commit=commit,
        functions=[function, "nemo_rl/algorithms/grpo.py (np.sum of the micro-batch metrics)"],
        settings=settings,
        values=common.run_steps(figures),
        version=args.version,
        era=args.era,
        script="scripts/parity/nemo_rl.py",
        notes=(
            "one ClippedPGLossFn call per process (garbage in padding and a leading prompt position, "
            "mask 0), global_valid_toks/seqs over the whole step, metrics summed over processes; "
            "reference_policy_kl_penalty 0 (the reference KL is not a mismatch figure); settings "
            "over grpo_math_1B.yaml's loss_fn; no figures where the loss refuses the settings"
        ),
    )


if __name__ == "__main__":
    main()
