"""The grammar of stored metric keys (audit.metrics.keys) and the families generated from one table
(audit.metrics.families): built and parsed in one place, round-tripping."""

from __future__ import annotations

import isoaudit.audit.metrics as metrics
from hypothesis import given
from hypothesis import strategies as st
from isoaudit.audit import metric_names
from isoaudit.audit.metrics import (
    LAG_SLICED,
    LENGTH_BUCKETS,
    METRIC_DESCRIPTIONS,
    PARAMETRIC,
    RS_OPTIONS,
    STEP_METRICS,
    TIS_FAMILY,
    lag_key,
    length_key,
    parse_lag_key,
    parse_length_key,
    parse_variant,
    variant_key,
)

numbers = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False).map(lambda x: float(f"{x:g}"))


@st.composite
def figures_at_parameters(draw: st.DrawFn) -> tuple[str, dict[str, float | str]]:
    name = draw(st.sampled_from(sorted(PARAMETRIC)))
    params: dict[str, float | str] = {}
    for key, default in PARAMETRIC[name].defaults.items():
        if draw(st.booleans()):
            params[key] = (
                draw(st.sampled_from(["token", "sample"])) if isinstance(default, str) else draw(numbers)
            )
    return name, params


@given(figures_at_parameters())
def test_a_variant_key_parses_back_to_its_figure_and_parameters(
    figure: tuple[str, dict[str, float | str]],
) -> None:
    name, params = figure
    key = variant_key(name, params)
    parsed_name, parsed = parse_variant(key)
    assert parsed_name == name
    assert parsed == {**PARAMETRIC[name].defaults, **params}
    assert variant_key(parsed_name, parsed) == key


@given(st.sampled_from(LAG_SLICED), st.integers(min_value=-(2**40), max_value=2**40))
def test_a_lag_key_parses_back(name: str, lag: int) -> None:
    assert parse_lag_key(lag_key(name, lag)) == (name, lag)


def test_every_step_metric_has_a_described_key_per_length_bucket() -> None:
    for name in STEP_METRICS:
        for bucket in LENGTH_BUCKETS:
            assert length_key(name, bucket) in METRIC_DESCRIPTIONS
            assert parse_length_key(length_key(name, bucket)) == (name, bucket)
            assert parse_lag_key(length_key(name, bucket)) is None


def test_keys_of_other_grammars_are_not_length_slices() -> None:
    assert parse_length_key("kl_k3") is None
    assert parse_length_key(lag_key("kl_k3", 1)) is None
    assert parse_length_key("tis_mean[cap=3]") is None


def test_families_are_generated_from_their_tables() -> None:
    assert all(PARAMETRIC[name].defaults == {"cap": 2.0} for name in TIS_FAMILY)
    assert {
        f"rs_{o}_{kind}" for o in RS_OPTIONS for kind in ("masked_fraction", "seq_masked_fraction")
    } <= set(PARAMETRIC)
    standing = [k for k in metric_names.required_variants() if k.startswith("tis_")]
    assert standing and all(parse_variant(k)[0] in TIS_FAMILY for k in standing)


def test_the_package_exports_every_public_name() -> None:
    assert all(hasattr(metrics, name) for name in metrics.__all__)
