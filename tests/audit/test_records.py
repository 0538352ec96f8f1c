"""The wire records: validation names the field; arrays round-trip exactly through JSON."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from isoaudit.audit.arrays import MAX_ARRAY_ELEMENTS
from isoaudit.audit.records import (
    Batch,
    RegionFingerprints,
    RegionFingerprintsBlock,
    SampleLogprobs,
    sample_key,
)
from pydantic import ValidationError

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
        ({"token_ids": [2**40] + [1] * 9}, "do not fit int32"),  # would wrap to int32 silently
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


def _two_samples() -> list[SampleLogprobs]:
    return [factories.sample(seed=1), factories.sample(seed=2, n_completion=3)]


def test_a_block_round_trips_and_stands_for_its_samples_records():
    samples = _two_samples()
    block = factories.fingerprints_block(samples)
    again = validate_record(json.loads(block.model_dump_json()))
    assert isinstance(again, RegionFingerprintsBlock) and again.lengths.tolist() == block.lengths.tolist()
    want = [factories.fingerprints(s, seed=i) for i, s in enumerate(samples)]
    got = again.samples()
    assert [r.model_dump(mode="json") for r in got] == [r.model_dump(mode="json") for r in want]
    assert all(r.checked() is r for r in got)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda b: b.update(lengths=np.array([1], np.int32)), "lengths"),  # one length for two keys
        (lambda b: b.update(lengths=np.array([2, 2], np.int32)), "lengths"),  # not the rows' count
        (lambda b: b.update(lengths=np.array([-1, 1 + b["positions"].size], np.int32)), "lengths"),
        (lambda b: b.update(sample_keys=[b["sample_keys"][0]] * 2), "sample_keys"),
        (lambda b: b.update(sample_keys=[]), "sample_keys"),
        (lambda b: b.update(sample_keys=["not a key", b["sample_keys"][1]]), "sample_keys[0]"),
        (lambda b: b.update(l2=b["l2"][:-1]), "l2"),
        (lambda b: b.update(positions=np.zeros_like(b["positions"])), "positions"),  # repeated in a sample
        (lambda b: b.update(ladder=b["ladder"][:, :2]), "ladder"),
    ],
)
def test_a_bad_block_names_the_field(change, field):
    body = dict(factories.fingerprints_block(_two_samples()))
    change(body)
    with pytest.raises(RecordError) as exc:
        validate_record(RegionFingerprintsBlock.model_construct(**body))
    assert exc.value.field == field, exc.value


def test_a_block_is_stored_as_the_records_it_stands_for(tmp_path):
    """Read back, a block is its per-sample records; sent again, it stores nothing twice."""
    from isoaudit.audit.db import Store

    samples = _two_samples()
    store = Store(f"sqlite:///{tmp_path / 'blocks.db'}")
    try:
        block = factories.fingerprints_block(samples, "layers.0.mlp")
        result = store.ingest([factories.run(), *samples, block])
        assert result.stored["fingerprints"] == 2 and not result.rejected
        again = store.ingest([block])
        assert again.duplicates["fingerprints"] == 2 and not again.stored["fingerprints"]
        stored = store.fingerprints("run-1", 0)
        want = {r.sample_key: r for r in block.samples()}
        assert sorted(r.sample_key for r in stored) == sorted(want)
        for record in stored:
            assert record.model_dump(mode="json") == want[record.sample_key].model_dump(mode="json")
    finally:
        store.dispose()


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


# ---------------------------------------------------------------------- property-based: bad input

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from isoaudit.audit.records import RecordError, validate_record  # noqa: E402


def valid_dicts() -> dict[str, dict]:
    s = factories.sample(topk_ids=np.zeros((6, 2), np.int32), topk_logprobs=-np.ones((6, 2), np.float32))
    return {
        "sample": s.model_dump(mode="json"),
        "fingerprints": factories.fingerprints(s).model_dump(mode="json"),
        "fingerprints_block": factories.fingerprints_block([s]).model_dump(mode="json"),
        "run": factories.run(config={"lr": 1e-6}).model_dump(mode="json"),
        "manifest": factories.manifest(regions=["embed"]).model_dump(mode="json"),
    }


VALID = valid_dicts()
FIELDS = {kind: sorted(body) for kind, body in VALID.items()}

#: Values that break decoders: odd numbers, odd text (NUL, lone surrogates, RTL), broken base64,
#: arrays of the wrong width or byte order, matrices declaring huge or negative shapes.
nasty = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=40),
    st.sampled_from(["\x00", "\ud800", "a\u202eb", "run-1\x00", "", "=", "AAA", "AAAA=", "not base64!"]),
    st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=12),
    st.lists(st.floats(allow_nan=True), max_size=12),
    st.builds(
        lambda shape, data: {"shape": shape, "data": base64.b64encode(data).decode()},
        st.lists(st.integers(min_value=-4, max_value=2**40), max_size=3),
        st.binary(max_size=64),
    ),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


@st.composite
def mutated(draw: st.DrawFn) -> dict:
    """A valid record's dict with one field replaced, removed, or one unknown field added; or an
    array truncated by a few bytes (misaligned) or shortened by whole elements."""
    kind = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[kind]))
    field = draw(st.sampled_from([*FIELDS[kind], "surprise"]))
    action = draw(st.sampled_from(["replace", "remove", "truncate"]))
    if action == "remove":
        body.pop(field, None)
    elif action == "truncate" and isinstance(body.get(field), str) and field not in ("kind", "run_id"):
        raw = base64.b64decode(body[field], validate=False) if _is_b64(body[field]) else body[field].encode()
        cut = draw(st.integers(min_value=1, max_value=max(1, len(raw))))
        body[field] = base64.b64encode(raw[:-cut]).decode()
    else:
        body[field] = draw(nasty)
    return body


def _is_b64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except ValueError:
        return False
    return True


@given(mutated())
@settings(max_examples=300, deadline=None)
def test_every_decoder_accepts_or_names_the_field(body):
    """Whatever the input, validation ends in a valid record or a RecordError naming a real field;
    never another exception (which the service would turn into a 500)."""
    try:
        record = validate_record(body)
    except RecordError as exc:
        top = exc.field.split(".")[0]
        kind = body.get("kind") if isinstance(body.get("kind"), str) else None
        assert top in {*FIELDS.get(kind, ()), "kind", "record", "surprise"}, exc
        assert str(exc).startswith(f"{exc.field}: ")
        return
    again = validate_record(json.loads(record.model_dump_json()))  # what was accepted round-trips
    assert again.model_dump(mode="json") == record.model_dump(mode="json")


@given(
    st.sampled_from([">i4", "<i4", "=i4"]),
    st.sampled_from([">f4", "<f4"]),
    st.integers(min_value=0, max_value=8),
)
@settings(max_examples=40, deadline=None)
def test_byte_order_of_a_constructed_record_does_not_change_its_values(int_order, float_order, n):
    """Arrays of either byte order are accepted and stored little-endian with the same values."""
    base = factories.sample(n_completion=n)
    record = SampleLogprobs.model_construct(
        **{
            **dict(base),
            "sample_key": None,
            "token_ids": base.token_ids.astype(int_order),
            "logprobs": base.logprobs.astype(float_order),
        }
    )
    checked = validate_record(record)
    assert checked.sample_key == base.sample_key
    again = SampleLogprobs.model_validate_json(checked.model_dump_json())
    assert again.token_ids.tolist() == base.token_ids.tolist()
    assert again.logprobs.view(np.uint32).tolist() == base.logprobs.view(np.uint32).tolist()


@given(st.lists(mutated(), min_size=1, max_size=6), st.integers(min_value=0, max_value=10**9))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_store_stores_the_valid_records_of_any_batch_and_names_the_rest(tmp_path_factory, bodies, tag):
    """Nothing partial: every record of a batch is stored, a duplicate, or rejected by name."""
    from isoaudit.audit.db import Store

    store = STORES.setdefault("sqlite", Store(f"sqlite:///{tmp_path_factory.mktemp('prop') / 's.db'}"))
    run_id = f"prop-{tag}"
    for body in bodies:
        if isinstance(body.get("run_id"), str) and body["run_id"] == "run-1":
            body["run_id"] = run_id
    result = store.ingest([*bodies, factories.sample(run_id=run_id, seed=tag % 1000)])
    accounted = sum(result.stored.values()) + sum(result.duplicates.values()) + len(result.rejected)
    assert accounted == len(bodies) + 1
    assert all(r.message.startswith(f"{r.field}: ") for r in result.rejected)
    assert {r.index for r in result.rejected} <= set(range(len(bodies)))


STORES: dict = {}
