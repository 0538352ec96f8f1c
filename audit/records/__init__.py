"""The wire format: what collectors send and the store keeps (DESIGN.md, "Records").

* :mod:`.checks`: the one checker of record fields: each rule written once, given to pydantic and
  checked by hand for records built with ``model_construct``;
* :mod:`.kinds`: the record kinds (runs, manifests, sample logprobs, region fingerprints, step stats);
* :mod:`.routes`: MoE routing carried on a sample record;
* :mod:`.boundary`: the store's boundary: one record or a batch, verified however it was built.

Arrays travel as base64 of their little-endian bytes (:mod:`audit.arrays`). Import the public names
from here.
"""

from isoaudit.audit.arrays import MAX_ARRAY_ELEMENTS
from isoaudit.audit.records.boundary import (
    RECORD_KINDS,
    AnyRecord,
    Batch,
    BatchShape,
    RecordOfAnyKind,
    Rejection,
    record_kind,
    validate_record,
)
from isoaudit.audit.records.canary import CANARY_TOP_K, Canary, CanaryOutput, canary_digest, held_digest
from isoaudit.audit.records.checks import (
    MAX_INT32,
    MAX_JSON_DEPTH,
    MAX_STEP,
    RUN_ID_PATTERN,
    SAMPLE_KEY_PATTERN,
    TIMESTAMP_YEARS,
    RecordError,
    check_json,
    check_text,
    check_timestamp,
    record_error,
    utc_timestamp,
)
from isoaudit.audit.records.environment import Environment
from isoaudit.audit.records.kinds import (
    SCHEMA_VERSION,
    AwareTimestamp,
    Case,
    ContractIdentities,
    FiniteFloat,
    LogprobSemantics,
    Manifest,
    OffPolicy,
    PathValue,
    Record,
    RegionFingerprints,
    Run,
    RunId,
    RuntimeFacts,
    SampleKey,
    SampleLogprobs,
    Seconds,
    Side,
    Step,
    StepStats,
    Timestamp,
    WeightSpan,
    check_weight_spans,
    off_policy_of,
    sample_key,
    utcnow,
)
from isoaudit.audit.records.routes import MAX_EXPERTS, MAX_MOE_LAYERS, MAX_TOP_K, Routes

__all__ = [
    "Environment",
    "CANARY_TOP_K",
    "Canary",
    "CanaryOutput",
    "canary_digest",
    "held_digest",
    "MAX_ARRAY_ELEMENTS",
    "MAX_EXPERTS",
    "MAX_INT32",
    "MAX_JSON_DEPTH",
    "MAX_MOE_LAYERS",
    "MAX_STEP",
    "MAX_TOP_K",
    "RECORD_KINDS",
    "RUN_ID_PATTERN",
    "SAMPLE_KEY_PATTERN",
    "SCHEMA_VERSION",
    "TIMESTAMP_YEARS",
    "AnyRecord",
    "AwareTimestamp",
    "Batch",
    "BatchShape",
    "Case",
    "ContractIdentities",
    "FiniteFloat",
    "LogprobSemantics",
    "Manifest",
    "OffPolicy",
    "PathValue",
    "Record",
    "RecordError",
    "RecordOfAnyKind",
    "RegionFingerprints",
    "Rejection",
    "Routes",
    "Run",
    "RunId",
    "RuntimeFacts",
    "SampleKey",
    "SampleLogprobs",
    "Seconds",
    "Side",
    "Step",
    "StepStats",
    "Timestamp",
    "WeightSpan",
    "check_json",
    "check_text",
    "check_timestamp",
    "check_weight_spans",
    "off_policy_of",
    "record_error",
    "record_kind",
    "sample_key",
    "utc_timestamp",
    "utcnow",
    "validate_record",
]
