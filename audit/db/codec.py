"""Records ↔ rows: a validated record as the row the store keeps (arrays as little-endian bytes), and a
stored row back as its record.

A stored row that cannot be read back (a value of :class:`~audit.db.types.Unreadable` in a column,
or content its record cannot be rebuilt from: written by hand, by another tool, or before a bound
existed) fails that row alone: :func:`readable` leaves it out of a listing and logs it, and
:func:`read_one` raises :class:`UnreadableRow` naming the row and the field for a read of that row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
from isoaudit.audit.arrays import from_bytes, to_bytes
from isoaudit.audit.db.engine import StoreError
from isoaudit.audit.db.models import Base, FingerprintRow, SampleRow
from isoaudit.audit.db.types import Unreadable
from isoaudit.audit.records import RegionFingerprints, SampleLogprobs, WeightSpan, utcnow
from isoaudit.audit.routing import routes_columns, routes_from_columns
from pydantic import ValidationError
from sqlalchemy import inspect
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select

log = logging.getLogger("isoaudit.store")

R = TypeVar("R")
V = TypeVar("V")


class UnreadableRow(StoreError):
    """A stored row that cannot be read back as what it stores. ``what`` names the row (``run
    'r1'``), ``field`` the column at fault (``row`` when it is the content as a whole)."""

    def __init__(self, what: str, field: str, reason: str) -> None:
        super().__init__(f"{field}: the stored {what} cannot be read ({reason})")
        self.what, self.field, self.reason = what, field, reason


def _unreadable_value(row: object) -> tuple[str, Unreadable] | None:
    """The first :class:`Unreadable` column value of an ORM row, a result row or a bare value."""
    if isinstance(row, Unreadable):
        return "value", row
    if isinstance(row, Base):
        for name, value in inspect(row).dict.items():
            if isinstance(value, Unreadable):
                return name, value
        return None
    if isinstance(row, Row | tuple):  # a result row: its ORM entities and plain columns
        fields = getattr(row, "_fields", ())
        for i, item in enumerate(row):
            found = _unreadable_value(item)
            if found is not None:
                name = fields[i] if found[0] == "value" and i < len(fields) else found[0]
                return name, found[1]
    return None


def check_readable(row: object, what: str) -> None:
    """Raise :class:`UnreadableRow` if a column of ``row`` came back :class:`Unreadable`."""
    found = _unreadable_value(row)
    if found is not None:
        raise UnreadableRow(what, found[0], found[1].reason)


#: What rebuilding a row's record or view raises when the stored content does not make one.
DECODE_ERRORS: tuple[type[Exception], ...] = (ValidationError, ValueError, TypeError, KeyError)


def read_one(row: R, convert: Callable[[R], V], what: str) -> V:
    """``convert(row)`` for a read of this one row; a row that cannot be read raises :class:`UnreadableRow`."""
    check_readable(row, what)
    try:
        return convert(row)
    except UnreadableRow:
        raise
    except DECODE_ERRORS as exc:
        raise UnreadableRow(what, "row", f"{type(exc).__name__}: {exc}") from exc


def readable(rows: Iterable[R], convert: Callable[[R], V], what: Callable[[R], str]) -> list[V]:
    """Each row converted, in order; a row that cannot be read is left out and logged (with
    ``what(row)``, which must read only the row's key), so one bad row never fails a listing."""
    out: list[V] = []
    for row in rows:
        try:
            out.append(read_one(row, convert, what(row)))
        except UnreadableRow as exc:
            log.error("left out of a listing: %s", exc)
    return out


def rows_of(session: Session, query: Select[Any]) -> list[Any]:
    """The rows of ``query`` (a select of a table's columns), each with its columns as attributes, as
    :func:`sample_record` and :func:`fingerprint_record` read them. On PostgreSQL (psycopg) they come
    in binary format: an array column arrives as its bytes, where the text format sends twice as
    many hex digits for the driver to decode (x3 the time on a step's fingerprints)."""
    bind = session.get_bind()
    if bind.dialect.name != "postgresql" or bind.dialect.driver != "psycopg":
        return list(session.execute(query).all())
    from psycopg.rows import namedtuple_row

    compiled = query.compile(dialect=bind.dialect, compile_kwargs={"render_postcompile": True})
    driver = session.connection().connection.driver_connection
    assert driver is not None  # a session's connection is checked out, so open
    with driver.cursor(binary=True, row_factory=namedtuple_row) as cursor:
        cursor.execute(str(compiled), compiled.params)
        return cursor.fetchall()


def sample_row(record: SampleLogprobs) -> dict[str, Any]:
    topk = (
        (record.topk_ids, record.topk_logprobs)
        if record.topk_ids is not None and record.topk_logprobs is not None
        else None
    )
    return {
        "run_id": record.run_id,
        "step": record.step,
        "side": record.side,
        "sample_key": record.sample_key,
        "weight_version": record.weight_version,
        "prompt_len": record.prompt_len,
        "n_tokens": int(record.token_ids.size),
        "temperature": record.temperature,
        "top_k": record.top_k,
        "top_p": record.top_p,
        "min_p": record.min_p,
        "advantage": record.advantage,
        "weight_spans": [span.model_dump() for span in record.weight_spans] if record.weight_spans else None,
        "semantics": record.semantics,
        "token_ids": to_bytes(record.token_ids.astype(np.int32, copy=False)),
        "logprobs": to_bytes(record.logprobs.astype(np.float32, copy=False)),
        "topk": int(topk[0].shape[1]) if topk else None,
        "topk_ids": to_bytes(topk[0]) if topk else None,
        "topk_logprobs": to_bytes(topk[1]) if topk else None,
        "path": dict(record.path) or None,
        "rank": record.rank,
        **routes_columns(record.routes),
        "dist_sketch_dim": int(record.dist_sketch.shape[1]) if record.dist_sketch is not None else None,
        "dist_sketch": to_bytes(record.dist_sketch.astype(np.float32, copy=False))
        if record.dist_sketch is not None
        else None,
        "created_at": utcnow(),
    }


def sample_record(row: SampleRow) -> SampleLogprobs:
    """The record of a stored row (a :class:`SampleRow`, or a row of its table's columns: :func:`rows_of`)."""
    n_completion = row.n_tokens - row.prompt_len
    topk = None
    if row.topk is not None and row.topk_ids is not None and row.topk_logprobs is not None:
        topk = (
            from_bytes(row.topk_ids, "<i4", (n_completion, row.topk)),
            from_bytes(row.topk_logprobs, "<f4", (n_completion, row.topk)),
        )
    # Stored rows were validated on the way in: construct without re-validating (the comparator's hot path).
    return SampleLogprobs.model_construct(
        run_id=row.run_id,
        step=row.step,
        side=row.side,
        sample_key=row.sample_key,
        weight_version=row.weight_version,
        prompt_len=row.prompt_len,
        token_ids=from_bytes(row.token_ids, "<i4"),
        logprobs=from_bytes(row.logprobs, "<f4"),
        temperature=row.temperature,
        top_k=row.top_k,
        top_p=row.top_p,
        min_p=row.min_p,
        advantage=row.advantage,
        weight_spans=[WeightSpan.model_construct(**span) for span in row.weight_spans]
        if row.weight_spans
        else None,
        semantics=row.semantics,
        topk_ids=topk[0] if topk else None,
        topk_logprobs=topk[1] if topk else None,
        path=row.path or {},
        rank=row.rank,
        routes=routes_from_columns(row.routes, row.routes_data),
        dist_sketch=from_bytes(row.dist_sketch, "<f4", (n_completion, row.dist_sketch_dim))
        if row.dist_sketch is not None and row.dist_sketch_dim is not None
        else None,
    )


def fingerprint_row(record: RegionFingerprints) -> dict[str, Any]:
    rows = int(record.positions.size)
    return {
        "run_id": record.run_id,
        "step": record.step,
        "sample_key": record.sample_key,
        "side": record.side,
        "case": record.case,
        "region": record.region,
        "forward_index": record.forward_index,
        "n_rows": rows,
        "ladder_bits": list(record.ladder_bits),
        "sketch_dim": int(record.sketch.shape[1]) if record.sketch.ndim == 2 and rows else 0,
        "positions": to_bytes(record.positions),
        "digest": to_bytes(record.digest),
        "ladder": to_bytes(record.ladder),
        "sketch": to_bytes(record.sketch),
        "l2": to_bytes(record.l2),
        "maxabs": to_bytes(record.maxabs),
        "created_at": utcnow(),
    }


def fingerprint_record(row: FingerprintRow) -> RegionFingerprints:
    """The record of a stored row (a :class:`FingerprintRow`, or a row of its table's columns: :func:`rows_of`)."""
    n, rungs = row.n_rows, len(row.ladder_bits)
    return RegionFingerprints.model_construct(
        run_id=row.run_id,
        step=row.step,
        side=row.side,
        case=row.case,
        sample_key=row.sample_key,
        region=row.region,
        forward_index=row.forward_index,
        positions=from_bytes(row.positions, "<i4"),
        digest=from_bytes(row.digest, "<u8"),
        ladder_bits=list(row.ladder_bits),
        ladder=from_bytes(row.ladder, "<u8", (n, rungs)),
        sketch=from_bytes(row.sketch, "<f4", (n, row.sketch_dim)),
        l2=from_bytes(row.l2, "<f4"),
        maxabs=from_bytes(row.maxabs, "<f4"),
    )
