"""The pages. Each has ``register(app)``: it registers its path with Dash's page registry and its
callbacks on that app (so several apps in one process never share callbacks). :mod:`.urls` holds
every page's path template and builds the links between them.

Order matters: Dash takes the first path template that matches (in ``order``), and ``<run_id>``
matches slashes too, so the longer run paths (sample, contract) get a lower ``order`` than the run page."""

from isoaudit.dashboard.pages import alerts, contract, run, runs, sample

PAGES = (runs, sample, contract, run, alerts)
