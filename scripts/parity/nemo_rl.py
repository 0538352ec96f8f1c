"""NeMo-RL's mismatch figures from its own ``ClippedPGLossFn`` (one call per process: each process's
samples are its micro-batch, normalized by the step's global token and sequence counts as its
``process_global_batch`` computes them), summed over processes as ``grpo.py`` sums micro-batch
metrics (``np.sum``). The loss settings are the release's ``examples/configs/grpo_math_1B.yaml``
``loss_fn`` section (and, from 0.7.0, ``ClippedPGLossConfig``'s defaults) under the fixture's.

python scripts/parity/nemo_rl.py --commit REF --era X [--version X.Y.Z] [--label L] [--settings JSON]
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--version", default=None)
    parser.add_argument("--label", default=None)
    parser.add_argument("--era", required=True)
    parser.add_argument("--settings", default="{}")
    args = parser.parse_args()
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
    config.update(settings)
    config["reference_policy_kl_penalty"] = 0.0  # the reference-model KL term: not a mismatch figure
    takes_logits = "next_token_logits" in losses.ClippedPGLossFn.__call__.__code__.co_varnames
    if takes_logits:
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # CPU run

    def make_loss() -> Any:
        if hasattr(losses.ClippedPGLossConfig, "model_fields"):  # pydantic from 0.7.0
            return losses.ClippedPGLossFn(losses.ClippedPGLossConfig(**config))
        return losses.ClippedPGLossFn(config)

    def call(loss_fn: Any, samples: list[dict], valid_seqs: Any, valid_toks: Any) -> dict[str, float]:
        step = common.padded(samples)

        # a leading prompt position: the loss reads [:, 1:] of every per-token field
        def lead(t: Any, value: float | None = None) -> Any:
            first = t[:, :1] if value is None else torch.full_like(t[:, :1], value)
            return torch.cat([first, t], dim=1)

        data = {
            "token_mask": lead(step["mask"], 0.0),
            "sample_mask": torch.ones(len(samples), dtype=torch.float64),
            "advantages": lead(step["token_advantages"]),
            "prev_logprobs": lead(step["trainer"]),
            "generation_logprobs": lead(step["rollout"]),
            "reference_policy_logprobs": lead(step["trainer"]),
            "input_ids": torch.zeros(len(samples), step["mask"].shape[1] + 1, dtype=torch.long),
        }
        if takes_logits:
            first = torch.zeros(len(samples), step["mask"].shape[1] + 1, 4, dtype=torch.float64)
        else:
            first = step["trainer"].clone()
        _, metrics = loss_fn(first, data, global_valid_seqs=valid_seqs, global_valid_toks=valid_toks)
        return {k: float(v) for k, v in metrics.items() if k in FIGURES}

    def figures(samples: list[dict]) -> dict:
        try:
            loss_fn = make_loss()
        except (AssertionError, ValueError) as refused:
            print(f"ClippedPGLossFn refuses {settings}: {refused}")
            return {}
        valid_toks = torch.tensor(float(sum(sum(s["mask"]) for s in samples)), dtype=torch.float64)
        valid_seqs = torch.tensor(float(len(samples)), dtype=torch.float64)
        summed: dict[str, float] = {}
        for rank in sorted({s["rank"] for s in samples}):
            try:
                metrics = call(loss_fn, [s for s in samples if s["rank"] == rank], valid_seqs, valid_toks)
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
