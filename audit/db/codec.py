"""Records ↔ rows: a validated record as the row the store keeps (arrays as little-endian bytes), and a
stored row back as its record."""

from __future__ import annotations

from typing import Any

import numpy as np
from isoaudit.audit.arrays import from_bytes, to_bytes
from isoaudit.audit.db.models import FingerprintRow, SampleRow
from isoaudit.audit.records import RegionFingerprints, SampleLogprobs, WeightSpan, utcnow
from isoaudit.audit.routing import routes_columns, routes_from_columns


def sample_row(record: SampleLogprobs) -> dict[str, Any]:
    topk = (
        (record.topk_ids, record.topk_logprobs)
        if record.topk_ids is not None and record.topk_logprobs is not None
        else None
    )
    return {
        "run_id": record.run_id,
        "step": record.step,
        "side": record.side,
        "sample_key": record.sample_key,
        "weight_version": record.weight_version,
        "prompt_len": record.prompt_len,
        "n_tokens": int(record.token_ids.size),
        "temperature": record.temperature,
        "top_k": record.top_k,
        "top_p": record.top_p,
        "min_p": record.min_p,
        "weight_spans": [span.model_dump() for span in record.weight_spans] if record.weight_spans else None,
        "semantics": record.semantics,
        "token_ids": to_bytes(record.token_ids.astype(np.int32, copy=False)),
        "logprobs": to_bytes(record.logprobs.astype(np.float32, copy=False)),
        "topk": int(topk[0].shape[1]) if topk else None,
        "topk_ids": to_bytes(topk[0]) if topk else None,
        "topk_logprobs": to_bytes(topk[1]) if topk else None,
        "path": dict(record.path) or None,
        "rank": record.rank,
        **routes_columns(record.routes),
        "created_at": utcnow(),
    }


def sample_record(row: SampleRow) -> SampleLogprobs:
    n_completion = row.n_tokens - row.prompt_len
    topk = None
    if row.topk is not None and row.topk_ids is not None and row.topk_logprobs is not None:
        topk = (
            from_bytes(row.topk_ids, "<i4", (n_completion, row.topk)),
            from_bytes(row.topk_logprobs, "<f4", (n_completion, row.topk)),
        )
    # Stored rows were validated on the way in: construct without re-validating (the comparator's hot path).
    return SampleLogprobs.model_construct(
        run_id=row.run_id,
        step=row.step,
        side=row.side,
        sample_key=row.sample_key,
        weight_version=row.weight_version,
        prompt_len=row.prompt_len,
        token_ids=from_bytes(row.token_ids, "<i4"),
        logprobs=from_bytes(row.logprobs, "<f4"),
        temperature=row.temperature,
        top_k=row.top_k,
        top_p=row.top_p,
        min_p=row.min_p,
        weight_spans=[WeightSpan.model_construct(**span) for span in row.weight_spans]
        if row.weight_spans
        else None,
        semantics=row.semantics,
        topk_ids=topk[0] if topk else None,
        topk_logprobs=topk[1] if topk else None,
        path=row.path or {},
        rank=row.rank,
        routes=routes_from_columns(row.routes, row.routes_data),
    )


def fingerprint_row(record: RegionFingerprints) -> dict[str, Any]:
    rows = int(record.positions.size)
    return {
        "run_id": record.run_id,
        "step": record.step,
        "sample_key": record.sample_key,
        "side": record.side,
        "case": record.case,
        "region": record.region,
        "forward_index": record.forward_index,
        "n_rows": rows,
        "ladder_bits": list(record.ladder_bits),
        "sketch_dim": int(record.sketch.shape[1]) if record.sketch.ndim == 2 and rows else 0,
        "positions": to_bytes(record.positions),
        "digest": to_bytes(record.digest),
        "ladder": to_bytes(record.ladder),
        "sketch": to_bytes(record.sketch),
        "l2": to_bytes(record.l2),
        "maxabs": to_bytes(record.maxabs),
        "created_at": utcnow(),
    }


def fingerprint_record(row: FingerprintRow) -> RegionFingerprints:
    n, rungs = row.n_rows, len(row.ladder_bits)
    return RegionFingerprints.model_construct(
        run_id=row.run_id,
        step=row.step,
        side=row.side,
        case=row.case,
        sample_key=row.sample_key,
        region=row.region,
        forward_index=row.forward_index,
        positions=from_bytes(row.positions, "<i4"),
        digest=from_bytes(row.digest, "<u8"),
        ladder_bits=list(row.ladder_bits),
        ladder=from_bytes(row.ladder, "<u8", (n, rungs)),
        sketch=from_bytes(row.sketch, "<f4", (n, row.sketch_dim)),
        l2=from_bytes(row.l2, "<f4"),
        maxabs=from_bytes(row.maxabs, "<f4"),
    )
