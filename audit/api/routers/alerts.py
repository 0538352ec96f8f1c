"""Alert rules (managed here or loaded from YAML), alerts, their notifications, and silences.

Rules made through the API belong to the caller's project and apply to its runs; global rules (the
defaults and a YAML file, ``project`` null) are visible to everyone and changed only by redeploying.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Response, status
from isoaudit.audit.alerts.history import get_alert, list_alerts, notifications
from isoaudit.audit.alerts.rules import (
    AlertRule,
    RuleSource,
    delete_rule,
    get_rule_row,
    list_rule_rows,
    rule_from_row,
    save_rule,
)
from isoaudit.audit.alerts.silences import (
    SilenceSpec,
    create_silence,
    expire_silence,
    get_silence,
    list_silences,
)
from isoaudit.audit.api.auth import Principal, ReadableRun, Reader, Writer, can_see
from isoaudit.audit.api.deps import get_store
from isoaudit.audit.api.errors import storable_body
from isoaudit.audit.api.schemas import UtcDatetime
from isoaudit.audit.db import Store
from isoaudit.audit.db.alerts import Alert, AlertState, Silence, StoredRule
from isoaudit.audit.records import utcnow
from pydantic import BaseModel, ConfigDict

router = APIRouter(prefix="/v1", tags=["alerts"])

RuleName = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]
StoreDep = Annotated[Store, Depends(get_store)]


class RuleOut(AlertRule):
    source: RuleSource
    created_at: UtcDatetime
    updated_at: UtcDatetime


class NotificationOut(BaseModel):
    """What one channel did with one transition (the payload it sent stays in the store)."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    event: Literal["firing", "resolved"]
    channel: str
    status: Literal["sent", "failed", "stored", "silenced"]
    attempts: int
    error: str | None
    created_at: UtcDatetime


def _rule_out(row: StoredRule) -> RuleOut:
    return RuleOut.model_validate(
        {
            **rule_from_row(row).model_dump(),
            "source": row.source,
            "created_at": row.created_at,
            "updated_at": row.updated_at,
        }
    )


def _not_found(what: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, detail=what)


# ---------------------------------------------------------------------- rules


@router.get("/alert-rules", response_model=list[RuleOut], summary="Rules applying to the caller's runs")
def list_rules(principal: Reader, store: StoreDep) -> list[RuleOut]:
    project = principal.project if principal is not None else None
    return [_rule_out(row) for row in list_rule_rows(store, project)]


@router.get("/alert-rules/{name}", response_model=RuleOut, summary="One rule")
def get_rule(name: RuleName, principal: Reader, store: StoreDep) -> RuleOut:
    row = get_rule_row(store, name)
    if row is None or not can_see(principal, row.project):
        raise _not_found(f"name: no rule {name!r}")
    return _rule_out(row)


def _check_rule_owner(store: Store, name: str, principal_project: str) -> None:
    row = get_rule_row(store, name)
    if row is not None and row.project != principal_project:
        if row.project is None:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, detail=f"name: {name!r} is a global rule (YAML or default)"
            )
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"name: {name!r} is taken")


@router.post(
    "/alert-rules",
    response_model=RuleOut,
    status_code=status.HTTP_201_CREATED,
    summary="Create a rule for the caller's project",
    responses={409: {"description": "a rule of that name exists"}},
)
def create_rule(rule: AlertRule, principal: Writer, store: StoreDep) -> RuleOut:
    storable_body(rule)
    if rule.project is not None and rule.project != principal.project:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, detail="project: a token can only make rules of its own project"
        )
    if get_rule_row(store, rule.name) is not None:
        raise HTTPException(
            status.HTTP_409_CONFLICT, detail=f"name: a rule {rule.name!r} exists; PUT replaces it"
        )
    return _rule_out(save_rule(store, rule.model_copy(update={"project": principal.project}), "api"))


@router.put(
    "/alert-rules/{name}",
    response_model=RuleOut,
    summary="Create or replace a rule of the caller's project",
    responses={403: {"description": "a global rule"}, 422: {"description": "invalid rule, or name differs"}},
)
def put_rule(name: RuleName, rule: AlertRule, principal: Writer, store: StoreDep) -> RuleOut:
    storable_body(rule)
    if rule.name != name:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=[
                {
                    "loc": ["body", "name"],
                    "msg": f"must equal the path's name {name!r}",
                    "type": "value_error",
                }
            ],
        )
    if rule.project is not None and rule.project != principal.project:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, detail="project: a token can only make rules of its own project"
        )
    _check_rule_owner(store, name, principal.project)
    return _rule_out(save_rule(store, rule.model_copy(update={"project": principal.project}), "api"))


@router.delete(
    "/alert-rules/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a rule of the caller's project (and its alerts)",
    responses={403: {"description": "a global rule"}, 404: {"description": "no such rule"}},
)
def remove_rule(name: RuleName, principal: Writer, store: StoreDep) -> Response:
    row = get_rule_row(store, name)
    if row is None or row.project not in (None, principal.project):
        raise _not_found(f"name: no rule {name!r}")
    if row.project is None:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, detail=f"name: {name!r} is a global rule (YAML or default)"
        )
    delete_rule(store, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


# ---------------------------------------------------------------------- alerts


@router.get("/alerts", response_model=list[Alert], summary="Alerts of the caller's runs, newest first")
def alerts(
    principal: Reader,
    store: StoreDep,
    state: Annotated[list[AlertState] | None, Query(description="only these states")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[Alert]:
    project = principal.project if principal is not None else None
    return list_alerts(store, project=project, states=state, limit=limit)


@router.get("/runs/{run_id}/alerts", response_model=list[Alert], summary="Alerts of one run, newest first")
def run_alerts(
    run_id: ReadableRun,
    store: StoreDep,
    state: Annotated[list[AlertState] | None, Query(description="only these states")] = None,
) -> list[Alert]:
    return list_alerts(store, run_id=run_id, states=state)


def _visible_alert(store: Store, alert_id: int, principal: Principal | None) -> Alert:
    alert = get_alert(store, alert_id)
    if alert is None or not can_see(principal, alert.project):
        raise _not_found(f"alert_id: no alert {alert_id}")
    return alert


AlertId = Annotated[int, Path(ge=1, le=2**62)]


@router.get("/alerts/{alert_id}", response_model=Alert, summary="One alert")
def alert(alert_id: AlertId, principal: Reader, store: StoreDep) -> Alert:
    return _visible_alert(store, alert_id, principal)


@router.get(
    "/alerts/{alert_id}/notifications",
    response_model=list[NotificationOut],
    summary="What each channel did with the alert's transitions",
)
def alert_notifications(alert_id: AlertId, principal: Reader, store: StoreDep) -> list[NotificationOut]:
    _visible_alert(store, alert_id, principal)
    return [NotificationOut.model_validate(n) for n in notifications(store, alert_id)]


# ---------------------------------------------------------------------- silences


@router.get("/silences", response_model=list[Silence], summary="Silences, latest ending first")
def silences(
    principal: Reader,
    store: StoreDep,
    active: Annotated[bool, Query(description="only those in force now")] = False,
) -> list[Silence]:
    project = principal.project if principal is not None else None
    return list_silences(store, project, active_at=utcnow() if active else None)


SilenceId = Annotated[int, Path(ge=1, le=2**62)]


@router.post(
    "/silences",
    response_model=Silence,
    status_code=status.HTTP_201_CREATED,
    summary="Mute notifications of matching alerts of the caller's project until it ends",
)
def add_silence(spec: SilenceSpec, principal: Writer, store: StoreDep) -> Silence:
    storable_body(spec)
    try:
        return create_silence(
            store, spec, project=principal.project, created_by=f"token:{principal.token_id}"
        )
    except ValueError as exc:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=[{"loc": ["body", "ends_at"], "msg": str(exc), "type": "value_error"}],
        ) from exc


@router.get("/silences/{silence_id}", response_model=Silence, summary="One silence")
def silence(silence_id: SilenceId, principal: Reader, store: StoreDep) -> Silence:
    row = get_silence(store, silence_id)
    if row is None or not can_see(principal, row.project):
        raise _not_found(f"silence_id: no silence {silence_id}")
    return row


@router.delete(
    "/silences/{silence_id}",
    response_model=Silence,
    summary="End a silence now (kept for the record)",
)
def end_silence(silence_id: SilenceId, principal: Writer, store: StoreDep) -> Silence:
    row = get_silence(store, silence_id)
    if row is None or row.project != principal.project:
        raise _not_found(f"silence_id: no silence {silence_id}")
    expire_silence(store, silence_id)
    ended = get_silence(store, silence_id)
    assert ended is not None
    return ended
