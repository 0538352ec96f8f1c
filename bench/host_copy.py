"""Host time of a recorded step's transfer (:class:`~isoaudit.collectors.transfer.HostCopy`).

A compiled trainer step with every region fingerprinted sends its fingerprints, logprobs and
distribution to the host in one asynchronous copy. This times the host side of that call (the
training thread waits for it) on a payload shaped like the compiled-trainer bench's step (0.5B:
123 regions x 1,024 rows), with each step's arrays kept ``--hold`` steps as a sink keeps them
before delivery, against what a user would write instead: ``torch.cat`` of the same tensors and
``.cpu()`` (which waits for the device). Parts: packing on the device, the pinned buffer, and
queueing the copy.

    python bench/host_copy.py            # CUDA only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import torch
from isoaudit.collectors.transfer import HostCopy


def payload(regions: int, rows: int, device: str) -> dict[str, torch.Tensor]:
    """Tensors like one step's: the fingerprint groups' fields (int64 digest and ladder, float32
    sketch, l2, maxabs) and the logprobs."""
    n = regions * rows
    return {
        "p0.digest": torch.randint(0, 1 << 62, (n,), device=device),
        "p0.ladder": torch.randint(0, 1 << 62, (n, 3), device=device),
        "p0.sketch": torch.randn(n, 8, device=device),
        "p0.l2": torch.randn(n, device=device),
        "p0.maxabs": torch.randn(n, device=device),
        "lp": torch.randn(rows, device=device),
    }


def timed(fn, steps: int, hold: int) -> list[float]:
    """Host seconds of each call, keeping each call's result ``hold`` calls."""
    held: deque[object] = deque(maxlen=max(hold, 1))
    out = []
    for _ in range(steps):
        torch.cuda._sleep(2_000_000)  # the device busy, as in a step: nothing here may wait for it
        t0 = time.perf_counter()
        held.append(fn())
        out.append(time.perf_counter() - t0)
        if hold == 0:
            held.clear()
    torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--regions", type=int, default=123)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hold", type=int, default=4, help="steps each result is kept (a sink's queue)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_copy.py: needs CUDA")
    tensors = payload(args.regions, args.rows, "cuda")
    size = sum(t.numel() * t.element_size() for t in tensors.values())

    def copy() -> object:
        return HostCopy(tensors)

    def packed() -> object:
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])

    def pinned() -> object:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def plain() -> object:
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]).cpu()

    results = {}
    for name, fn in (
        ("HostCopy", copy),
        ("pack on device", packed),
        ("pinned buffer", pinned),
        ("cat + .cpu()", plain),
    ):
        timed(fn, 5, args.hold)  # warm: allocator caches
        results[name] = 1e6 * statistics.median(timed(fn, args.steps, args.hold))
    print(f"{torch.cuda.get_device_name()}: {size / 2**20:.1f} MiB a step, results kept {args.hold} steps")
    for name, us in results.items():
        print(f"  {name:<16} {us:9.1f} us host")
    print(f"HostCopy against cat + .cpu(): ratio {results['HostCopy'] / results['cat + .cpu()']:.3f}")


if __name__ == "__main__":
    main()
