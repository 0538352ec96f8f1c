"""TRL's figures from GRPOTrainer's own code (see common.py).

TRL computes them inline in ``GRPOTrainer._generate_and_score_completions``, a method that needs a
model, vLLM and accelerate: this script locates in the snapshot's ``grpo_trainer.py`` (with ``ast``)
the two ``if self.use_vllm and self.vllm_importance_sampling_correction:`` blocks of that method (the
ratio and the metric logging) and executes exactly those source lines, once per process, with the
tensors bound (``old_per_token_logps`` the trainer's, ``sampling_per_token_logps`` the rollout's,
``completion_mask``) and ``nanmin``/``nanmax`` taken from the snapshot's ``trl/trainer/utils.py``.
The cross-process reduction is TRL's own: each process's block runs twice, first to record what it
hands to ``accelerator.gather``, then with ``gather`` returning every process's values stacked (what
accelerate returns), so the logged ``.mean()``/``nanmean``/``nanmin``/``max`` are TRL's expressions.
``GRPOConfig.__post_init__``'s mapping of the deprecated cap onto ``clip_max`` runs the same way.

python scripts/parity/trl.py [--commit REF --label LABEL --version VERSION]
"""

from __future__ import annotations

import argparse
import ast
import math
import sys
import textwrap
import types
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "huggingface/trl"
TRAINER = "trl/trainer/grpo_trainer.py"
METHOD = "GRPOTrainer._generate_and_score_completions"

#: label: (ref, version, isoaudit era, [settings, ...])
RELEASES: dict[str, tuple[str, str | None, str, list[dict[str, Any]]]] = {
    "0.26.2": (
        "v0.26.2",
        "0.26.2",
        "0.26.0",
        [
            {},
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_cap": 2.0},
            {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_cap": 1.5},
            {"vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_cap": 5.0},
            {"vllm_importance_sampling_correction": False},
        ],
    ),
    "1.5.1": ("v1.5.1", "1.5.1", "0.26.0", [{}, {"vllm_importance_sampling_mode": "token_truncate"}]),
    "1.6.0": (
        "v1.6.0",
        "1.6.0",
        "1.6.0",
        [
            {},
            {
                "vllm_importance_sampling_mode": "token_mask",
                "vllm_importance_sampling_clip_min": 0.5,
                "vllm_importance_sampling_clip_max": 2.0,
            },
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_cap": 2.0},
        ],
    ),
    "head": (
        "HEAD",
        None,
        "1.6.0",
        [
            {},
            {
                "vllm_importance_sampling_mode": "sequence_truncate",
                "vllm_importance_sampling_clip_min": 0.8,
                "vllm_importance_sampling_clip_max": None,
            },
            {
                "vllm_importance_sampling_mode": "token_mask",
                "vllm_importance_sampling_clip_min": 0.9,
                "vllm_importance_sampling_clip_max": 1.1,
            },
            {"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": 0.5},
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.5},
            {"vllm_importance_sampling_mode": "token_truncate"},
        ],
    ),
}


def _segment(source: str, node: ast.AST) -> str:
    """The node's exact source lines, dedented."""
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]  # type: ignore[attr-defined]
    return textwrap.dedent("\n".join(lines))


def _method_blocks(source: str) -> tuple[str, str]:
    """The ratio block and the metric block of _generate_and_score_completions."""
    tree = ast.parse(source)
    method = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "_generate_and_score_completions"
    )
    ratio = metrics = None
    for node in sorted((n for n in ast.walk(method) if isinstance(n, ast.If)), key=lambda n: n.lineno):
        test = ast.get_source_segment(source, node.test) or ""
        if "self.use_vllm and self.vllm_importance_sampling_correction" not in test:
            continue
        text = _segment(source, node)
        if "vllm_importance_sampling_ratio = torch.exp(" in text and ratio is None:
            ratio = text
        elif "sampling/importance_sampling_ratio/mean" in text and metrics is None:
            metrics = text
    if ratio is None or metrics is None:
        raise SystemExit("the importance-sampling blocks are not in this snapshot's method")
    return ratio, metrics


def _functions(source: str, names: list[str]) -> str:
    tree = ast.parse(source)
    return "\n\n".join(
        _segment(source, n) for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names
    )


def _config_block(source: str) -> str | None:
    """GRPOConfig.__post_init__'s ``if self.vllm_importance_sampling_cap is not None:`` (1.6.0 on)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
            for n in ast.walk(node):
                if isinstance(n, ast.If) and (ast.get_source_segment(source, n.test) or "") == (
                    "self.vllm_importance_sampling_cap is not None"
                ):
                    return _segment(source, n)
    return None


class _Accelerator:
    """accelerate's gather across the step's processes: recording, then answering with all of them."""

    def __init__(self) -> None:
        self.recorded: list[Any] = []
        self.answers: list[Any] | None = None

    def gather(self, tensor: Any) -> Any:
        import torch

        if self.answers is None:
            self.recorded.append(tensor.detach().clone())
            return tensor.reshape(1)
        return torch.stack(self.answers.pop(0))


def run_release(ref: str, label: str, version: str | None, era: str, configs: list[dict[str, Any]]) -> None:
    commit, _ = common.resolve_commit(REPOSITORY, ref)
    tree = common.checkout(REPOSITORY, commit)
    import torch

    trainer_src = (tree / TRAINER).read_text()
    ratio_block, metric_block = _method_blocks(trainer_src)
    helpers = _functions((tree / "trl/trainer/utils.py").read_text(), ["nanmin", "nanmax"])
    config_src = (tree / "trl/trainer/grpo_config.py").read_text()
    cap_block = _config_block(config_src)
    defaults_ns: dict[str, Any] = {}
    for node in ast.walk(ast.parse(config_src)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            if name.startswith("vllm_importance_sampling_") and isinstance(node.value, ast.Call):
                for kw in node.value.keywords:
                    if kw.arg == "default":
                        defaults_ns[name] = ast.literal_eval(kw.value)
    helper_ns: dict[str, Any] = {"torch": torch}
    exec(compile(helpers, "trl/trainer/utils.py", "exec"), helper_ns)  # noqa: S102

    for index, declared in enumerate(configs):
        config = types.SimpleNamespace(**{**defaults_ns, **declared})
        if cap_block is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(
                    compile(cap_block, "trl/trainer/grpo_config.py", "exec"),
                    {"self": config, "warnings": warnings},
                )  # noqa: S102

        def figures(samples: list[dict[str, Any]], config: types.SimpleNamespace = config) -> dict[str, Any]:
            ranks = sorted({s["rank"] for s in samples})
            accelerator = _Accelerator()
            shards = [common.padded([s for s in samples if s["rank"] == r]) for r in ranks]

            def run(shard: dict[str, Any], metrics: dict[str, Any]) -> None:
                trainer = types.SimpleNamespace(
                    use_vllm=True,
                    tools=None,
                    accelerator=accelerator,
                    _metrics={"train": metrics},
                    **{k: v for k, v in vars(config).items()},
                )
                scope: dict[str, Any] = {
                    "self": trainer,
                    "torch": torch,
                    "math": math,
                    "nanmin": helper_ns["nanmin"],
                    "nanmax": helper_ns["nanmax"],
                    "old_per_token_logps": shard["trainer"],
                    "sampling_per_token_logps": shard["rollout"],
                    "completion_mask": shard["mask"],
                    "tool_mask": None,
                    "device": "cpu",
                    "mode": "train",
                }
                exec(compile(ratio_block, TRAINER, "exec"), scope)  # noqa: S102
                exec(compile(metric_block, TRAINER, "exec"), scope)  # noqa: S102

            per_rank = []
            for shard in shards:
                accelerator.recorded = []
                run(shard, defaultdict(list))
                per_rank.append(accelerator.recorded)
            # every process logs the same reduced values: run process 0 with the gathered answers
            accelerator.answers = [list(values) for values in zip(*per_rank, strict=True)]
            logged: dict[str, list[float]] = defaultdict(list)
            run(shards[0], logged)
            return {name: values[-1] for name, values in logged.items()}

        suffix = "" if index == 0 else f"+{index}"
        common.write_fixture(
            "trl",
            f"{label}{suffix}",
            repository=REPOSITORY,
            commit=commit,
            functions=[f"{TRAINER}:{METHOD}", "trl/trainer/utils.py:nanmin", "trl/trainer/utils.py:nanmax"],
            settings=declared,
            values=common.run_steps(figures),
            version=version,
            era=era,
            script="scripts/parity/trl.py",
            notes=(
                "TRL computes these inline in GRPOTrainer._generate_and_score_completions: the two "
                "'if self.use_vllm and self.vllm_importance_sampling_correction:' blocks (ratio, metrics) were "
                "located with ast in the snapshot's grpo_trainer.py and their exact source lines executed per "
                "process, tensors bound (old_per_token_logps = trainer, sampling_per_token_logps = rollout, "
                "completion_mask, tool_mask None, float64); accelerator.gather answered with every process's "
                "values stacked, so the cross-process reduction is TRL's own expression; nanmin/nanmax from "
                "the snapshot's trl/trainer/utils.py; GRPOConfig defaults read from the snapshot's "
                "grpo_config.py and its __post_init__ cap -> clip_max block executed where present"
            ),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit")
    parser.add_argument("--label")
    parser.add_argument("--version")
    args = parser.parse_args()
    if args.commit:
        (_, _, era, configs) = RELEASES.get(args.label or "head", RELEASES["head"])
        run_release(args.commit, args.label or "head", args.version, era, configs)
        return
    common.run_each_release(
        __file__, [(label, ref, version) for label, (ref, version, _, _) in RELEASES.items()]
    )


if __name__ == "__main__":
    main()
