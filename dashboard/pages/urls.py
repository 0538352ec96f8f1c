"""The dashboard's URLs: each page's path template and the links to it, built in one place.

``/runs/<run_id>?step=N`` is the link alert notices carry; run ids are quoted whole (a slash in one
stays inside its path segment)."""

from __future__ import annotations

from urllib.parse import quote

RUNS = "/"
ALERTS = "/alerts"
RUN = "/runs/<run_id>"
CONTRACT = "/runs/<run_id>/contract"
SAMPLE = "/runs/<run_id>/steps/<step>/samples/<sample_key>"


def run_path(run_id: str, step: int | None = None) -> str:
    """The run page, opened at ``step``'s samples when given."""
    path = f"/runs/{quote(run_id, safe='')}"
    return path if step is None else f"{path}?step={int(step)}"


def contract_path(run_id: str) -> str:
    return f"{run_path(run_id)}/contract"


def sample_path(run_id: str, step: int, sample_key: str) -> str:
    return f"{run_path(run_id)}/steps/{int(step)}/samples/{sample_key}"
