"""Bearer-token authentication of API requests (the tokens themselves live in ``audit.auth``).

Writes always need a token; reads need one unless ``require_token_for_reads`` is off, and a token,
when given, always limits what is visible to its project. Another project's run answers 404 on reads
(its existence is not disclosed) and 403 on writes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from isoaudit.audit.api.deps import get_settings, get_store
from isoaudit.audit.auth import Principal, create_token, verify_token
from isoaudit.audit.db import Store
from isoaudit.audit.records import RunId
from isoaudit.audit.settings import Settings

__all__ = ["Principal", "Reader", "Writer", "create_token", "readable_run", "ReadableRun"]

_bearer = HTTPBearer(
    auto_error=False, description="A project token from `isoaudit tokens create --project NAME`."
)


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail, headers={"WWW-Authenticate": "Bearer"})


def _principal(store: Store, credentials: HTTPAuthorizationCredentials | None) -> Principal | None:
    if credentials is None:
        return None
    principal = verify_token(store, credentials.credentials)
    if principal is None:
        raise _unauthorized("Authorization: the bearer token is not valid")
    return principal


def require_writer(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    store: Annotated[Store, Depends(get_store)],
) -> Principal:
    """The caller's project; writes are never anonymous."""
    principal = _principal(store, credentials)
    if principal is None:
        raise _unauthorized("Authorization: a bearer token is required")
    return principal


def optional_reader(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    store: Annotated[Store, Depends(get_store)],
    settings: Annotated[Settings, Depends(get_settings)],
) -> Principal | None:
    """The caller's project, or ``None`` (everything visible) when reads are open and no token came."""
    principal = _principal(store, credentials)
    if principal is None and settings.require_token_for_reads:
        raise _unauthorized("Authorization: a bearer token is required")
    return principal


Writer = Annotated[Principal, Depends(require_writer)]
Reader = Annotated[Principal | None, Depends(optional_reader)]


def can_see(principal: Principal | None, project: str | None) -> bool:
    """Whether ``principal`` may see something of ``project`` (``None``: global, visible to all)."""
    return principal is None or project is None or project == principal.project


def readable_run(
    run_id: Annotated[RunId, Path(description="the client-chosen run id")],
    principal: Reader,
    store: Annotated[Store, Depends(get_store)],
) -> str:
    """The run id in the path, if that run exists and the caller may see it (else 404)."""
    project = store.run_project(run_id)
    if project is None or not can_see(principal, project):
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"run_id: no run {run_id!r}")
    return run_id


ReadableRun = Annotated[str, Depends(readable_run)]
