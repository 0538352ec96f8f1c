"""The record kinds of the wire format: what collectors send and the store keeps (DESIGN.md, "Records").

Four kinds of record and the RL loop's step figures, each a pydantic model with a ``kind`` tag so a
batch can mix them. Every field's rule is a spec of :mod:`audit.records.checks`, given to pydantic
(validated records) and checked by hand (:meth:`Record.checked`, for records built with
``model_construct``); content rules run on every record however it was built.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal, get_args

import numpy as np
from isoaudit.audit.arrays import (
    Float32Array,
    Float32Matrix,
    Int32Array,
    Int32Matrix,
    UInt64Array,
    UInt64Matrix,
)
from isoaudit.audit.frameworks import declaration_of
from isoaudit.audit.records.canary import Canary
from isoaudit.audit.records.checks import (
    ADVANTAGE,
    COUNT32,
    FLOAT32_MATRIX,
    FLOAT32_VECTOR,
    INT32_MATRIX,
    INT32_VECTOR,
    MIN_P,
    REGION,
    RUN_ID,
    SAMPLE_KEY,
    STEP,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    UINT64_MATRIX,
    UINT64_VECTOR,
    VERSION,
    RecordError,
    check_distinct_positions,
    check_json,
    check_logprobs,
    check_member,
    check_non_negative,
    check_text,
    record_error,
    utc_timestamp,
)
from isoaudit.audit.records.environment import Environment
from isoaudit.audit.records.routes import Routes
from numpy.typing import ArrayLike
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

SCHEMA_VERSION: Final = 1

Side = Literal["trainer", "rollout"]
Case = Literal["trainer_fwd", "trainer_recompute", "engine_prefill", "engine_decode"]
LogprobSemantics = Literal["raw", "processed"]

_SIDES = frozenset(get_args(Side))
_CASES = frozenset(get_args(Case))
_SEMANTICS = frozenset(get_args(LogprobSemantics))

RunId = Annotated[str, RUN_ID.field()]
SampleKey = Annotated[str, SAMPLE_KEY.field(description="16 bytes as 32 lowercase hex digits")]
Step = Annotated[int, STEP.field()]


def sample_key(prompt_ids: ArrayLike, completion_ids: ArrayLike = ()) -> str:
    """The identity both sides derive from the tokens alone: SHA-256 of (prompt ‖ completion) as
    little-endian int32, first 16 bytes in hex. No ids need coordinating across processes."""
    tokens = np.concatenate(
        [np.asarray(prompt_ids, dtype="<i4").ravel(), np.asarray(completion_ids, dtype="<i4").ravel()]
    )
    return hashlib.sha256(tokens.astype("<i4", copy=False).tobytes()).hexdigest()[:32]


def utcnow() -> datetime:
    """Now, in UTC: the default of every record's timestamp."""
    return datetime.now(UTC)


def _timestamp(value: datetime) -> datetime:
    try:
        return utc_timestamp(value)
    except ValueError as exc:
        raise PydanticCustomError("timestamp_range", str(exc)) from None


#: A stored timestamp: kept in UTC (a naive one is taken as UTC), refused outside UTC years
#: 1970..9999 (:data:`audit.records.checks.TIMESTAMP_YEARS`), so every database gives it back.
Timestamp = Annotated[datetime, AfterValidator(_timestamp)]
#: The same, given with its time zone (a naive one is refused).
AwareTimestamp = Annotated[AwareDatetime, AfterValidator(_timestamp)]


# ---------------------------------------------------------------------- records


class Record(BaseModel):
    """Shared configuration: arrays allowed, unknown fields rejected (a typo must not vanish)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", frozen=False)

    schema_version: Literal[1] = SCHEMA_VERSION

    def checked(self) -> Record:
        """This record, verified however it was built (validated, ``model_construct``'ed or changed
        since); raises :class:`RecordError`. Kinds without a fast check of their own (runs and
        manifests: one per process, not per token) are validated again in full and the new copy
        returned."""
        try:
            return type(self).model_validate(self.model_dump(warnings=False))
        except ValidationError as exc:
            raise record_error(exc) from None


def _check_schema_version(record: Record) -> None:
    if getattr(record, "schema_version", None) != SCHEMA_VERSION:
        raise RecordError(
            "schema_version", f"{getattr(record, 'schema_version', None)!r} is not {SCHEMA_VERSION}"
        )


class Run(Record):
    kind: Literal["run"] = "run"
    run_id: RunId
    name: str = Field(default="", max_length=256)
    started_at: Timestamp = Field(default_factory=utcnow)
    config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_off_policy(self) -> Run:
        try:
            off_policy_of(self.config)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"config.off_policy{'.' + where if where else ''}: {first['msg']}") from None
        return self

    @model_validator(mode="after")
    def _check_framework(self) -> Run:
        try:
            declaration_of(self.config)
        except ValueError as exc:
            raise ValueError(f"config.{exc}") from None
        return self

    @model_validator(mode="after")
    def _check_text(self) -> Run:
        check_text(self.name, "name")
        check_json(self.config, "config")
        return self


class RuntimeFacts(BaseModel):
    """What one side's numerics depend on. ``None`` means "not known", never "off"."""

    model_config = ConfigDict(extra="allow")

    framework: str | None = None
    framework_version: str | None = None
    torch_version: str | None = None
    device: str | None = None
    arch: str | None = None
    dtype: str | None = None
    lm_head_dtype: str | None = None
    logprobs_mode: str | None = None
    prefix_caching: bool | None = None
    async_scheduling: bool | None = None
    chunked_prefill: bool | None = None
    cuda_graphs: bool | None = None
    batch_invariant: bool | None = None
    attention_backend: str | None = None
    tp_size: int | None = Field(default=None, ge=1)
    pp_size: int | None = Field(default=None, ge=1)
    ep_size: int | None = Field(default=None, ge=1)
    remediation: str | None = None
    router_replay: str | None = Field(
        default=None,
        description="MoE routing replay (R3) on this side: 'off', or how the rollout's routes are replayed "
        "('verl_router_replay', 'vllm_routed_experts', ...); None: not known",
    )


class ContractIdentities(BaseModel):
    """The three SHA-256 identities of an execution contract (``audit.contract``)."""

    model_config = ConfigDict(extra="forbid")

    semantic: str | None = None
    numerical_policy: str | None = None
    deployment: str | None = None


class Manifest(Record):
    """One per side per process per change of anything numerics depend on."""

    weight_tensor_digests: dict[str, str] = Field(
        default_factory=dict,
        description="tensor name -> digest of the weights this side actually holds (after a sync, not what "
        "was sent), taken at each weight version change",
    )

    kind: Literal["manifest"] = "manifest"
    run_id: RunId
    side: Side
    case: Case
    process: str = Field(default="", max_length=256, description="host:pid[/rank], to tell processes apart")
    created_at: Timestamp = Field(default_factory=utcnow)
    runtime: RuntimeFacts = Field(default_factory=RuntimeFacts)
    regions: list[str] = Field(default_factory=list, description="canonical regions this side hooks")
    unobserved: dict[str, str] = Field(
        default_factory=dict, description="region (or '*') -> why this side cannot observe it"
    )
    contract: ContractIdentities = Field(default_factory=ContractIdentities)
    numerical_policy: dict[str, Any] = Field(
        default_factory=dict, description="the contract's numerical-policy fields, to name differences"
    )
    weight_version: str | None = VERSION.field(default=None)
    weight_digest: str | None = Field(default=None, max_length=256)
    environment: Environment | None = Field(
        default=None,
        description="the libraries, backends, flags and environment pins this side ran with "
        "(audit.records.environment); None: not recorded",
    )
    canary: Canary | None = Field(
        default=None,
        description="the canary this side ran through its real forward after its latest weight version "
        "change (isoaudit.audit.records.canary)",
    )
    effective_weight_tensor_digests: dict[str, str] = Field(
        default_factory=dict,
        description="tensor name -> digest of the weights this side's quantized GEMMs effectively multiply "
        "by (dequantized), where it quantizes; empty otherwise",
    )

    @model_validator(mode="after")
    def _check_text(self) -> Manifest:
        check_text(self.process, "process")
        for name in ("runtime", "contract"):
            check_json(getattr(self, name).model_dump(), name)
        for name in (
            "regions",
            "unobserved",
            "numerical_policy",
            "weight_tensor_digests",
            "effective_weight_tensor_digests",
        ):
            check_json(getattr(self, name), name)
        for name in ("weight_version", "weight_digest"):
            if getattr(self, name) is not None:
                check_text(getattr(self, name), name)
        return self

    def content_hash(self) -> str:
        """Identity for idempotent ingest: everything but the timestamp."""
        body = self.model_dump(mode="json", exclude={"created_at"})
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _weight_version(value: Any) -> Any:
    """A weight version may be given as an integer; it is kept as text."""
    return str(value) if isinstance(value, int | np.integer) and not isinstance(value, bool) else value


PathValue = int | float | bool | str


class WeightSpan(BaseModel):
    """Completion tokens ``[start, next span's start)`` were sampled with weight ``version``."""

    model_config = ConfigDict(extra="forbid")

    start: int = COUNT32.field(description="completion index of the span's first token")
    version: str = Field(min_length=1, max_length=VERSION.max_length)

    @model_validator(mode="before")
    @classmethod
    def _coerce_version(cls, data: Any) -> Any:
        if isinstance(data, dict) and "version" in data:
            data = {**data, "version": _weight_version(data["version"])}
        return data


def check_weight_spans(spans: list[WeightSpan], n_completion: int) -> None:
    """Spans start at completion index 0, strictly increase, and start inside the completion."""
    if not spans:
        raise RecordError("weight_spans", "give at least one span, or leave it out")
    for i, span in enumerate(spans):
        check_text(span.version, f"weight_spans.{i}.version")
    starts = [span.start for span in spans]
    if starts[0] != 0:
        raise RecordError("weight_spans", f"the first span must start at completion index 0, not {starts[0]}")
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            raise RecordError("weight_spans", f"span {i} starts at {starts[i]}, not after {starts[i - 1]}")
    if starts[-1] >= max(n_completion, 1):
        raise RecordError(
            "weight_spans",
            f"span {len(starts) - 1} starts at {starts[-1]}, past the {n_completion} completion tokens",
        )


class OffPolicy(BaseModel):
    """A run's declared off-policy design, ``Run.config["off_policy"]``: what asynchronous RL does on
    purpose (PipelineRL, one-step-off-policy trainers, AReaL), so the audit can tell it from a bug."""

    model_config = ConfigDict(extra="forbid")

    max_staleness: int = COUNT32.field(
        description="largest policy lag (trainer version - sampling version) the objective corrects",
    )
    in_flight_updates: bool = Field(
        default=False,
        description="weights may change while a sequence is generated: one sample may span versions",
    )


def off_policy_of(config: dict[str, Any]) -> OffPolicy | None:
    """The off-policy declaration in a run's config, or None when the run declares none."""
    body = config.get("off_policy") if isinstance(config, dict) else None
    return None if body is None else OffPolicy.model_validate(body)


class SampleLogprobs(Record):
    """The sampled tokens of one sample and the logprob one side assigned to each.

    ``token_ids`` is the whole sequence (prompt ‖ completion); ``logprobs`` has one value per
    completion token, i.e. ``len(token_ids) - prompt_len`` values, each finite and ≤ 0.
    """

    kind: Literal["sample"] = "sample"
    run_id: RunId
    step: Step
    side: Side
    sample_key: SampleKey | None = Field(default=None, description="derived from the tokens when omitted")
    weight_version: str | None = VERSION.field(default=None)
    prompt_len: int = COUNT32.field()
    token_ids: Int32Array
    logprobs: Float32Array
    temperature: float = TEMPERATURE.field(default=1.0)
    top_k: int | None = TOP_K.field(default=None)
    top_p: float | None = TOP_P.field(default=None)
    min_p: float | None = MIN_P.field(
        default=None, description="min-p: the engine's sampler, or what the trainer applied"
    )
    weight_spans: list[WeightSpan] | None = Field(
        default=None,
        description="the weight version of each span of completion tokens, in order from index 0 "
        "(asynchronous RL with in-flight weight updates); absent: every token is weight_version's",
    )
    rank: int | None = COUNT32.field(
        default=None,
        description="the rank that recorded this side of the sample (a torch.distributed trainer rank, "
        "an engine worker's data-parallel rank); absent for a single-process job",
    )

    advantage: float | None = ADVANTAGE.field(
        default=None,
        description="the sample's advantage in the trainer's objective (trainer side), for the framework "
        "figures that depend on its sign (PRIME-RL's masks); absent: not known",
    )

    semantics: LogprobSemantics = "processed"
    routes: Routes | None = Field(
        default=None, description="MoE routing: the experts each layer chose per token"
    )
    topk_ids: Int32Matrix | None = None
    topk_logprobs: Float32Matrix | None = None
    path: dict[str, PathValue] = Field(
        default_factory=dict,
        description="how this side computed this sample where the runtime may take another path, e.g. "
        "prefix_cached_tokens (prompt tokens served from a prefix cache), prefill_chunks",
    )
    dist_sketch: Float32Matrix | None = Field(
        default=None,
        description="per completion token, the full-vocabulary sketch R^T sqrt(p) of the distribution "
        "its logprob comes from ([n_completion, 32]; audit.distribution), on fingerprinted steps",
    )

    @model_validator(mode="before")
    @classmethod
    def _coerce_weight_version(cls, data: Any) -> Any:
        if isinstance(data, dict) and "weight_version" in data:
            data = {**data, "weight_version": _weight_version(data["weight_version"])}
        return data

    @model_validator(mode="after")
    def _check(self) -> SampleLogprobs:
        # pydantic has just run Routes' own validator (it runs on a Routes object passed in as
        # well), so of the routes only the bound that needs the sample is left.
        return self._checked(routes_checked=True)

    def checked(self) -> SampleLogprobs:
        """Every field's type and bounds, and the arrays' dtypes, lengths, signs and finiteness, in
        vectorised reductions; derives ``sample_key`` from the tokens when it is unset."""
        return self._checked(routes_checked=False)

    def _checked(self, *, routes_checked: bool) -> SampleLogprobs:
        _check_schema_version(self)
        RUN_ID.check(self.run_id, "run_id")
        STEP.check(self.step, "step")
        check_member(self.side, "side", _SIDES)
        tokens = INT32_VECTOR.check(self.token_ids, "token_ids")
        logprobs = FLOAT32_VECTOR.check(self.logprobs, "logprobs")
        n_tokens = tokens.size
        prompt_len = COUNT32.check(self.prompt_len, "prompt_len")
        if prompt_len > n_tokens:
            raise RecordError("prompt_len", f"{prompt_len} is past the end of token_ids ({n_tokens} tokens)")
        n_completion = n_tokens - prompt_len
        if logprobs.size != n_completion:
            raise RecordError(
                "logprobs",
                f"{logprobs.size} values for {n_completion} completion tokens "
                f"(token_ids has {n_tokens}, prompt_len is {prompt_len})",
            )
        check_logprobs(logprobs, "logprobs", allow_neg_inf=False)
        check_non_negative(tokens, "token_ids", "token id")
        self._check_scalars()
        self._check_topk(n_completion)
        self._check_dist_sketch(n_completion)
        if self.routes is not None:
            if not isinstance(self.routes, Routes):
                raise RecordError("routes", "expected a Routes record")
            if routes_checked:
                self.routes.check_within(n_tokens)
            else:
                self.routes.check(n_tokens)
        if self.weight_spans is not None:
            if not isinstance(self.weight_spans, list) or not all(
                isinstance(span, WeightSpan) for span in self.weight_spans
            ):
                raise RecordError("weight_spans", "expected a list of WeightSpan(start, version)")
            check_weight_spans(self.weight_spans, n_completion)
        if self.sample_key is None:
            self.sample_key = sample_key(tokens)
        else:
            SAMPLE_KEY.check(self.sample_key, "sample_key")
        return self

    def _check_scalars(self) -> None:
        self.weight_version = _weight_version(self.weight_version)
        if self.weight_version is not None:
            VERSION.check(self.weight_version, "weight_version")
        TEMPERATURE.check(self.temperature, "temperature")
        if self.top_k is not None:
            TOP_K.check(self.top_k, "top_k")
        if self.top_p is not None:
            TOP_P.check(self.top_p, "top_p")
        if self.min_p is not None:
            MIN_P.check(self.min_p, "min_p")
        if self.advantage is not None:
            self.advantage = ADVANTAGE.check(self.advantage, "advantage")
        check_member(self.semantics, "semantics", _SEMANTICS)
        if self.rank is not None:
            COUNT32.check(self.rank, "rank")
        path = self.path
        if type(path) is not dict:
            raise RecordError("path", f"expected a dict, got {type(path).__name__}")
        if path:
            for name, value in path.items():
                if type(name) is not str or not isinstance(value, PathValue):
                    raise RecordError(
                        "path", f"{name!r}: expected a str key and an int, float, bool or str value"
                    )
            check_json(path, "path")

    def _check_topk(self, n_completion: int) -> None:
        ids, logprobs = self.topk_ids, self.topk_logprobs
        if (ids is None) != (logprobs is None):
            raise RecordError("topk_logprobs", "topk_ids and topk_logprobs: give both or neither")
        if ids is None or logprobs is None:
            return
        INT32_MATRIX.check(ids, "topk_ids")
        FLOAT32_MATRIX.check(logprobs, "topk_logprobs")
        if ids.shape != logprobs.shape or ids.shape[0] != n_completion:
            raise RecordError(
                "topk_logprobs",
                f"shape {list(logprobs.shape)} and topk_ids {list(ids.shape)} must both be [{n_completion}, k]",
            )
        check_non_negative(ids, "topk_ids", "token id")
        # -inf is a real answer here: a token outside the kept top-k/top-p set has probability 0.
        check_logprobs(logprobs, "topk_logprobs", allow_neg_inf=True)

    def _check_dist_sketch(self, n_completion: int) -> None:
        if self.dist_sketch is None:
            return
        sketch = FLOAT32_MATRIX.check(self.dist_sketch, "dist_sketch")
        if sketch.shape[0] != n_completion:
            raise RecordError(
                "dist_sketch",
                f"shape {list(sketch.shape)}: expected one row per completion token ({n_completion})",
            )
        if not np.isfinite(sketch).all():
            raise RecordError("dist_sketch", "values must be finite")

    @property
    def completion_ids(self) -> np.ndarray:
        return self.token_ids[self.prompt_len :]


def _check_row_fields(record: RegionFingerprints | RegionFingerprintsBlock, rows: int) -> None:
    """Each row field of fingerprints an array of its kind with ``rows`` rows (a matrix may be
    empty when there are none)."""
    for name, rule in (("digest", UINT64_VECTOR), ("l2", FLOAT32_VECTOR), ("maxabs", FLOAT32_VECTOR)):
        array = rule.check(getattr(record, name), name)
        if array.shape[0] != rows:
            raise RecordError(name, f"{array.shape[0]} rows for {rows} positions")
    for name, rule in (("ladder", UINT64_MATRIX), ("sketch", FLOAT32_MATRIX)):
        array = rule.check(getattr(record, name), name)
        if array.shape[0] != rows and rows:
            raise RecordError(name, f"{array.shape[0]} rows for {rows} positions")


class RegionFingerprints(Record):
    """Per-token-row fingerprints of one region's output for one sample (``audit.fingerprints``).

    Float fields (``sketch``, ``l2``, ``maxabs``) may hold NaN or infinities: they describe what a side
    computed, and an overflowing activation is exactly what a diagnosis needs to see.
    """

    kind: Literal["fingerprints"] = "fingerprints"
    run_id: RunId
    step: Step
    side: Side
    case: Case
    sample_key: SampleKey
    region: str = REGION.field(description="canonical region name, e.g. layers.2.mlp")
    forward_index: int = COUNT32.field(default=0, description="which call of the region, when it runs twice")
    positions: Int32Array
    digest: UInt64Array
    ladder_bits: list[int] = Field(default_factory=list, description="mantissa bits kept at each ladder rung")
    ladder: UInt64Matrix
    sketch: Float32Matrix
    l2: Float32Array
    maxabs: Float32Array

    @model_validator(mode="after")
    def _check(self) -> RegionFingerprints:
        return self.checked()

    def checked(self) -> RegionFingerprints:
        """Types and bounds of the scalars; every row array aligned with ``positions``; positions
        distinct and non-negative (one comparison pass when they are sorted, as collectors send them)."""
        _check_schema_version(self)
        RUN_ID.check(self.run_id, "run_id")
        STEP.check(self.step, "step")
        check_member(self.side, "side", _SIDES)
        check_member(self.case, "case", _CASES)
        SAMPLE_KEY.check(self.sample_key, "sample_key")
        REGION.check(self.region, "region")
        COUNT32.check(self.forward_index, "forward_index")
        positions = INT32_VECTOR.check(self.positions, "positions")
        rows = positions.size
        _check_row_fields(self, rows)
        bits = self.ladder_bits
        if type(bits) is not list or not all(type(b) is int and 0 <= b <= 64 for b in bits):
            raise RecordError("ladder_bits", "expected a list of integers in 0..64")
        if rows and self.ladder.shape[1] != len(bits):
            raise RecordError("ladder", f"{self.ladder.shape[1]} rungs but ladder_bits names {len(bits)}")
        check_distinct_positions(positions, "positions")
        return self


#: The most samples one block of fingerprints names.
MAX_BLOCK_SAMPLES: Final = 65_536


class RegionFingerprintsBlock(Record):
    """One region call's fingerprints for every sample of a step at once: the columnar form a
    collector sends, one record per region call where :class:`RegionFingerprints` is one per sample
    and region call (a step with every region fingerprinted is a thousand of those, each a Python
    object the training process would build). The rows of ``sample_keys[i]`` are the next
    ``lengths[i]`` rows of every row field, in order; the store keeps the block as the per-sample
    records it stands for (:meth:`samples`), so reading it back gives :class:`RegionFingerprints`."""

    kind: Literal["fingerprints_block"] = "fingerprints_block"
    run_id: RunId
    step: Step
    side: Side
    case: Case
    region: str = REGION.field(description="canonical region name, e.g. layers.2.mlp")
    forward_index: int = COUNT32.field(default=0, description="which call of the region, when it runs twice")
    sample_keys: list[SampleKey] = Field(
        max_length=MAX_BLOCK_SAMPLES, description="the samples, in the order of their rows"
    )
    lengths: Int32Array
    positions: Int32Array
    digest: UInt64Array
    ladder_bits: list[int] = Field(default_factory=list, description="mantissa bits kept at each ladder rung")
    ladder: UInt64Matrix
    sketch: Float32Matrix
    l2: Float32Array
    maxabs: Float32Array

    @model_validator(mode="after")
    def _check(self) -> RegionFingerprintsBlock:
        return self.checked()

    def checked(self) -> RegionFingerprintsBlock:
        """``sample_keys`` and ``lengths`` matching each other and the rows, then each sample's
        record as :meth:`RegionFingerprints.checked` checks it (its positions distinct and
        non-negative among its own)."""
        _check_schema_version(self)
        keys = self.sample_keys
        if type(keys) is not list or not keys:
            raise RecordError("sample_keys", "expected a non-empty list of sample keys")
        for i, key in enumerate(keys):
            SAMPLE_KEY.check(key, f"sample_keys[{i}]")
        if len(set(keys)) != len(keys):
            raise RecordError("sample_keys", "a sample named twice")
        positions = INT32_VECTOR.check(self.positions, "positions")
        lengths = INT32_VECTOR.check(self.lengths, "lengths")
        if lengths.size != len(keys):
            raise RecordError("lengths", f"{lengths.size} lengths for {len(keys)} sample keys")
        check_non_negative(lengths, "lengths", "length")
        if int(lengths.sum(dtype=np.int64)) != positions.size:
            raise RecordError("lengths", f"add up to {int(lengths.sum())} rows, not {positions.size}")
        _check_row_fields(self, positions.size)  # the whole block's rows: no sample's cut short
        for sample in self.samples():  # each sample's rows as its own record would be checked
            sample.checked()
        return self

    def samples(self) -> list[RegionFingerprints]:
        """The per-sample records the block stands for (row views of its arrays, not copies)."""
        shared: dict[str, Any] = {
            "run_id": self.run_id,
            "step": self.step,
            "side": self.side,
            "case": self.case,
            "region": self.region,
            "forward_index": self.forward_index,
            "ladder_bits": self.ladder_bits,
        }
        out = []
        start = 0
        for key, length in zip(self.sample_keys, np.asarray(self.lengths).tolist(), strict=True):
            rows = slice(start, start + length)
            start += length
            out.append(
                RegionFingerprints.model_construct(
                    **shared,
                    sample_key=key,
                    positions=self.positions[rows],
                    digest=self.digest[rows],
                    ladder=self.ladder[rows],
                    sketch=self.sketch[rows],
                    l2=self.l2[rows],
                    maxabs=self.maxabs[rows],
                )
            )
        return out


def count_records(records: Sequence[Record]) -> int:
    """How many records ``records`` stand for as the store keeps them: a
    :class:`RegionFingerprintsBlock` one per sample, any other record one."""
    return sum(len(r.sample_keys) if isinstance(r, RegionFingerprintsBlock) else 1 for r in records)


def expand_blocks(records: Sequence[Record]) -> list[Record]:
    """``records`` with each :class:`RegionFingerprintsBlock` replaced by its per-sample records."""
    out: list[Record] = []
    for record in records:
        if isinstance(record, RegionFingerprintsBlock):
            out += record.samples()
        else:
            out.append(record)
    return out


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
#: A duration.
Seconds = NonNegativeFloat


class StepStats(Record):
    """The RL loop's own figures for one step (reward, entropy, clip fraction, phase times), so the
    dashboard can set the mismatch beside what the job optimises. One per (run, step); a second
    one for the same step replaces nothing (the first stored wins, as for every record)."""

    kind: Literal["step_stats"] = "step_stats"
    run_id: RunId
    step: Step
    reward_mean: FiniteFloat | None = None
    reward_std: NonNegativeFloat | None = None
    entropy: NonNegativeFloat | None = None
    clip_fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    generation_s: Seconds | None = None
    training_s: Seconds | None = None
    extras: dict[str, FiniteFloat] = Field(
        default_factory=dict, max_length=64, description="any other per-step figure, by name"
    )
    created_at: Timestamp = Field(default_factory=utcnow)

    @model_validator(mode="after")
    def _check_names(self) -> StepStats:
        for name in self.extras:
            check_text(name, f"extras.{name}")
            if not 0 < len(name) <= 128:
                raise ValueError(f"extras: a figure name must be 1..128 characters, got {len(name)}")
        return self

    def figures(self) -> dict[str, float]:
        """Every figure that was given, by name (extras included)."""
        named = {
            k: getattr(self, k)
            for k in ("reward_mean", "reward_std", "entropy", "clip_fraction", "generation_s", "training_s")
            if getattr(self, k) is not None
        }
        return {**named, **self.extras}
