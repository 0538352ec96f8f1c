"""The boundary's checks of ``SampleLogprobs.routes`` on every way a record arrives: built with
``model_construct`` (collectors; ``validate_record`` runs ``checked``), a dict (the store, the HTTP
ingest after JSON), JSON text, and a dict holding a ready ``Routes`` object (which pydantic takes
without validating, so the record's validator has to). Each refusal names its field; a routes check
that is skipped on any path fails here. Also the base64 decoder against the standard library's."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from isoaudit.audit import arrays
from isoaudit.audit.records import RecordError, Routes, SampleLogprobs, validate_record
from isoaudit.audit.records.routes import _repeats

N_TOKENS = 6


def _experts(tokens: int, layers: int, top_k: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """Distinct ids per (token, layer), as a router's top-k gives them."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens * layers, num_experts)), axis=1)[:, :top_k]
    return ids.astype(np.uint8 if num_experts <= 256 else np.uint16).reshape(tokens, layers * top_k)


def _routes_fields(**change: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "layers": [0, 3],
        "top_k": 2,
        "num_experts": 8,
        "positions": np.arange(N_TOKENS, dtype=np.int32),
        "experts": _experts(N_TOKENS, 2, 2, 8),
        "replayed": None,
    }
    return {**fields, **change}


def _sample_fields(routes: Any) -> dict[str, Any]:
    return {
        "run_id": "r",
        "step": 0,
        "side": "trainer",
        "prompt_len": 2,
        "token_ids": np.arange(N_TOKENS, dtype=np.int32),
        "logprobs": np.full(N_TOKENS - 2, -0.5, dtype=np.float32),
        "routes": routes,
    }


def _constructed(routes_fields: dict[str, Any]) -> SampleLogprobs:
    routes = Routes.model_construct(**routes_fields)
    return validate_record(SampleLogprobs.model_construct(**_sample_fields(routes)))  # type: ignore[return-value]


def _wire(value: Any) -> Any:
    """A field as it travels (arrays as base64), built by hand so a bad array can be sent too."""
    if not isinstance(value, np.ndarray):
        return value
    data = base64.b64encode(
        np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
    ).decode()
    return data if value.ndim == 1 else {"shape": list(value.shape), "data": data}


def _as_dict(routes_fields: dict[str, Any]) -> dict[str, Any]:
    routes = {k: _wire(v) for k, v in routes_fields.items() if v is not None}
    return {"kind": "sample", **{k: _wire(v) for k, v in _sample_fields(routes).items()}}


def _from_dict(routes_fields: dict[str, Any]) -> SampleLogprobs:
    return validate_record(_as_dict(routes_fields))  # type: ignore[return-value]


def _from_json(routes_fields: dict[str, Any]) -> SampleLogprobs:
    try:
        return SampleLogprobs.model_validate_json(json.dumps(_as_dict(routes_fields)))
    except Exception as exc:  # pydantic's ValidationError: the boundary's error is its cause
        from isoaudit.audit.records import record_error
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            raise record_error(exc) from None
        raise


def _ready_routes_in_dict(routes_fields: dict[str, Any]) -> SampleLogprobs:
    """A dict whose ``routes`` is a Routes object nobody validated (pydantic passes it through)."""
    body = {"kind": "sample", **{k: _wire(v) for k, v in _sample_fields(None).items()}}
    body["routes"] = Routes.model_construct(**routes_fields)
    return validate_record(body)  # type: ignore[return-value]


PATHS: dict[str, Callable[[dict[str, Any]], SampleLogprobs]] = {
    "constructed": _constructed,
    "dict": _from_dict,
    "json": _from_json,
    "ready_routes_in_dict": _ready_routes_in_dict,
}

GOOD = _routes_fields()
DUPLICATE = GOOD["experts"].copy()
DUPLICATE[N_TOKENS - 1, 3] = DUPLICATE[N_TOKENS - 1, 2]  # last token, second layer, both slots

#: (change to good routes, field, message regex: pydantic words the scalar bounds on its paths) for every refusal of the routes check.
REFUSALS = [
    ({"layers": [3, 0]}, "routes.layers", "strictly ascending"),
    ({"layers": []}, "routes.layers", "at least one layer"),
    ({"layers": [0, 2000]}, "routes.layers", "layer indices in 0..1024"),
    ({"top_k": 0}, "routes.top_k", "outside 1..64|greater than or equal to 1"),
    ({"top_k": 2, "num_experts": 1}, "routes.top_k", "2 exceeds num_experts 1"),
    ({"num_experts": 70_000}, "routes.num_experts", "outside 1..65535|less than or equal to 65535"),
    ({"experts": GOOD["experts"][:, :3]}, "routes.experts", r"must be \[6 positions, 2 layers x 2\]"),
    ({"experts": GOOD["experts"][:5]}, "routes.experts", r"must be \[6 positions, 2 layers x 2\]"),
    (
        {"experts": np.where(GOOD["experts"] == 7, 8, GOOD["experts"]).astype(np.uint8)},
        "routes.experts",
        "not below num_experts 8",
    ),
    ({"experts": DUPLICATE}, "routes.experts", "chose the same expert twice"),
    ({"positions": np.asarray([0, 1, 3, 2, 4, 5], np.int32)}, "routes.positions", "strictly ascending"),
    ({"positions": np.asarray([-1, 0, 1, 2, 3, 4], np.int32)}, "routes.positions", "negative position"),
    (
        {"positions": np.asarray([0, 1, 2, 3, 4, 6], np.int32)},
        "routes.positions",
        "6 is past the sample's 6 tokens",
    ),
    ({"replayed": np.asarray([0, 1, 0, 0, 0], np.uint8)}, "routes.replayed", "5 values for 6 positions"),
    (
        {"replayed": np.asarray([0, 1, 2, 0, 0, 0], np.uint8)},
        "routes.replayed",
        r"0 \(computed\) or 1 \(replayed\)",
    ),
]


@pytest.mark.parametrize("path", PATHS)
def test_good_routes_pass_every_path(path: str) -> None:
    sample = PATHS[path](_routes_fields(replayed=np.asarray([0, 1, 1, 0, 0, 1], np.uint8)))
    assert sample.routes is not None
    assert np.array_equal(sample.routes.experts, GOOD["experts"])
    assert sample.routes.experts.dtype == np.uint8


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("change", "field", "fragment"), REFUSALS, ids=[f"{f}:{m}" for _, f, m in REFUSALS])
def test_every_refusal_names_its_field_on_every_path(
    path: str, change: dict, field: str, fragment: str
) -> None:
    with pytest.raises(RecordError) as info:
        PATHS[path](_routes_fields(**change))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ") and re.search(fragment, str(info.value))


@pytest.mark.parametrize("path", ["constructed", "ready_routes_in_dict"])
def test_wrong_dtype_of_expert_ids_is_refused(path: str) -> None:
    with pytest.raises(RecordError, match=r"^routes\.experts: expected a uint8 or uint16 numpy array"):
        PATHS[path](_routes_fields(experts=GOOD["experts"].astype(np.int32)))
    with pytest.raises(RecordError, match=r"^routes\.positions: expected int32"):
        PATHS[path](_routes_fields(positions=np.arange(N_TOKENS, dtype=np.int64)))


def test_wire_bytes_that_fit_no_id_width_are_refused() -> None:
    body = _as_dict(GOOD)
    body["routes"]["experts"] = {"shape": [6, 4], "data": base64.b64encode(bytes(6 * 4 * 4)).decode()}
    with pytest.raises(RecordError, match=r"^routes\.experts: .*fit neither uint8 nor uint16"):
        validate_record(body)


def test_the_realistic_shape_is_checked_to_the_last_id() -> None:
    """1,024 tokens x 48 layers x top-8 of 128: a duplicate or an out-of-range id in the very last
    slot is still found (the check neither samples nor stops early without a hit)."""
    experts = _experts(1024, 48, 8, 128, seed=1)
    fields = _routes_fields(layers=list(range(48)), top_k=8, num_experts=128, experts=experts)
    fields["positions"] = np.arange(1024, dtype=np.int32)

    def sample(experts: np.ndarray) -> SampleLogprobs:
        routes = Routes.model_construct(**{**fields, "experts": experts})
        body = {**_sample_fields(routes), "token_ids": np.arange(1024, dtype=np.int32)}
        body["logprobs"] = np.full(1022, -0.5, dtype=np.float32)
        return SampleLogprobs.model_construct(**body)

    assert validate_record(sample(experts)).routes is not None
    duplicate = experts.copy()
    duplicate[-1, -1] = duplicate[-1, -8]
    with pytest.raises(RecordError, match="same expert twice"):
        validate_record(sample(duplicate))
    high = experts.copy()
    high[-1, -1] = 128
    with pytest.raises(RecordError, match="not below num_experts 128"):
        validate_record(sample(high))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 40),
    layers=st.integers(1, 5),
    top_k=st.integers(1, 9),
    extra=st.integers(0, 300),
    where=st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True)),
    seed=st.integers(0, 2**16),
)
def test_any_planted_duplicate_is_refused_and_distinct_ids_pass(
    tokens: int, layers: int, top_k: int, extra: int, where: tuple[float, float], seed: int
) -> None:
    num_experts = top_k + extra
    experts = _experts(tokens, layers, top_k, num_experts, seed)
    fields = _routes_fields(
        layers=list(range(layers)),
        top_k=top_k,
        num_experts=num_experts,
        positions=np.arange(tokens, dtype=np.int32),
        experts=experts,
    )
    routes = Routes.model_construct(**fields)
    routes.check(tokens)  # distinct ids pass
    rows = experts.reshape(tokens * layers, top_k)
    assert not _repeats(rows)
    if top_k < 2:
        return
    row = int(where[0] * rows.shape[0])
    s, t = sorted(np.random.default_rng(seed).choice(top_k, 2, replace=False).tolist())
    bad = rows.copy()
    bad[row, t] = bad[row, s]
    assert _repeats(bad) == any(len(set(r.tolist())) < top_k for r in bad)
    with pytest.raises(RecordError, match=r"^routes\.experts: one layer chose the same expert twice"):
        Routes.model_construct(**{**fields, "experts": bad.reshape(experts.shape)}).check(tokens)


BASE64ISH = st.text(alphabet="ABCDabcd0189+/=-_ \n\x00é", max_size=14)


@settings(max_examples=400, deadline=None)
@given(text=BASE64ISH | st.binary(max_size=30).map(lambda b: base64.b64encode(b).decode()))
def test_base64_decoder_accepts_and_refuses_what_the_standard_library_does(text: str) -> None:
    def outcome(decode: Callable[[str], bytes]) -> bytes | str:
        try:
            return decode(text)
        except (binascii.Error, ValueError):
            return "refused"

    assert outcome(arrays.b64decode) == outcome(lambda v: base64.b64decode(v, validate=True))


def test_base64_without_pybase64_uses_the_standard_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrays, "_pybase64", None)
    assert arrays.b64decode("YWJj=") == b"abc"  # the standard library's leniency, kept
    with pytest.raises(binascii.Error):
        arrays.b64decode("YW-j")
    sample = _from_dict(GOOD)
    assert np.array_equal(sample.routes.experts, GOOD["experts"])  # type: ignore[union-attr]


@pytest.mark.parametrize("path", PATHS)
def test_expert_id_bound_at_the_widths_edges(path: str) -> None:
    """uint8 ids with 256 experts cannot be out of range (255 passes); uint16 ids with 300 experts
    are bounded (299 passes, 300 is refused)."""
    experts = _experts(N_TOKENS, 2, 2, 256)
    experts[0, 0] = 255 if 255 not in experts[0, :2] else experts[0, 0]
    assert PATHS[path](_routes_fields(num_experts=256, experts=experts)).routes is not None
    wide = _experts(N_TOKENS, 2, 2, 300)
    wide[:, 0] = 299
    wide[:, 1] = 298
    assert PATHS[path](_routes_fields(num_experts=300, experts=wide)).routes.experts.dtype == np.uint16  # type: ignore[union-attr]
    wide[N_TOKENS - 1, 3] = 300 if wide[N_TOKENS - 1, 2] != 300 else 301
    with pytest.raises(RecordError, match=r"^routes\.experts: an expert id is not below num_experts 300"):
        PATHS[path](_routes_fields(num_experts=300, experts=wide))
