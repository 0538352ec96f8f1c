"""Error responses that say which field is wrong and never echo the request back (a rejected batch
can be megabytes of base64)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError


def field_errors(errors: Sequence[Any], prefix: tuple[str | int, ...] = ()) -> list[dict[str, Any]]:
    """``{"loc", "msg", "type"}`` per error, ``loc`` prefixed (e.g. with ``"body"``)."""
    return [
        {
            "loc": [*prefix, *error.get("loc", ())],
            "msg": str(error.get("msg", "")),
            "type": str(error.get("type", "")),
        }
        for error in errors
    ]


def request_validation_error(
    exc: ValidationError, prefix: tuple[str | int, ...] = ("body",)
) -> RequestValidationError:
    """A pydantic error raised while validating a body by hand, as FastAPI's 422."""
    return RequestValidationError(field_errors(exc.errors(include_input=False, include_url=False), prefix))


async def _validation_handler(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": field_errors(exc.errors())}, status_code=422)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_handler)
