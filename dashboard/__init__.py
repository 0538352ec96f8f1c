"""The isoaudit dashboard: a Dash multi-page app over the store (DESIGN.md, "Dashboard").

Three layers: :mod:`dashboard.data` (queries through ``audit.queries`` -> pandas frames),
:mod:`dashboard.figures` (frames -> plotly figures) and :mod:`dashboard.pages` (thin layouts and
callbacks). ``create_app(store_or_url)`` builds the app; ``isoaudit dashboard`` serves it.
"""

from isoaudit.dashboard.app import create_app

__all__ = ["create_app"]
