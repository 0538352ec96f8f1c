"""``/runs/<run_id>/contract``: both sides' latest manifests side by side, the handshake verdict and
the history of manifest changes."""

from __future__ import annotations

import dash
import dash_bootstrap_components as dbc
from dash import dcc, html
from dash.development.base_component import Component
from isoaudit.audit.db import reads
from isoaudit.dashboard import context, data
from isoaudit.dashboard.components import frame_table, no_run
from isoaudit.dashboard.pages import contract_changes, urls

# Component ids.
VERDICT = "contract-verdict"
FIELDS = "contract-fields"
HISTORY = "contract-history"
DIFFERS = "contract-differs"  # the class of a field row whose value differs between the sides


def verdict(view: reads.ContractView) -> dbc.Alert:
    """Whether the two sides' latest manifests agree on one numerical policy, and if not, why."""
    if view.handshake is None:
        missing = [side for side, m in (("trainer", view.trainer), ("rollout", view.rollout)) if m is None]
        return dbc.Alert(
            f"No handshake: no manifest from the {' and '.join(missing)} yet.",
            color="secondary",
            id=VERDICT,
        )
    if view.handshake.ok:
        return dbc.Alert("Handshake: the two sides share one numerical policy.", color="success", id=VERDICT)
    return dbc.Alert(
        [html.Strong("Handshake refused:"), html.Ul([html.Li(r) for r in view.handshake.reasons])],
        color="danger",
        id=VERDICT,
    )


def layout(run_id: str | None = None, against: str | None = None, **_: object) -> Component:
    store = context.store()
    if not run_id or store.get_run(run_id) is None:
        return no_run(run_id)
    view = reads.contract_view(store, run_id)
    fields = data.contract_frame(view)
    n_diff = int(fields["differs"].sum()) if len(fields) else 0
    return html.Div(
        [
            dcc.Link("← run", href=urls.run_path(run_id)),
            html.H3(f"Contract of {run_id}", className="mt-2"),
            verdict(view),
            contract_changes.section(store, run_id, against),
            html.H5(f"Latest manifests ({n_diff} differing fields)", className="mt-3"),
            frame_table(
                fields.drop(columns=["differs"]),
                row_class=lambda r: f"table-warning {DIFFERS}" if fields.loc[r.name, "differs"] else None,
                table_id=FIELDS,
            ),
            html.H5("Manifest history", className="mt-3"),
            frame_table(data.history_frame(view.history), table_id=HISTORY),
        ]
    )


def register(app: dash.Dash) -> None:
    dash.register_page(
        __name__,
        path_template=urls.CONTRACT,
        name="Contract",
        title="isoaudit: contract",
        layout=layout,
        order=2,
    )
