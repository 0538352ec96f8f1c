"""The alert rule model (DESIGN.md, "Alerts"), its YAML form, the default rules, and keeping rules in
the store.

A rule compares one step metric, aggregated over the last ``window`` compared steps, with a
threshold. The metric may be named as any framework names it (``verl:rollout_corr/k3_kl``,
``kl_sample_train_v1``; see :mod:`audit.metric_names`): the rule keeps the stored key it resolves to
and labels itself ``metric_alias`` with the name as written, so notices speak the user's language. Durations count compared steps (not wall time): ``for`` is how many consecutive breaching
steps it takes to fire (0 or 1: the first), ``keep_firing_for`` how many consecutive clear steps a
firing alert stays firing before it resolves (0: it resolves at the first clear step).

YAML::

    rules:
      - name: kl_k3_warning
        metric: kl_k3
        comparison: ">"
        threshold: 1e-3
        for: 3
        severity: warning
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from isoaudit.audit.db import Store
from isoaudit.audit.db.alerts import RuleDefinition, RuleRepository, StoredRule
from isoaudit.audit.metric_names import UnknownMetric, accepted_names, resolve
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

Comparison = Literal[">", ">=", "<", "<=", "==", "!="]
Aggregation = Literal["last", "mean", "max", "min", "sum"]
Severity = Literal["info", "warning", "critical"]
RuleSource = Literal["default", "yaml", "api"]

COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}

_LABEL_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"


class AlertRule(BaseModel):
    """One rule. ``project`` None applies it to every project's runs (rules from YAML and defaults)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    metric: str = Field(
        description="a step metric of audit.metrics (kl_k3, kl_k3/len_0_256, kl_k3/lag_1, tis_mean[cap=3]) "
        "or a framework's name for one (verl:rollout_corr/k3_kl, kl_sample_train_v1)",
        json_schema_extra={"enum": list[JsonValue](accepted_names())},
    )
    comparison: Comparison = ">"
    threshold: float = Field(allow_inf_nan=False)
    window: int = Field(default=1, ge=1, le=1000, description="compared steps the metric is aggregated over")
    aggregation: Aggregation = "last"
    for_steps: int = Field(
        default=0, ge=0, le=100_000, alias="for", description="breaching steps before firing"
    )
    keep_firing_for: int = Field(default=0, ge=0, le=100_000, description="clear steps before resolving")
    severity: Severity = "warning"
    labels: dict[str, str] = Field(default_factory=dict)
    description: str = Field(default="", max_length=2000)
    enabled: bool = True
    project: str | None = Field(default=None, max_length=128)

    @model_validator(mode="before")
    @classmethod
    def _resolve_alias(cls, data: Any) -> Any:
        """A framework name becomes the stored key; the name as written is kept as a label."""
        if isinstance(data, dict) and isinstance(data.get("metric"), str):
            try:
                key = resolve(data["metric"])
            except UnknownMetric:
                return data  # the field validator reports it, naming the field
            if key != data["metric"]:
                labels = data.get("labels")
                labels = dict(labels) if isinstance(labels, dict) else {}
                labels.setdefault("metric_alias", data["metric"])
                data = {**data, "metric": key, "labels": labels}
        return data

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        try:
            return resolve(value)
        except UnknownMetric as exc:
            raise ValueError(str(exc).removeprefix("metric: ")) from None

    @field_validator("labels")
    @classmethod
    def _label_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not re.match(_LABEL_NAME, key):
                raise ValueError(f"label name {key!r} must match {_LABEL_NAME}")
        return value

    def breaches(self, value: float | None) -> bool:
        """Whether an (aggregated) value breaches; no data (None, NaN) never does."""
        return value is not None and not math.isnan(value) and COMPARE[self.comparison](value, self.threshold)

    def aggregate(self, values: Iterable[float | None]) -> float | None:
        """The window's value: ``aggregation`` over the values that exist (None when none does)."""
        present = [float(v) for v in values if v is not None and not math.isnan(float(v))]
        if self.aggregation == "last":
            return present[-1] if present else None
        if not present:
            return None
        if self.aggregation == "mean":
            return math.fsum(present) / len(present)
        if self.aggregation == "sum":
            return math.fsum(present)
        return max(present) if self.aggregation == "max" else min(present)

    def condition(self) -> str:
        """e.g. ``mean(kl_k3 over 5 steps) > 0.001``."""
        subject = (
            self.metric if self.window == 1 else f"{self.aggregation}({self.metric} over {self.window} steps)"
        )
        return f"{subject} {self.comparison} {self.threshold:g}"


#: DESIGN.md's defaults (a sustained small mismatch warns, a large one pages at once), with the
#: thresholds the field uses, each citing where it comes from.
DEFAULT_RULES_YAML = """
rules:
  - name: kl_k3_warning
    metric: kl_k3
    comparison: ">"
    threshold: 1.0e-3
    for: 3
    severity: warning
    description: >-
      Train-rollout mismatch KL (k3) above 1e-3 for 3 compared steps. Source: the SGLang RL team's
      training-inference mismatch study (slime/Miles), where dense models run at k3 KL 1e-5 to 1e-3.
  - name: kl_k3_critical
    metric: kl_k3
    comparison: ">"
    threshold: 1.0e-2
    severity: critical
    description: Train-rollout mismatch KL (k3) above 1e-2.
  - name: token_mult_prob_error_warning
    metric: nemo-rl:token_mult_prob_error
    comparison: ">"
    threshold: 1.05
    severity: warning
    description: >-
      Mean multiplicative probability error exp|Δ| above 1.05. Source: NeMo-RL's GRPO nightly tests,
      which require max(train/token_mult_prob_error) < 1.05.
  - name: kl_sample_train_v1_warning
    metric: tinker:kl_sample_train_v1
    comparison: ">"
    threshold: 1.0e-2
    severity: warning
    description: >-
      Sampler-trainer KL (k1, Tinker's kl_sample_train_v1) above 0.01. Source: the Tinker cookbook's RL
      hyperparameter guide: stable training keeps kl_sample_train_v1 below 0.01.
"""


class RulesFileError(ValueError):
    """A rules file that cannot be used; the message names the rule and field."""


def parse_rules(text: str, origin: str = "<rules>") -> list[AlertRule]:
    """Rules from YAML text: a mapping with ``rules:`` or a bare list."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RulesFileError(f"{origin}: not valid YAML: {exc}") from exc
    items = document.get("rules") if isinstance(document, dict) else document
    if document is None:
        items = []
    if not isinstance(items, list):
        raise RulesFileError(f"{origin}: expected a list of rules under 'rules:'")
    rules: list[AlertRule] = []
    for index, item in enumerate(items):
        try:
            rules.append(AlertRule.model_validate(item))
        except ValidationError as exc:
            name = item.get("name", f"#{index}") if isinstance(item, dict) else f"#{index}"
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'rule'}: {e['msg']}" for e in exc.errors()
            )
            raise RulesFileError(f"{origin}: rule {name}: {problems}") from exc
    names = [rule.name for rule in rules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RulesFileError(f"{origin}: rule names must be unique; repeated: {', '.join(duplicates)}")
    return rules


def load_rules(path: str | Path) -> list[AlertRule]:
    """Rules from a YAML file."""
    path = Path(path)
    return parse_rules(path.read_text(), str(path))


def default_rules() -> list[AlertRule]:
    return parse_rules(DEFAULT_RULES_YAML, "default rules")


# ---------------------------------------------------------------------- rules in the store


def rule_from_row(row: RuleDefinition) -> AlertRule:
    """The rule model of a stored rule."""
    return AlertRule.model_validate(
        {
            "name": row.name,
            "metric": row.metric,
            "comparison": row.comparison,
            "threshold": row.threshold,
            "window": row.window_steps,
            "aggregation": row.aggregation,
            "for": row.for_steps,
            "keep_firing_for": row.keep_firing_for,
            "severity": row.severity,
            "labels": dict(row.labels),
            "description": row.description,
            "enabled": row.enabled,
            "project": row.project,
        }
    )


def rule_definition(rule: AlertRule) -> RuleDefinition:
    """What the store keeps of a rule model."""
    return RuleDefinition(
        name=rule.name,
        project=rule.project,
        metric=rule.metric,
        comparison=rule.comparison,
        threshold=rule.threshold,
        window_steps=rule.window,
        aggregation=rule.aggregation,
        for_steps=rule.for_steps,
        keep_firing_for=rule.keep_firing_for,
        severity=rule.severity,
        labels=dict(rule.labels),
        description=rule.description,
        enabled=rule.enabled,
    )


def save_rule(store: Store, rule: AlertRule, source: RuleSource = "api") -> StoredRule:
    """Create the rule, or replace the one of that name (its open alerts carry on under the new terms)."""
    return RuleRepository(store.sessions).save(rule_definition(rule), source)


def install_rules(store: Store, rules: Iterable[AlertRule], source: RuleSource, *, replace: bool) -> int:
    """Install rules by name: ``replace`` overwrites rules of the same name (a YAML file is the truth);
    otherwise existing ones are kept (defaults never undo a user's edit). Returns how many were written."""
    stored = RuleRepository(store.sessions)
    written = 0
    for rule in rules:
        if replace or stored.get(rule.name) is None:
            stored.save(rule_definition(rule), source)
            written += 1
    return written


def get_rule_row(store: Store, name: str) -> StoredRule | None:
    """The stored rule of that name."""
    return RuleRepository(store.sessions).get(name)


def list_rule_rows(
    store: Store, project: str | None = None, *, include_global: bool = True
) -> list[StoredRule]:
    """Rules of ``project`` (and the global ones), or every rule when ``project`` is None."""
    return RuleRepository(store.sessions).list(project, include_global=include_global)


def delete_rule(store: Store, name: str) -> bool:
    """Delete a rule and (by cascade) its alerts."""
    return RuleRepository(store.sessions).delete(name)
