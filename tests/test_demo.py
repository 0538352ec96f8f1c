"""``make demo`` end to end (shortened): native steps mismatch and are localised; once the control API
switches the run to ``invariant``, both sides compute the same bits."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (the kernels extra)"
)


@pytest.mark.slow
def test_demo_mismatch_then_remediation(tmp_path):
    from collectors.demo import main

    rows = main(
        [
            "--steps",
            "3",
            "--switch-at",
            "1",
            "--samples",
            "3",
            "--database-url",
            f"sqlite:///{tmp_path / 'demo.db'}",
            "--model-dir",
            str(tmp_path / "model"),
        ]
    )
    native, invariant = rows[0], rows[-1]
    assert native["mode"] == "native" and native["metrics"]["exact_match_fraction"] < 1.0
    assert native["diagnoses"] == ["numerical"] and all(f.startswith("layers.") for f in native["first"])
    assert invariant["mode"] == "invariant"
    assert (
        invariant["metrics"]["logprob_abs_diff_mean"] == 0.0
        and invariant["metrics"]["exact_match_fraction"] == 1.0
    )
    assert invariant["diagnoses"] == ["clean"]
