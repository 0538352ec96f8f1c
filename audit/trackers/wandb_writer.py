"""isoaudit's figures in W&B: into the job's own run, or into a run of isoaudit's own.

Both kinds of run get ``define_metric("isoaudit/*", step_metric="isoaudit/step")``, so isoaudit's
figures are charted against isoaudit's step, whatever the run's own step counter says.

**The job's run** (``wandb.run`` of the job) belongs to the job: its step counter advances when the
job logs, and a job that logs with an explicit ``step=N`` has every log below the counter dropped.
So isoaudit never commits a row there while the job runs: each compared step is logged with
``commit=False`` into the row the job is building (the job's next log commits it), at most one
compared step per job row (a second would overwrite the first); the others wait, in order, for the
next row. Closing writes what still waits: all but the last as rows of their own (each advances
the job's counter by one), the last into the open row, which the job's ``wandb.finish`` commits.

**A run of isoaudit's own** (``wandb.init(id=wandb_run_id(run), resume="allow",
reinit="create_new")``): one per isoaudit run, resumed by its stable id, never made ``wandb.run``
(so the job's later ``wandb.log`` never lands in it), with console capture and system metrics off.
Each compared step is a row.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

from isoaudit.audit.trackers.base import Tracker, require
from isoaudit.audit.trackers.figures import PREFIX, RUN_TAG, STEP_KEY, wandb_run_id

log = logging.getLogger(__name__)

#: At most this many compared steps wait for the job's next row; beyond it the oldest is dropped.
MAX_PENDING = 1024
#: Seconds W&B holds back a second alert of the same title.
ALERT_WAIT_S = 1


class WandbWriter:
    """Logs compared steps into the W&B run ``run``; build it with :meth:`attach` or :meth:`own`."""

    tracker: Tracker = "wandb"

    def __init__(self, run: Any, *, shared: bool, max_pending: int = MAX_PENDING) -> None:
        self.run = run
        self.shared = shared
        self.target = str(run.id)
        self.max_pending = max_pending
        self.logged = 0
        self.dropped = 0  # compared steps that never reached the job's run (the wait list overflowed)
        self.own_rows = 0  # rows isoaudit committed in the job's run (at close only)
        self._pending: deque[dict[str, float | int]] = deque()
        self._row: int | None = None  # the job's row our last step went into
        run.define_metric(STEP_KEY)
        run.define_metric(PREFIX + "*", step_metric=STEP_KEY)

    @classmethod
    def attach(cls, run: Any, run_id: str) -> WandbWriter:
        """Into the job's own run ``run`` (``wandb.run``), which keeps its step counter."""
        writer = cls(run, shared=True)
        run.config.update({RUN_TAG: run_id}, allow_val_change=True)
        return writer

    @classmethod
    def own(
        cls,
        run_id: str,
        *,
        name: str | None = None,
        project: str | None = None,
        entity: str | None = None,
        mode: str | None = None,
        group: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> WandbWriter:
        """Into isoaudit run ``run_id``'s own W&B run, created or resumed (by
        :func:`~isoaudit.audit.trackers.figures.wandb_run_id`). ``project``/``entity``/``mode``: None
        leaves them to W&B (``WANDB_PROJECT``, ...); ``name``: the run's display name (default
        ``run_id``); ``group``: the isoaudit project."""
        wandb = require("wandb")
        run = wandb.init(
            id=wandb_run_id(run_id),
            name=name or run_id,
            resume="allow",
            reinit="create_new",
            project=project,
            entity=entity,
            mode=mode,
            group=group,
            job_type="isoaudit",
            config={RUN_TAG: run_id, **(config or {})},
            settings=wandb.Settings(
                console="off",
                silent=True,
                x_disable_stats=True,
                x_disable_machine_info=True,
                save_code=False,
                x_save_requirements=False,
            ),
        )
        return cls(run, shared=False)

    # ------------------------------------------------------------------ writing

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        row: dict[str, float | int] = {STEP_KEY: step, **{PREFIX + k: v for k, v in figures.items()}}
        if not self.shared:
            self.run.log(row)
            self.logged += 1
            return
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append(row)
        self.poll()

    def poll(self) -> None:
        """Put the oldest waiting step into the job's open row, once the job moved past the row
        our previous step went into."""
        if not self.shared or not self._pending:
            return
        current = int(self.run.step)
        if self._row is not None and current == self._row:
            return
        self.run.log(self._pending.popleft(), commit=False)
        self._row = current
        self.logged += 1

    def alert(self, title: str, text: str, level: str) -> bool:
        self.run.alert(title=title, text=text, level=level, wait_duration=ALERT_WAIT_S)
        return True

    def close(self) -> None:
        """The job's run: what still waits (see the module docstring); isoaudit's own: finish it."""
        if not self.shared:
            self.run.finish()
            return
        self.poll()
        if not self._pending:
            return
        if self._row is not None and int(self.run.step) == self._row:
            self.run.log({}, commit=True)  # our previous step is in the open row: commit it first
            self.own_rows += 1
        while self._pending:
            row = self._pending.popleft()
            last = not self._pending
            self.run.log(row, commit=not last)
            self.own_rows += 0 if last else 1
            self.logged += 1
