"""PRIME-RL's mismatch figures from its own loss (``compute_loss`` with the release's built-in loss
function, src/prime_rl/trainer/rl/loss.py), the trainer's token-level ``mismatch_kl/all`` (its
``compute_importance_ratio_and_mismatch_kl`` over the loss tokens, as src/prime_rl/trainer/rl/train.py
does from 0.5.1.dev192), and its logger's reduction: ``Tensors.compute_stats`` of
src/prime_rl/trainer/utils.py, run on a one-process gloo group holding every process's tensors (what
its all-gather gives), then ``filter_rl_trainer_tensor_stats_for_wandb`` where the release has it.

The loss settings are the release's loss config class defaults (read from its source) under the
fixture's (``loss.<field>``).

python scripts/parity/prime_rl.py --commit TAG --era SINCE [--version V] [--label L] [--settings JSON]
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "PrimeIntellect-ai/prime-rl"
PACKAGES = ("prime_rl", "prime_rl.trainer", "prime_rl.trainer.rl", "prime_rl.utils", "prime_rl.configs")
STUBS = [
    "beartype",
    "jaxtyping",
    "torchtitan.distributed.utils",
    "prime_rl.trainer.rl.config",
    "prime_rl.configs.trainer",
    "prime_rl.utils.utils",
    "prime_rl.utils.logger",
    "prime_rl.utils.pathing",
    "prime_rl.trainer.world",
]
#: keys the trainer logs for the train–rollout mismatch (the rest of its tensors are not mismatch figures)
MISMATCH_KEYS = {
    "mismatch_kl",
    "masked_mismatch_kl",
    "unmasked_mismatch_kl",
    "is_masked",
    "is_masked_low",
    "is_masked_high",
    "sequence_masked_low",
    "sequence_masked_high",
    "geo_masked_low",
    "geo_masked_high",
    "geo_seq_ratio",
    "masked_advantage_positive",
    "masked_advantage_negative",
}


def packages(tree: Path) -> None:
    """PRIME-RL's packages as bare folders of the snapshot (no ``__init__``)."""
    for name in PACKAGES:
        module = types.ModuleType(name)
        module.__path__ = [str(tree / "src" / name.replace(".", "/"))]
        sys.modules[name] = module


def class_defaults(tree: Path, class_name: str) -> dict[str, Any] | None:
    """The field defaults of a config class in the snapshot's source (``x: T = 1.0`` or
    ``x: T = Field(1.0, ...)``)."""
    for path in sorted(tree.rglob("*.py")):
        text = path.read_text(errors="ignore")
        if f"class {class_name}(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                out: dict[str, Any] = {}
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value:
                        value = item.value
                        if isinstance(value, ast.Call) and value.args:
                            value = value.args[0]
                        try:
                            out[item.target.id] = ast.literal_eval(value)
                        except ValueError:
                            pass
                return out
    return None


def main() -> None:
    args = common.release_arguments(__doc__)
    settings: dict[str, Any] = json.loads(args.settings)
    commit, _ = common.resolve_commit(REPOSITORY, args.commit)
    tree = common.checkout(REPOSITORY, commit)
    import torch
    import torch.distributed as dist

    packages(tree)
    common.stub_modules(STUBS, tree)
    loss = common.load_module(tree, "src/prime_rl/trainer/rl/loss.py", "prime_rl.trainer.rl.loss")
    utils = common.load_module(tree, "src/prime_rl/trainer/utils.py", "prime_rl.trainer.utils")

    # the logger's statistics, on CPU: one gloo process holding every process's tensors
    moved = torch.Tensor.to
    torch.Tensor.to = lambda self, *a, **k: self if a and a[0] == "cuda" else moved(self, *a, **k)  # type: ignore[method-assign]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    kind = settings.get("loss.type", "default")
    class_name = {"default": "DefaultLossConfig", "ipo": "IPOLossConfig"}[kind]
    defaults = class_defaults(tree, class_name)
    if defaults is None:  # before the loss types: one LossConfig
        class_name, defaults = "LossConfig", class_defaults(tree, "LossConfig") or {}
    config = types.SimpleNamespace(
        **{**defaults, **{k.removeprefix("loss."): v for k, v in settings.items()}}
    )
    if kind == "ipo":
        rl_fn = lambda inputs: loss.ipo_loss_fn(inputs, config)  # noqa: E731
    else:
        rl_fn = lambda inputs: loss.default_loss_fn(inputs, config)  # noqa: E731
    parameters = inspect.signature(loss.compute_loss).parameters
    token_kl = '"mismatch_kl/all"' in (tree / "src/prime_rl/trainer/rl/train.py").read_text()

    def micro_batch(samples: list[dict]) -> dict[str, Any]:
        step = common.padded(samples)
        n = [int(x) for x in step["lengths"]]
        rows = lambda t: [t[i, : n[i]] for i in range(len(samples))]  # noqa: E731
        trainer, rollout = rows(step["trainer"]), rows(step["rollout"])
        mask = [m.bool() for m in rows(step["mask"])]
        given = {
            "trainer_logprobs": trainer,
            "inference_logprobs": rollout,
            "teacher_logprobs": None,
            "ref_logprobs": None,
            "advantages": rows(step["token_advantages"]),
            "loss_mask": mask,
            "loss_config": config,
            "loss_fn": rl_fn,
            "rl_loss_fn": rl_fn,
            "loss_fns": {"rl": rl_fn},
            "training_mode": "rl",
            "loss_scale": 1,
            "rl_scale": 1,
            "ce_scale": 1,
            "ref_kl_scale": 1,
            "rl_weights": None,
            "ce_weights": None,
            "ref_kl_weights": None,
        }
        _, tensors = loss.compute_loss(**{k: v for k, v in given.items() if k in parameters})
        out = {k: v for k, v in tensors.items() if k in MISMATCH_KEYS}
        if token_kl:  # train.py: k3 of the forward's logprobs against the inference's, on the loss mask
            kl = [
                loss.compute_importance_ratio_and_mismatch_kl(t, r)[2][m]
                for t, r, m in zip(trainer, rollout, mask, strict=True)
            ]
            out["mismatch_kl/all"] = torch.cat(kl)
        return out

    def figures(samples: list[dict]) -> dict:
        tensors = utils.Tensors()
        for rank in sorted({s["rank"] for s in samples}):
            for key, value in micro_batch([s for s in samples if s["rank"] == rank]).items():
                tensors[key].append(value.detach())
        stats = tensors.compute_stats()
        if hasattr(utils, "filter_rl_trainer_tensor_stats_for_wandb"):
            stats = utils.filter_rl_trainer_tensor_stats_for_wandb(stats)
        return stats

    common.write_fixture(
        "prime-rl",
        args.label or args.version or "head",
        repository=REPOSITORY,
        commit=commit,
        functions=[
            "src/prime_rl/trainer/rl/loss.py:compute_loss",
            "src/prime_rl/trainer/utils.py:Tensors.compute_stats",
        ]
        + (["src/prime_rl/trainer/rl/train.py (mismatch_kl/all)"] if token_kl else [])
        + (
            ["src/prime_rl/trainer/utils.py:filter_rl_trainer_tensor_stats_for_wandb"]
            if hasattr(utils, "filter_rl_trainer_tensor_stats_for_wandb")
            else []
        ),
        settings=settings,
        values=common.run_steps(figures),
        version=args.version,
        era=args.era,
        script="scripts/parity/prime_rl.py",
        notes=(
            f"loss {class_name} ({json.dumps(vars(config), sort_keys=True)}); one micro-batch per process, "
            "each sample's tensors its full length (masked spans in the loss mask, no padding), advantages "
            "broadcast over tokens; statistics on one gloo process holding every process's tensors"
        ),
    )


if __name__ == "__main__":
    main()
