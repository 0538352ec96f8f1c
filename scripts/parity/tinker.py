"""Tinker's figures from tinker-cookbook's own ``compute_kl_sample_train`` (see common.py).

python scripts/parity/tinker.py [--commit SHA]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPOSITORY = "thinking-machines-lab/tinker-cookbook"
FUNCTION = "tinker_cookbook/rl/metrics.py:compute_kl_sample_train"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", default="HEAD", help="a sha or tag (v0.1.0)")
    parser.add_argument("--version", default=None, help="the release the commit is (labels the fixture)")
    args = parser.parse_args()
    commit, _ = common.resolve_commit(REPOSITORY, args.commit)
    tree = common.checkout(REPOSITORY, commit)
    common.stub_modules(["tinker", "tinker_cookbook.utils.trace"], tree)
    import torch

    metrics = common.load_module(tree, "tinker_cookbook/rl/metrics.py")

    class Array:  # tinker's TensorData: .to_torch()
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def to_torch(self) -> torch.Tensor:
            return self.tensor

    class Datum:
        def __init__(self, logprobs: torch.Tensor, mask: torch.Tensor) -> None:
            self.loss_fn_inputs = {"logprobs": Array(logprobs), "mask": Array(mask)}

    def figures(samples: list[dict]) -> dict:
        step = common.padded(samples)
        data = [Datum(step["rollout"][i], step["mask"][i]) for i in range(len(samples))]
        training = [step["trainer"][i] for i in range(len(samples))]
        out = metrics.compute_kl_sample_train(data, training)
        return {
            "kl_sample_train_v1": out["optim/kl_sample_train_v1"],
            "kl_sample_train_v2": out["optim/kl_sample_train_v2"],
            "entropy": out["optim/entropy"],
        }

    common.write_fixture(
        "tinker",
        args.version or "head",
        repository=REPOSITORY,
        commit=commit,
        functions=[FUNCTION],
        settings={},
        values=common.run_steps(figures),
        version=args.version,
        era="0.1.0",
        script="scripts/parity/tinker.py",
        notes="each datum padded to the batch's width with garbage (mask 0), as tinker's datums carry their own mask",
    )


if __name__ == "__main__":
    main()
