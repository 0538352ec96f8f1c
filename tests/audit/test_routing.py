"""Routing agreement (audit.routing): hand-computed agreement, flip rate, Jaccard and first flips;
the record's boundary checks; storage round trip; the ``routing`` sub-cause of ``numerical``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from isoaudit.audit.compare import compare_sample, step_summary
from isoaudit.audit.records import RecordError, Routes, SampleLogprobs, validate_record
from isoaudit.audit.routing import (
    compare_routes,
    routes_columns,
    routes_from_columns,
    step_routing,
    step_routing_metrics,
)

# Three tokens, two MoE layers, top-2. Per (token, layer) the trainer's and rollout's sets:
#   layer 0: {0,1} vs {1,0} (equal, other slot order) | {2,3} vs {2,7} (overlap 1) | {4,5} vs {6,7} (0)
#   layer 1: {1,2} vs {1,2}                            | {3,4} vs {3,4}            | {5,6} vs {6,5}
TRAINER = [[0, 1, 1, 2], [2, 3, 3, 4], [4, 5, 5, 6]]
ROLLOUT = [[1, 0, 1, 2], [2, 7, 3, 4], [6, 7, 6, 5]]


def routes(rows: list[list[int]], positions: list[int] | None = None, **kw: object) -> Routes:
    positions = positions if positions is not None else list(range(len(rows)))
    return Routes(
        layers=[0, 1],
        top_k=2,
        num_experts=8,
        positions=np.asarray(positions, dtype=np.int32),
        experts=np.asarray(rows, dtype=np.uint8).reshape(len(rows), 4),
        **kw,
    )


def test_hand_computed_agreement_flip_rate_and_jaccard() -> None:
    comparison = compare_routes(routes(TRAINER), routes(ROLLOUT))
    assert comparison is not None
    m = comparison.metrics()
    # 4 of 6 (token, layer) sets agree; 3 of 12 decisions flipped (0 + 1 + 2 in layer 0).
    assert m["routing_set_agreement"] == pytest.approx(4 / 6)
    assert m["routing_flip_rate"] == pytest.approx(3 / 12)
    # Jaccard: layer 0: 1, 1/3, 0; layer 1: 1, 1, 1 -> (4/3 + 3) / 6.
    assert m["routing_jaccard_mean"] == pytest.approx(13 / 18)
    assert m["routing_token_flip_fraction"] == pytest.approx(2 / 3)
    assert m["routing_flipped_tokens"] == 2 and m["routing_tokens"] == 3
    assert m["routing_first_flip_layer"] == 0
    assert comparison.first_flip() == (0, 1)
    assert comparison.first_flip_layers().tolist() == [-1, 0, 0]
    counts = comparison.layer_counts()
    assert counts[0] == {
        "tokens": 3,
        "decisions": 6,
        "agree": 1,
        "flipped_decisions": 3,
        "jaccard_sum": pytest.approx(4 / 3),
        "first_flips": 2,
    }
    assert counts[1]["agree"] == 3 and counts[1]["first_flips"] == 0


def test_only_positions_and_layers_both_sides_routed_count() -> None:
    # The engine never runs the last sampled token: its route exists on the trainer side only.
    trainer = routes(TRAINER)
    rollout = Routes(
        layers=[1],
        top_k=2,
        num_experts=8,
        positions=np.asarray([0, 1], dtype=np.int32),
        experts=np.asarray([[1, 2], [4, 3]], dtype=np.uint8),
    )
    comparison = compare_routes(trainer, rollout)
    assert comparison is not None
    assert comparison.layers == [1] and comparison.positions.tolist() == [0, 1]
    assert comparison.metrics()["routing_set_agreement"] == 1.0
    assert comparison.first_flip() is None
    assert math.isnan(comparison.metrics()["routing_first_flip_layer"])
    assert compare_routes(trainer, None) is None


def test_first_flip_is_the_lowest_layer_then_position() -> None:
    trainer = routes([[0, 1, 1, 2], [2, 3, 3, 4]])
    rollout = routes([[0, 1, 1, 3], [2, 4, 3, 4]])  # token 0 flips in layer 1, token 1 in layer 0
    comparison = compare_routes(trainer, rollout)
    assert comparison is not None and comparison.first_flip() == (0, 1)
    assert comparison.first_flip_layers().tolist() == [1, 0]


def test_replayed_fraction_and_missing_routes() -> None:
    # Replay on: positions 0 and 2 replayed, 1 missing; 3 is the sequence's last (needs no route).
    trainer = routes(TRAINER + [[0, 1, 1, 2]], replayed=np.asarray([1, 0, 1, 0], dtype=np.uint8))
    comparison = compare_routes(trainer, routes(ROLLOUT), n_tokens=4)
    assert comparison is not None
    m = comparison.metrics()
    assert m["routing_replayed_fraction"] == pytest.approx(2 / 3)
    assert m["routing_missing_routes"] == 1
    assert comparison.missing_routes().tolist() == [1]
    plain = compare_routes(routes(TRAINER), routes(ROLLOUT)).metrics()  # type: ignore[union-attr]
    assert "routing_replayed_fraction" not in plain


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layers": [1, 0]}, "routes.layers"),
        ({"layers": []}, "routes.layers"),
        ({"top_k": 9}, "routes.top_k"),
        ({"experts": np.asarray([[0, 1, 1, 9]] * 3, dtype=np.uint8)}, "routes.experts"),
        ({"experts": np.asarray([[0, 0, 1, 2]] * 3, dtype=np.uint8)}, "routes.experts"),
        ({"experts": np.zeros((3, 3), dtype=np.uint8)}, "routes.experts"),
        ({"positions": np.asarray([0, 2, 1], dtype=np.int32)}, "routes.positions"),
        ({"replayed": np.asarray([0, 2, 1], dtype=np.uint8)}, "routes.replayed"),
        ({"replayed": np.asarray([0, 1], dtype=np.uint8)}, "routes.replayed"),
    ],
)
def test_boundary_refuses_bad_routes_by_field(change: dict, field: str) -> None:
    good = routes([[0, 1, 1, 2], [2, 3, 3, 4], [4, 5, 5, 6]])
    bad = Routes.model_construct(**{**dict(good), **change})
    sample = SampleLogprobs.model_construct(
        **{
            **dict(_sample(good)),
            "routes": bad,
        }
    )
    with pytest.raises(RecordError) as info:
        validate_record(sample)
    assert info.value.field == field


def test_positions_must_fall_inside_the_sample() -> None:
    with pytest.raises(RecordError, match="routes.positions: 9 is past the sample's 4 tokens"):
        _sample(routes(TRAINER, positions=[0, 1, 9]))


def _sample(r: Routes, side: str = "trainer", logprobs: list[float] | None = None) -> SampleLogprobs:
    lp = np.asarray(logprobs if logprobs is not None else [-1.0, -2.0], dtype=np.float32)
    return SampleLogprobs.model_construct(
        run_id="r",
        step=0,
        side=side,
        sample_key=None,
        weight_version=None,
        prompt_len=4 - lp.size,
        token_ids=np.arange(4, dtype=np.int32),
        logprobs=lp,
        temperature=1.0,
        top_k=None,
        top_p=None,
        min_p=None,
        weight_spans=None,
        rank=None,
        semantics="processed",
        routes=r,
        topk_ids=None,
        topk_logprobs=None,
        path={},
    ).checked()


def test_json_round_trip_keeps_one_byte_ids_and_storage_round_trip() -> None:
    sample = _sample(routes(TRAINER, replayed=np.asarray([1, 1, 0], dtype=np.uint8)))
    body = sample.model_dump(mode="json")
    again = validate_record(body)
    assert isinstance(again, SampleLogprobs) and again.routes is not None
    assert again.routes.experts.dtype == np.uint8
    assert np.array_equal(again.routes.experts, sample.routes.experts)  # type: ignore[union-attr]
    columns = routes_columns(again.routes)
    assert len(columns["routes_data"]) == 3 * 4 + 3 * 4 + 3  # positions, 12 one-byte ids, marks
    stored = routes_from_columns(columns["routes"], columns["routes_data"])
    assert stored is not None
    assert np.array_equal(stored.experts, again.routes.experts)
    assert stored.replayed.tolist() == [1, 1, 0]  # type: ignore[union-attr]
    wide = Routes(
        layers=[3],
        top_k=2,
        num_experts=300,
        positions=np.asarray([0], dtype=np.int32),
        experts=np.asarray([[299, 7]], dtype=np.uint16),
    )
    cols = routes_columns(wide)
    back = routes_from_columns(cols["routes"], cols["routes_data"])
    assert back is not None and back.experts.tolist() == [[299, 7]] and back.experts.dtype == np.uint16
    assert Routes.model_validate(wide.model_dump(mode="json")).experts.tolist() == [[299, 7]]


def test_step_aggregate_sums_samples_per_layer() -> None:
    a = (_sample(routes(TRAINER)), _sample(routes(ROLLOUT), "rollout"))
    b = (_sample(routes(TRAINER)), _sample(routes(TRAINER), "rollout"))  # agrees everywhere
    summary = step_routing([a, b])
    assert summary is not None
    assert summary["layers"]["0"]["tokens"] == 6 and summary["layers"]["0"]["agree"] == 4
    assert summary["layers"]["0"]["example"] == a[0].sample_key
    m = step_routing_metrics(summary)
    assert m["routing_set_agreement"] == pytest.approx(10 / 12)
    assert m["routing_flip_rate"] == pytest.approx(3 / 24)
    assert m["routing_token_flip_fraction"] == pytest.approx(2 / 6)
    assert step_routing([(a[0], _sample(None, "rollout"))]) is None  # type: ignore[arg-type]
    step = step_summary([a, b], [])
    assert step["metrics"]["routing_flip_rate"] == pytest.approx(3 / 24)


def test_a_flip_that_explains_the_gap_is_the_routing_sub_cause_of_numerical() -> None:
    # Prompt of 2 tokens, completion tokens at positions 2 and 3, predicted from positions 1 and 2.
    # The routing of position 1 flips in layer 0; the token at position 2 holds the whole gap.
    trainer = _sample(routes(TRAINER), logprobs=[-1.0, -2.0])
    rollout = _sample(routes(ROLLOUT), "rollout", logprobs=[-1.5, -2.0])
    result = compare_sample(trainer, rollout)
    assert result.diagnosis.kind == "numerical"
    evidence = result.diagnosis.evidence
    assert evidence["cause"] == "routing"
    assert evidence["routing"]["layer"] == 0 and evidence["routing"]["position"] == 1
    assert evidence["routing"]["trainer_experts"] == [2, 3]
    assert evidence["routing"]["rollout_experts"] == [2, 7]
    assert evidence["routing"]["completion_token"] == 0
    assert "flipped the routing of MoE layer 0 at position 1" in result.diagnosis.sentence
    assert result.metrics["routing_set_agreement"] == pytest.approx(4 / 6)


def test_a_flip_that_does_not_explain_the_gap_leaves_the_verdict() -> None:
    # Only position 2 (predicting nothing in the completion after it) flips... the gap is at the
    # token predicted from position 1, whose routing agrees.
    trainer_rows = [[0, 1, 1, 2], [2, 3, 3, 4], [4, 5, 5, 6]]
    rollout_rows = [[0, 1, 1, 2], [2, 3, 3, 4], [4, 7, 5, 6]]
    trainer = _sample(routes(trainer_rows), logprobs=[-1.0, -2.0])
    rollout = _sample(routes(rollout_rows), "rollout", logprobs=[-1.5, -2.0])
    result = compare_sample(trainer, rollout)
    assert result.diagnosis.evidence.get("cause") != "routing"
    assert result.metrics["routing_flipped_tokens"] == 1
