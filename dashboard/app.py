"""The app factory: one Dash app over one store, with the pages of ``dashboard.pages``."""

from __future__ import annotations

import dash
import dash_bootstrap_components as dbc
from dash import dcc, html
from isoaudit.audit.db import Store
from isoaudit.dashboard import context
from isoaudit.dashboard.pages import PAGES, urls

NAV = (("Runs", urls.RUNS), ("Alerts", urls.ALERTS))
#: The shell's location: a callback that sets it navigates without reloading the page.
SHELL_LOCATION = "shell-location"


def _shell() -> html.Div:
    """The navigation bar over the page the URL names."""
    brand = dbc.NavbarBrand("isoaudit", href=urls.RUNS)
    links = [dbc.NavItem(dbc.NavLink(label, href=href, active="exact")) for label, href in NAV]
    return html.Div(
        [
            dbc.Navbar(
                dbc.Container([brand, dbc.Nav(links, navbar=True)], fluid=True), color="dark", dark=True
            ),
            dbc.Container(dash.page_container, fluid=True, className="py-3"),
            dcc.Location(id=SHELL_LOCATION, refresh="callback-nav"),
        ]
    )


#: Bootstrap's CSS ships in ``dashboard/assets`` (Dash serves that folder): the dashboard must work
#: on a machine without internet access, so nothing is fetched from a CDN.


def create_app(
    store_or_url: Store | str | None = None,
    *,
    auth: tuple[str, str] | None = None,
    live_interval_ms: int = 5000,
    requests_pathname_prefix: str | None = None,
    stalled_after_s: float = context.STALLED_AFTER_S,
) -> dash.Dash:
    """The dashboard over ``store_or_url`` (a :class:`Store`, a database URL, or None for
    ``ISOAUDIT_DATABASE_URL`` / the SQLite default). ``auth`` = (user, password) puts every route
    behind HTTP basic auth; live pages poll every ``live_interval_ms`` while their run is live; steps
    ready to compare that wait ``stalled_after_s`` seconds with no worker comparing get a banner
    naming the command that compares them."""
    store = store_or_url if isinstance(store_or_url, Store) else Store(store_or_url)
    app = dash.Dash(
        __name__,
        use_pages=True,
        pages_folder="",
        suppress_callback_exceptions=True,
        title="isoaudit",
        requests_pathname_prefix=requests_pathname_prefix,
    )
    app.server.config[context.STORE_KEY] = store
    app.server.config[context.INTERVAL_KEY] = live_interval_ms
    app.server.config[context.STALLED_KEY] = stalled_after_s
    for page in PAGES:
        page.register(app)
    app.layout = _shell
    if auth is not None:
        import dash_auth

        dash_auth.BasicAuth(app, {auth[0]: auth[1]})
    # Dash sets itself up on its first request (registering the scripts it may serve), and another
    # request arriving on another thread meanwhile finds that half done: a 500 on a script and a
    # blank page, seen under gunicorn's threads. So the first request is made here, before serving
    # (Dash's set-up runs before the basic-auth check, so a 401 does it too).
    app.server.test_client().get("/_dash-layout")
    return app
