"""The run page's component ids, one constant each: its layouts, callbacks and the browser tests
name components through these."""

from __future__ import annotations

# The page's own machinery.
STATE = "run-state"  # dcc.Store: the LiveState its step figures were drawn with
INTERVAL = "run-interval"  # dcc.Interval: the live tick, disabled once the run is idle
NAV = "run-nav"  # dcc.Location: where a click on a cell or a row sends the browser

# Header.
TITLE = "run-title"
STATUS = "run-status"
BACKLOG = "run-backlog"  # the banner over steps of the run no worker compares
BACKLOG_SLOT = "run-backlog-slot"  # where the tick redraws it

# Remediation toggle.
MODE = "run-mode"
CONTROL = "run-control"  # dcc.Store: the desired mode and version this page last read
CONTROL_MESSAGE = "run-control-message"
CONTROL_OK = "run-control-ok"
CONTROL_CONFLICT = "run-control-conflict"
APPLIED = "run-applied"
DESIRED_MODE = "run-desired-mode"


def applied_mode(side: str) -> str:
    """The mode ``side`` (trainer or rollout) last reported applying."""
    return f"run-applied-{side}"


# Step metrics, heatmaps and diagnoses.
TIMELINES = "run-timelines"
POSITION = "run-position"
POSITION_STAT = "run-position-stat"
DIVERGENCE = "run-divergence"
DIAGNOSES = "run-diagnoses"

# MoE routing.
ROUTING_SECTION = "run-routing-section"
ROUTING = "run-routing"
ROUTING_VALUE = "run-routing-value"
ROUTING_STEPS = "run-routing-steps"  # dcc.Store: the last step the routing heatmap draws
ROUTING_LINE = "run-routing-line"

# The loop's own figures.
LOOP = "run-loop"
LOOP_STEPS = "run-loop-steps"  # dcc.Store: the last step the loop figure draws

# Ranks.
RANKS = "run-ranks"
RANK_FIGURE = "run-rank-figure"

# A step's samples.
STEP = "run-step"
SAMPLES = "run-samples"
