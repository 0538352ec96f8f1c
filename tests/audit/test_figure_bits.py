"""Stored figures keep their bits: every era of every framework, at every fixture's settings, on
the parity inputs and on a larger step (clamped ratios, an empty sample, two ranks), the threshold
figures (at their defaults, at :data:`THRESHOLD_VARIANTS` and on :func:`threshold_edge_steps`) and
the position bins, against the values the comparator stored before those figures were restructured
(``tests/fixtures/figure_bits.json``: per case, the SHA-256 of its figures' float hex). The parity
tests allow 1e-6; stored figures must not move at all.

The bits of ``np.exp`` and ``np.log`` depend on the machine: numpy runs its own AVX-512F code where
the CPU has it and the C library's elsewhere. So the golden holds one set of digests per math
library (:func:`math_library`), each recorded from the same code; a machine with neither is
skipped, saying so. Record a new machine's set (``python tests/audit/test_figure_bits.py``) only
from a commit whose figures pass on a recorded one. The shared arrays are read-only: a framework writing into one would change
another's figures."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from isoaudit.audit.frameworks import StepTokens, framework_figures, framework_table
from isoaudit.audit.metrics.core import threshold_figures
from isoaudit.audit.metrics.families import BAND_FAMILY, RS_OPTIONS, TIS_FAMILY, TokenView
from isoaudit.audit.records import SampleLogprobs
from isoaudit.audit.summaries import position_bins

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_framework_parity import FIXTURE_FILES, INPUTS, step_tokens  # noqa: E402

GOLDEN = HERE.parents[0] / "fixtures" / "figure_bits.json"


def large_step() -> StepTokens:
    rng = np.random.default_rng(41)
    lengths = [int(n) for n in rng.integers(1, 400, 40)]
    lengths[7] = 0
    trainer = [(-rng.exponential(1.0, n)).astype(np.float32) for n in lengths]
    rollout = [t + rng.normal(0, 0.05, t.size).astype(np.float32) for t in trainer]
    rollout[3][:5] -= 25.0  # |Δ| over verl's and slime's safety bound of 20
    rollout[11][2] += 30.0
    return StepTokens.of(
        trainer,
        rollout,
        advantages=[float(a) for a in rng.normal(0, 1, len(lengths))],
        ranks=[i % 2 for i in range(len(lengths))],
    )


def long_step() -> StepTokens:
    """Samples of thousands of tokens, one of them empty, with clamped ratios: their sums are the
    rows of a padded block (``StepTokens.sample_sums``)."""
    rng = np.random.default_rng(43)
    lengths = [3000, 0, 2400, 2800, 3000, 2600]
    trainer = [(-rng.exponential(1.0, n)).astype(np.float32) for n in lengths]
    rollout = [t + rng.normal(0, 0.05, t.size).astype(np.float32) for t in trainer]
    rollout[0][:3] -= 25.0
    return StepTokens.of(
        trainer,
        rollout,
        advantages=[float(a) for a in rng.normal(0, 1, len(lengths))],
        ranks=[i % 2 for i in range(len(lengths))],
    )


def large_pairs(non_finite: bool) -> list[tuple[SampleLogprobs, SampleLogprobs]]:
    """A step's pairs: lengths across several position bins (and past 4,096), an empty sample, ties
    of the largest |Δ| between samples, and (``non_finite``) -inf logprobs."""
    rng = np.random.default_rng(7)
    pairs = []
    for i, n in enumerate([5000, 0, 17, 300, 1, 1100, 4097, 64, 64, 2000]):
        t = (-rng.exponential(1.0, n)).astype(np.float32)
        r = np.minimum(t + rng.normal(0, 0.05, n).astype(np.float32), 0)
        if n > 40:
            r[40] = t[40] - 3.0  # the same largest |Δ| in position bin 2 of several samples
        common = dict(run_id="r", step=0, prompt_len=1, token_ids=np.arange(i, n + 1 + i, dtype=np.int32))
        pairs.append(
            (
                SampleLogprobs(side="trainer", logprobs=t, **common),
                SampleLogprobs(side="rollout", logprobs=r, **common),
            )
        )
        if non_finite and n > 10:  # as an engine's -inf logprob reaches the comparison unvalidated
            r = r.copy()
            r[i % 7] = -np.inf
            pairs[-1] = (pairs[-1][0], pairs[-1][1].model_copy(update={"logprobs": r}))
    return pairs


#: Threshold figures away from their defaults: per-sample aggregation, caps and bounds near 1 (where
#: most tokens sit on either side), inverted and empty bounds, bands of 0, >= 1 and < 0.
THRESHOLD_VARIANTS: list[str] = [
    "is_fraction_high[upper=1.01,aggregate=sample]",
    "is_fraction_low[lower=0.99,aggregate=sample]",
    "is_oob_fraction[lower=0.9,upper=1.1,aggregate=sample]",
    "is_oob_fraction[lower=2,upper=0.5]",
    "is_seq_fraction_high[upper=1.001]",
    "is_seq_fraction_low[lower=0.999]",
    "geo_oob_seq_fraction[lower=0.99,upper=1.01]",
    *(f"{name}[cap={cap:g}]" for name in TIS_FAMILY for cap in (0.5, 1.0, 1.05)),
    *(
        f"rs_{option}_{what}[{bounds}]"
        for option in RS_OPTIONS
        for what in ("masked_fraction", "seq_masked_fraction")
        for bounds in (
            ("lower=0.95,upper=1.05", "lower=1.5,upper=0.5")
            if option.endswith("k1")
            else ("upper=0.0001", "upper=0.003", "upper=0")
        )
    ),
    *(f"{name}[band={band:g}]" for name in BAND_FAMILY for band in (0.0, 0.02, 1.0, 1.5, -1.0)),
]


def threshold_edge_steps() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Steps at the edges of the threshold figures: identical sides, one token, empty samples only,
    and every token beyond the ±20 bound."""
    rng = np.random.default_rng(3)
    t = (-rng.exponential(1.0, 300)).astype(np.float32)
    offsets = np.array([0, 0, 100, 100, 300])
    return {
        "identical": (t, t.copy(), offsets),
        "one_token": (t[:1], t[:1] - np.float32(0.25), np.array([0, 1])),
        "empty": (t[:0], t[:0], np.array([0, 0, 0])),
        "clamped": (t, t - np.float32(30.0) * np.sign(rng.normal(size=300)).astype(np.float32), offsets),
    }


def digest(figures: dict[str, Any]) -> str:
    """SHA-256 of the figures' names and exact values (lists of numbers, None and keys too)."""

    def exact(v: Any) -> str:
        if isinstance(v, list):
            return "[" + ",".join(exact(x) for x in v) + "]"
        return float(v).hex() if isinstance(v, float | int | np.floating) else repr(v)

    text = "\n".join(f"{k}={exact(v)}" for k, v in sorted(figures.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def figures_bits() -> dict[str, str]:
    """{case: digest} of every fixture's era and settings on each input, and of every framework at
    once on one shared step."""
    steps = {name: step_tokens(samples) for name, samples in INPUTS.items()}
    out: dict[str, str] = {}
    with np.errstate(all="ignore"):
        for path in FIXTURE_FILES:
            fixture = json.loads(path.read_text())
            table = framework_table(fixture["framework"])
            era = table.era(fixture["version"])
            settings, _ = table.settings_of(era, fixture["settings"])
            for name in [*fixture["values"], "large", "long"]:
                tokens = (
                    {"large": large_step, "long": long_step}[name]()
                    if name in ("large", "long")
                    else steps[name]
                )
                try:
                    got = era.compute(tokens, settings)
                except ValueError:
                    continue
                out[f"{path.parent.name}/{path.stem}/{name}"] = digest(got)
    out["all/large"] = digest(framework_figures(large_step()))
    out["all/long"] = digest(framework_figures(long_step()))
    for non_finite in (False, True):
        pairs = large_pairs(non_finite)
        out[f"position_bins/{non_finite}"] = digest(position_bins(pairs))
        t = np.concatenate([p[0].logprobs for p in pairs])
        r = np.concatenate([p[1].logprobs for p in pairs])
        offsets = np.concatenate([[0], np.cumsum([p[0].logprobs.size for p in pairs])])
        out[f"threshold_figures/{non_finite}"] = digest(threshold_figures(TokenView(t, r, offsets), []))
        view = TokenView(t, r, offsets)
        out[f"threshold_variants/{non_finite}"] = digest(threshold_figures(view, THRESHOLD_VARIANTS))
    for name, (t, r, offsets) in threshold_edge_steps().items():
        out[f"threshold_figures/{name}"] = digest(
            threshold_figures(TokenView(t, r, offsets), THRESHOLD_VARIANTS)
        )
    return out


def math_library() -> str:
    """Which code computes numpy's float64 ``exp`` and ``log`` here: ``avx512f`` (numpy's own, on a
    CPU with AVX-512F) or the C library (``glibc-2.36``)."""
    from numpy._core import _multiarray_umath as umath

    if umath.__cpu_features__.get("AVX512F") and "AVX512F" in umath.__cpu_dispatch__:
        return "avx512f"
    name, version = platform.libc_ver()
    return f"{name}-{version}"


def test_framework_figures_keep_their_bits() -> None:
    library = math_library()
    recorded: dict[str, dict[str, Any]] = json.loads(GOLDEN.read_text())
    if library not in recorded:
        pytest.skip(f"no figures recorded for numpy's math on {library} (recorded: {sorted(recorded)})")
    expected = recorded[library]
    got = figures_bits()
    assert set(got) == set(expected)
    wrong = sorted(case for case, value in expected.items() if got[case] != value)
    assert not wrong, f"{len(wrong)} cases changed: {wrong[:10]}"


@pytest.mark.parametrize("lengths", [[2000, 0, 1500, 1900, 1100], [1500] * 4, [3000, 2, 5, 2000], [0, 0]])
def test_sample_sums_add_each_sample_as_numpy_does(lengths: list[int]) -> None:
    """Per-sample sums (``StepTokens.sample_sums``, and the blocks' sums a framework reads) depend on
    the sample's own tokens only: bit for bit ``np.add.reduceat`` of the sample alone (its first
    token, then numpy's pairwise sum of the rest), zeros' signs, infinities and NaN included, 0.0
    for an empty sample; so a step's blocks add its samples up as one pass over the step would."""
    rng = np.random.default_rng(5)
    trainer = [rng.normal(0, 1, n).astype(np.float32) for n in lengths]
    rollout = [t - rng.normal(0, 1e-3, t.size).astype(np.float32) for t in trainer]
    tokens = StepTokens.of(trainer, rollout)
    values = rng.normal(0, 1, tokens.n_tokens) * 10.0 ** rng.integers(-8, 8, tokens.n_tokens)
    if tokens.n_tokens:
        values[tokens.offsets[2] : tokens.offsets[3]] = -0.0  # a sum of negative zeros
        values[tokens.offsets[1]] = np.inf
        values[tokens.offsets[3] + 1] = np.nan
    expected = by_sample(values, tokens.offsets)
    got = tokens.sample_sums(values)
    assert [float(x).hex() for x in got] == [float(x).hex() for x in expected]
    assert all(np.signbit(got) == np.signbit(expected))
    by_hand = by_sample(tokens.trainer - tokens.rollout, tokens.offsets)
    assert [float(x).hex() for x in tokens.blocks.sums("d")] == [float(x).hex() for x in by_hand]


def by_sample(values: np.ndarray, offsets: np.ndarray) -> list[float]:
    """Each sample's values summed alone (a copy, away from its neighbours); 0.0 if empty."""
    spans = zip(offsets[:-1], offsets[1:], strict=True)
    return [np.add.reduceat(values[a:b].copy(), [0])[0] if b > a else 0.0 for a, b in spans]


def test_shared_step_arrays_are_read_only() -> None:
    tokens = large_step()
    framework_figures(tokens)
    names = ("delta", "p_trainer", "p_rollout", "exp_delta", "abs_delta", "exp_abs_delta", "k3", "delta_sums")
    shared = [getattr(tokens, name) for name in names]
    shared += [tokens.clamped_delta(20.0), tokens.exp_clamped_delta(20.0)]
    for array in shared:
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0.0


if __name__ == "__main__":  # record this machine's math library: python tests/audit/test_figure_bits.py
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    recorded[math_library()] = figures_bits()
    GOLDEN.write_text(json.dumps(recorded, indent=0, sort_keys=True) + "\n")
