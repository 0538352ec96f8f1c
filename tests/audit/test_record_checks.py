"""The one checker of record fields (audit.records.checks): each rule is one spec that both pydantic
(validated records) and the hand checks (``model_construct``'ed records) enforce, so the two paths
cannot drift apart."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from isoaudit.audit.records import RecordError, RegionFingerprints, SampleLogprobs, validate_record
from isoaudit.audit.records.checks import (
    COUNT32,
    MIN_P,
    REGION,
    RUN_ID,
    SAMPLE_KEY,
    STEP,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    VERSION,
    FloatRange,
    IntRange,
    Text,
)
from pydantic import ValidationError

from tests import factories

Spec = IntRange | FloatRange | Text

SAMPLE_FIELDS: dict[str, Spec] = {
    "run_id": RUN_ID,
    "step": STEP,
    "sample_key": SAMPLE_KEY,
    "weight_version": VERSION,
    "prompt_len": COUNT32,
    "temperature": TEMPERATURE,
    "top_k": TOP_K,
    "top_p": TOP_P,
    "min_p": MIN_P,
    "rank": COUNT32,
}
FINGERPRINT_FIELDS: dict[str, Spec] = {
    "run_id": RUN_ID,
    "step": STEP,
    "sample_key": SAMPLE_KEY,
    "region": REGION,
    "forward_index": COUNT32,
}


def refused_values(spec: Spec) -> list[Any]:
    """Values just outside what ``spec`` admits."""
    if isinstance(spec, IntRange):
        return [spec.low - 1, spec.high + 1]
    if isinstance(spec, FloatRange):
        out = [spec.low if spec.low_open else spec.low - 1.0, math.nan, math.inf]
        return out + ([spec.high + 1.0] if math.isfinite(spec.high) else [])
    out = ["x" * (spec.max_length + 1)]
    if spec.min_length:
        out.append("")
    if spec.pattern:
        out.append("not matching!")
    return out


def cases() -> list[tuple[type, str, Any]]:
    return [
        (model, name, value)
        for model, fields in ((SampleLogprobs, SAMPLE_FIELDS), (RegionFingerprints, FINGERPRINT_FIELDS))
        for name, spec in fields.items()
        for value in refused_values(spec)
    ]


def good(model: type) -> SampleLogprobs | RegionFingerprints:
    sample = factories.sample()
    return sample if model is SampleLogprobs else factories.fingerprints(sample)


@pytest.mark.parametrize(("model", "name", "value"), cases(), ids=repr)
def test_both_paths_refuse_what_the_spec_refuses(model: type, name: str, value: Any) -> None:
    record = good(model)
    with pytest.raises(ValidationError) as validated:
        model.model_validate({**dict(record), name: value})
    assert name in str(validated.value)
    with pytest.raises(RecordError) as constructed:
        validate_record(model.model_construct(**{**dict(record), name: value}))
    assert constructed.value.field == name and str(constructed.value).startswith(f"{name}: ")


def test_the_schema_states_each_spec() -> None:
    """What the OpenAPI document says of a field is what the hand check enforces."""
    properties = SampleLogprobs.model_json_schema()["properties"]

    def schema(name: str) -> dict[str, Any]:
        body = properties[name]
        return next((arm for arm in body.get("anyOf", []) if arm.get("type") != "null"), body)

    for name, spec in SAMPLE_FIELDS.items():
        stated = schema(name)
        if isinstance(spec, IntRange):
            assert (stated["minimum"], stated["maximum"]) == (spec.low, spec.high), name
        elif isinstance(spec, FloatRange):
            low = stated.get("exclusiveMinimum", stated.get("minimum"))
            assert low == spec.low and ("exclusiveMinimum" in stated) == spec.low_open, name
            assert stated.get("maximum", math.inf) == spec.high, name
        else:
            assert stated["maxLength"] == spec.max_length and stated.get("pattern") == spec.pattern, name


def test_a_constructed_record_with_numpy_scalars_passes() -> None:
    record = factories.sample()
    fields = {**dict(record), "step": np.int64(3), "temperature": np.float32(0.5), "top_p": np.float32(0.5)}
    assert validate_record(SampleLogprobs.model_construct(**fields)).step == 3
