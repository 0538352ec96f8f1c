"""The pages. Each module has ``register(app)``: it registers its path with Dash's page registry and
its callbacks on that app (so several apps in one process never share callbacks)."""

from dashboard.pages import alerts, contract, run, runs, sample

PAGES = (runs, run, sample, contract, alerts)
