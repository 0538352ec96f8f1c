"""``/runs/<run_id>/contract``: both sides' latest manifests side by side, the handshake verdict and
the history of manifest changes."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import dash
import dash_bootstrap_components as dbc
from dash import dcc, html
from isoaudit.audit.db import reads as queries
from isoaudit.dashboard import context, data
from isoaudit.dashboard.components import frame_table, not_found


def verdict(view: queries.ContractView) -> dbc.Alert:
    if view.handshake is None:
        missing = [side for side, m in (("trainer", view.trainer), ("rollout", view.rollout)) if m is None]
        return dbc.Alert(
            f"No handshake: no manifest from the {' and '.join(missing)} yet.",
            color="secondary",
            id="contract-verdict",
        )
    if view.handshake.ok:
        return dbc.Alert(
            "Handshake: the two sides share one numerical policy.", color="success", id="contract-verdict"
        )
    return dbc.Alert(
        [html.Strong("Handshake refused:"), html.Ul([html.Li(r) for r in view.handshake.reasons])],
        color="danger",
        id="contract-verdict",
    )


def layout(run_id: str | None = None, **_: Any) -> html.Div:
    store = context.store()
    if not run_id or store.get_run(run_id) is None:
        return not_found(f"No run {run_id!r} in this store.")
    view = queries.contract_view(store, run_id)
    fields = data.contract_frame(view)
    n_diff = int(fields["differs"].sum()) if len(fields) else 0
    return html.Div(
        [
            dcc.Link("← run", href=f"/runs/{quote(run_id, safe='')}"),
            html.H3(f"Contract of {run_id}", className="mt-2"),
            verdict(view),
            html.H5(f"Latest manifests ({n_diff} differing fields)"),
            frame_table(
                fields.drop(columns=["differs"]),
                row_class=lambda r: (
                    "table-warning contract-differs" if fields.loc[r.name, "differs"] else None
                ),
                table_id="contract-fields",
            ),
            html.H5("Manifest history", className="mt-3"),
            frame_table(data.history_frame(view.history), table_id="contract-history"),
        ]
    )


def register(app: dash.Dash) -> None:
    dash.register_page(
        __name__,
        path_template="/runs/<run_id>/contract",
        name="Contract",
        title="isoaudit: contract",
        layout=layout,
        order=2,
    )
