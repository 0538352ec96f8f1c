"""isoaudit.audit.diagnosis, one test per diagnosed case, on records built for the case: the lm_head's
precision named with its side, truncation told apart from raw-vs-processed, a prefix cache that
crossed a weight update, silent stale weights (held digests, the embedding), and off-policy by design
against undeclared or out-of-bound lags. Each has a clean control that must not alarm."""

from __future__ import annotations

import numpy as np
import pytest
from isoaudit.audit.compare import compare_sample, compare_samples, step_summary
from isoaudit.audit.records import Manifest, OffPolicy, RuntimeFacts, SampleLogprobs, WeightSpan

from tests import factories

VOCAB, N, PROMPT = 100, 256, 6


def sampled(temperature: float = 0.7, top_k: int | None = None, seed: int = 0):
    """Tokens the engine sampled from random logits after temperature and top-k (renormalised over
    the kept set), and three logprobs of each: raw, temperature-only, and fully processed."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (N, VOCAB))
    scaled = logits / temperature
    if top_k is not None:
        kth = np.sort(scaled, axis=1)[:, -top_k][:, None]
        truncated = np.where(scaled >= kth, scaled, -np.inf)
    else:
        truncated = scaled

    def log_softmax(x: np.ndarray) -> np.ndarray:
        top = x.max(axis=1, keepdims=True)
        return x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))

    processed_all = log_softmax(truncated)
    tokens = np.array([rng.choice(VOCAB, p=np.exp(row)) for row in processed_all], dtype=np.int32)
    pick = np.arange(N), tokens

    def at(x: np.ndarray) -> np.ndarray:
        return x[pick].astype(np.float32)

    return tokens, at(log_softmax(logits)), at(log_softmax(scaled)), at(processed_all)


def record(side: str, tokens: np.ndarray, logprobs: np.ndarray, **fields) -> SampleLogprobs:
    return SampleLogprobs(
        run_id="run-1",
        step=3,
        side=side,
        prompt_len=PROMPT,
        token_ids=np.concatenate([np.arange(PROMPT, dtype=np.int32), tokens]),
        logprobs=logprobs,
        **fields,
    )


def noisy(logprobs: np.ndarray, scale: float = 1e-3, seed: int = 1) -> np.ndarray:
    """Zero-mean kernel noise, as two correct implementations differ."""
    rng = np.random.default_rng(seed)
    return np.minimum(logprobs + rng.normal(0, scale, logprobs.size), 0).astype(np.float32)


def manifest(side: str, **runtime) -> Manifest:
    case = "trainer_fwd" if side == "trainer" else "engine_prefill"
    return factories.manifest(side, case, runtime=RuntimeFacts(**runtime))


# ------------------------------------------------------------------ lm_head precision (item 7)


def test_lm_head_precision_is_named_with_its_side() -> None:
    tokens, _, temp_only, _ = sampled()
    trainer, rollout = (
        record("trainer", tokens, temp_only, temperature=0.7),
        record("rollout", tokens, noisy(temp_only), temperature=0.7),
    )
    fp32 = manifest("trainer", dtype="bfloat16", lm_head_dtype="float32")
    bf16 = manifest("rollout", dtype="bfloat16", lm_head_dtype="bfloat16")
    got = compare_sample(trainer, rollout, trainer_manifests=[fp32], rollout_manifests=[bf16]).diagnosis
    assert got.kind == "numerical" and got.evidence["cause"] == "precision"
    assert got.evidence["precision"] == {
        "field": "runtime.lm_head_dtype",
        "trainer": "float32",
        "rollout": "bfloat16",
        "side": "rollout",
    }
    assert "rollout computes the lm_head/logits in bfloat16" in got.sentence
    assert "runtime.lm_head_dtype" in got.sentence

    # with fingerprints locating it, the first divergence is still reported beside the precision
    logits_t = factories.fingerprints(trainer, "logits", seed=4, rows=N + PROMPT)
    logits_r = factories.fingerprints(rollout, "logits", "engine_prefill", seed=5, rows=N + PROMPT)
    located = compare_sample(
        trainer, rollout, [logits_t], [logits_r], trainer_manifests=[fp32], rollout_manifests=[bf16]
    ).diagnosis
    assert located.kind == "numerical" and located.evidence["first_divergence"]["region"] == "logits"
    assert "lm_head/logits in bfloat16" in located.sentence

    # control: the same precision on both sides is not named (no fingerprints: inconclusive)
    same = manifest("rollout", dtype="bfloat16", lm_head_dtype="float32")
    control = compare_sample(trainer, rollout, trainer_manifests=[fp32], rollout_manifests=[same]).diagnosis
    assert control.kind == "inconclusive" and "precision" not in control.evidence


# ------------------------------------------------------ truncation vs raw-vs-processed (item 3)


def test_top_k_engine_against_a_temperature_only_trainer_names_top_k() -> None:
    tokens, _, temp_only, processed = sampled(top_k=20)
    rollout = record("rollout", tokens, processed, temperature=0.7, top_k=20)
    trainer = record("trainer", tokens, temp_only, temperature=0.7)  # applied temperature only
    got = compare_sample(trainer, rollout).diagnosis
    assert got.kind == "semantics" and got.evidence["cause"] == "truncation_mismatch"
    assert got.evidence["parameters"] == {"top_k": {"rollout": 20, "trainer": None}}
    assert "parameter at fault: top_k" in got.sentence and "temperature=0.7" in got.sentence

    # a trainer that applies the same truncation agrees up to kernel noise: not semantics
    aligned = record("trainer", tokens, noisy(processed), temperature=0.7, top_k=20)
    assert compare_sample(aligned, rollout).diagnosis.kind in ("numerical", "inconclusive")


def test_raw_engine_logprobs_are_raw_vs_processed_not_truncation() -> None:
    tokens, raw, _, processed = sampled(top_k=20)
    rollout = record("rollout", tokens, raw, temperature=0.7, top_k=20, semantics="raw")
    trainer = record("trainer", tokens, processed, temperature=0.7, top_k=20)
    got = compare_sample(trainer, rollout).diagnosis
    assert got.kind == "semantics" and got.evidence["cause"] == "raw_vs_processed"
    assert got.evidence["raw_side"] == "rollout"


def test_each_sampling_parameter_is_named_and_off_spellings_agree() -> None:
    tokens, _, temp_only, _ = sampled()
    rollout = record("rollout", tokens, temp_only, temperature=0.7, top_p=0.9, min_p=0.05)
    trainer = record("trainer", tokens, noisy(temp_only), temperature=0.7)
    got = compare_sample(trainer, rollout).diagnosis
    assert got.evidence["cause"] == "truncation_mismatch"
    assert set(got.evidence["parameters"]) == {"top_p", "min_p"}
    hotter = record("trainer", tokens, noisy(temp_only), temperature=1.0)
    assert (
        compare_sample(hotter, record("rollout", tokens, temp_only, temperature=0.7)).diagnosis.evidence[
            "cause"
        ]
        == "temperature_mismatch"
    )
    # vLLM spells "no top-k" as 0 or -1 and "no top-p" as 1.0: the same as leaving them out
    off = record("rollout", tokens, temp_only, temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)
    trainer = record("trainer", tokens, noisy(temp_only), temperature=0.7, top_k=-1)
    assert compare_sample(trainer, off).diagnosis.kind in ("numerical", "inconclusive")


# ------------------------------------------------ prefix cache across a weight update (item 4)


def test_prefix_cache_that_crossed_a_weight_update_is_named_as_such() -> None:
    tokens, _, temp_only, _ = sampled()
    trainer = record("trainer", tokens, temp_only, temperature=0.7, weight_version=4)
    stale = record(
        "rollout",
        tokens,
        noisy(temp_only, 1e-2),
        temperature=0.7,
        weight_version=4,
        path={"prefix_cached_tokens": 6, "prefix_cache_stale_tokens": 6, "prefix_cache_weight_version": "3"},
    )
    got = compare_sample(trainer, stale).diagnosis
    assert got.kind == "inference_path" and got.evidence["cause"] == "prefix_cache_crossed_weight_update"
    assert "Prefix cache crossed a weight update" in got.sentence and "version 3" in got.sentence

    # prefix caching in general (fresh blocks, one side only) is a different finding
    fresh = record(
        "rollout",
        tokens,
        noisy(temp_only, 1e-2),
        temperature=0.7,
        weight_version=4,
        path={"prefix_cached_tokens": 6},
    )
    general = compare_sample(
        trainer,
        fresh,
        trainer_manifests=[manifest("trainer")],
        rollout_manifests=[manifest("rollout", prefix_caching=True)],
    ).diagnosis
    assert general.kind == "inference_path" and general.evidence["cause"] == "path_differs"
    assert "crossed" not in general.sentence


# -------------------------------------------------------------- silent stale weights (item 2)


def test_same_claimed_version_with_different_held_weights_names_the_tensors() -> None:
    tokens, _, temp_only, _ = sampled()
    trainer = record("trainer", tokens, temp_only, temperature=0.7, weight_version=7)
    rollout = record("rollout", tokens, noisy(temp_only, 1e-2), temperature=0.7, weight_version=7)
    held = {
        "model.embed_tokens.weight": "aa",
        "model.layers.0.mlp.down_proj.weight": "bb",
        "lm_head.weight": "cc",
    }
    synced = factories.manifest("trainer", weight_version="7", weight_tensor_digests=held)
    partial = factories.manifest(
        "rollout",
        "engine_prefill",
        weight_version="7",
        weight_tensor_digests={**held, "model.layers.0.mlp.down_proj.weight": "stale"},
    )
    older = factories.manifest("rollout", "engine_prefill", weight_version="6", weight_tensor_digests=held)
    got = compare_sample(
        trainer, rollout, trainer_manifests=[synced], rollout_manifests=[partial, older]
    ).diagnosis
    assert got.kind == "weights" and got.evidence["cause"] == "held_weights_differ"
    assert got.evidence["differing_tensors"] == ["model.layers.0.mlp.down_proj.weight"]
    assert "both claim weight version 7" in got.sentence and "down_proj" in got.sentence

    # control: the engine holds what the trainer holds
    fine = factories.manifest("rollout", "engine_prefill", weight_version="7", weight_tensor_digests=held)
    control = compare_sample(trainer, rollout, trainer_manifests=[synced], rollout_manifests=[fine]).diagnosis
    assert control.kind != "weights"


def test_held_digests_of_another_dtype_are_a_precision_difference_not_stale_weights() -> None:
    """An fp32 lm_head against a bf16 one: their digests differ because the dtypes do; only tensors
    held alike are compared (and a differing one of those still names the tensor)."""
    tokens, _, temp_only, _ = sampled()
    trainer = record("trainer", tokens, temp_only, temperature=0.7, weight_version=7)
    rollout = record("rollout", tokens, noisy(temp_only, 1e-2), temperature=0.7, weight_version=7)
    held = {"model.embed_tokens.weight": "bfloat16[512,128]:00000000000000aa"}
    tm = factories.manifest(
        "trainer",
        weight_version="7",
        weight_tensor_digests={**held, "lm_head.weight": "float32[512,128]:1111111111111111"},
        runtime={"lm_head_dtype": "float32", "dtype": "bfloat16"},
    )
    rm = factories.manifest(
        "rollout",
        "engine_prefill",
        weight_version="7",
        weight_tensor_digests={**held, "lm_head.weight": "bfloat16[512,128]:2222222222222222"},
        runtime={"lm_head_dtype": "bfloat16", "dtype": "bfloat16"},
    )
    got = compare_sample(trainer, rollout, trainer_manifests=[tm], rollout_manifests=[rm]).diagnosis
    assert got.kind != "weights"
    assert got.evidence.get("precision", {}).get("field") == "runtime.lm_head_dtype"
    stale = rm.model_copy(
        update={
            "weight_tensor_digests": {
                **rm.weight_tensor_digests,
                "model.embed_tokens.weight": "bfloat16[512,128]:bb",
            }
        }
    )
    got = compare_sample(trainer, rollout, trainer_manifests=[tm], rollout_manifests=[stale]).diagnosis
    assert got.kind == "weights" and got.evidence["differing_tensors"] == ["model.embed_tokens.weight"]
    assert got.evidence["not_comparable"] == ["lm_head.weight"]


def test_an_embedding_that_differs_means_the_weights_differ() -> None:
    tokens, _, temp_only, _ = sampled()
    trainer = record("trainer", tokens, temp_only, temperature=0.7, weight_version=7)
    rollout = record("rollout", tokens, noisy(temp_only, 1e-2), temperature=0.7, weight_version=7)
    embed_t = factories.fingerprints(trainer, "embed", seed=3)
    embed_r = factories.fingerprints(rollout, "embed", "engine_prefill", seed=3)
    embed_r.digest = embed_r.digest.copy()
    embed_r.digest[PROMPT + 2] ^= np.uint64(1)  # one looked-up row differs
    got = compare_sample(trainer, rollout, [embed_t], [embed_r]).diagnosis
    assert got.kind == "weights" and got.evidence["cause"] == "embedding_differs"
    assert got.evidence["positions"] == [PROMPT + 2]

    # a different compute dtype changes looked-up values without different weights: not "weights"
    dtype = compare_sample(
        trainer,
        rollout,
        [embed_t],
        [embed_r],
        trainer_manifests=[manifest("trainer", dtype="float32")],
        rollout_manifests=[manifest("rollout", dtype="bfloat16")],
    ).diagnosis
    assert dtype.kind == "numerical" and dtype.evidence["cause"] == "precision"


# --------------------------------------------------------------- off-policy by design (item 6)


def lagged(trainer_version: int, spans: list[tuple[int, int]]) -> tuple[SampleLogprobs, SampleLogprobs]:
    tokens, _, temp_only, _ = sampled()
    trainer = record("trainer", tokens, temp_only, temperature=0.7, weight_version=trainer_version)
    rollout = record(
        "rollout",
        tokens,
        noisy(temp_only, 2e-2),
        temperature=0.7,
        weight_version=spans[0][1],
        weight_spans=[WeightSpan(start=start, version=str(v)) for start, v in spans],
    )
    return trainer, rollout


@pytest.mark.parametrize(
    ("spans", "policy", "kind", "cause"),
    [
        ([(0, 4)], OffPolicy(max_staleness=1), "off_policy", "declared_lag"),
        ([(0, 4)], None, "weights", "undeclared_lag"),
        ([(0, 3)], OffPolicy(max_staleness=1), "weights", "lag_out_of_bounds"),
        ([(0, 6)], OffPolicy(max_staleness=1), "weights", "lag_out_of_bounds"),  # rollout newer
        (
            [(0, 4), (100, 5)],
            OffPolicy(max_staleness=1, in_flight_updates=True),
            "off_policy",
            "declared_lag",
        ),
        ([(0, 4), (100, 5)], OffPolicy(max_staleness=1), "weights", "lag_out_of_bounds"),
    ],
)
def test_a_declared_lag_is_off_policy_and_anything_else_stays_weights(spans, policy, kind, cause) -> None:
    trainer, rollout = lagged(5, spans)
    [got] = compare_samples([(trainer, rollout)], policy=policy)
    assert got.diagnosis.kind == kind and got.diagnosis.evidence["cause"] == cause, got.diagnosis.sentence
    if kind == "off_policy":
        assert "off-policy by design" in got.diagnosis.sentence


def test_policy_lag_is_reported_per_step_and_metrics_are_sliced_by_lag() -> None:
    trainer, rollout = lagged(5, [(0, 4), (100, 5)])  # tokens 0..99 one version behind, the rest current
    pairs = [(trainer, rollout)]
    comparisons = compare_samples(pairs, policy=OffPolicy(max_staleness=1, in_flight_updates=True))
    assert comparisons[0].metrics["policy_lag_max"] == 1 and comparisons[0].metrics["policy_lag_min"] == 0
    metrics = step_summary(pairs, comparisons)["metrics"]
    assert metrics["policy_lag_max"] == 1.0 and metrics["off_policy_token_fraction"] == pytest.approx(100 / N)
    assert metrics["n_tokens/lag_1"] == 100 and metrics["n_tokens/lag_0"] == N - 100
    assert metrics["kl_k3/lag_1"] >= 0 and metrics["kl_k3/lag_0"] >= 0


def test_the_clean_control_is_clean_even_off_policy() -> None:
    tokens, _, temp_only, _ = sampled()
    trainer = record("trainer", tokens, temp_only, temperature=0.7, weight_version=5)
    rollout = record("rollout", tokens, temp_only.copy(), temperature=0.7, weight_version=4)
    [got] = compare_samples([(trainer, rollout)], policy=OffPolicy(max_staleness=1))
    assert got.diagnosis.kind == "clean"


def test_the_run_declares_its_policy_in_its_config() -> None:
    run = factories.run(config={"off_policy": {"max_staleness": 2, "in_flight_updates": True}})
    from isoaudit.audit.records import off_policy_of

    assert off_policy_of(run.config) == OffPolicy(max_staleness=2, in_flight_updates=True)
    assert off_policy_of(factories.run().config) is None
    with pytest.raises(ValueError, match="config.off_policy.max_staleness"):
        factories.run(config={"off_policy": {"max_staleness": "one"}})
    with pytest.raises(ValueError, match="weight_spans: span 1 starts at 0"):
        lagged(5, [(0, 4), (0, 5)])
