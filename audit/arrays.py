"""Numpy arrays as pydantic fields: base64 little-endian on the wire, raw bytes in the store.

A record carries thousands of numbers per sample; JSON lists of floats would be ten times larger and
lose the exact bits. Every array field therefore travels as base64 of its little-endian bytes (a plain
string for 1-D arrays, ``{"shape": [...], "data": "..."}`` for matrices) and is held in memory as a
numpy array of a fixed dtype.
"""

from __future__ import annotations

import base64
import binascii
import importlib
from types import ModuleType
from typing import Annotated, Any

import numpy as np
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema


def _simd_base64() -> ModuleType | None:
    """pybase64 when installed (vLLM brings it): the standard library's decoder is ~50x slower on a
    route matrix."""
    try:
        return importlib.import_module("pybase64")
    except ImportError:  # pragma: no cover - tests/audit/test_records_routes.py runs without it too
        return None


_pybase64 = _simd_base64()

#: Upper bound on the elements of one array field: 4M tokens of one sample is already far past any
#: context length in use, and it keeps one bad record from exhausting the service's memory.
MAX_ARRAY_ELEMENTS = 1 << 22


def to_bytes(array: np.ndarray) -> bytes:
    """The little-endian bytes of ``array`` (C order), as stored."""
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def from_bytes(raw: bytes, dtype: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Inverse of :func:`to_bytes` for a known dtype (e.g. ``"<i4"``) and optional shape."""
    array = np.frombuffer(raw, dtype=np.dtype(dtype))
    return array.reshape(shape) if shape is not None else array


def b64decode(value: str | bytes) -> bytes:
    """``base64.b64decode(value, validate=True)``, bit for bit and refusal for refusal, fast.

    pybase64 (when installed) decodes first; it is stricter than the standard library in one place
    (padding after a whole quad, ``"YWJj="``), so whatever it refuses is decided by the standard
    library, which therefore accepts and refuses exactly what it always did."""
    if _pybase64 is not None:
        try:
            return _pybase64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            pass
    return base64.b64decode(value, validate=True)


def _coerce(value: Any, dtype: np.dtype, ndim: int) -> np.ndarray:
    if isinstance(value, dict):
        try:
            shape = tuple(int(s) for s in value["shape"])
            data = value["data"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError('a matrix must be {"shape": [rows, cols], "data": "<base64>"}') from exc
        array = _coerce(data, dtype, 1)
        if int(np.prod(shape)) != array.size:
            raise ValueError(f"shape {list(shape)} does not match {array.size} decoded elements")
        array = array.reshape(shape)
    elif isinstance(value, str | bytes) and not isinstance(value, np.ndarray):
        try:
            raw = b64decode(value) if isinstance(value, str) else bytes(value)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("not valid base64") from exc
        if len(raw) % dtype.itemsize:
            raise ValueError(
                f"{len(raw)} bytes is not a whole number of {dtype.itemsize}-byte {dtype.name} values"
            )
        array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
    else:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot read as a {dtype.name} array") from exc
        if array.size and array.dtype.kind not in "biuf":
            raise ValueError(f"expected numbers, got {array.dtype}")
        if array.dtype != dtype:
            if dtype.kind in "iu" and array.size and array.dtype.kind == "f":
                raise ValueError(f"expected integers for a {dtype.name} array, got floats")
            _check_range(array, dtype)
            array = array.astype(dtype)
    if array.ndim == 1 and ndim == 2 and array.size == 0:
        array = array.reshape(0, 0)
    return within_limits(array, ndim)


def within_limits(array: np.ndarray, ndim: int) -> np.ndarray:
    """``array`` if it has ``ndim`` dimensions and at most :data:`MAX_ARRAY_ELEMENTS` elements."""
    if array.ndim != ndim:
        raise ValueError(f"expected a {ndim}-D array, got {array.ndim}-D with shape {list(array.shape)}")
    if array.size > MAX_ARRAY_ELEMENTS:
        raise ValueError(f"{array.size} elements exceed the limit of {MAX_ARRAY_ELEMENTS}")
    return array


def _check_range(array: np.ndarray, dtype: np.dtype) -> None:
    """Refuse values a cast to ``dtype`` would wrap (integers) or turn into infinities (floats)."""
    if not array.size:
        return
    if dtype.kind in "iu" and array.dtype.kind in "iub":
        info = np.iinfo(dtype)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            raise ValueError(f"values {low}..{high} do not fit {dtype.name} ({info.min}..{info.max})")
    elif dtype.kind == "f" and array.dtype.kind == "f":
        finite = array[np.isfinite(array)]
        limit = float(np.finfo(dtype).max)
        if finite.size and float(np.abs(finite).max()) > limit:
            raise ValueError(f"a value of magnitude {float(np.abs(finite).max()):.3g} overflows {dtype.name}")


def _serialize(array: np.ndarray) -> str | dict[str, Any]:
    data = base64.b64encode(to_bytes(array)).decode("ascii")
    return data if array.ndim == 1 else {"shape": list(array.shape), "data": data}


def _matrix_schema(description: str) -> dict[str, Any]:
    """The JSON schema of a matrix on the wire: ``{"shape": [rows, cols], "data": "<base64>"}``."""
    return {
        "type": "object",
        "required": ["shape", "data"],
        "properties": {
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "data": {"type": "string", "format": "byte"},
        },
        "description": description,
    }


def _array_type(dtype: str, ndim: int) -> Any:  # Any: a type form (Annotated[np.ndarray, ...])
    """The pydantic field type of a ``dtype`` array of ``ndim`` (1 or 2) dimensions."""
    np_dtype = np.dtype(dtype)
    schema: dict[str, Any] = (
        {"type": "string", "format": "byte", "description": f"base64 of little-endian {np_dtype.name}"}
        if ndim == 1
        else _matrix_schema(f"row-major {np_dtype.name} matrix, data as base64 little-endian")
    )
    return Annotated[
        np.ndarray,
        BeforeValidator(lambda v: _coerce(v, np_dtype, ndim)),
        PlainSerializer(_serialize, when_used="json"),
        WithJsonSchema(schema),
    ]


Int32Array = _array_type("int32", 1)
Float32Array = _array_type("float32", 1)
UInt64Array = _array_type("uint64", 1)
Int32Matrix = _array_type("int32", 2)
Float32Matrix = _array_type("float32", 2)
UInt64Matrix = _array_type("uint64", 2)
UInt8Array = _array_type("uint8", 1)


def _expert_ids(value: Any) -> np.ndarray:
    """A matrix of expert ids kept in the narrowest of uint8/uint16 that it came in: a model with at
    most 256 experts routes in one byte per choice. On the wire the shape tells the two apart (the
    payload holds one or two bytes per element)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "u" and value.dtype.itemsize in (1, 2):
            array = value
        else:
            array = _coerce(value, np.dtype(np.uint16), 2)
    elif isinstance(value, dict):
        try:
            shape = tuple(int(s) for s in value["shape"])
            raw = b64decode(value["data"])
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise ValueError('expert ids must be {"shape": [rows, cols], "data": "<base64>"}') from exc
        n = int(np.prod(shape))
        if len(raw) == n:
            array = np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        elif len(raw) == 2 * n:
            array = np.frombuffer(raw, dtype="<u2").astype(np.uint16, copy=False).reshape(shape)
        else:
            raise ValueError(f"{len(raw)} bytes fit neither uint8 nor uint16 for shape {list(shape)}")
    else:
        wide = _coerce(value, np.dtype(np.uint16), 2)
        array = wide.astype(np.uint8) if not wide.size or int(wide.max()) < 256 else wide
    return within_limits(array, 2)


#: Expert ids ``[tokens, layers x top_k]`` as uint8 (at most 256 experts) or uint16.
ExpertIdMatrix = Annotated[
    np.ndarray,
    BeforeValidator(_expert_ids),
    PlainSerializer(_serialize, when_used="json"),
    WithJsonSchema(
        _matrix_schema("row-major uint8 (1 byte per element) or little-endian uint16 (2 bytes) matrix")
    ),
]
