"""What a tracker is given per compared step, and the names it is given under.

A compared step's figures go to W&B and MLflow under the user's framework names: the table of
``isoaudit compare --names FRAMEWORK`` (:func:`isoaudit.audit.metric_names.as_framework`), or
without a framework isoaudit's own canonical names. Each is prefixed ``isoaudit/`` so it never
collides with the figure of the same name the framework logs itself, and has its own x-axis,
``isoaudit/step`` (a tracker run's own step counter belongs to the job).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from functools import cache
from typing import Any

from isoaudit.audit.metric_names import FRAMEWORKS, as_framework, canonical_names, framework_aliases

#: Prepended to every figure's name in a tracker.
PREFIX = "isoaudit/"
#: isoaudit's step, the x-axis of its figures in W&B (the job's run has a step counter of its own).
STEP_KEY = PREFIX + "step"
#: The tag (MLflow) and config key (W&B) that name the isoaudit run a tracker run holds figures of.
RUN_TAG = "isoaudit.run_id"

#: Longest metric name MLflow stores.
MLFLOW_MAX_NAME = 250


def check_framework(framework: str | None, field: str = "names") -> str | None:
    """``framework`` if it is one ``--names`` knows (or None); else ValueError naming ``field``."""
    if framework is not None and framework not in FRAMEWORKS:
        raise ValueError(f"{field}: {framework!r} is not one of {', '.join(FRAMEWORKS)}")
    return framework


@cache
def _canonical() -> tuple[str, ...]:
    return tuple(canonical_names())


def tracked_figures(metrics: Mapping[str, Any], framework: str | None = None) -> dict[str, float]:
    """A compared step's ``metrics`` (stored keys) as a tracker logs them: under ``framework``'s
    names (the ``--names`` table, in its order) or, without one, under isoaudit's canonical names.
    Only finite numbers: a figure without data (None, NaN) is left out, a gap in the chart."""
    check_framework(framework)
    if framework is not None:
        named = as_framework(metrics, framework)
    else:
        named = {key: metrics[key] for key in _canonical() if key in metrics}
    return {name: float(value) for name, value in named.items() if _finite(value)}


def source_keys(framework: str | None = None) -> list[str]:
    """The stored keys :func:`tracked_figures` reads (to ask a store or the API for those alone)."""
    check_framework(framework)
    if framework is None:
        return list(_canonical())
    keys = (k for alias in framework_aliases(framework) for k in (alias.key, alias.same_as) if k)
    return list(dict.fromkeys(keys))


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def wandb_run_id(run_id: str) -> str:
    """The W&B run id of isoaudit run ``run_id``'s own W&B run: stable, so a restarted worker or a
    resumed job resumes the same W&B run; readable, with a digest so two isoaudit ids that differ
    only in characters W&B refuses (``.``, ``:``) never share one (at most 58 characters)."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:40]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"isoaudit-{readable}-{digest}"


def mlflow_metric_name(name: str) -> str:
    """``name`` as MLflow accepts it on every platform: ASCII letters, digits, ``_ - . / `` and
    space (anything else becomes ``_``), no empty, ``.`` or ``..`` path segment, no leading slash,
    at most 250 characters."""
    cleaned = re.sub(r"[^A-Za-z0-9_\-. /]", "_", name)
    parts = [part for part in cleaned.split("/") if part]
    parts = ["_" if part in (".", "..") else part for part in parts]
    return "/".join(parts)[:MLFLOW_MAX_NAME].rstrip("/") or "_"


#: W&B's alert levels by isoaudit severity.
_LEVELS = {"critical": "ERROR", "error": "ERROR", "warning": "WARN", "info": "INFO"}


def alert_level(severity: str, event: str = "firing") -> str:
    """The W&B alert level of an isoaudit alert: a resolution is INFO, firing goes by severity."""
    return "INFO" if event == "resolved" else _LEVELS.get(severity, "WARN")


def alert_title(rule: str, run_id: str, event: str = "firing") -> str:
    """A W&B alert's title (W&B keeps fewer than 64 characters; it also holds back a second alert
    of the same title within the wait duration, so the title names the rule, run and event)."""
    title = f"isoaudit {rule} {event} on {run_id}"
    return title if len(title) < 64 else title[:60] + "..."
