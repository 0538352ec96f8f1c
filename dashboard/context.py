"""What a callback needs of the request it serves: the app's store and who is asking."""

from __future__ import annotations

import flask
from isoaudit.audit.db import Store

STORE_KEY = "ISOAUDIT_STORE"
INTERVAL_KEY = "ISOAUDIT_LIVE_INTERVAL_MS"
STALLED_KEY = "ISOAUDIT_STALLED_AFTER_S"
#: Ready steps waiting this long with no worker comparing anything of their run are called stalled:
#: long enough to cover a worker's start (a second or two) and a slow batch, which holds a claim.
STALLED_AFTER_S = 30.0


def store() -> Store:
    """The store of the app serving this request (each app keeps its own, in its Flask config)."""
    return flask.current_app.config[STORE_KEY]


def live_interval_ms() -> int:
    return int(flask.current_app.config.get(INTERVAL_KEY, 5000))


def stalled_after_s() -> float:
    return float(flask.current_app.config.get(STALLED_KEY, STALLED_AFTER_S))


def user() -> str:
    """Who makes a change: the basic-auth user when the dashboard has credentials, else ``dashboard``."""
    auth = flask.request.authorization if flask.has_request_context() else None
    name = auth.username if auth is not None and auth.username else None
    return f"dashboard:{name}" if name else "dashboard"
