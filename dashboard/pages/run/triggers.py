"""How the run page's callbacks are registered: at each tick of the page's interval, or on a
user's action; either way the callback also gets the page's state (:data:`ids.STATE`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dash
from dash import Input, Output, State
from isoaudit.dashboard.pages.run import ids

#: What ``app.callback(...)`` returns: it registers the function it is given.
Register = Callable[[Callable[..., Any]], Any]


def on_tick(app: dash.Dash, *outputs: Output, also: tuple[Input | State, ...] = ()) -> Register:
    """A live callback, called at every tick as ``(n_intervals, state, *also)``."""
    return app.callback(
        *outputs,
        Input(ids.INTERVAL, "n_intervals"),
        State(ids.STATE, "data"),
        *also,
        prevent_initial_call=True,
    )


def on_page_event(app: dash.Dash, *dependencies: Output | Input | State) -> Register:
    """A callback of a user's action, called with its inputs and states, then the page's state."""
    return app.callback(*dependencies, State(ids.STATE, "data"), prevent_initial_call=True)
