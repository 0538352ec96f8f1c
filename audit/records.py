"""The wire format: what collectors send and the store keeps (DESIGN.md, "Records").

Four record kinds, each a pydantic model with a ``kind`` tag so a batch can mix them. Validation is
strict where a wrong value would silently corrupt a comparison (lengths, signs, NaNs, enumerations)
and every error names the field it is about.

The same checks run at the store's boundary (:func:`validate_record`) on every record, however it
was built: collectors build records with ``model_construct`` to skip pydantic's cost, so the array
kinds carry a :meth:`~SampleLogprobs.check` of their own: vectorised numpy reductions over the
arrays plus type checks of the scalars, a few microseconds a record (``bench/ingest.py``). MoE routes
are 55x the bytes of tokens and logprobs at a 48-layer top-8 shape; their check is one reduction,
one transposing copy and k(k-1)/2 plane comparisons, checked once per validation
(``bench/records.py`` times it against the same sample without routes).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, get_args

import numpy as np
from isoaudit.audit.arrays import (
    MAX_ARRAY_ELEMENTS,
    ExpertIdMatrix,
    Float32Array,
    Float32Matrix,
    Int32Array,
    Int32Matrix,
    UInt8Array,
    UInt64Array,
    UInt64Matrix,
)
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

SCHEMA_VERSION = 1

Side = Literal["trainer", "rollout"]
Case = Literal["trainer_fwd", "trainer_recompute", "engine_prefill", "engine_decode"]
LogprobSemantics = Literal["raw", "processed"]

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
SAMPLE_KEY_PATTERN = r"^[0-9a-f]{32}$"
#: The largest step (and other 64-bit counters) a record may carry; the columns are BIGINT.
MAX_STEP = 2**62
#: 32-bit INTEGER columns (prompt_len, top_k, forward_index) refuse anything larger.
MAX_INT32 = 2**31 - 1

RunId = Annotated[str, Field(min_length=1, max_length=128, pattern=RUN_ID_PATTERN)]
SampleKey = Annotated[
    str, Field(pattern=SAMPLE_KEY_PATTERN, description="16 bytes as 32 lowercase hex digits")
]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]


def sample_key(prompt_ids: Any, completion_ids: Any = ()) -> str:
    """The identity both sides derive from the tokens alone: SHA-256 of (prompt ‖ completion) as
    little-endian int32, first 16 bytes in hex. No ids need coordinating across processes."""
    tokens = np.concatenate(
        [np.asarray(prompt_ids, dtype="<i4").ravel(), np.asarray(completion_ids, dtype="<i4").ravel()]
    )
    return hashlib.sha256(tokens.astype("<i4", copy=False).tobytes()).hexdigest()[:32]


def utcnow() -> datetime:
    return datetime.now(UTC)


# ---------------------------------------------------------------------- boundary checks


class RecordError(ValueError):
    """A record refused at the boundary. ``field`` names what is wrong and the message starts with it
    (``"logprobs: NaN at completion index 3"``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Rejection:
    """One record of a batch that was not stored, and why: ``index`` in the batch, its ``kind``
    (``"unknown"`` when it has none we know), the ``field`` at fault and a ``message`` starting with it."""

    index: int
    kind: str
    field: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_RUN_ID_RE = re.compile(RUN_ID_PATTERN)
_SAMPLE_KEY_RE = re.compile(SAMPLE_KEY_PATTERN)
_SIDES = frozenset(get_args(Side))
_CASES = frozenset(get_args(Case))
_SEMANTICS = frozenset(get_args(LogprobSemantics))
_FLOAT32_MAX = float(np.finfo(np.float32).max)
#: How deeply free-form JSON (a run's config, a manifest's facts) may nest.
MAX_JSON_DEPTH = 32


def check_text(value: str, field: str) -> str:
    """Refuse text a database cannot keep: NUL (PostgreSQL refuses it) and lone surrogates (not UTF-8)."""
    if "\x00" in value:
        raise RecordError(field, "contains a NUL character")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RecordError(field, "contains a lone surrogate (not valid Unicode text)") from None
    return value


def _text(value: Any, field: str, *, max_length: int, min_length: int = 0) -> str:
    if type(value) is not str:
        raise RecordError(field, f"expected a string, got {type(value).__name__}")
    if not min_length <= len(value) <= max_length:
        raise RecordError(field, f"length {len(value)} is outside {min_length}..{max_length}")
    return check_text(value, field)


def _int(value: Any, field: str, low: int, high: int) -> int:
    if type(value) is not int and not isinstance(value, np.integer):
        raise RecordError(field, f"expected an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise RecordError(field, f"{int(value)} is outside {low}..{high}")
    return int(value)


def _member(value: Any, field: str, allowed: frozenset[str]) -> None:
    if type(value) is not str or value not in allowed:
        raise RecordError(field, f"{value!r} is not one of {', '.join(sorted(allowed))}")


def _run_id(value: Any) -> None:
    # The pattern admits ASCII letters, digits and ._:- only, so no NUL or surrogate gets past it.
    if type(value) is not str or not 1 <= len(value) <= 128 or not _RUN_ID_RE.match(value):
        raise RecordError("run_id", f"{value!r} must be 1-128 of A-Z a-z 0-9 . _ : - (starting alphanumeric)")


def _sample_key(value: Any) -> None:
    if type(value) is not str or not _SAMPLE_KEY_RE.match(value):
        raise RecordError("sample_key", "must be 32 lowercase hex digits")


#: The dtype each array kind must have: (numpy kind letter, item size, name for messages).
_DTYPES = {
    "i": ("i", 4, "int32"),
    "f": ("f", 4, "float32"),
    "u": ("u", 8, "uint64"),
    "b": ("u", 1, "uint8"),
}


def _array(value: Any, field: str, kind: str, ndim: int) -> np.ndarray:
    """``value`` if it is a numpy array of ``kind`` (``i`` int32, ``f`` float32, ``u`` uint64) with
    ``ndim`` dimensions and at most MAX_ARRAY_ELEMENTS elements (byte order free: stored little-endian)."""
    if not isinstance(value, np.ndarray):
        raise RecordError(field, f"expected a numpy array, got {type(value).__name__}")
    dtype = value.dtype
    letter, itemsize, name = _DTYPES[kind]
    if dtype.kind != letter or dtype.itemsize != itemsize:
        raise RecordError(field, f"expected {name}, got {dtype}")
    if value.ndim != ndim:
        raise RecordError(field, f"expected a {ndim}-D array, got shape {list(value.shape)}")
    if value.size > MAX_ARRAY_ELEMENTS:
        raise RecordError(field, f"{value.size} elements exceed the limit of {MAX_ARRAY_ELEMENTS}")
    return value


_min = np.minimum.reduce
_max = np.maximum.reduce


def _non_negative(array: np.ndarray, field: str, what: str) -> None:
    if array.size and _min(array, axis=None) < 0:
        raise RecordError(field, f"negative {what} at index {int(np.flatnonzero(array.ravel() < 0)[0])}")


def _logprobs(array: np.ndarray, field: str, *, allow_neg_inf: bool) -> None:
    """Every value ≤ 0 and not NaN (and finite unless ``allow_neg_inf``), in two reductions."""
    if not array.size:
        return
    if _max(array, axis=None) <= 0 and (allow_neg_inf or _min(array, axis=None) >= -_FLOAT32_MAX):
        return  # NaN propagates through both reductions, so it fails the comparisons
    flat = array.ravel()
    for problem, mask in (
        ("NaN", np.isnan(flat)),
        ("positive value", flat > 0),
        ("-inf", np.isneginf(flat) if not allow_neg_inf else np.zeros(flat.shape, bool)),
    ):
        if mask.any():
            raise RecordError(field, f"{problem} at {_where(field)} index {int(np.flatnonzero(mask)[0])}")


def _where(field: str) -> str:
    return "completion" if field == "logprobs" else "flat"


def check_json(value: Any, field: str, depth: int = 0) -> None:
    """Free-form JSON a database keeps as such: str keys, finite numbers, clean text, bounded depth."""
    if depth > MAX_JSON_DEPTH:
        raise RecordError(field, f"nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RecordError(field, f"{value} is not a finite number (JSON has no NaN or infinity)")
    elif isinstance(value, str):
        check_text(value, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise RecordError(field, f"key {key!r} is not a string")
            check_text(key, field)
            check_json(item, f"{field}.{key}", depth + 1)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_json(item, f"{field}.{i}", depth + 1)
    else:
        raise RecordError(field, f"{type(value).__name__} is not JSON (use str, number, bool, list, dict)")


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


def _schema_version(record: Record) -> None:
    if getattr(record, "schema_version", None) != SCHEMA_VERSION:
        raise RecordError(
            "schema_version", f"{getattr(record, 'schema_version', None)!r} is not {SCHEMA_VERSION}"
        )


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
    weight_version: str | None = Field(default=None, max_length=128)
    weight_digest: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _check_text(self) -> Manifest:
        check_text(self.process, "process")
        for name in ("runtime", "contract"):
            check_json(getattr(self, name).model_dump(), name)
        for name in ("regions", "unobserved", "numerical_policy"):
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


def _repeats(rows: np.ndarray) -> bool:
    """Whether any row of ``rows`` [n, k] holds a value twice: one transposing copy into contiguous
    slot planes, then k(k-1)/2 plane comparisons into one reused buffer, stopping at the first hit
    (sorting each tiny row costs ~25x more; comparing strided columns ~10x)."""
    n, k = rows.shape
    if k < 2 or not n:
        return False
    planes = np.ascontiguousarray(rows.T)
    same = np.empty(n, dtype=bool)
    for s in range(1, k):
        for t in range(s):
            np.equal(planes[s], planes[t], out=same)
            if same.any():
                return True
    return False


#: Bounds of a routing record: MoE layers, experts chosen per token, experts per layer.
MAX_MOE_LAYERS = 1024
MAX_TOP_K = 64
MAX_EXPERTS = 65535


class Routes(BaseModel):
    """The experts each MoE layer chose for each token of one sample on one side (issue 19).

    ``experts[j, l * top_k + s]`` is the expert that layer ``layers[l]`` put in slot ``s`` for the
    token at absolute position ``positions[j]``: slot order as the router produced it (the combine
    order), one byte per choice for up to 256 experts. ``replayed[j]`` (trainer side, routing replay
    R3) is 1 where the route was taken from the rollout instead of computed by the router.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    layers: list[int] = Field(description="decoder layer index of each MoE layer recorded, ascending")
    top_k: int = Field(ge=1, le=MAX_TOP_K)
    num_experts: int = Field(ge=1, le=MAX_EXPERTS)
    positions: Int32Array
    experts: ExpertIdMatrix
    replayed: UInt8Array | None = None

    @model_validator(mode="after")
    def _check(self) -> Routes:
        self.check(None)
        return self

    def check(self, n_tokens: int | None) -> None:
        """Shapes, bounds and distinctness, in vectorised reductions; ``n_tokens``: the sample's
        sequence length (positions must fall inside it). Raises RecordError naming ``routes.<field>``."""
        self._check_arrays(n_tokens)

    def check_within(self, n_tokens: int | None) -> None:
        """The one check that needs the sample: the last position inside its ``n_tokens`` tokens
        (for Routes that :meth:`check` has already passed, e.g. just built by pydantic)."""
        positions = self.positions
        if n_tokens is not None and positions.size and int(positions[-1]) >= n_tokens:
            raise RecordError(
                "routes.positions", f"{int(positions[-1])} is past the sample's {n_tokens} tokens"
            )

    def _check_arrays(self, n_tokens: int | None) -> None:
        layers = self.layers
        if type(layers) is not list or not all(type(i) is int and 0 <= i <= MAX_MOE_LAYERS for i in layers):
            raise RecordError("routes.layers", f"expected a list of layer indices in 0..{MAX_MOE_LAYERS}")
        if not layers or any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
            raise RecordError("routes.layers", "expected at least one layer, strictly ascending")
        top_k = _int(self.top_k, "routes.top_k", 1, MAX_TOP_K)
        num_experts = _int(self.num_experts, "routes.num_experts", 1, MAX_EXPERTS)
        if top_k > num_experts:
            raise RecordError("routes.top_k", f"{top_k} exceeds num_experts {num_experts}")
        positions = _array(self.positions, "routes.positions", "i", 1)
        experts = self.experts
        if not isinstance(experts, np.ndarray) or experts.dtype.kind != "u" or experts.dtype.itemsize > 2:
            raise RecordError("routes.experts", "expected a uint8 or uint16 numpy array")
        width = len(layers) * top_k
        if experts.ndim != 2 or experts.shape != (positions.size, width):
            raise RecordError(
                "routes.experts",
                f"shape {list(experts.shape)} must be [{positions.size} positions, {len(layers)} layers x {top_k}]",
            )
        # Ids below num_experts: one reduction (uint8 ids of a model with 256 or more experts
        # cannot be out of range at all).
        if (
            experts.size
            and num_experts < 256**experts.dtype.itemsize
            and int(_max(experts, axis=None)) >= num_experts
        ):
            raise RecordError("routes.experts", f"an expert id is not below num_experts {num_experts}")
        if positions.size:
            _non_negative(positions, "routes.positions", "position")
            if positions.size > 1 and not (positions[1:] > positions[:-1]).all():
                raise RecordError("routes.positions", "must be strictly ascending")
            self.check_within(n_tokens)
            if top_k > 1 and _repeats(experts.reshape(positions.size * len(layers), top_k)):
                raise RecordError("routes.experts", "one layer chose the same expert twice for a token")
        if self.replayed is not None:
            replayed = _array(self.replayed, "routes.replayed", "b", 1)
            if replayed.size != positions.size:
                raise RecordError("routes.replayed", f"{replayed.size} values for {positions.size} positions")
            if replayed.size and int(_max(replayed, axis=None)) > 1:
                raise RecordError("routes.replayed", "values must be 0 (computed) or 1 (replayed)")

    def layer_experts(self) -> np.ndarray:
        """``experts`` as ``[positions, layers, top_k]``."""
        return self.experts.reshape(self.positions.size, len(self.layers), self.top_k)


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
    weight_version: str | None = Field(default=None, max_length=128)
    prompt_len: int = Field(ge=0, le=MAX_INT32)
    token_ids: Int32Array
    logprobs: Float32Array
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(
        default=None, ge=0.0, le=1.0, description="min-p: the engine's sampler, or what the trainer applied"
    )
    weight_spans: list[WeightSpan] | None = Field(
        default=None,
        description="the weight version of each span of completion tokens, in order from index 0 "
        "(asynchronous RL with in-flight weight updates); absent: every token is weight_version's",
    )
    rank: int | None = Field(
        default=None,
        ge=0,
        le=MAX_INT32,
        description="the rank that recorded this side of the sample (a torch.distributed trainer rank, "
        "an engine worker's data-parallel rank); absent for a single-process job",
    )

    @model_validator(mode="after")
    def _check_weight_spans(self) -> SampleLogprobs:
        if self.weight_spans is not None:
            check_weight_spans(self.weight_spans, int(self.token_ids.size) - int(self.prompt_len))
        return self

    semantics: LogprobSemantics = "processed"
    routes: Routes | None = Field(
        default=None, description="MoE routing: the experts each layer chose per token (issue 19)"
    )
    topk_ids: Int32Matrix | None = None
    topk_logprobs: Float32Matrix | None = None
    path: dict[str, PathValue] = Field(
        default_factory=dict,
        description="how this side computed this sample where the runtime may take another path, e.g. "
        "prefix_cached_tokens (prompt tokens served from a prefix cache), prefill_chunks",
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
        # well: tests/audit/test_records_routes.py), so only the bound that needs the sample is left.
        return self._checked(routes_checked=True)

    def checked(self) -> SampleLogprobs:
        """Every field's type and bounds, and the arrays' dtypes, lengths, signs and finiteness, in
        vectorised reductions; derives ``sample_key`` from the tokens when it is unset."""
        return self._checked(routes_checked=False)

    def _checked(self, *, routes_checked: bool) -> SampleLogprobs:
        _schema_version(self)
        _run_id(self.run_id)
        _int(self.step, "step", 0, MAX_STEP)
        _member(self.side, "side", _SIDES)
        tokens = _array(self.token_ids, "token_ids", "i", 1)
        logprobs = _array(self.logprobs, "logprobs", "f", 1)
        n_tokens = tokens.size
        prompt_len = _int(self.prompt_len, "prompt_len", 0, MAX_INT32)
        if prompt_len > n_tokens:
            raise RecordError("prompt_len", f"{prompt_len} is past the end of token_ids ({n_tokens} tokens)")
        n_completion = n_tokens - prompt_len
        if logprobs.size != n_completion:
            raise RecordError(
                "logprobs",
                f"{logprobs.size} values for {n_completion} completion tokens "
                f"(token_ids has {n_tokens}, prompt_len is {prompt_len})",
            )
        _logprobs(logprobs, "logprobs", allow_neg_inf=False)
        _non_negative(tokens, "token_ids", "token id")
        self._check_scalars()
        self._check_topk(n_completion)
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
            try:
                check_weight_spans(self.weight_spans, n_completion)
            except ValueError as exc:
                raise RecordError("weight_spans", str(exc).removeprefix("weight_spans: ")) from None
        if self.sample_key is None:
            self.sample_key = sample_key(tokens)
        else:
            _sample_key(self.sample_key)
        return self

    def _check_scalars(self) -> None:
        self.weight_version = _weight_version(self.weight_version)
        if self.weight_version is not None:
            _text(self.weight_version, "weight_version", max_length=128)
        temperature = self.temperature
        if type(temperature) is not float and (
            isinstance(temperature, bool) or not isinstance(temperature, int | float | np.floating)
        ):
            raise RecordError("temperature", f"expected a number, got {type(temperature).__name__}")
        if not 0 <= temperature < math.inf:  # NaN fails too
            raise RecordError("temperature", f"{temperature} is not a finite number ≥ 0")
        if self.top_k is not None:
            _int(self.top_k, "top_k", -1, MAX_INT32)
        top_p = self.top_p
        if top_p is not None and (
            isinstance(top_p, bool) or not isinstance(top_p, float | int) or not 0 < top_p <= 1
        ):
            raise RecordError("top_p", f"{top_p!r} is not a number in (0, 1]")
        min_p = self.min_p
        if min_p is not None and (
            isinstance(min_p, bool) or not isinstance(min_p, float | int) or not 0 <= min_p <= 1
        ):
            raise RecordError("min_p", f"{min_p!r} is not a number in [0, 1]")
        _member(self.semantics, "semantics", _SEMANTICS)
        if self.rank is not None:
            _int(self.rank, "rank", 0, MAX_INT32)
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
        _array(ids, "topk_ids", "i", 2)
        _array(logprobs, "topk_logprobs", "f", 2)
        if ids.shape != logprobs.shape or ids.shape[0] != n_completion:
            raise RecordError(
                "topk_logprobs",
                f"shape {list(logprobs.shape)} and topk_ids {list(ids.shape)} must both be [{n_completion}, k]",
            )
        _non_negative(ids, "topk_ids", "token id")
        # -inf is a real answer here: a token outside the kept top-k/top-p set has probability 0.
        _logprobs(logprobs, "topk_logprobs", allow_neg_inf=True)

    @property
    def completion_ids(self) -> np.ndarray:
        return self.token_ids[self.prompt_len :]


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
    region: str = Field(min_length=1, max_length=128, description="canonical region name, e.g. layers.2.mlp")
    forward_index: int = Field(
        default=0, ge=0, le=MAX_INT32, description="which call of the region, when it runs twice"
    )
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
        _schema_version(self)
        _run_id(self.run_id)
        _int(self.step, "step", 0, MAX_STEP)
        _member(self.side, "side", _SIDES)
        _member(self.case, "case", _CASES)
        _sample_key(self.sample_key)
        _text(self.region, "region", min_length=1, max_length=128)
        _int(self.forward_index, "forward_index", 0, MAX_INT32)
        positions = _array(self.positions, "positions", "i", 1)
        rows = positions.size
        for name, kind in (("digest", "u"), ("l2", "f"), ("maxabs", "f")):
            array = _array(getattr(self, name), name, kind, 1)
            if array.shape[0] != rows:
                raise RecordError(name, f"{array.shape[0]} rows for {rows} positions")
        for name, kind in (("ladder", "u"), ("sketch", "f")):
            array = _array(getattr(self, name), name, kind, 2)
            if array.shape[0] != rows and rows:
                raise RecordError(name, f"{array.shape[0]} rows for {rows} positions")
        bits = self.ladder_bits
        if type(bits) is not list or not all(type(b) is int and 0 <= b <= 64 for b in bits):
            raise RecordError("ladder_bits", "expected a list of integers in 0..64")
        if rows and self.ladder.shape[1] != len(bits):
            raise RecordError("ladder", f"{self.ladder.shape[1]} rungs but ladder_bits names {len(bits)}")
        _non_negative(positions, "positions", "position")
        if rows > 1 and not (positions[1:] > positions[:-1]).all() and np.unique(positions).size != rows:
            raise RecordError("positions", "repeated position")
        return self


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class StepStats(Record):
    """The RL loop's own figures for one step (reward, entropy, clip fraction, phase times), so the
    dashboard can set the mismatch beside what the job optimises. One per (run, step); a second
    one for the same step replaces nothing (the first stored wins, as for every record)."""

    kind: Literal["step_stats"] = "step_stats"
    run_id: RunId
    step: Step
    reward_mean: FiniteFloat | None = None
    reward_std: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    entropy: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    clip_fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    generation_s: Seconds | None = None
    training_s: Seconds | None = None
    extras: dict[str, FiniteFloat] = Field(
        default_factory=dict, max_length=64, description="any other per-step figure, by name"
    )
    created_at: datetime = Field(default_factory=utcnow)

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


AnyRecord = Annotated[
    Run | Manifest | SampleLogprobs | RegionFingerprints | StepStats, Field(discriminator="kind")
]
RECORD_KINDS = ("run", "manifest", "sample", "fingerprints", "step_stats")

_record_adapter: TypeAdapter[Run | Manifest | SampleLogprobs | RegionFingerprints | StepStats] = TypeAdapter(
    AnyRecord
)


def record_error(exc: ValidationError, *, tagged: bool = False) -> RecordError:
    """The first error of a failed validation as a :class:`RecordError` naming its field (the kind tag
    of a discriminated union, ``tagged``, is dropped from the location)."""
    errors = exc.errors(include_input=False, include_url=False)
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, RecordError):
        return cause
    loc = list(first.get("loc", ()))
    if tagged and loc and loc[0] in RECORD_KINDS:
        loc = loc[1:]
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        loc = ["kind"]
    field = ".".join(str(part) for part in loc) or "record"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return RecordError(field, f"{first.get('msg', 'invalid')}{more}")


def record_kind(item: Any) -> str:
    """The kind tag of a record or of its dict, ``"unknown"`` when there is no kind we know."""
    kind = item.get("kind") if isinstance(item, dict) else getattr(item, "kind", None)
    return kind if isinstance(kind, str) and kind in RECORD_KINDS else "unknown"


def validate_record(item: Any) -> Run | Manifest | SampleLogprobs | RegionFingerprints | StepStats:
    """The store's boundary: a record (however built) or its dict, verified; raises RecordError."""
    if isinstance(item, Record):
        return item.checked()  # type: ignore[return-value]
    if not isinstance(item, dict):
        raise RecordError("record", f"expected a record object, got {type(item).__name__}")
    try:
        return _record_adapter.validate_python(item)
    except ValidationError as exc:
        raise record_error(exc, tagged=True) from None


class Batch(BaseModel):
    """What a sink sends in one request. The store keeps its valid records in one transaction and
    refuses each invalid one by name (:class:`Rejection`)."""

    model_config = ConfigDict(extra="forbid")

    records: list[AnyRecord] = Field(max_length=100_000)


class BatchShape(BaseModel):
    """A body that is a batch at all: an object with a list of records (each checked on its own)."""

    model_config = ConfigDict(extra="forbid")

    records: list[Any] = Field(max_length=100_000)
