"""Cost of fingerprinting one activation in a forward hook, against the cheapest possible reduction.

    python bench/fingerprints.py [--rows 16384] [--hidden 4096] [--dtype bfloat16] [--device cpu]

Prints the time of the collector's ``fingerprint_rows(x)`` (digest + ladder + sketch + l2 + maxabs;
on CUDA the fused pass of ``isoaudit.kernels.fingerprint``, ``ISOAUDIT_FINGERPRINT_TRITON=0`` for the torch
path) and of a plain ``x.float().sum(-1)`` over the same tensor, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isoaudit.collectors.fingerprints import fingerprint_rows  # noqa: E402  (the fused kernel on CUDA, torch elsewhere)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` after one warm-up call (synchronising on CUDA)."""

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8 * 2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    x = torch.randn(args.rows, args.hidden, device=device).to(getattr(torch, args.dtype))
    base = timed(lambda: x.float().sum(-1), device, args.repeats)
    fingerprint = timed(lambda: fingerprint_rows(x), device, args.repeats)
    print(
        f"fingerprint_rows [{args.rows}, {args.hidden}] {args.dtype} on {device} "
        f"(torch threads {torch.get_num_threads()}): {fingerprint * 1e3:.1f} ms; "
        f"x.float().sum(-1): {base * 1e3:.1f} ms; ratio {fingerprint / base:.2f}x"
    )


if __name__ == "__main__":
    main()
