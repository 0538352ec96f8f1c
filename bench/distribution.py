"""Cost of a fingerprinted step's full-distribution record (top-k + full-vocabulary sketch) on the
trainer side, against the logprobs it computes anyway.

    python bench/distribution.py [--positions 4096] [--vocab 151936] [--k 8] [--device cuda]

Prints the time of ``processed_logprobs`` (the baseline: fp32 log-softmax rows of the sampled
positions, gathered at the sampled tokens), of the same rows plus ``distribution_rows`` (top-k and
the float64 sketch ``Rᵀ√p``), and their ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isoaudit.collectors.distribution import distribution_rows, sketch_rows  # noqa: E402
from isoaudit.collectors.logprobs import processed_logprob_rows, processed_logprobs  # noqa: E402
from isoaudit.kernels._triton import use_triton  # noqa: E402

from bench.fingerprints import timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    n, vocab = args.positions, args.vocab
    logits = torch.randn(1, n + 1, vocab, device=device, dtype=torch.bfloat16) * 3
    ids = torch.randint(0, vocab, (1, n + 1))
    predict, target = np.arange(n), np.arange(1, n + 1)
    temperature, sample_of = np.array([0.7]), np.zeros(n, dtype=np.int64)

    def baseline() -> object:
        return processed_logprobs(logits, ids, predict, target, temperature, sample_of)

    def with_distribution() -> object:
        rows, targets = processed_logprob_rows(logits, ids, predict, target, temperature, sample_of)
        return rows.gather(1, targets[:, None]), distribution_rows(rows, args.k)

    base = timed(baseline, device, args.repeats)
    full = timed(with_distribution, device, args.repeats)
    print(
        f"[{n} positions, vocab {vocab}] k={args.k} on {device}: logprobs {base * 1e3:.1f} ms; "
        f"logprobs + top-k + sketch {full * 1e3:.1f} ms; ratio {full / base:.2f}x"
    )
    if use_triton(logits):  # the sketch alone: the one-pass kernel against float64 torch
        rows, _ = processed_logprob_rows(logits, ids, predict, target, temperature, sample_of)
        one_pass = timed(lambda: sketch_rows(rows, "triton"), device, args.repeats)
        chunks = timed(lambda: sketch_rows(rows, "torch"), device, args.repeats)
        print(
            f"  sketch alone: one pass {one_pass * 1e3:.2f} ms; float64 torch {chunks * 1e3:.2f} ms; "
            f"ratio {one_pass / chunks:.2f}x"
        )


if __name__ == "__main__":
    main()
