"""Write docs/parity.md: every framework figure isoaudit shows, by release, with its definition and
the commit of the framework's own code its golden fixture came from (tests/test_parity_doc.py keeps
the file in step with audit.frameworks and the fixtures).

    python scripts/parity/table.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "parity.md"
FIXTURES = ROOT / "tests" / "fixtures" / "parity"

HEADER = """# Framework parity

Every number isoaudit shows under a framework's name (`isoaudit compare --names verl`,
`/metrics?framework=verl`, the trackers' `tracker_names`, alert rules and gates on
`verl:rollout_corr/k3_kl`) is computed as that framework's own code computes it, at the release the
run declares (`session(..., framework="verl==0.7.1", framework_config={...})`, or `config.framework`
and `config.framework_config` of the run; the TRL callback declares its installed TRL and its
`GRPOConfig`). A run that declares nothing gets each framework's newest code with its defaults.
`isoaudit metrics list --framework verl@0.6` shows one release's figures and what changed between
releases; `isoaudit compare --names verl --json` says which release and settings it used (`declared`,
`default`, or `unset` for a setting the framework requires and the run did not give: that figure is
then not computed).

**How it is proven.** `scripts/parity/<framework>.py` extracts the framework's code at a pinned
commit from a snapshot (a bare clone; `scripts/parity/common.py` says where), imports the metric
function itself, and runs it on the shared input steps of `tests/fixtures/parity/inputs.json`
(ragged lengths, masked spans inside responses and padding holding garbage, |Δ| beyond 20, one-token
samples, bit-identical sides, four processes of unequal sizes), on float64 tensors, so that
definitions are compared free of float32 rounding. Its values are kept as fixtures (data, with the
commit and the function); `tests/audit/test_framework_parity.py` requires isoaudit's figure for
every name, at every release era, to equal them within 1e-6 relative, and
`tests/service/test_framework_parity_api.py` reads them back through `isoaudit compare --names --json`
and `/metrics?framework=`. To see what moved upstream, re-run a script against a newer commit
(`python scripts/parity/verl.py --commit <sha>`): the fixture changes (`git diff`) and the golden test
names every figure whose definition moved.

**What isoaudit assumes.** The tokens a framework masks out of its loss (tool output, padding) are
not recorded, so every recorded token counts; one micro-batch per process per step; per-process
means use each sample's recorded `rank`; figures that depend on the sign of the advantage use the
trainer's recorded `advantage` (left out when none was recorded).
"""


def _fixtures() -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in sorted(FIXTURES.glob("*/*.json")):
        body = json.loads(path.read_text())
        body["path"] = path.relative_to(ROOT).as_posix()
        out.setdefault((body["framework"], body["era"]), []).append(body)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from isoaudit.audit.frameworks import FRAMEWORK_TABLES, REQUIRED

    fixtures = _fixtures()
    lines = [HEADER]
    for table in FRAMEWORK_TABLES.values():
        if not table.eras:
            continue
        lines.append(f"## {table.name}\n")
        lines.append(f"Source: [{table.repository}](https://github.com/{table.repository}).\n")
        lines.append("| releases | introduced by | what changed | fixtures (commit) |")
        lines.append("| --- | --- | --- | --- |")
        for i, era in enumerate(table.eras):
            until = table.eras[i + 1].since if i + 1 < len(table.eras) else None
            span = era.since if era.released else f"{era.since} (unreleased)"
            span += f" up to {until}" if until else " on"
            proofs = ", ".join(
                f"`{Path(f['path']).name}` ({f['commit'][:10]})"
                for f in fixtures.get((table.name, era.since), [])
            )
            lines.append(
                f"| {_cell(span)} | `{era.commit[:10]}` {era.date} | {_cell(era.change)} | {proofs or '—'} |"
            )
        lines.append("")
        head = table.head
        lines.append(f"Figures of the newest code ({head.since}):\n")
        lines.append("| name | definition | settings | equals isoaudit | upstream function |")
        lines.append("| --- | --- | --- | --- | --- |")
        for figure in head.figures:
            names = " ".join(f"`{n}`" for n in (figure.name, *figure.also))
            settings = ", ".join(figure.settings)
            lines.append(
                f"| {names} | {_cell(figure.definition)} | {settings} | {f'`{figure.same_as}`' if figure.same_as else ''} "
                f"| `{_cell(figure.source)}` |"
            )
        defaults = head.defaults
        if defaults:
            shown = ", ".join(
                f"`{k}` = {'(required, no default)' if v is REQUIRED else f'`{v!r}`'}"
                for k, v in defaults.items()
            )
            lines.append(f"\nSettings and their defaults: {shown}.")
        older = [
            (era, [f for f in era.figures if head.figure(f.name) is None or head.figure(f.name) != f])
            for era in table.eras[:-1]
        ]
        changed = [(era, figs) for era, figs in older if figs]
        if changed:
            lines.append("\nDefinitions of earlier releases that differ from the newest:\n")
            lines.append("| releases from | name | definition |")
            lines.append("| --- | --- | --- |")
            for era, figs in changed:
                for figure in figs:
                    lines.append(f"| {era.since} | `{figure.name}` | {_cell(figure.definition)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
