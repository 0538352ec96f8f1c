"""What every tracker writer offers, and the lazy import of the tracker libraries.

W&B and MLflow are optional extras (``isoaudit[wandb]``, ``isoaudit[mlflow]``): nothing imports
them until a writer is opened, and a missing one is a :class:`TrackerUnavailable` naming the extra.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from types import ModuleType
from typing import Literal, Protocol

Tracker = Literal["wandb", "mlflow"]
#: The trackers isoaudit logs into, by the name a user gives them.
TRACKERS: tuple[Tracker, ...] = ("wandb", "mlflow")
#: The module each tracker imports.
_MODULES: dict[str, str] = {"wandb": "wandb", "mlflow": "mlflow"}


class TrackerUnavailable(ImportError):
    """A tracker's library is not installed; the message names the extra that installs it."""


def check_installed(tracker: str) -> None:
    """Raise :class:`TrackerUnavailable` now (at configuration, not at the first step) when
    ``tracker``'s library is missing; ValueError for a tracker isoaudit does not know."""
    if tracker not in _MODULES:
        raise ValueError(f"trackers: {tracker!r} is not one of {', '.join(TRACKERS)}")
    if importlib.util.find_spec(_MODULES[tracker]) is None:
        raise TrackerUnavailable(_missing(tracker))


def require(tracker: str) -> ModuleType:
    """``tracker``'s library, imported on first use."""
    try:
        return importlib.import_module(_MODULES[tracker])
    except ImportError as exc:
        raise TrackerUnavailable(_missing(tracker)) from exc


def _missing(tracker: str) -> str:
    return f"{tracker} is not installed: pip install 'isoaudit[{tracker}]'"


class TrackerWriter(Protocol):
    """Logs one isoaudit run's compared steps into one tracker run. Called from one thread only
    (a session's follower, the worker's tracker thread), never from the job's or the comparator's."""

    tracker: Tracker
    #: The tracker's id of the run written into.
    target: str
    #: True when the run is the job's own (logged beside the job's figures), False for one of isoaudit's.
    shared: bool
    #: Compared steps handed to the tracker.
    logged: int

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        """Log ``figures`` (:func:`isoaudit.audit.trackers.figures.tracked_figures`) at isoaudit step ``step``."""

    def poll(self) -> None:
        """Hand over what waits for the tracker's next row (called every tick of the caller)."""

    def alert(self, title: str, text: str, level: str) -> bool:
        """Raise an alert in the tracker; False where the tracker has no alerts."""

    def close(self) -> None:
        """Hand over what still waits, and finish the run if it is isoaudit's own."""
