"""The ``stale_engine_state`` diagnosis from the sides' canaries (``Manifest.canary``): its three
readings, what it leaves to ``weights`` and ``numerical``, and the canary through the store and the
comparison worker on SQLite and PostgreSQL."""

from __future__ import annotations

import numpy as np
import pytest
from isoaudit.audit.diagnosis import diagnose
from isoaudit.audit.records import Canary, CanaryOutput, Manifest, canary_digest, held_digest
from isoaudit.audit.stale_state import stale_engine_state

from tests import factories
from tests.audit.stale_records import (
    CANARY,
    POLICY,
    TOP,
    canary,
    held_at,
    manifests,
    output,
    stale_run,
    values_at,
)


def test_the_digest_is_order_free_and_bit_exact() -> None:
    values = values_at(1)
    assert canary_digest(CANARY, TOP, values) == canary_digest(CANARY, TOP[::-1], values[::-1])
    nudged = list(values)
    nudged[3] = float(np.nextafter(np.float32(values[3]), np.float32(0)))
    assert canary_digest(CANARY, TOP, nudged) != canary_digest(CANARY, TOP, values)
    assert canary_digest(CANARY[1:], TOP, values) != canary_digest(CANARY, TOP, values)
    assert held_digest({"a": "x", "b": "y"}) == held_digest({"b": "y", "a": "x"}) and held_digest({}) is None


def test_one_arithmetic_equal_weights_differing_canaries_is_stale() -> None:
    t0, r0 = manifests("r", 0, stale=False)
    tm, rm = manifests("r", 1, stale=True)
    # one policy identity is a claim: never seen to give equal canaries, it proves nothing
    assert stale_engine_state(tm, rm, [tm], [rm]) is None
    found = stale_engine_state(tm, rm, [t0, tm], [r0, rm])
    assert found is not None and found.kind == "stale_engine_state"
    assert found.evidence["cause"] == "canaries_differ_under_one_arithmetic"
    assert found.evidence["canaries_agreed_at_version"] == "0"
    assert found.evidence["held_tensors_agreeing"] == 4
    assert found.evidence["max_abs_logprob_diff"] == pytest.approx(0.005)
    assert "hold old weights" in found.sentence and "vLLM's LLM.generate" in found.sentence
    t1, r1 = manifests("r", 1, stale=False)
    assert stale_engine_state(t1, r1, [t0, t1], [r0, r1]) is None


def test_canaries_of_different_arithmetic_or_unknown_weights_are_not_compared() -> None:
    t0, r0 = manifests("r", 0, stale=False)
    tm, rm = manifests("r", 1, stale=True)

    def stale(rollout: Manifest) -> object:
        return stale_engine_state(tm, rollout, [t0, tm], [r0, rollout])

    other = rm.model_copy(update={"canary": rm.canary.model_copy(update={"arithmetic": "e" * 64})})
    assert stale(other) is None  # sides that differ legitimately: left to numerical
    native = rm.model_copy(update={"canary": rm.canary.model_copy(update={"arithmetic": None})})
    assert stale(native) is None
    assert stale(rm.model_copy(update={"weight_tensor_digests": {}})) is None  # "held agree" unknown
    old = rm.model_copy(update={"weight_version": "0"})
    assert stale(old) is None  # a canary of another version says nothing of this one
    assert (
        stale(rm.model_copy(update={"canary": Canary(weight_version="1", error="RuntimeError: x")})) is None
    )


def test_a_side_against_its_own_reference() -> None:
    _, r0 = manifests("r", 0, stale=False)
    tm, rm = manifests("r", 1, stale=False)
    graph_path = "the reference engine's CUDA-graph decode (bucket 1)"
    eager_path = "the same decode run eagerly from the held parameters"
    fresh = output(values_at(0), graph_path)
    agreed = r0.canary.model_copy(
        update={"output": fresh, "reference": output(values_at(0), eager_path), "arithmetic": None}
    )
    before = r0.model_copy(update={"canary": agreed})
    graph = output(values_at(0.5), graph_path)
    eager = output(values_at(1), eager_path)
    own = rm.canary.model_copy(update={"output": graph, "reference": eager, "arithmetic": None})
    stale = rm.model_copy(update={"canary": own})
    # never seen to agree: the two paths may differ in their bits on this setup; no verdict
    assert stale_engine_state(tm, stale, [tm], [stale]) is None
    found = stale_engine_state(tm, stale, [tm], [before, stale])
    assert found is not None and found.evidence["cause"] == "canary_differs_from_own_reference"
    assert found.evidence["side"] == "rollout" and "CUDA-graph decode" in found.sentence
    assert found.evidence["paths_agreed_at_version"] == "0"
    agree = own.model_copy(update={"reference": graph})
    assert stale_engine_state(tm, rm.model_copy(update={"canary": agree}), [tm], [before]) is None


def test_a_canary_deaf_to_a_weight_change() -> None:
    _, r1 = manifests("r", 1, stale=False)
    _, r2 = manifests("r", 2, stale=False)
    same = r1.canary.output
    deaf = r2.model_copy(update={"canary": r2.canary.model_copy(update={"output": same, "arithmetic": None})})
    first = r1.model_copy(update={"canary": r1.canary.model_copy(update={"arithmetic": None})})
    found = stale_engine_state(None, deaf, (), [first, deaf])
    assert found is not None and found.evidence["cause"] == "canary_unchanged_by_weight_update"
    assert found.evidence["previous_weight_version"] == "1" and found.evidence["weight_version"] == "2"
    # the same canary under unchanged held weights is no evidence
    unchanged = deaf.model_copy(
        update={"canary": deaf.canary.model_copy(update={"held_digest": first.canary.held_digest})}
    )
    assert stale_engine_state(None, unchanged, (), [first, unchanged]) is None


def _pair(step: int, gap: float = 0.125) -> tuple[object, object, dict]:
    trainer = factories.sample("trainer", step=step, seed=step, weight_version=str(step))
    rollout = factories.sample(
        "rollout",
        step=step,
        seed=step,
        weight_version=str(step),
        logprobs=(trainer.logprobs - np.float32(gap)),
    )
    return trainer, rollout, {"bitwise_mismatch_count": trainer.logprobs.size}


def test_the_order_weights_then_stale_then_the_rest() -> None:
    trainer, rollout, metrics = _pair(1)
    t0, r0 = manifests("run-1", 0, stale=False)
    tm, rm = manifests("run-1", 1, stale=True)
    assert diagnose(trainer, rollout, metrics, None, [t0, tm], [r0, rm]).kind == "stale_engine_state"
    other = {**held_at(1), "model.layers.0.mlp.down_proj.weight": "bfloat16[64,128]:ffff"}
    differing = rm.model_copy(update={"weight_tensor_digests": other})
    assert diagnose(trainer, rollout, metrics, None, [t0, tm], [r0, differing]).kind == "weights"  # first
    tm, rm = manifests("run-1", 1, stale=False)  # canaries agree: not stale, the rest decides
    assert diagnose(trainer, rollout, metrics, None, [t0, tm], [r0, rm]).kind == "inconclusive"


def test_the_canary_through_the_store_and_the_worker(store) -> None:
    keys = stale_run(store)
    kinds = {r.step: r.diagnosis for r in store.sample_results("stale-run")}
    assert kinds == {0: "clean", 1: "stale_engine_state", 2: "clean"}
    (result,) = store.sample_results("stale-run", 1)
    assert result.sample_key == keys[1]
    stored = [m for m in store.manifests("stale-run", "rollout") if m.weight_version == "1"]
    assert stored and stored[-1].canary == manifests("stale-run", 1, stale=True)[1].canary
    assert stored[-1].canary.arithmetic == POLICY


def test_the_canary_record_refuses_what_a_database_cannot_keep() -> None:
    with pytest.raises(ValueError, match="finite"):
        CanaryOutput(path="x", digest="0", top_ids=[1], top_logprobs=[float("-inf")])
    with pytest.raises(ValueError, match="one entry each"):
        CanaryOutput(path="x", digest="0", top_ids=[1, 2], top_logprobs=[0.0])
    with pytest.raises(ValueError, match="NUL"):
        canary("1", held_at(1), values_at(1), "bad\x00path")
