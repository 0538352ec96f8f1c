"""The comparator and the diagnosis, built from records: each DESIGN.md class from a case that causes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from isoaudit.audit.compare import compare_sample
from isoaudit.audit.grid import DIFFERS, EQUAL, NOT_OBSERVED, RegionGrid, compare_fingerprints
from isoaudit.audit.records import RuntimeFacts, SampleLogprobs
from isoaudit.audit.regions import canonical_regions

from tests import factories
from tests.audit.causal_stack import run_stack


def sampled_pair(
    temperature: float = 0.7, n: int = 64, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens sampled at ``temperature`` from random logits; their raw and processed logprobs."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 200, generator=generator) * 3
    processed_all = torch.log_softmax(logits / temperature, -1)
    tokens = torch.multinomial(processed_all.exp(), 1, generator=generator).squeeze(1)
    raw = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    processed = processed_all.gather(1, tokens[:, None]).squeeze(1)
    return tokens.numpy().astype(np.int32), raw.numpy(), processed.numpy()


def record(side: str, tokens: np.ndarray, logprobs: np.ndarray, prompt: int = 8, **fields) -> SampleLogprobs:
    prompt_ids = np.arange(prompt, dtype=np.int32)
    return SampleLogprobs(
        run_id="run-1",
        step=0,
        side=side,
        prompt_len=prompt,
        token_ids=np.concatenate([prompt_ids, tokens]),
        logprobs=logprobs.astype(np.float32),
        **fields,
    )


def test_identical_sides_are_clean_with_zero_kl():
    tokens, _, processed = sampled_pair()
    result = compare_sample(record("trainer", tokens, processed), record("rollout", tokens, processed))
    assert result.diagnosis.kind == "clean"
    assert result.metrics["kl_k3"] == 0.0 and result.metrics["bitwise_mismatch_count"] == 0


def test_raw_against_processed_under_temperature_is_semantics():
    tokens, raw, processed = sampled_pair(temperature=0.7, n=512)
    trainer = record("trainer", tokens, processed, temperature=0.7)
    result = compare_sample(trainer, record("rollout", tokens, raw, temperature=0.7, semantics="raw"))
    assert result.diagnosis.kind == "semantics"
    assert "raw" in result.diagnosis.sentence and "temperature=0.7" in result.diagnosis.sentence
    # Mislabelled (both say "processed"): the systematic offset still gives it away.
    result = compare_sample(trainer, record("rollout", tokens, raw, temperature=0.7))
    assert result.diagnosis.kind == "semantics"
    assert result.diagnosis.evidence["mean_delta"] > 0


def test_small_unbiased_noise_at_temperature_is_not_semantics():
    tokens, _, processed = sampled_pair(temperature=0.7, n=512)
    noisy = np.minimum(processed + np.random.default_rng(0).normal(0, 2e-3, processed.size), 0)
    result = compare_sample(
        record("trainer", tokens, processed, temperature=0.7),
        record("rollout", tokens, noisy, temperature=0.7),
    )
    assert result.diagnosis.kind == "inconclusive"  # no fingerprints: it cannot be located
    assert "rollout" in result.diagnosis.sentence or "trainer" in result.diagnosis.sentence


def test_different_weight_versions_is_weights():
    tokens, _, processed = sampled_pair()
    result = compare_sample(
        record("trainer", tokens, processed, weight_version=8),
        record("rollout", tokens, processed * 1.01, weight_version=7),
    )
    assert result.diagnosis.kind == "weights"
    evidence = result.diagnosis.evidence
    assert evidence["trainer_weight_version"] == "8" and evidence["rollout_weight_version"] == "7"
    assert evidence["policy_lag_max"] == 1 and evidence["cause"] == "undeclared_lag"
    assert evidence["logprob_abs_diff_mean"] == result.metrics["logprob_abs_diff_mean"]


def test_prefix_caching_on_one_side_is_inference_path():
    tokens, _, processed = sampled_pair()
    trainer_manifest = factories.manifest("trainer", runtime=RuntimeFacts(framework="torch"))
    rollout_manifest = factories.manifest(
        "rollout", "engine_prefill", runtime=RuntimeFacts(framework="vllm", prefix_caching=True)
    )
    result = compare_sample(
        record("trainer", tokens, processed),
        record("rollout", tokens, processed * 1.001),
        trainer_manifests=[trainer_manifest],
        rollout_manifests=[rollout_manifest],
    )
    assert result.diagnosis.kind == "inference_path"
    assert "prefix_caching" in result.diagnosis.sentence


def test_perturbed_layer2_mlp_is_numerical_with_first_divergence_there():
    tokens, _, processed = sampled_pair(n=24)
    trainer = record("trainer", tokens, processed)
    rollout = record("rollout", tokens, processed * 1.001)
    trainer_prints = run_stack(trainer, "trainer")
    rollout_prints = run_stack(rollout, "rollout", perturb=("layers.2.mlp", 13))
    result = compare_sample(trainer, rollout, trainer_prints, rollout_prints)
    assert result.diagnosis.kind == "numerical"
    assert result.first_divergence == ("layers.2.mlp", 13)
    assert "layers.2.mlp" in result.diagnosis.sentence
    grid = result.grid
    regions = canonical_regions(4)
    assert grid.regions == regions
    first_row = regions.index("layers.2.mlp")
    # Everything before the injection agrees; the injected row differs only at 13; later rows differ
    # from 13 on (causal spread) and agree before it.
    assert (grid.state[:first_row] == EQUAL).all()
    assert grid.state[first_row].tolist() == [
        DIFFERS if p == 13 else EQUAL for p in range(grid.positions.size)
    ]
    assert (grid.state[first_row + 1 :, :13] == EQUAL).all() and (
        grid.state[first_row + 1 :, 13] == DIFFERS
    ).all()
    assert result.grid.origins[0] == ("layers.2.mlp", 13)
    assert np.isfinite(grid.rel_l2[first_row, 13]) and grid.rel_l2[first_row, 13] > 0


def test_bitwise_equal_regions_report_nothing():
    tokens, _, processed = sampled_pair(n=16)
    trainer, rollout = record("trainer", tokens, processed), record("rollout", tokens, processed)
    grid = compare_fingerprints(run_stack(trainer, "trainer"), run_stack(rollout, "rollout"))
    assert grid.differing_cells() == [] and grid.origins == [] and not grid.has_unobserved()


def test_unobserved_region_is_never_equal_and_is_named():
    tokens, _, processed = sampled_pair(n=16)
    trainer, rollout = record("trainer", tokens, processed), record("rollout", tokens, processed * 1.001)
    rollout_prints = run_stack(
        rollout, "rollout", perturb=("layers.1.attn", 3), skip_regions=("layers.1.attn",)
    )
    result = compare_sample(trainer, rollout, run_stack(trainer, "trainer"), rollout_prints)
    grid = result.grid
    row = grid.regions.index("layers.1.attn")
    assert (grid.state[row] == NOT_OBSERVED).all()
    assert grid.not_observed_regions() == ["layers.1.attn"]
    # The divergence surfaces at the next observed region, with the unobserved one named as a caveat.
    assert result.diagnosis.kind == "numerical"
    assert result.first_divergence == ("layers.1.post_attn_norm", 3)
    assert "layers.1.attn" in result.diagnosis.sentence


def test_no_fingerprints_on_one_side_is_inconclusive_naming_it():
    tokens, _, processed = sampled_pair(n=16)
    trainer, rollout = record("trainer", tokens, processed), record("rollout", tokens, processed * 1.001)
    result = compare_sample(trainer, rollout, run_stack(trainer, "trainer"), [])
    assert result.diagnosis.kind == "inconclusive"
    assert "rollout" in result.diagnosis.sentence


def test_prefill_and_decode_rows_merge_by_position():
    tokens, _, processed = sampled_pair(n=12)
    trainer, rollout = record("trainer", tokens, processed), record("rollout", tokens, processed)
    full = run_stack(rollout, "rollout")
    split = []
    for r in full:
        for case, rows in (("engine_prefill", slice(0, 8)), ("engine_decode", slice(8, None))):
            split.append(
                r.model_copy(
                    update={
                        "case": case,
                        "positions": r.positions[rows],
                        "digest": r.digest[rows],
                        "ladder": r.ladder[rows],
                        "sketch": r.sketch[rows],
                        "l2": r.l2[rows],
                        "maxabs": r.maxabs[rows],
                    }
                )
            )
    grid = compare_fingerprints(run_stack(trainer, "trainer"), split)
    assert (grid.state == EQUAL).all()


def test_grid_json_round_trip():
    tokens, _, processed = sampled_pair(n=10)
    trainer, rollout = record("trainer", tokens, processed), record("rollout", tokens, processed)
    grid = compare_fingerprints(
        run_stack(trainer, "trainer"), run_stack(rollout, "rollout", perturb=("embed", 2))
    )
    again = RegionGrid.from_json(grid.to_json())
    assert (
        again.regions == grid.regions and (again.state == grid.state).all() and again.origins == grid.origins
    )


def test_pairs_with_different_tokens_are_refused():
    a, b = factories.sample("trainer", seed=1), factories.sample("rollout", seed=2)
    with pytest.raises(ValueError, match="sample_key"):
        compare_sample(a, b)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (
            {"prefix_cached_tokens": 0, "prefill_chunks": 1},
            "inconclusive",
        ),  # on, but not taken for this sample
        ({"prefix_cached_tokens": 16}, "inference_path"),
        ({"prefix_cached_tokens": 0, "prefill_chunks": 3}, "inference_path"),
    ],
)
def test_inference_path_blames_only_paths_the_sample_took(path, expected):
    tokens, _, processed = sampled_pair()
    engine = factories.manifest(
        "rollout",
        "engine_prefill",
        runtime=RuntimeFacts(framework="vllm", prefix_caching=True, chunked_prefill=True),
    )
    result = compare_sample(
        record("trainer", tokens, processed),
        record("rollout", tokens, processed * 1.001, path=path),
        trainer_manifests=[factories.manifest("trainer", runtime=RuntimeFacts(framework="torch"))],
        rollout_manifests=[engine],
    )
    assert result.diagnosis.kind == expected
    if expected == "inference_path":
        assert result.diagnosis.evidence["rollout_path"] == path


def test_sample_path_round_trips_through_the_store(store):
    sample = factories.sample("rollout", path={"prefix_cached_tokens": 7, "prefill_chunks": 2})
    store.ingest([sample])
    [got] = store.samples("run-1", 0)
    assert got.path == {"prefix_cached_tokens": 7, "prefill_chunks": 2}
