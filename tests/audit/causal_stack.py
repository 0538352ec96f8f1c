"""A small causal network whose layers produce every canonical region, for comparator tests.

Each region's output is a deterministic function of the previous region's output at positions up to
its own (a running mean stands in for attention), so a change injected at (region, position) spreads
to later regions at that position and after, exactly as in a decoder.
"""

from __future__ import annotations

import numpy as np
import torch
from isoaudit.audit.records import RegionFingerprints, SampleLogprobs
from isoaudit.audit.regions import canonical_regions
from isoaudit.collectors.fingerprints import fingerprint_rows


def run_stack(
    sample: SampleLogprobs,
    side: str,
    *,
    num_layers: int = 4,
    hidden: int = 32,
    perturb: tuple[str, int] | None = None,
    skip_regions: tuple[str, ...] = (),
    case: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[RegionFingerprints]:
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.as_tensor(sample.token_ids.astype(np.int64))
    embed = torch.randn(int(tokens.max()) + 1, hidden, generator=generator)
    x = embed[tokens].to(dtype)
    records = []
    positions = np.arange(tokens.numel(), dtype=np.int32)
    for index, region in enumerate(canonical_regions(num_layers)):
        if index > 0:
            weight = torch.randn(hidden, hidden, generator=generator) / hidden**0.5
            causal_mean = torch.cumsum(x.float(), 0) / torch.arange(1, x.shape[0] + 1)[:, None]
            x = torch.tanh((x.float() + causal_mean) @ weight).to(dtype)
        if perturb is not None and perturb[0] == region:
            x = x.clone()
            x[perturb[1], 0] = x[perturb[1], 0] + 0.25
        if region in skip_regions:
            continue
        rows = fingerprint_rows(x).to_host()
        records.append(
            RegionFingerprints(
                run_id=sample.run_id,
                step=sample.step,
                side=side,
                case=case or ("trainer_fwd" if side == "trainer" else "engine_prefill"),
                sample_key=sample.sample_key,
                region=region,
                positions=positions,
                ladder_bits=list(rows.ladder_bits),
                **rows.fields(),
            )
        )
    return records
