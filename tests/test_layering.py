"""DESIGN.md's "may import" table holds: the import-linter contracts in pyproject.toml pass, the
checker really reads our packages (a contract we know to be false is reported broken), and the
service's comparison path runs without loading torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
    "lint-imports"
)
needs_linter = pytest.mark.skipif(
    LINT_IMPORTS is None, reason="lint-imports (import-linter) is not installed"
)


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    assert LINT_IMPORTS is not None
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@needs_linter
def test_the_import_contracts_hold():
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert " broken" in result.stdout and "0 broken" in result.stdout


@needs_linter
def test_the_checker_reports_a_contract_that_is_false(tmp_path: Path):
    """Not vacuous: the API does import the store, so forbidding it must be reported."""
    config = tmp_path / "false.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["audit"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "known false"\ntype = "forbidden"\n'
        'source_modules = ["audit.api"]\nforbidden_modules = ["audit.store"]\n'
    )
    result = lint_imports(str(config))
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout + result.stderr


def test_the_service_compares_without_loading_torch():
    """What the static contract says, observed: importing the API, worker, comparator, metrics and
    diagnosis leaves torch unloaded (the service image need not ship it)."""
    code = (
        "import sys\n"
        "import audit.api.app, audit.worker, audit.compare, audit.metrics, audit.diagnosis\n"
        "loaded = sorted(m for m in ('torch', 'triton', 'vllm', 'transformers') if m in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"loaded: {result.stdout.strip()}"
