"""The wire format: what collectors send and the store keeps (DESIGN.md, "Records").

Four record kinds, each a pydantic model with a ``kind`` tag so a batch can mix them. Validation is
strict where a wrong value would silently corrupt a comparison (lengths, signs, NaNs, enumerations)
and every error names the field it is about.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from audit.arrays import Float32Array, Float32Matrix, Int32Array, Int32Matrix, UInt64Array, UInt64Matrix

SCHEMA_VERSION = 1

Side = Literal["trainer", "rollout"]
Case = Literal["trainer_fwd", "trainer_recompute", "engine_prefill", "engine_decode"]
LogprobSemantics = Literal["raw", "processed"]

RunId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]
SampleKey = Annotated[
    str, Field(pattern=r"^[0-9a-f]{32}$", description="16 bytes as 32 lowercase hex digits")
]
Step = Annotated[int, Field(ge=0, le=2**62)]


def sample_key(prompt_ids: Any, completion_ids: Any = ()) -> str:
    """The identity both sides derive from the tokens alone: SHA-256 of (prompt ‖ completion) as
    little-endian int32, first 16 bytes in hex. No ids need coordinating across processes."""
    tokens = np.concatenate(
        [np.asarray(prompt_ids, dtype="<i4").ravel(), np.asarray(completion_ids, dtype="<i4").ravel()]
    )
    return hashlib.sha256(tokens.astype("<i4", copy=False).tobytes()).hexdigest()[:32]


def utcnow() -> datetime:
    return datetime.now(UTC)


class Record(BaseModel):
    """Shared configuration: arrays allowed, unknown fields rejected (a typo must not vanish)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", frozen=False)

    schema_version: Literal[1] = SCHEMA_VERSION


class Run(Record):
    kind: Literal["run"] = "run"
    run_id: RunId
    name: str = Field(default="", max_length=256)
    started_at: datetime = Field(default_factory=utcnow)
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
    created_at: datetime = Field(default_factory=utcnow)
    runtime: RuntimeFacts = Field(default_factory=RuntimeFacts)
    regions: list[str] = Field(default_factory=list, description="canonical regions this side hooks")
    unobserved: dict[str, str] = Field(
        default_factory=dict, description="region (or '*') -> why this side cannot observe it"
    )
    contract: ContractIdentities = Field(default_factory=ContractIdentities)
    numerical_policy: dict[str, Any] = Field(
        default_factory=dict, description="the contract's numerical-policy fields, to name differences"
    )
    weight_version: str | None = None
    weight_digest: str | None = None

    def content_hash(self) -> str:
        """Identity for idempotent ingest: everything but the timestamp."""
        body = self.model_dump(mode="json", exclude={"created_at"})
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class WeightSpan(BaseModel):
    """Completion tokens ``[start, next span's start)`` were sampled with weight ``version``."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(ge=0, le=2**31 - 1, description="completion index of the span's first token")
    version: str = Field(min_length=1, max_length=128)

    @model_validator(mode="before")
    @classmethod
    def _coerce_version(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and isinstance(data.get("version"), int)
            and not isinstance(data["version"], bool)
        ):
            data = {**data, "version": str(data["version"])}
        return data


def check_weight_spans(spans: list[WeightSpan], n_completion: int) -> None:
    """Spans start at completion index 0, strictly increase, and start inside the completion."""
    if not spans:
        raise ValueError("weight_spans: give at least one span, or leave it out")
    starts = [span.start for span in spans]
    if starts[0] != 0:
        raise ValueError(f"weight_spans: the first span must start at completion index 0, not {starts[0]}")
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            raise ValueError(f"weight_spans: span {i} starts at {starts[i]}, not after {starts[i - 1]}")
    if starts[-1] >= max(n_completion, 1):
        raise ValueError(
            f"weight_spans: span {len(starts) - 1} starts at {starts[-1]}, past the {n_completion} completion tokens"
        )


class OffPolicy(BaseModel):
    """A run's declared off-policy design, ``Run.config["off_policy"]``: what asynchronous RL does on
    purpose (PipelineRL, one-step-off-policy trainers, AReaL), so the audit can tell it from a bug."""

    model_config = ConfigDict(extra="forbid")

    max_staleness: int = Field(
        ge=0,
        le=2**31 - 1,
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
    completion token, i.e. ``len(token_ids) - prompt_len`` values.
    """

    kind: Literal["sample"] = "sample"
    run_id: RunId
    step: Step
    side: Side
    sample_key: SampleKey | None = Field(default=None, description="derived from the tokens when omitted")
    weight_version: str | None = None
    prompt_len: int = Field(ge=0)
    token_ids: Int32Array
    logprobs: Float32Array
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(
        default=None, ge=0.0, le=1.0, description="min-p: the engine's sampler, or what the trainer applied"
    )
    weight_spans: list[WeightSpan] | None = Field(
        default=None,
        description="the weight version of each span of completion tokens, in order from index 0 "
        "(asynchronous RL with in-flight weight updates); absent: every token is weight_version's",
    )

    @model_validator(mode="after")
    def _check_weight_spans(self) -> SampleLogprobs:
        if self.weight_spans is not None:
            check_weight_spans(self.weight_spans, int(self.token_ids.size) - int(self.prompt_len))
        return self

    semantics: LogprobSemantics = "processed"
    topk_ids: Int32Matrix | None = None
    topk_logprobs: Float32Matrix | None = None
    path: dict[str, int | float | bool | str] = Field(
        default_factory=dict,
        description="how this side computed this sample where the runtime may take another path, e.g. "
        "prefix_cached_tokens (prompt tokens served from a prefix cache), prefill_chunks",
    )

    @model_validator(mode="before")
    @classmethod
    def _coerce_weight_version(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("weight_version"), int):
            data = {**data, "weight_version": str(data["weight_version"])}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> SampleLogprobs:
        n_tokens = self.token_ids.size
        if self.prompt_len > n_tokens:
            raise ValueError(
                f"prompt_len: {self.prompt_len} is past the end of token_ids ({n_tokens} tokens)"
            )
        n_completion = n_tokens - self.prompt_len
        if self.logprobs.size != n_completion:
            raise ValueError(
                f"logprobs: {self.logprobs.size} values for {n_completion} completion tokens "
                f"(token_ids has {n_tokens}, prompt_len is {self.prompt_len})"
            )
        if np.isnan(self.logprobs).any():
            raise ValueError(
                f"logprobs: NaN at completion index {int(np.flatnonzero(np.isnan(self.logprobs))[0])}"
            )
        if (self.logprobs > 0).any():
            raise ValueError(
                f"logprobs: positive value at completion index {int(np.flatnonzero(self.logprobs > 0)[0])}"
            )
        if (self.token_ids < 0).any():
            raise ValueError("token_ids: negative token id")
        if (self.topk_ids is None) != (self.topk_logprobs is None):
            raise ValueError("topk_ids and topk_logprobs: give both or neither")
        if self.topk_ids is not None and self.topk_logprobs is not None:
            if self.topk_ids.shape != self.topk_logprobs.shape or self.topk_ids.shape[0] != n_completion:
                raise ValueError(
                    f"topk_logprobs: shape {list(self.topk_logprobs.shape)} and topk_ids {list(self.topk_ids.shape)} "
                    f"must both be [{n_completion}, k]"
                )
        derived = sample_key(self.token_ids)
        if self.sample_key is None:
            self.sample_key = derived
        return self

    @property
    def completion_ids(self) -> np.ndarray:
        return self.token_ids[self.prompt_len :]


class RegionFingerprints(Record):
    """Per-token-row fingerprints of one region's output for one sample (``audit.fingerprints``)."""

    kind: Literal["fingerprints"] = "fingerprints"
    run_id: RunId
    step: Step
    side: Side
    case: Case
    sample_key: SampleKey
    region: str = Field(min_length=1, max_length=128, description="canonical region name, e.g. layers.2.mlp")
    forward_index: int = Field(default=0, ge=0, description="which call of the region, when it runs twice")
    positions: Int32Array
    digest: UInt64Array
    ladder_bits: list[int] = Field(default_factory=list, description="mantissa bits kept at each ladder rung")
    ladder: UInt64Matrix
    sketch: Float32Matrix
    l2: Float32Array
    maxabs: Float32Array

    @model_validator(mode="after")
    def _check_rows(self) -> RegionFingerprints:
        rows = self.positions.size
        for name in ("digest", "l2", "maxabs"):
            if getattr(self, name).shape[0] != rows:
                raise ValueError(f"{name}: {getattr(self, name).shape[0]} rows for {rows} positions")
        for name in ("ladder", "sketch"):
            if getattr(self, name).shape[0] != rows and rows:
                raise ValueError(f"{name}: {getattr(self, name).shape[0]} rows for {rows} positions")
        if rows and self.ladder.shape[1] != len(self.ladder_bits):
            raise ValueError(
                f"ladder: {self.ladder.shape[1]} rungs but ladder_bits names {len(self.ladder_bits)}"
            )
        if (self.positions < 0).any():
            raise ValueError("positions: negative position")
        if rows > 1 and np.unique(self.positions).size != rows:
            raise ValueError("positions: repeated position")
        return self


AnyRecord = Annotated[Run | Manifest | SampleLogprobs | RegionFingerprints, Field(discriminator="kind")]


class Batch(BaseModel):
    """What a sink sends in one request; stored all-or-nothing."""

    model_config = ConfigDict(extra="forbid")

    records: list[AnyRecord] = Field(max_length=100_000)
