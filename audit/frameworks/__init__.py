"""The figures RL frameworks log for the train–rollout mismatch, each computed as that framework's own
code computes it, at the release a run declares (DESIGN.md, "Metrics"; docs/parity.md).

One module a framework (:mod:`.verl`, :mod:`.slime`, …), each a table of eras (:class:`Era`: from
which release, introduced by which upstream commit, which figures, their settings and defaults, and
their arithmetic). A run declares what it runs under in its config (``framework: "verl==0.7.1"``,
``framework_config: {rollout_rs_threshold: 2.0}``; integrations fill it in when they can tell); the
comparator computes every framework's figures for each step, the declared framework at its release
and settings, the others at their newest code and defaults, and stores them under
``framework:name`` keys (``verl:rollout_corr/k3_kl``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from isoaudit.audit.frameworks import nemo_rl, openrlhf, prime_rl, skyrl, slime, tinker, trl, verl
from isoaudit.audit.frameworks.base import REQUIRED, Era, Figure, Framework, StepTokens
from isoaudit.audit.metrics.blocks import idle_threads

log = logging.getLogger(__name__)

#: Every framework, in display order.
FRAMEWORK_TABLES: dict[str, Framework] = {
    f.name: f
    for f in (
        verl.FRAMEWORK,
        slime.FRAMEWORK,
        skyrl.FRAMEWORK,
        trl.FRAMEWORK,
        openrlhf.FRAMEWORK,
        nemo_rl.FRAMEWORK,
        tinker.FRAMEWORK,
        prime_rl.FRAMEWORK,
    )
}
FRAMEWORKS: tuple[str, ...] = tuple(FRAMEWORK_TABLES)

_SPEC = re.compile(
    r"^\s*(?P<name>[A-Za-z][A-Za-z0-9_.-]*)\s*(?:(?:==|@)\s*(?P<version>[0-9][0-9A-Za-z.+-]*))?\s*$"
)


@dataclass(frozen=True)
class Declaration:
    """What a run runs under: a framework, its release (None: its newest code), its settings."""

    framework: str
    version: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def table(self) -> Framework:
        return FRAMEWORK_TABLES[self.framework]

    @property
    def era(self) -> Era:
        return self.table.era(self.version)

    def spec(self) -> str:
        return self.framework if self.version is None else f"{self.framework}=={self.version}"


#: A tiny step the declared settings are tried on, so a value the framework would refuse is refused
#: when the run is declared, not at every comparison.
_PROBE = StepTokens.of(
    [np.array([-0.5, -1.0]), np.array([-2.0])],
    [np.array([-0.6, -0.9]), np.array([-2.5])],
    advantages=[1.0, -1.0],
    ranks=[0, 1],
)


def framework_table(name: str) -> Framework:
    """The table of ``name`` (``nemo_rl`` and ``NeMo-RL`` spell ``nemo-rl``)."""
    key = name.strip().lower().replace("_", "-")
    if key not in FRAMEWORK_TABLES:
        raise ValueError(f"framework: {name!r} is not one of {', '.join(FRAMEWORKS)}")
    return FRAMEWORK_TABLES[key]


def parse_declaration(spec: str, settings: Mapping[str, Any] | None = None) -> Declaration:
    """``verl``, ``verl==0.7.1`` or ``verl@0.6`` (and the framework's settings) as a
    :class:`Declaration`, checked: a known framework, a release it covers, settings its figures read."""
    if not isinstance(spec, str):
        raise ValueError(f"framework: expected text like 'verl==0.7.1', got {type(spec).__name__}")
    match = _SPEC.match(spec)
    if match is None:
        raise ValueError(f"framework: {spec!r} is not NAME, NAME==VERSION or NAME@VERSION (like verl==0.7.1)")
    table = framework_table(match["name"])
    version = match["version"]
    era = table.era(version)
    if settings is not None and not isinstance(settings, Mapping):
        raise ValueError(f"framework_config: expected a mapping of settings, got {type(settings).__name__}")
    values, _ = table.settings_of(era, settings)  # raises on a setting the era does not read
    with np.errstate(all="ignore"):
        era.compute(_PROBE, values)  # raises on a value the framework's code would refuse
    return Declaration(table.name, version, dict(settings or {}))


def declaration_of(config: Mapping[str, Any] | None) -> Declaration | None:
    """The declaration in a run's config (``framework``, ``framework_config``), or None."""
    if not config or config.get("framework") in (None, ""):
        if config and config.get("framework_config"):
            raise ValueError("framework_config: given without framework (say which, like 'verl==0.7.1')")
        return None
    return parse_declaration(config["framework"], config.get("framework_config"))


def qualified(framework: str, name: str) -> str:
    """The stored key of a framework figure: ``verl:rollout_corr/k3_kl``."""
    return f"{framework}:{name}"


def _era_and_settings(table: Framework, declared: Declaration | None) -> tuple[Era, dict[str, Any]]:
    if declared is not None and declared.framework == table.name:
        era = declared.era
        values, _ = table.settings_of(era, declared.settings)
    else:
        era = table.head
        values, _ = table.settings_of(era, None)
    return era, values


def framework_figures(
    tokens: StepTokens, declared: Declaration | None = None, *, threads: int | None = None
) -> dict[str, float]:
    """Every framework's figures of one step under their stored keys: the declared framework at its
    release and settings, every other at its newest code and defaults. A figure whose required
    setting is unset, or whose input was not recorded (``needs``), is left out. The reductions the
    frameworks read at their defaults are measured first, in one pass over the step's blocks on
    ``threads`` threads (default: the machine's idle cores, :func:`idle_threads`); each framework's figures are then
    computed from them in turn, in the frameworks' order."""
    out: dict[str, float] = {}
    if tokens.n_tokens == 0:
        return out
    tokens.prepare(idle_threads() if threads is None else threads)
    for table in FRAMEWORK_TABLES.values():
        if not table.eras:
            continue
        era, values = _era_and_settings(table, declared)
        with np.errstate(all="ignore"):
            try:
                figures = era.compute(tokens, values)
            except ValueError as exc:  # settings declared before a check existed: the others still count
                log.warning("%s figures not computed: %s", table.name, exc)
                continue
        for name, value in figures.items():
            out[qualified(table.name, name)] = float(value)
    return out


def used_settings(declared: Declaration | None) -> dict[str, dict[str, Any]]:
    """For each framework: the release whose code the figures follow and each setting's value and
    origin ("declared", "default", "unset"), as ``isoaudit compare --names`` reports it."""
    out: dict[str, dict[str, Any]] = {}
    for table in FRAMEWORK_TABLES.values():
        if not table.eras:
            continue
        mine = declared is not None and declared.framework == table.name
        era = declared.era if mine and declared is not None else table.head
        values, origin = table.settings_of(era, declared.settings if mine and declared is not None else None)
        out[table.name] = {
            "version": declared.version if mine and declared is not None else None,
            "era": era.since,
            "commit": era.commit,
            "settings": {k: {"value": values.get(k), "origin": origin[k]} for k in era.defaults},
        }
    return out


__all__ = [
    "FRAMEWORKS",
    "FRAMEWORK_TABLES",
    "REQUIRED",
    "Declaration",
    "Era",
    "Figure",
    "Framework",
    "StepTokens",
    "declaration_of",
    "framework_figures",
    "framework_table",
    "parse_declaration",
    "qualified",
    "used_settings",
]
