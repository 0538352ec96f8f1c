"""isoaudit.audit.metric_names: the names users type resolve to the frameworks' own figures (stored
under ``framework:name`` keys) or to canonical metrics; the comparator stores every framework's
figures; steps stored before framework figures existed are read through the canonical metric a
figure equals."""

from __future__ import annotations

import numpy as np
import pytest
from isoaudit.audit import metric_names as names
from isoaudit.audit.compare import compare_samples, step_summary
from isoaudit.audit.frameworks import parse_declaration
from isoaudit.audit.metric_names import UnknownMetric, resolve

from tests import factories

#: Figures users know each framework by, under its own names (each must resolve to its own figure).
LISTED = {
    "verl": [
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/chi2_token",
        "rollout_corr/log_ppl_diff",
        "rollout_corr/ppl_ratio",
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_oob_ratio",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_std",
        "training/rollout_actor_probs_pearson_corr",
    ],
    "slime": [
        "train_rollout_logprob_abs_diff",
        "mis_k3_kl",
        "mis_tis_truncate_fraction",
        "mis_rs_mask_fraction_low",
    ],
    "skyrl": [
        "policy/rollout_train_logprobs_abs_diff_mean",
        "policy/rollout_train_logprobs_abs_diff_std",
        "policy/rollout_train_logprobs_abs_diff_max",
    ],
    "trl": [
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/max",
    ],
    "openrlhf": ["vllm_kl"],
    "nemo-rl": [
        "token_mult_prob_error",
        "gen_kl_error",
        "policy_kl_error",
        "js_divergence_error",
        "is_oob_ratio",
    ],
    "tinker": ["kl_sample_train_v1", "kl_sample_train_v2"],
    "prime-rl": ["mismatch_kl/all/mean", "is_masked/mean", "is_masked_low/mean", "is_masked_high/mean"],
}


def test_every_listed_figure_is_its_frameworks_own() -> None:
    assert set(LISTED) == set(names.FRAMEWORKS)
    for framework, aliases in LISTED.items():
        for alias in aliases:
            key = resolve(f"{framework}:{alias}")
            assert key == f"{framework}:{alias}" and names.is_key(key), (framework, alias, key)
            assert names.definition(key) and "\n" not in names.definition(key)


def test_names_without_a_definition_upstream_are_gone() -> None:
    """OpenRLHF logs no is_filter_ratio; PRIME-RL's kl_ent_ratio needs the full entropy."""
    for name in ("openrlhf:is_filter_ratio", "openrlhf:is_filter_ratio:icepop", "prime-rl:kl_ent_ratio/mean"):
        with pytest.raises(UnknownMetric):
            resolve(name)


def test_resolution_rules() -> None:
    assert resolve("kl_k3") == "kl_k3"
    assert resolve("verl:rollout_corr/k3_kl") == "verl:rollout_corr/k3_kl"
    assert resolve("kl_sample_train_v1") == "tinker:kl_sample_train_v1"  # bare and unique
    assert resolve("optim/kl_sample_train_v2") == "tinker:kl_sample_train_v2"  # a spelling it also logs
    assert resolve("train/token_mult_prob_error") == "nemo-rl:token_mult_prob_error"
    assert resolve("train/mis_k3_kl") == "slime:mis_k3_kl"
    assert resolve("kl_k3/len_0_256") == "kl_k3/len_0_256"
    assert resolve("kl_k3/lag_2") == "kl_k3/lag_2"
    assert resolve("tis_mean[cap=2.5]") == "tis_mean[cap=2.5]"
    assert resolve("rollout_corr/k3_kl", framework="verl") == "verl:rollout_corr/k3_kl"
    with pytest.raises(UnknownMetric, match="did you mean kl_k3"):
        resolve("kl_k33")
    with pytest.raises(UnknownMetric, match="framework"):
        names.framework_aliases("deepspeed-chat")


def test_ambiguous_bare_alias_asks_for_its_framework(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two frameworks logging one name for different figures: the bare name must be qualified."""
    other = names.Alias("slime", "vllm_kl", "slime:vllm_kl")
    monkeypatch.setitem(names._BY_BARE, "vllm_kl", [*names._BY_BARE["vllm_kl"], other])
    with pytest.raises(UnknownMetric, match="ambiguous.*openrlhf:vllm_kl.*slime:vllm_kl"):
        resolve("vllm_kl")
    assert resolve("openrlhf:vllm_kl") == "openrlhf:vllm_kl"


def _pairs() -> list:
    pairs = []
    for seed in range(3):
        trainer = factories.sample("trainer", seed=seed, weight_version=4)
        noisy = np.minimum(trainer.logprobs + np.float32(0.01 * (seed + 1)), 0).astype(np.float32)
        rollout = factories.sample("rollout", seed=seed, logprobs=noisy, weight_version=4)
        pairs.append((trainer, rollout))
    return pairs


def test_a_step_carries_every_frameworks_figures_at_their_defaults() -> None:
    pairs = _pairs()
    metrics = step_summary(pairs, compare_samples(pairs))["metrics"]
    verl = names.as_framework(metrics, "verl")
    assert verl["rollout_corr/k3_kl"] == pytest.approx(metrics["kl_k3"], rel=1e-6)
    assert "rollout_corr/rollout_is_mean" not in verl  # verl logs no IS figures unless rollout_is is set
    assert names.as_framework(metrics, "tinker")["kl_sample_train_v1"] == pytest.approx(metrics["kl_k1"])
    assert "slime:train_rollout_logprob_abs_diff" in metrics
    assert metrics["policy_lag_max"] == 0 and "kl_k3/lag_0" in metrics


def test_a_declared_release_and_settings_change_the_figures() -> None:
    pairs = _pairs()
    declared = parse_declaration("verl==0.9.0", {"rollout_is": "token", "rollout_is_threshold": 1.001})
    metrics = step_summary(pairs, compare_samples(pairs), framework=declared)["metrics"]
    assert "verl:rollout_corr/rollout_is_mean" in metrics
    assert metrics["verl:rollout_corr/rollout_is_max"] <= 1.001


def test_older_steps_are_read_through_the_canonical_metric_a_figure_equals() -> None:
    old_step = {"kl_k1": 0.25, "kl_k3": 0.5}
    assert names.as_framework(old_step, "tinker") == {"kl_sample_train_v1": 0.25}
    assert names.lookup(old_step, "tinker:kl_sample_train_v1") == 0.25
    assert names.lookup(old_step, "verl:rollout_corr/rollout_is_std") is None
    # a step with framework figures but not this one: the framework does not log it there
    assert names.lookup({**old_step, "verl:rollout_corr/kl": 0.25}, "openrlhf:vllm_kl") is None


def test_select_keys_by_the_names_asked() -> None:
    metrics = {"kl_k3": 0.5, "kl_k1": 0.25, "verl:rollout_corr/k3_kl": 0.5, "tinker:kl_sample_train_v1": 0.25}
    assert names.select(metrics, ["verl:rollout_corr/k3_kl", "kl_sample_train_v1", "kl_k2"]) == {
        "verl:rollout_corr/k3_kl": 0.5,
        "kl_sample_train_v1": 0.25,
    }
    with pytest.raises(UnknownMetric):
        names.select(metrics, ["no_such_metric"])


def test_selector_options_and_catalogue_cover_every_alias() -> None:
    options = names.selector_options()
    values = {o["value"] for o in options}
    assert {a.key for a in names.ALIASES if a.same_as is None} <= values
    assert all(o["label"] and o["title"] for o in options)
    kl = next(o for o in options if o["value"] == "kl_k1")
    assert "tinker:kl_sample_train_v1" in kl["label"]
    rows = {row["key"]: row for row in names.catalogue()}
    assert rows["tis_mean[cap=3]"]["parameters"] == {"cap": 3.0}
    assert {a["framework"] for a in rows["kl_k1"]["aliases"]} >= {"tinker", "openrlhf"}
    assert set(names.accepted_names()) >= {a.qualified for a in names.ALIASES}


def test_framework_catalogue_by_release() -> None:
    old = names.framework_catalogue("verl@0.6")
    new = names.framework_catalogue("verl")
    assert old["era"] == "0.6.1" and new["era"] == new["eras"][-1]["since"]
    assert [e["selected"] for e in old["eras"]].index(True) == 0
    assert "rollout_rs_threshold" in new["required"]
    with pytest.raises(ValueError, match="older than the oldest"):
        names.framework_catalogue("verl==0.1.0")
