"""Error responses that say which field is wrong and never echo the request back (a rejected batch
can be megabytes of base64), and 503 for any request the database could not answer in time."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from isoaudit.audit.db import UNAVAILABLE_ERRORS, UnreadableRow
from isoaudit.audit.records import RecordError, check_json
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("isoaudit.api")

#: What a client should do on 503: wait this long and send the same request again.
RETRY_AFTER_S = 1


def field_errors(errors: Sequence[Any], prefix: tuple[str | int, ...] = ()) -> list[dict[str, Any]]:
    """``{"loc", "msg", "type"}`` per error, ``loc`` prefixed (e.g. with ``"body"``). A model-level
    check that names its field (:class:`audit.records.RecordError`) gets that field in ``loc``."""
    out = []
    for error in errors:
        loc = [*prefix, *error.get("loc", ())]
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, RecordError):
            loc += cause.field.split(".")
        out.append({"loc": loc, "msg": str(error.get("msg", "")), "type": str(error.get("type", ""))})
    return out


def storable_body(body: BaseModel) -> None:
    """Refuse, as a 422 naming the field, a body whose text a database cannot keep (NUL, lone
    surrogates): PostgreSQL would otherwise answer 500. (Dumped as JSON: datetimes become text.)"""
    try:
        check_json(body.model_dump(mode="json"), "")
    except RecordError as exc:
        field = [part for part in exc.field.split(".") if part]
        message = str(exc).split(": ", 1)[-1]
        raise RequestValidationError(
            [{"loc": ["body", *field], "msg": message, "type": "value_error"}]
        ) from None


def request_validation_error(
    exc: ValidationError, prefix: tuple[str | int, ...] = ("body",)
) -> RequestValidationError:
    """A pydantic error raised while validating a body by hand, as FastAPI's 422."""
    return RequestValidationError(field_errors(exc.errors(include_input=False, include_url=False), prefix))


async def _validation_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": field_errors(exc.errors())}, status_code=422)


def database_unavailable_response() -> JSONResponse:
    return JSONResponse(
        {"detail": "database: unavailable (locked, restarting or unreachable); nothing was changed, retry"},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _database_handler(_request: Request, exc: Exception) -> JSONResponse:
    # The database did not answer (SQLite locked past its busy timeout, a connection cut, a server
    # restarting, the pool exhausted): the transaction rolled back, so the request changed nothing.
    cause = exc.__cause__ or exc
    log.warning("database unavailable: %s", type(getattr(cause, "orig", None) or cause).__name__)
    return database_unavailable_response()


async def _unreadable_handler(_request: Request, exc: Exception) -> JSONResponse:
    # A stored row no isoaudit boundary let in (written by hand, by another tool): a fault of the
    # server's data, said plainly and logged; listings leave such rows out and keep answering.
    log.error("unreadable row: %s", exc)
    return JSONResponse({"detail": str(exc)}, status_code=500)


async def _http_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's own answer, except that 405 names what is wrong (the method), as every 4xx here does."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return JSONResponse(
            {"detail": f"method: {request.method} is not allowed here (allowed: {allowed})"},
            status_code=405,
            headers=exc.headers,
        )
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        # FastAPI's message for a body it could not parse (not JSON, or a broken form): name the field.
        return JSONResponse(
            {"detail": "body: could not be parsed (send JSON with Content-Type: application/json)"},
            status_code=400,
        )
    return await http_exception_handler(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(UnreadableRow, _unreadable_handler)
    for unavailable in UNAVAILABLE_ERRORS:
        app.add_exception_handler(unavailable, _database_handler)
