"""`isoaudit serve` as its own process, as a deployment runs it, for the fault and load tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def serve(
    url: str,
    port: int,
    *,
    worker: bool = False,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start `isoaudit serve` on ``url`` and return once ``/healthz`` answers (``worker``: run the
    comparison worker and alert evaluation too, as its child process; ``args``: more options)."""
    command = [sys.executable, "-m", "isoaudit.cli", "serve", "--database-url", url, "--port", str(port)]
    command += ["--log-level", "warning", *args] + ([] if worker else ["--no-worker"])
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "ISOAUDIT_DEFAULT_ALERT_RULES": "1" if worker else "0", **(env or {})},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        assert process.poll() is None, "isoaudit serve exited during start-up"
        time.sleep(0.1)
    raise AssertionError("isoaudit serve did not answer /healthz within 60 s")


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux /proc), zombies left out."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return [c for c in found if alive(c)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until ``condition`` held; an AssertionError naming ``what`` after ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - started
