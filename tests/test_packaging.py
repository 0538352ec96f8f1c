"""The project's shape: the core imports without optional extras; docker-compose.yml is valid."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_core_imports_without_vllm_or_dash():
    # Block the optional extras and import every core module: none may need them.
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['dash'] = None\n"
        "import isoaudit, isoaudit.audit.records, isoaudit.audit.db, isoaudit.cli, isoaudit.audit.db.schema, isoaudit.collectors, isoaudit.kernels\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(
    shutil.which("docker-compose") is None and shutil.which("docker") is None, reason="no compose"
)
def test_docker_compose_config_is_valid():
    command = (
        ["docker-compose", "config", "-q"]
        if shutil.which("docker-compose")
        else ["docker", "compose", "config", "-q"]
    )
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
