"""isoaudit.audit.metric_names: every framework figure listed here is an alias of one stored key, and the
comparator's step figures contain every key an alias reads."""

from __future__ import annotations

import numpy as np
import pytest
from isoaudit.audit import metric_names as names
from isoaudit.audit.compare import compare_samples, step_summary
from isoaudit.audit.metric_names import UnknownMetric, resolve

from tests import factories

#: The figures each framework logs, under its own names.
LISTED = {
    "verl": [
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/chi2_token",
        "rollout_corr/chi2_seq",
        "rollout_corr/log_ppl_diff",
        "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/log_ppl_diff_max",
        "rollout_corr/log_ppl_diff_min",
        "rollout_corr/ppl_ratio",
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_eff_sample_size",
        "rollout_corr/rollout_is_ratio_fraction_high",
        "rollout_corr/rollout_is_ratio_fraction_low",
        "rollout_corr/rollout_is_seq_mean",
        "rollout_corr/rollout_is_seq_fraction_high",
        "rollout_corr/rollout_rs_token_k1_masked_fraction",
        "rollout_corr/rollout_rs_token_k2_masked_fraction",
        "rollout_corr/rollout_rs_token_k3_masked_fraction",
        "rollout_corr/rollout_rs_seq_sum_k3_masked_fraction",
        "rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction",
        "rollout_corr/rollout_rs_seq_max_k3_masked_fraction",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_std",
    ],
    "slime": [
        "train_rollout_logprob_abs_diff",
        "mis_truncate_fraction",
        "mis_mask_fraction_low",
        "mis_k3_kl",
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
    "openrlhf": ["vllm_kl", "is_filter_ratio", "is_filter_ratio:icepop"],
    "nemo-rl": ["token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error"],
    "tinker": ["kl_sample_train_v1", "kl_sample_train_v2"],
    "prime-rl": ["mismatch_kl/all/mean", "kl_ent_ratio/mean"],
}


def test_every_listed_figure_is_an_alias_of_a_stored_key() -> None:
    assert set(LISTED) == set(names.FRAMEWORKS)
    for framework, aliases in LISTED.items():
        for alias in aliases:
            key = resolve(f"{framework}:{alias}")
            assert names.is_key(key), (framework, alias, key)
            assert names.definition(key) and "\n" not in names.definition(key)


def test_resolution_rules() -> None:
    assert resolve("kl_k3") == "kl_k3"
    assert resolve("verl:rollout_corr/k3_kl") == "kl_k3"
    assert resolve("kl_sample_train_v1") == "kl_k1"  # bare and unique
    assert resolve("optim/kl_sample_train_v2") == "kl_k2"  # a spelling it also logs under
    assert resolve("train/token_mult_prob_error") == "token_mult_prob_error"
    assert resolve("sampling/importance_sampling_ratio/mean") == "tis_mean[cap=3]"  # TRL's default cap
    assert resolve("mis_truncate_fraction") == "is_fraction_high[aggregate=sample]"
    assert resolve("kl_k3/len_0_256") == "kl_k3/len_0_256"
    assert resolve("kl_k3/lag_2") == "kl_k3/lag_2"
    assert resolve("tis_mean[cap=2.5]") == "tis_mean[cap=2.5]"
    assert resolve("rollout_corr/k3_kl", framework="verl") == "kl_k3"
    with pytest.raises(UnknownMetric, match="did you mean kl_k3"):
        resolve("kl_k33")
    with pytest.raises(UnknownMetric, match="framework"):
        names.framework_aliases("deepspeed-chat")


def test_ambiguous_bare_alias_asks_for_its_framework(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two frameworks logging one name for different figures: the bare name must be qualified."""
    other = names.Alias("slime", "vllm_kl", "kl_k3")
    monkeypatch.setitem(names._BY_BARE, "vllm_kl", [*names._BY_BARE["vllm_kl"], other])
    with pytest.raises(UnknownMetric, match="ambiguous.*openrlhf:vllm_kl.*slime:vllm_kl"):
        resolve("vllm_kl")
    assert resolve("openrlhf:vllm_kl") == "kl_k1"


def test_step_summary_carries_every_aliased_key() -> None:
    """The comparator computes each key some alias reads, so every framework's names are answered."""
    pairs = []
    for seed in range(3):
        trainer = factories.sample("trainer", seed=seed, weight_version=4)
        noisy = np.minimum(trainer.logprobs + np.float32(0.01 * (seed + 1)), 0).astype(np.float32)
        rollout = factories.sample("rollout", seed=seed, logprobs=noisy, weight_version=4)
        pairs.append((trainer, rollout))
    summary = step_summary(pairs, compare_samples(pairs))
    for alias in names.ALIASES:
        assert alias.key in summary["metrics"], alias
    verl = names.as_framework(summary["metrics"], "verl")
    assert verl["rollout_corr/k3_kl"] == summary["metrics"]["kl_k3"]
    assert summary["metrics"]["policy_lag_max"] == 0 and "kl_k3/lag_0" in summary["metrics"]


def test_select_keys_by_the_names_asked() -> None:
    metrics = {"kl_k3": 0.5, "kl_k1": 0.25}
    assert names.select(metrics, ["verl:rollout_corr/k3_kl", "kl_sample_train_v1", "kl_k2"]) == {
        "verl:rollout_corr/k3_kl": 0.5,
        "kl_sample_train_v1": 0.25,
    }
    with pytest.raises(UnknownMetric):
        names.select(metrics, ["no_such_metric"])


def test_selector_options_and_catalogue_cover_every_alias() -> None:
    options = names.selector_options()
    values = {o["value"] for o in options}
    assert {a.key for a in names.ALIASES} <= values
    assert all(o["label"] and o["title"] for o in options)
    kl = next(o for o in options if o["value"] == "kl_k3")
    assert "verl:rollout_corr/k3_kl" in kl["label"]
    rows = {row["key"]: row for row in names.catalogue()}
    assert rows["tis_mean[cap=3]"]["parameters"] == {"cap": 3.0}
    assert {a["framework"] for a in rows["kl_k1"]["aliases"]} >= {"verl", "tinker", "openrlhf"}
    assert set(names.accepted_names()) >= {a.qualified for a in names.ALIASES}
