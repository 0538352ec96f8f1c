"""Cost of fingerprinting one activation, against the cheapest possible read of the same tensor.

    python bench/fingerprints.py [--shapes 1024x896:bfloat16,1024x151936:float32] [--device cuda]

For each ``ROWSxWIDTH:DTYPE`` prints the time of the collector's ``fingerprint_rows(x)`` (digest +
ladder + sketch + l2 + maxabs; on CUDA the fused pass of ``isoaudit.kernels.fingerprint``,
``ISOAUDIT_FINGERPRINT_TRITON=0`` for the torch path) and of a plain ``x.float().sum(-1)`` over
the same tensor (one read, what any reduction costs at least), and their ratio; then the same for
``--regions``, many regions through one call of the multi-region kernel. The default shapes are a
compiled trainer step's regions at 8 x 128 and 8 x 1,280 tokens of a 0.5B model (hidden 896, MLP
4,864, the fp32 logits of a 151,936 vocabulary).
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

DEFAULT_SHAPES = (
    "1024x896:bfloat16,1024x4864:bfloat16,1024x151936:float32,"
    "10240x896:bfloat16,10240x4864:bfloat16,2048x151936:float32"
)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call of ``fn`` after one warm-up call (on CUDA between events, so the
    figure is the device's, launch latency included once)."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


def parse_shape(text: str) -> tuple[int, int, torch.dtype]:
    """``ROWSxWIDTH:DTYPE`` (dtype bfloat16, float16 or float32) as (rows, width, dtype)."""
    try:
        size, dtype = text.split(":")
        rows, width = (int(v) for v in size.lower().split("x"))
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(dtype)
    except ValueError as exc:
        raise SystemExit(f"--shapes: '{text}' is not ROWSxWIDTH:DTYPE (bfloat16, float16, float32)") from exc
    return rows, width, getattr(torch, dtype)


def regions_case(text: str, device: torch.device) -> tuple[str, Callable[[], object], Callable[[], object]]:
    """``COUNTxROWSxWIDTH:DTYPE[+...]``: that many regions of that shape through one call of the
    multi-region kernel (as a compiled forward's op makes), as (label, call, a plain read of each
    region)."""
    from isoaudit.collectors.fingerprint_op import FingerprintBuffers
    from isoaudit.collectors.fingerprint_regions import Region, fingerprint_regions_into
    from isoaudit.collectors.fingerprints import default_ladder_bits

    regions = []
    for part in text.split("+"):
        count, rest = part.split("x", 1)
        rows, width, dtype = parse_shape(rest)
        for _ in range(int(count)):
            x = torch.randn(rows, width, device=device).to(dtype)
            regions.append(Region(len(regions), x, default_ladder_bits(dtype)))
    buffers = FingerprintBuffers(len(regions), regions[0].rows.shape[0], device)
    return (
        f"{len(regions)} regions {text}",
        lambda: fingerprint_regions_into(regions, buffers.ints, buffers.floats),
        lambda: [region.rows.float().sum(-1) for region in regions],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated ROWSxWIDTH:DTYPE")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--regions",
        default="96x1024x896:bfloat16+24x1024x4864:bfloat16",
        help="'+'-joined COUNTxROWSxWIDTH:DTYPE: one multi-region call over them ('' for none)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"fingerprint_rows on {device} (torch threads {torch.get_num_threads()}):")
    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = []
    for text in args.shapes.split(","):
        rows, width, dtype = parse_shape(text)
        x = torch.randn(rows, width, device=device).to(dtype)
        label = f"[{rows}, {width}] {str(dtype).removeprefix('torch.')}"
        cases.append((label, lambda x=x: fingerprint_rows(x), lambda x=x: x.float().sum(-1)))
    if args.regions:
        cases.append(regions_case(args.regions, device))
    for label, call, read in cases:
        fingerprint = timed(call, device, args.repeats)
        base = timed(read, device, args.repeats)
        print(
            f"  {label}: {fingerprint * 1e6:.0f} us; x.float().sum(-1) {base * 1e6:.0f} us; "
            f"ratio {fingerprint / base:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
