"""Small builders of valid records for tests."""

from __future__ import annotations

import numpy as np
from isoaudit.audit.records import Manifest, RegionFingerprints, RegionFingerprintsBlock, Run, SampleLogprobs


def sample(
    side: str = "trainer",
    *,
    run_id: str = "run-1",
    step: int = 0,
    prompt_len: int = 4,
    n_completion: int = 6,
    seed: int = 0,
    logprobs: np.ndarray | None = None,
    **fields,
) -> SampleLogprobs:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, prompt_len + n_completion).astype(np.int32)
    if logprobs is None:
        logprobs = -rng.random(n_completion).astype(np.float32)
    return SampleLogprobs(
        run_id=run_id,
        step=step,
        side=side,
        prompt_len=prompt_len,
        token_ids=tokens,
        logprobs=logprobs,
        **fields,
    )


def fingerprints(
    record: SampleLogprobs,
    region: str = "embed",
    case: str = "trainer_fwd",
    *,
    seed: int = 0,
    rows: int | None = None,
) -> RegionFingerprints:
    rng = np.random.default_rng(seed)
    n = record.token_ids.size if rows is None else rows
    return RegionFingerprints(
        run_id=record.run_id,
        step=record.step,
        side=record.side,
        case=case,
        sample_key=record.sample_key,
        region=region,
        positions=np.arange(n, dtype=np.int32),
        digest=rng.integers(0, 2**63, n, dtype=np.uint64),
        ladder_bits=[6, 4, 2, 0],
        ladder=rng.integers(0, 2**63, (n, 4), dtype=np.uint64),
        sketch=rng.standard_normal((n, 16)).astype(np.float32),
        l2=rng.random(n).astype(np.float32),
        maxabs=rng.random(n).astype(np.float32),
    )


def fingerprints_block(
    records: list[SampleLogprobs], region: str = "embed", case: str = "trainer_fwd", *, seed: int = 0
) -> RegionFingerprintsBlock:
    """One region's fingerprints for ``records`` (samples of one run, step and side) in one block:
    sample i's rows are those :func:`fingerprints` gives it with ``seed + i``."""
    parts = [fingerprints(r, region, case, seed=seed + i) for i, r in enumerate(records)]
    return RegionFingerprintsBlock(
        run_id=records[0].run_id,
        step=records[0].step,
        side=records[0].side,
        case=case,
        region=region,
        sample_keys=[p.sample_key for p in parts],
        lengths=np.array([p.positions.size for p in parts], dtype=np.int32),
        positions=np.concatenate([p.positions for p in parts]),
        digest=np.concatenate([p.digest for p in parts]),
        ladder_bits=[6, 4, 2, 0],
        ladder=np.concatenate([p.ladder for p in parts]),
        sketch=np.concatenate([p.sketch for p in parts]),
        l2=np.concatenate([p.l2 for p in parts]),
        maxabs=np.concatenate([p.maxabs for p in parts]),
    )


def run(run_id: str = "run-1", **fields) -> Run:
    return Run(run_id=run_id, name=fields.pop("name", "test run"), **fields)


def manifest(side: str = "trainer", case: str = "trainer_fwd", run_id: str = "run-1", **fields) -> Manifest:
    return Manifest(run_id=run_id, side=side, case=case, **fields)
