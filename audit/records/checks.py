"""The one checker of record fields: every bound, pattern and array rule of the wire format, written once.

Each rule is a spec (:class:`IntRange`, :class:`FloatRange`, :class:`Text`, :class:`ArrayRule`) or a
function over a field's value. A spec gives pydantic its constraint (``spec.field()``, so validated
records, API parameters and the OpenAPI document carry it) and checks a value by hand
(``spec.check(value, field)``) for records built with ``model_construct``, which skips pydantic's
cost: vectorised numpy reductions over the arrays and type checks of the scalars, a few microseconds
a record (``bench/ingest.py``). Content rules that pydantic cannot state (signs, NaNs, lengths that
depend on other fields) are functions here, run on every record however it was built.

Every refusal is a :class:`RecordError` whose message starts with the field it is about.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypedDict, Unpack

import numpy as np
from isoaudit.audit.arrays import within_limits
from pydantic import Field, ValidationError

#: The largest step (and other 64-bit counters) a record may carry; the columns are BIGINT.
MAX_STEP = 2**62
#: 32-bit INTEGER columns (prompt_len, top_k, forward_index) refuse anything larger.
MAX_INT32 = 2**31 - 1
#: How deeply free-form JSON (a run's config, a manifest's facts) may nest.
MAX_JSON_DEPTH = 32
#: Integers in free-form JSON: what a 64-bit signed integer holds (databases' and most readers' limit).
JSON_INT_RANGE = (-(2**63), 2**63 - 1)
#: The UTC years a stored timestamp may lie in: what PostgreSQL, SQLite's text and Python's
#: ``datetime`` all give back unchanged (a year-1 time with a positive offset is year 0 in UTC,
#: which PostgreSQL keeps as BC and Python cannot read).
TIMESTAMP_YEARS = (1970, 9999)

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
SAMPLE_KEY_PATTERN = r"^[0-9a-f]{32}$"

_FLOAT32_MAX = float(np.finfo(np.float32).max)


class RecordError(ValueError):
    """A record refused at the boundary. ``field`` names what is wrong and the message starts with it
    (``"logprobs: NaN at completion index 3"``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class FieldOptions(TypedDict, total=False):
    """What a field declaration adds to its spec's constraint."""

    default: object
    description: str


# ---------------------------------------------------------------------- scalar specs


@dataclass(frozen=True)
class IntRange:
    """An integer in ``low..high`` (a Python or numpy integer; not a bool)."""

    low: int
    high: int

    def field(self, **options: Unpack[FieldOptions]) -> Any:  # Any: what pydantic's Field() returns
        """The pydantic field of this range."""
        return Field(ge=self.low, le=self.high, **options)

    def check(self, value: object, field: str) -> int:
        if type(value) is not int and not isinstance(value, np.integer):
            raise RecordError(field, f"expected an integer, got {type(value).__name__}")
        if not self.low <= value <= self.high:
            raise RecordError(field, f"{int(value)} is outside {self.low}..{self.high}")
        return int(value)


@dataclass(frozen=True)
class FloatRange:
    """A finite number from ``low`` (excluded when ``low_open``) to ``high`` (a float, an int or a
    numpy float; not a bool)."""

    low: float
    high: float = math.inf
    low_open: bool = False

    def field(self, **options: Unpack[FieldOptions]) -> Any:  # Any: what pydantic's Field() returns
        """The pydantic field of this range."""
        return Field(
            gt=self.low if self.low_open else None,
            ge=None if self.low_open or not math.isfinite(self.low) else self.low,
            le=self.high if math.isfinite(self.high) else None,
            allow_inf_nan=False,
            **options,
        )

    def describe(self) -> str:
        if not math.isfinite(self.high) and not math.isfinite(self.low):
            return "a finite number"
        if not math.isfinite(self.high):
            return f"a finite number {'>' if self.low_open else '≥'} {self.low:g}"
        return f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def check(self, value: object, field: str) -> float:
        if type(value) is not float and (
            isinstance(value, bool) or not isinstance(value, int | float | np.floating)
        ):
            raise RecordError(field, f"expected a number, got {type(value).__name__}")
        number = float(value)
        above = number > self.low if self.low_open else number >= self.low
        if not (above and number <= self.high and math.isfinite(number)):  # NaN fails too
            raise RecordError(field, f"{value!r} is not {self.describe()}")
        return number


@dataclass(frozen=True)
class Text:
    """A string of ``min_length..max_length`` characters that a database can keep, matching
    ``pattern`` when given; ``rule`` says what a refused value must be (``{value}`` its repr)."""

    max_length: int
    min_length: int = 0
    pattern: str | None = None
    rule: str | None = None
    _compiled: re.Pattern[str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.pattern or ""))

    def field(self, **options: Unpack[FieldOptions]) -> Any:  # Any: what pydantic's Field() returns
        """The pydantic field of this text."""
        return Field(
            min_length=self.min_length or None, max_length=self.max_length, pattern=self.pattern, **options
        )

    def check(self, value: object, field: str) -> str:
        if self.rule is not None:
            if (
                type(value) is not str
                or not self.min_length <= len(value) <= self.max_length
                or not self._compiled.match(value)
            ):
                raise RecordError(field, self.rule.format(value=repr(value)))
        elif type(value) is not str:
            raise RecordError(field, f"expected a string, got {type(value).__name__}")
        elif not self.min_length <= len(value) <= self.max_length:
            raise RecordError(field, f"length {len(value)} is outside {self.min_length}..{self.max_length}")
        return check_text(value, field)


STEP = IntRange(0, MAX_STEP)
#: A count or index kept in a 32-bit column (prompt_len, rank, forward_index, a span's start).
COUNT32 = IntRange(0, MAX_INT32)
#: A sampler's top-k: -1 (off) or a count.
TOP_K = IntRange(-1, MAX_INT32)
RUN_ID = Text(
    max_length=128,
    min_length=1,
    pattern=RUN_ID_PATTERN,
    rule="{value} must be 1-128 of A-Z a-z 0-9 . _ : - (starting alphanumeric)",
)
SAMPLE_KEY = Text(max_length=32, pattern=SAMPLE_KEY_PATTERN, rule="must be 32 lowercase hex digits")
#: A weight version (given as an integer, it is kept as text).
VERSION = Text(max_length=128)
REGION = Text(max_length=128, min_length=1)
TEMPERATURE = FloatRange(0.0)
TOP_P = FloatRange(0.0, 1.0, low_open=True)
MIN_P = FloatRange(0.0, 1.0)
#: A sample's advantage in the RL objective: any finite number.
ADVANTAGE = FloatRange(-math.inf)


def check_member(value: object, field: str, allowed: frozenset[str]) -> None:
    """``value`` is one of ``allowed`` (the arguments of the field's ``Literal``)."""
    if type(value) is not str or value not in allowed:
        raise RecordError(field, f"{value!r} is not one of {', '.join(sorted(allowed))}")


def utc_timestamp(value: datetime) -> datetime:
    """``value`` in UTC (a naive one is taken as UTC); ``ValueError`` outside :data:`TIMESTAMP_YEARS`."""
    low, high = TIMESTAMP_YEARS
    try:
        utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (OverflowError, ValueError):  # past Python's year 1..9999 once moved to UTC
        utc = None
    if utc is None or not low <= utc.year <= high:
        raise ValueError(f"{value.isoformat()} is outside UTC years {low}..{high}")
    return utc


def check_timestamp(value: object, field: str) -> datetime:
    """A record's timestamp, by hand: a ``datetime`` in :data:`TIMESTAMP_YEARS`, returned in UTC."""
    if not isinstance(value, datetime):
        raise RecordError(field, f"expected a datetime, got {type(value).__name__}")
    try:
        return utc_timestamp(value)
    except ValueError as exc:
        raise RecordError(field, str(exc)) from None


# ---------------------------------------------------------------------- text and JSON


def check_text(value: str, field: str) -> str:
    """Refuse text a database cannot keep: NUL (PostgreSQL refuses it) and lone surrogates (not UTF-8)."""
    if "\x00" in value:
        raise RecordError(field, "contains a NUL character")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RecordError(field, "contains a lone surrogate (not valid Unicode text)") from None
    return value


def check_json(value: object, field: str, depth: int = 0) -> None:
    """Free-form JSON a database keeps as such: str keys, finite numbers, clean text, bounded depth."""
    if depth > MAX_JSON_DEPTH:
        raise RecordError(field, f"nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        low, high = JSON_INT_RANGE
        if not low <= value <= high:
            raise RecordError(field, "an integer outside the 64-bit range (-2**63..2**63-1)")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RecordError(field, f"{value} is not a finite number (JSON has no NaN or infinity)")
    elif isinstance(value, str):
        check_text(value, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise RecordError(field, f"key {key!r} is not a string")
            check_text(key, field)
            check_json(item, f"{field}.{key}", depth + 1)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_json(item, f"{field}.{i}", depth + 1)
    else:
        raise RecordError(field, f"{type(value).__name__} is not JSON (use str, number, bool, list, dict)")


# ---------------------------------------------------------------------- arrays


@dataclass(frozen=True)
class ArrayRule:
    """A numpy array of ``dtype`` (any byte order: stored little-endian) with ``ndim`` dimensions
    and at most :data:`MAX_ARRAY_ELEMENTS` elements."""

    dtype: str
    ndim: int
    _want: np.dtype = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_want", np.dtype(self.dtype))

    def check(self, value: object, field: str) -> np.ndarray:
        if not isinstance(value, np.ndarray):
            raise RecordError(field, f"expected a numpy array, got {type(value).__name__}")
        want = self._want
        if value.dtype.kind != want.kind or value.dtype.itemsize != want.itemsize:
            raise RecordError(field, f"expected {self.dtype}, got {value.dtype}")
        try:
            return within_limits(value, self.ndim)
        except ValueError as exc:
            raise RecordError(field, str(exc)) from None


#: The rules of the array field types of :mod:`audit.arrays` (``Int32Array`` is INT32_VECTOR, ...).
INT32_VECTOR = ArrayRule("int32", 1)
INT32_MATRIX = ArrayRule("int32", 2)
FLOAT32_VECTOR = ArrayRule("float32", 1)
FLOAT32_MATRIX = ArrayRule("float32", 2)
UINT64_VECTOR = ArrayRule("uint64", 1)
UINT64_MATRIX = ArrayRule("uint64", 2)
UINT8_VECTOR = ArrayRule("uint8", 1)

_min = np.minimum.reduce
_max = np.maximum.reduce


def array_max(array: np.ndarray) -> Any:  # Any: a numpy scalar of the array's dtype
    """The largest element, in one reduction."""
    return _max(array, axis=None)


def check_non_negative(array: np.ndarray, field: str, what: str) -> None:
    if array.size and _min(array, axis=None) < 0:
        raise RecordError(field, f"negative {what} at index {int(np.flatnonzero(array.ravel() < 0)[0])}")


def check_logprobs(array: np.ndarray, field: str, *, allow_neg_inf: bool) -> None:
    """Every value ≤ 0 and not NaN (and finite unless ``allow_neg_inf``), in two reductions."""
    if not array.size:
        return
    if _max(array, axis=None) <= 0 and (allow_neg_inf or _min(array, axis=None) >= -_FLOAT32_MAX):
        return  # NaN propagates through both reductions, so it fails the comparisons
    flat = array.ravel()
    where = "completion" if field == "logprobs" else "flat"
    for problem, mask in (
        ("NaN", np.isnan(flat)),
        ("positive value", flat > 0),
        ("-inf", np.isneginf(flat) if not allow_neg_inf else np.zeros(flat.shape, bool)),
    ):
        if mask.any():
            raise RecordError(field, f"{problem} at {where} index {int(np.flatnonzero(mask)[0])}")


def check_distinct_positions(positions: np.ndarray, field: str) -> None:
    """Non-negative and no position twice: one comparison pass when sorted, as collectors send them."""
    check_non_negative(positions, field, "position")
    rows = positions.size
    if rows > 1 and not (positions[1:] > positions[:-1]).all() and np.unique(positions).size != rows:
        raise RecordError(field, "repeated position")


def record_error(exc: ValidationError, *, tags: Collection[str] = ()) -> RecordError:
    """The first error of a failed validation as a :class:`RecordError` naming its field. ``tags``:
    the kind tags of a discriminated union, dropped from the location (``sample.prompt_len`` is
    ``prompt_len``)."""
    errors = exc.errors(include_input=False, include_url=False)
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, RecordError):
        return cause
    loc = list(first.get("loc", ()))
    if loc and loc[0] in tags:
        loc = loc[1:]
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        loc = ["kind"]
    field = ".".join(str(part) for part in loc) or "record"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return RecordError(field, f"{first.get('msg', 'invalid')}{more}")
