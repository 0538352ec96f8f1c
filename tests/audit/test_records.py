"""The wire records: validation names the field; arrays round-trip exactly through JSON."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from audit.arrays import MAX_ARRAY_ELEMENTS
from audit.records import Batch, RegionFingerprints, SampleLogprobs, sample_key
from tests import factories


def sample_dict(**overrides):
    body = factories.sample().model_dump(mode="json")
    body.update(overrides)
    return body


def error_text(exc: pytest.ExceptionInfo) -> str:
    return str(exc.value)


def test_sample_round_trips_through_json_bit_exact():
    record = factories.sample(logprobs=np.array([-0.0, -1e-45, -3.4e38, -1.5e-38, -0.5, -1.0], np.float32))
    again = SampleLogprobs.model_validate_json(record.model_dump_json())
    assert again.token_ids.dtype == np.int32 and again.logprobs.dtype == np.float32
    assert again.token_ids.tobytes() == record.token_ids.tobytes()
    assert again.logprobs.view(np.uint32).tolist() == record.logprobs.view(np.uint32).tolist()
    assert again.sample_key == record.sample_key


def test_arrays_travel_as_base64_strings():
    body = factories.sample().model_dump(mode="json")
    assert isinstance(body["token_ids"], str) and isinstance(body["logprobs"], str)


def test_sample_key_is_derived_from_the_tokens():
    prompt, completion = [1, 2, 3], [4, 5]
    record = SampleLogprobs(
        run_id="r", step=0, side="rollout", prompt_len=3, token_ids=prompt + completion, logprobs=[-1.0, -2.0]
    )
    assert record.sample_key == sample_key(prompt, completion) == sample_key(prompt + completion)
    assert len(record.sample_key) == 32


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"logprobs": [-1.0, -2.0]}, "logprobs"),
        ({"logprobs": [-1.0, 0.5, -1.0, -1.0, -1.0, -1.0]}, "logprobs: positive"),
        ({"logprobs": [-1.0, float("nan"), -1.0, -1.0, -1.0, -1.0]}, "logprobs: NaN"),
        ({"side": "critic"}, "side"),
        ({"prompt_len": 11}, "prompt_len"),
        ({"prompt_len": -1}, "prompt_len"),
        ({"token_ids": "not base64!"}, "token_ids"),
        ({"temperature": -0.1}, "temperature"),
        ({"sample_key": "xyz"}, "sample_key"),
        ({"run_id": ""}, "run_id"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_sample_names_the_field(overrides, field):
    with pytest.raises(ValidationError) as exc:
        SampleLogprobs.model_validate(sample_dict(**overrides))
    assert field in error_text(exc)


def test_unknown_case_is_rejected():
    record = factories.sample()
    body = factories.fingerprints(record).model_dump(mode="json")
    body["case"] = "engine_magic"
    with pytest.raises(ValidationError) as exc:
        RegionFingerprints.model_validate(body)
    assert "case" in error_text(exc)


def test_oversize_array_is_rejected():
    tokens = np.zeros(MAX_ARRAY_ELEMENTS + 1, np.int32)
    with pytest.raises(ValidationError) as exc:
        SampleLogprobs(
            run_id="r", step=0, side="trainer", prompt_len=0, token_ids=tokens, logprobs=np.zeros(1)
        )
    assert "token_ids" in error_text(exc) and "exceed" in error_text(exc)


def test_fingerprint_rows_must_agree():
    record = factories.sample()
    body = factories.fingerprints(record).model_dump(mode="json")
    body["l2"] = factories.fingerprints(record, rows=3).model_dump(mode="json")["l2"]
    with pytest.raises(ValidationError) as exc:
        RegionFingerprints.model_validate(body)
    assert "l2" in error_text(exc)


def test_fingerprints_round_trip_matrices():
    record = factories.fingerprints(factories.sample())
    again = RegionFingerprints.model_validate_json(record.model_dump_json())
    assert again.ladder.shape == record.ladder.shape and (again.ladder == record.ladder).all()
    assert (again.sketch == record.sketch).all() and again.digest.dtype == np.uint64


def test_batch_is_discriminated_by_kind():
    s = factories.sample()
    batch = Batch.model_validate(
        {
            "records": [
                factories.run().model_dump(mode="json"),
                s.model_dump(mode="json"),
                factories.fingerprints(s).model_dump(mode="json"),
            ]
        }
    )
    assert [r.kind for r in batch.records] == ["run", "sample", "fingerprints"]
    with pytest.raises(ValidationError) as exc:
        Batch.model_validate({"records": [{"kind": "sample", **sample_dict(prompt_len=99)}]})
    assert "records.0.sample" in error_text(exc) and "prompt_len" in error_text(exc)
