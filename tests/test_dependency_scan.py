"""`make lint`'s vulnerability scan (scripts/vulnerabilities.py): a vulnerability found fails it
unless ignored with a reason; an advisory database that cannot be consulted is said plainly and
does not fail it (checked with the real pip-audit, its network sent to a closed local port)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "vulnerabilities.py"


def scan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def report(tmp_path: Path, *dependencies: dict) -> str:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"dependencies": list(dependencies), "fixes": []}))
    return str(path)


VULNERABLE = {
    "name": "requests",
    "version": "2.19.0",
    "vulns": [{"id": "PYSEC-2018-28", "fix_versions": ["2.20.0"], "aliases": ["CVE-2018-18074"]}],
}
CLEAN = {"name": "httpx", "version": "0.28.1", "vulns": []}


def test_a_vulnerability_found_fails_and_names_package_id_and_fix(tmp_path: Path):
    done = scan("--report", report(tmp_path, VULNERABLE, CLEAN), "--ignore", str(tmp_path / "none.txt"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "requests 2.19.0: PYSEC-2018-28 / CVE-2018-18074 (fixed in: 2.20.0)" in done.stdout
    assert "1 vulnerabilities in 2 audited distributions" in done.stdout


def test_an_ignored_vulnerability_passes_with_its_reason_shown(tmp_path: Path):
    ignore = tmp_path / "ignore.txt"
    ignore.write_text("# comment\n\nCVE-2018-18074  # we never send credentials over redirects\n")
    done = scan("--report", report(tmp_path, VULNERABLE, CLEAN), "--ignore", str(ignore))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ignored requests 2.19.0: PYSEC-2018-28 (we never send credentials over redirects)" in done.stdout


@pytest.mark.parametrize("line", ["CVE-2018-18074", "CVE-2018-18074  #", "two words  # reason"])
def test_an_ignore_without_a_reason_is_refused(tmp_path: Path, line: str):
    ignore = tmp_path / "ignore.txt"
    ignore.write_text(line + "\n")
    done = scan("--report", report(tmp_path, CLEAN), "--ignore", str(ignore))
    assert done.returncode == 2 and "ignore.txt:1: expected `VULNERABILITY-ID  # reason`" in done.stderr


def test_an_index_without_advisory_data_is_said_plainly_and_passes(tmp_path: Path):
    unknown = [
        {"name": n, "skip_reason": f"Dependency not found on PyPI and could not be audited: {n} (1.0)"}
        for n in "ab"
    ]
    done = scan(
        "--report",
        report(tmp_path, *unknown, {"name": "isoaudit", "skip_reason": "distribution marked as editable"}),
    )
    assert done.returncode == 0
    assert (
        done.stdout.startswith("vulnerability scan: NOT CHECKED") and "'not found' for 2 of 3" in done.stdout
    )


def test_some_unknown_distributions_are_listed_and_the_rest_judged(tmp_path: Path):
    local = {
        "name": "torch",
        "skip_reason": "Dependency not found on PyPI and could not be audited: torch (2.13.0+cpu)",
    }
    done = scan("--report", report(tmp_path, CLEAN, local))
    assert done.returncode == 0
    assert "1 distributions unknown to the advisory database, not audited: torch" in done.stdout
    assert "no known vulnerabilities in 1 audited distributions" in done.stdout


@pytest.mark.slow
def test_the_real_pip_audit_without_network_says_not_checked_and_passes():
    pytest.importorskip("pip_audit")
    dead = "http://127.0.0.1:9"  # discard port: nothing listens, every request is refused at once
    done = scan(env={"HTTPS_PROXY": dead, "HTTP_PROXY": dead, "https_proxy": dead, "http_proxy": dead})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("vulnerability scan: NOT CHECKED"), done.stdout + done.stderr
