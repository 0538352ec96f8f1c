"""The contract page's "What changed" section: what differs in the environment and the runtime facts
(versions, backends, flags, pins) between the two sides, since each side's previous manifest, and
against another run (``?against=RUN``), key by key with old → new (``audit.db.reads.environment``)."""

from __future__ import annotations

from urllib.parse import quote

import pandas as pd
from dash import dcc, html
from dash.development.base_component import Component
from isoaudit.audit.db.reads.environment import EnvironmentReport, Point, UnknownPoint, environment_diff
from isoaudit.audit.db.store import Store
from isoaudit.audit.environment import shown
from isoaudit.dashboard.components import frame_table
from isoaudit.dashboard.pages import urls

# Component ids.
SECTION = "contract-changes"
SIDES_TABLE = "contract-changes-sides"
PREVIOUS_TABLE = "contract-changes-previous"
AGAINST_TABLE = "contract-changes-against"
AGAINST_LINKS = "contract-changes-runs"

#: Other runs offered to compare against (newest first).
OTHER_RUNS = 12

COLUMNS = ["comparison", "group", "key", "old", "new"]


def changes_frame(report: EnvironmentReport) -> pd.DataFrame:
    """One row per changed key: which comparison, its group, the key, old and new."""
    rows = [
        {
            "comparison": f"{part.old_label} → {part.new_label}",
            "group": group,
            "key": change.key,
            "old": shown(change.old),
            "new": shown(change.new),
        }
        for part in report.diffs
        for group, changes in part.diff.by_group().items()
        for change in changes
    ]
    return pd.DataFrame(rows, columns=COLUMNS)


def _table(report: EnvironmentReport, table_id: str, empty: str) -> Component:
    frame = changes_frame(report)
    if not len(frame):
        return html.P(empty, id=table_id, className="text-muted")
    return frame_table(frame, table_id=table_id)


def section(store: Store, run_id: str, against: str | None = None) -> Component:
    """The section: the sides, since the previous manifests, and against ``against`` when given."""
    sides = environment_diff(store, Point(run_id), sides=True)
    previous = environment_diff(store, Point(run_id))
    children: list[Component] = [
        html.H5("What changed", className="mt-3"),
        html.H6("Between the sides (latest manifests)"),
        _table(sides, SIDES_TABLE, "The two sides' environments agree."),
        html.H6("Since each side's previous manifest"),
        _table(previous, PREVIOUS_TABLE, "Nothing changed since the previous manifests."),
    ]
    others = [r.run_id for r in store.list_runs(limit=OTHER_RUNS + 1) if r.run_id != run_id][:OTHER_RUNS]
    if others:
        children.append(
            html.P(
                [html.Span("Compare with run: ")]
                + [
                    dcc.Link(
                        other,
                        href=f"{urls.contract_path(run_id)}?against={quote(other, safe='')}",
                        className="me-2",
                    )
                    for other in others
                ],
                id=AGAINST_LINKS,
            )
        )
    if against:
        try:
            report = environment_diff(store, Point(run_id), Point.parse(against))
        except (UnknownPoint, ValueError) as exc:
            children.append(html.P(f"against: {exc}", id=AGAINST_TABLE, className="text-danger"))
        else:
            children += [
                html.H6(f"Against {against} (each side against the same side)"),
                _table(report, AGAINST_TABLE, f"Nothing differs from {against}."),
            ]
    return html.Div(children, id=SECTION)
