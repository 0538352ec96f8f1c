"""Every launch the FP8 tile table may pick, and both fingerprint kernels, compile for Hopper
(sm_90) on any machine (``scripts/hopper_compile.py``): a kernel Triton's code generator refuses
fails here rather than in a GPU run. It runs in a child process because the test session
interprets Triton (TRITON_INTERPRET=1), which cannot build cubins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .conftest import needs_triton

ROOT = Path(__file__).resolve().parents[2]


@needs_triton
def test_every_table_launch_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "hopper_compile.py")],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT / "tests",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "ok   fp8" in done.stdout and "ok   fingerprint regions" in done.stdout
