"""Known vulnerabilities of the installed dependencies, for ``make lint``: pip-audit over this
environment, judged here so that an unreachable advisory database is said plainly and never fails
the build, while a vulnerability found does, unless ``scripts/vulnerabilities-ignore.txt`` lists it
with a reason.

Exit status: 0 (nothing found, everything found is ignored with a reason, or the database could
not be consulted: said so), 1 (a vulnerability not ignored), 2 (pip-audit itself broke, or the
ignore file is malformed).

``python scripts/vulnerabilities.py [--report FILE.json] [--ignore FILE]``; ``--report`` judges
a pip-audit JSON report already made (the tests use it) instead of running pip-audit.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IGNORE_FILE = Path(__file__).with_name("vulnerabilities-ignore.txt")

#: What a failed connection to the advisory database looks like in pip-audit's error output.
_OFFLINE = re.compile(
    r"ConnectionError|ConnectTimeout|ReadTimeout|Max retries exceeded|NameResolutionError|"
    r"Temporary failure in name resolution|Name or service not known|Network is unreachable|"
    r"Connection refused|timed out",
    re.IGNORECASE,
)
_NOT_FOUND = "Dependency not found on PyPI"


@dataclass
class Verdict:
    """What the scan says: ``found`` (package, version, id, fixed in), ``ignored`` (the same, with
    the reason), ``unaudited`` (package, why), ``audited`` (how many were checked)."""

    audited: int = 0
    found: list[tuple[str, str, str, str]] = field(default_factory=list)
    ignored: list[tuple[str, str, str, str]] = field(default_factory=list)
    unaudited: list[tuple[str, str]] = field(default_factory=list)
    offline: str | None = None

    @property
    def status(self) -> int:
        return 1 if self.found else 0

    def lines(self) -> list[str]:
        if self.offline is not None:
            return [
                f"vulnerability scan: NOT CHECKED, the advisory database could not be consulted ({self.offline})"
            ]
        out = []
        for name, version, vuln, fixed in self.found:
            out.append(f"vulnerability scan: {name} {version}: {vuln} (fixed in: {fixed or 'no fix yet'})")
        for name, version, vuln, reason in self.ignored:
            out.append(f"vulnerability scan: ignored {name} {version}: {vuln} ({reason})")
        local = [name for name, why in self.unaudited if _NOT_FOUND not in why and "editable" not in why]
        unknown = [name for name, why in self.unaudited if _NOT_FOUND in why]
        if unknown:
            out.append(
                f"vulnerability scan: {len(unknown)} distributions unknown to the advisory database, not "
                f"audited: {', '.join(sorted(unknown))}"
            )
        if local:
            out.append(f"vulnerability scan: not audited: {', '.join(sorted(local))}")
        verdict = f"{len(self.found)} vulnerabilities" if self.found else "no known vulnerabilities"
        out.append(
            f"vulnerability scan: {verdict} in {self.audited} audited distributions"
            + (f" ({len(self.ignored)} ignored with a reason)" if self.ignored else "")
        )
        return out


def read_ignores(path: Path) -> dict[str, str]:
    """``ID  # reason`` per line (``#`` lines and blank lines skipped); a reason is required."""
    if not path.exists():
        return {}
    ignores = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        vuln, _, reason = (part.strip() for part in line.partition("#"))
        if not vuln or " " in vuln or not reason:
            raise ValueError(f"{path}:{number}: expected `VULNERABILITY-ID  # reason`, got {raw!r}")
        ignores[vuln] = reason
    return ignores


def judge(report: dict[str, Any], ignores: dict[str, str]) -> Verdict:
    """The verdict of one pip-audit JSON report (``-f json``)."""
    verdict = Verdict()
    for dependency in report.get("dependencies", []):
        name, version = dependency.get("name", "?"), dependency.get("version", "?")
        if "skip_reason" in dependency:
            verdict.unaudited.append((name, str(dependency["skip_reason"])))
            continue
        verdict.audited += 1
        for vuln in dependency.get("vulns", []):
            ids = [vuln.get("id", "?"), *vuln.get("aliases", [])]
            fixed = ", ".join(vuln.get("fix_versions", []))
            reason = next((ignores[i] for i in ids if i in ignores), None)
            if reason is not None:
                verdict.ignored.append((name, version, ids[0], reason))
            else:
                verdict.found.append((name, version, " / ".join(ids), fixed))
    if verdict.audited == 0 and verdict.unaudited:
        not_found = sum(_NOT_FOUND in why for _, why in verdict.unaudited)
        if not_found:  # every lookup answered "not found": the index serves no advisory data
            verdict.offline = (
                f"the package index answered 'not found' for {not_found} of {len(verdict.unaudited)} "
                "installed distributions: it serves no per-release vulnerability data here"
            )
    return verdict


def run_pip_audit(timeout_s: int) -> tuple[dict[str, Any] | None, str]:
    """pip-audit over this interpreter's environment: (its JSON report or ``None``, its stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        done = subprocess.run(
            [sys.executable, "-m", "pip_audit", "--local", "--skip-editable", "--progress-spinner", "off"]
            + ["--timeout", str(timeout_s), "-f", "json", "-o", str(out)],
            capture_output=True,
            text=True,
        )
        report = json.loads(out.read_text()) if out.exists() and out.stat().st_size else None
    return report, done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="judge this pip-audit JSON report instead of scanning")
    parser.add_argument(
        "--ignore", type=Path, default=IGNORE_FILE, help="ignored vulnerabilities, with reasons"
    )
    parser.add_argument("--timeout", type=int, default=15, help="seconds per request to the database")
    args = parser.parse_args(argv)
    try:
        ignores = read_ignores(args.ignore)
    except ValueError as exc:
        print(f"vulnerability scan: {exc}", file=sys.stderr)
        return 2
    if args.report is not None:
        report, errors = json.loads(args.report.read_text()), ""
    else:
        report, errors = run_pip_audit(args.timeout)
    if report is None:
        offline = _OFFLINE.search(errors)
        if offline is None:
            print(f"vulnerability scan: pip-audit failed:\n{errors.strip()}", file=sys.stderr)
            return 2
        verdict = Verdict(offline=f"network: {offline.group(0)}")
    else:
        verdict = judge(report, ignores)
    for line in verdict.lines():
        print(line)
    return verdict.status


if __name__ == "__main__":
    sys.exit(main())
