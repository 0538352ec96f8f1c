"""A step's per-token quantities reduced per sample in one pass over blocks of whole samples
(``audit.metrics.blocks``): the same reductions whatever the blocks and the threads; samples whose
sides mostly agree bitwise reduce their differing tokens and count the others' common value, the
counts and extremes exactly, the sums within rounding."""

from __future__ import annotations

import time

import numpy as np
import pytest
from isoaudit.audit.frameworks.base import STANDARD
from isoaudit.audit.metric_names import required_variants
from isoaudit.audit.metrics import blocks, core
from isoaudit.audit.metrics.blocks import QUANTITIES, Block, TokenBlocks, at_agreeing
from isoaudit.audit.summaries import POSITION_REDUCTIONS


def mixed_step(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples that agree everywhere, on most tokens, on few, and empty ones."""
    rng = np.random.default_rng(seed)
    lengths = [0, 700, 1, 300, 2000, 5, 0, 900, 64]
    share = [0.0, 0.3, 0.0, 0.0, 0.3, 1.0, 0.0, 0.9, 0.45]  # of tokens whose sides differ
    t, r = [], []
    for n, p in zip(lengths, share, strict=True):
        trainer = (-rng.exponential(1.0, n)).astype(np.float32)
        noise = (rng.random(n) < p) * rng.normal(0, 1e-2, n)
        t.append(trainer)
        r.append(np.minimum(trainer + noise, 0).astype(np.float32))
    return np.concatenate(t), np.concatenate(r), np.concatenate([[0], np.cumsum(lengths)])


def every_reduction(t: np.ndarray, r: np.ndarray, o: np.ndarray, **kwargs: int) -> dict:
    """What the worker measures of a step: the per-sample statistics, threshold figures, the
    frameworks' reductions and the position bins' segments."""
    measured = TokenBlocks(t, r, o, **kwargs)
    core.sample_and_step_metrics(
        t, r, o, variants=required_variants(), blocks=measured, also=[*STANDARD, *POSITION_REDUCTIONS]
    )
    return dict(measured._done)


def bits(values: dict) -> dict:
    return {key: value.tobytes() for key, value in values.items()}


def test_blocks_and_threads_do_not_change_a_reduction() -> None:
    t, r, o = mixed_step()
    whole = bits(every_reduction(t, r, o, block_tokens=1 << 30))
    assert bits(every_reduction(t, r, o, block_tokens=1)) == whole
    measured = TokenBlocks(t, r, o, block_tokens=600)
    measured.measure(every_reduction(t, r, o).keys(), threads=3)
    assert bits(measured._done) == whole


def test_samples_that_mostly_agree_count_their_agreeing_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    t, r, o = mixed_step(1)
    split = every_reduction(t, r, o)
    monkeypatch.setattr(blocks, "SHARED_BELOW", 0.0)  # every token of every sample, one by one
    dense = every_reduction(t, r, o)
    assert split.keys() == dense.keys()
    moved = 0
    for key, value in split.items():
        other = dense[key]
        if value.dtype.kind in "iub" or key[0] in ("max", "min", "first"):
            assert value.tobytes() == other.tobytes(), key  # counts and extremes exactly
            continue
        moved += value.tobytes() != other.tobytes()
        np.testing.assert_allclose(value, other, rtol=1e-13, atol=1e-300, err_msg=str(key))
    assert moved  # the sums did take the other order: this test would see it go wrong


@pytest.mark.parametrize("name", sorted(QUANTITIES))
def test_a_quantity_found_constant_where_the_sides_agree_is(name: str) -> None:
    """``at_agreeing``'s value is the quantity's on agreeing tokens of any logprob."""
    constant = at_agreeing(name)
    if constant is None:
        return
    rng = np.random.default_rng(2)
    logprobs = np.concatenate([-rng.exponential(3.0, 500), [-0.0, -1e-30, -80.0]]).astype(np.float32)
    probe = Block(logprobs.astype(np.float64), logprobs.astype(np.float64), np.array([logprobs.size]),
                  (logprobs, logprobs), True)  # fmt: skip
    probe.shared["agreeing"] = None
    with np.errstate(all="ignore"):
        values = probe[name]
    assert np.all(values == constant) and np.all(np.signbit(values) == np.signbit(constant)), name


def test_a_quantity_of_the_logprobs_themselves_is_not_constant() -> None:
    for name in ("t", "r", "exp_t", "exp_r", "core_pr", "nemo_js"):
        assert at_agreeing(name) is None, name


def test_own_load_counts_this_process_busy_cores() -> None:
    wall, cpu = time.monotonic(), time.process_time()
    own = blocks._OwnLoad()
    while time.monotonic() - wall < 1.2:  # busy for over a second (a core's worth, on an idle machine)
        sum(range(1000))
    busy = (time.process_time() - cpu) / (time.monotonic() - wall)  # what it got of a core, load or not
    assert busy > 0.2 and abs(own() - busy) < 0.05
    idle = blocks._OwnLoad()
    time.sleep(1.1)
    assert idle() < 0.2


@pytest.mark.parametrize(
    ("load", "own", "threads"), [(1.0, 1.0, 2), (2.0, 1.0, 1), (1.0, 0.0, 1), (0.1, 0.0, 2)]
)
def test_idle_threads_leaves_this_process_own_load_out(
    load: float, own: float, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    monkeypatch.setattr(blocks.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(blocks, "_own_load", lambda: own)
    assert blocks.idle_threads() == threads
