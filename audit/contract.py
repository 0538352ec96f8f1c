"""The execution contract (DESIGN.md, "Execution contract"): what both sides promise to compute, how.

A contract names, for every (canonical region, case) pair, the implementation that computes it
(id @ version × arch), the route it takes and its constants — stored as bit patterns, never as
decimal floats, because ``1e-6`` parsed on two machines is a promise about text, not about bits.
Claims add what cannot be read off one entry: topology (pinned to one layout, or invariant over a
domain), state invalidation (e.g. the prefix cache on weight sync) and admitted tolerances.

Three SHA-256 identities over canonical JSON (:func:`identities`):

* ``semantic`` — *which function*: schema_version, model, cases, and each entry's constants.
* ``numerical_policy`` — *which bits*: everything semantic plus each entry's implementation,
  version, arch, route and fused_into, and every claim. It is the hash of
  :func:`numerical_policy_fields`, a flat ``{field: value}`` dict a Manifest carries, so a
  diagnosis can name the differing fields. Both sides must share it (:func:`handshake`).
* ``deployment`` — the whole contract including its ``deployment`` section (names, hosts,
  labels, notes): logged with every manifest, never keyed on.

All three are order-free: reordering cases, entries or claims changes none of them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

import numpy as np
from isoaudit.audit.records import Case, ContractIdentities, Manifest
from isoaudit.audit.regions import canonical_regions, region_order
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

CONTRACT_SCHEMA_VERSION: Final = 1

#: Element types a constant may carry, with their width in bits.
CONSTANT_DTYPES: dict[str, int] = {
    "bfloat16": 16,
    "float16": 16,
    "float32": 32,
    "float64": 64,
    "int8": 8,
    "int16": 16,
    "int32": 32,
    "int64": 64,
    "uint8": 8,
    "uint16": 16,
    "uint32": 32,
    "uint64": 64,
    "bool": 8,
}
ConstantDtype = Literal[
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
]

#: How a region is reached. ``invariant``: an invariant kernel of ``kernels`` (bits independent of
#: the topology named by an invariant claim). ``reference``: that kernel's exact torch reference.
#: ``native``: the framework's own kernel. ``fused``: computed inside another region's kernel.
Route = Literal["invariant", "reference", "native", "fused"]

#: The prefix of implementation ids owned by the ``kernels`` package (its registry).
KERNELS_PREFIX = "kernels."

Name = Annotated[str, Field(min_length=1, max_length=200)]


class ContractError(ValueError):
    """A contract that cannot be used; ``field`` names where (``problems`` lists every one)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        self.field = problems[0].split(":", 1)[0] if problems else ""
        super().__init__("; ".join(problems))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Constant(_Model):
    """A constant as the bits it has on the device: ``{"dtype": "float32", "bits": "0x3f800000"}``."""

    dtype: ConstantDtype
    bits: str

    def value(self) -> np.generic:
        """The constant as a numpy scalar of its dtype (bfloat16 widened to float32)."""
        raw = int(self.bits, 16)
        if self.dtype == "bfloat16":
            return np.array([raw << 16], dtype=np.uint32).view(np.float32)[0]
        width = CONSTANT_DTYPES[self.dtype]
        unsigned = np.array([raw], dtype=f"uint{width}")
        return unsigned.view(np.bool_ if self.dtype == "bool" else np.dtype(self.dtype))[0]


def constant(value: float | int | bool, dtype: ConstantDtype) -> Constant:
    """The :class:`Constant` holding ``value`` rounded to ``dtype`` (round-to-nearest-even)."""
    if dtype not in CONSTANT_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(CONSTANT_DTYPES)}")
    width = CONSTANT_DTYPES[dtype]
    if dtype == "bfloat16":
        f32 = int(np.array([value], dtype=np.float32).view(np.uint32)[0])
        if (f32 & 0x7F800000) == 0x7F800000 and f32 & 0x7FFFFF:
            bits = (f32 >> 16) | 0x40  # NaN stays NaN
        else:
            bits = (f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16
    else:
        bits = int(np.array([value], dtype=np.bool_ if dtype == "bool" else dtype).view(f"uint{width}")[0])
    return Constant(dtype=dtype, bits=f"0x{bits:0{width // 4}x}")


class Implementation(_Model):
    id: Name = Field(
        description="an implementation id, e.g. kernels.rmsnorm.invariant (ours), or vllm.rms_norm for a native kernel"
    )
    version: Name


class CompositionEntry(_Model):
    """One (region, case) pair and how it is computed."""

    region: Name
    case: Case
    implementation: Implementation
    arch: Name = Field(description='device architecture, e.g. "sm_90", "x86_64-avx512", or "any"')
    route: Route
    fused_into: str | None = Field(
        default=None, description="for route 'fused': the region whose kernel computes it"
    )
    # Bare numbers and strings are admitted here only so validate() can name them: see module docstring.
    constants: dict[str, Constant | StrictInt | StrictFloat | str] = Field(default_factory=dict)


class IntRange(_Model):
    min: StrictInt
    max: StrictInt


class TopologyClaim(_Model):
    """The listed regions' bits do not depend on the topology axes of ``domain``: ``pinned`` (each
    axis held at one value, min == max) or ``invariant`` (same bits over the whole range)."""

    kind: Literal["topology"] = "topology"
    regions: list[Name] = Field(min_length=1, description='canonical names or fnmatch patterns; "*" for all')
    cases: list[Case] = Field(default_factory=list, description="empty: every case of the contract")
    mode: Literal["pinned", "invariant"]
    domain: dict[Name, IntRange] = Field(min_length=1, description="e.g. batch_size, tp_size, num_tokens")


class StateInvalidationClaim(_Model):
    """Cached state that is dropped on an event, e.g. the prefix cache on weight sync."""

    kind: Literal["state_invalidation"] = "state_invalidation"
    state: Literal["prefix_cache", "kv_cache", "cuda_graphs", "compiled_graphs", "autotune_cache"]
    on: Literal["weight_sync", "remediation_switch", "contract_change"]


class ToleranceClaim(_Model):
    """An admitted, attributed difference: the listed regions may differ by up to ``max_ulps`` (in
    their output dtype) or agree only to ``min_agreeing_bits`` mantissa bits (the fingerprint ladder)."""

    kind: Literal["tolerance"] = "tolerance"
    regions: list[Name] = Field(min_length=1)
    cases: list[Case] = Field(default_factory=list)
    max_ulps: StrictInt | None = Field(default=None, ge=0)
    min_agreeing_bits: StrictInt | None = Field(default=None, ge=0, le=52)
    reason: str = Field(min_length=1, max_length=500)


Claim = Annotated[TopologyClaim | StateInvalidationClaim | ToleranceClaim, Field(discriminator="kind")]


class ModelSpec(_Model):
    family: Name = Field(description="adapter family, e.g. qwen3, llama, mistral")
    name: Name
    num_layers: StrictInt = Field(ge=0)
    hidden_size: StrictInt = Field(ge=1)
    vocab_size: StrictInt = Field(ge=1)
    dtype: Literal["bfloat16", "float16", "float32"]
    lm_head_dtype: Literal["bfloat16", "float16", "float32"] = "float32"


class Deployment(_Model):
    """Where and by whom — logged (the ``deployment`` identity), never keyed on."""

    name: str = ""
    description: str = ""
    hosts: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    notes: str = ""


class Contract(_Model):
    schema_version: Literal[1] = CONTRACT_SCHEMA_VERSION
    model: ModelSpec
    cases: list[Case] = Field(min_length=1)
    composition: list[CompositionEntry] = Field(min_length=1)
    claims: list[Claim] = Field(default_factory=list)
    deployment: Deployment = Field(default_factory=Deployment)


# ----------------------------------------------------------------------------- canonical JSON


def canonical_json(obj: Any) -> bytes:
    """Compact, key-sorted, UTF-8 JSON of ``obj`` (a pydantic model or JSON data).

    Floats are refused: the identities must hash bits, and the text of a float is not bits.
    """
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    _refuse_floats(data, "")
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _refuse_floats(data: Any, path: str) -> None:
    for where, value in _walk(data, path):
        if isinstance(value, float):
            raise ValueError(
                f"{where or '<root>'}: decimal float {value!r} cannot be canonicalised; store bits"
            )


def _walk(data: Any, path: str) -> Iterable[tuple[str, Any]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _walk(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list | tuple):
        for i, value in enumerate(data):
            yield from _walk(value, f"{path}[{i}]")
    else:
        yield path, data


def _sha256(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


# ----------------------------------------------------------------------------- identities


def _covers(patterns: Iterable[str], region: str) -> bool:
    return any(fnmatchcase(region, p) for p in patterns)


def _claim_cases(claim: TopologyClaim | ToleranceClaim, contract: Contract) -> list[str]:
    return sorted(set(claim.cases or contract.cases))


def _constant_text(value: Any) -> Any:
    return f"{value.dtype}:{value.bits}" if isinstance(value, Constant) else value


def _entry_key(entry: CompositionEntry) -> str:
    return f"composition.{entry.region}.{entry.case}"


def semantic_fields(contract: Contract) -> dict[str, Any]:
    """The fields of the ``semantic`` identity: which function is computed."""
    out: dict[str, Any] = {"schema_version": contract.schema_version, "cases": sorted(set(contract.cases))}
    for name, value in contract.model.model_dump(mode="json").items():
        out[f"model.{name}"] = value
    for entry in contract.composition:
        for name, value in entry.constants.items():
            out[f"{_entry_key(entry)}.constants.{name}"] = _constant_text(value)
    return out


def numerical_policy_fields(contract: Contract) -> dict[str, Any]:
    """The flat ``{field: value}`` dict a Manifest carries as ``numerical_policy``: the semantic fields
    plus implementation, arch, route and claims per (region, case). Its hash is the identity."""
    out = semantic_fields(contract)
    for entry in contract.composition:
        key = _entry_key(entry)
        out[f"{key}.implementation"] = f"{entry.implementation.id}@{entry.implementation.version}"
        out[f"{key}.arch"] = entry.arch
        out[f"{key}.route"] = entry.route
        if entry.fused_into is not None:
            out[f"{key}.fused_into"] = entry.fused_into
    regions = sorted({e.region for e in contract.composition}, key=region_order)
    topology: dict[str, list[str]] = {}
    tolerance: dict[str, list[str]] = {}
    for claim in contract.claims:
        if isinstance(claim, StateInvalidationClaim):
            events = out.setdefault(f"claims.state_invalidation.{claim.state}", [])
            out[f"claims.state_invalidation.{claim.state}"] = sorted({*events, claim.on})
            continue
        if isinstance(claim, TopologyClaim):
            domain = ",".join(f"{axis}={r.min}..{r.max}" for axis, r in sorted(claim.domain.items()))
            text, target = f"{claim.mode}:{domain}", topology
        else:
            text = f"max_ulps={claim.max_ulps},min_agreeing_bits={claim.min_agreeing_bits}"
            target = tolerance
        for region in regions:
            if _covers(claim.regions, region):
                for case in _claim_cases(claim, contract):
                    target.setdefault(f"{region}.{case}", []).append(text)
    for prefix, claims in (("claims.topology", topology), ("claims.tolerance", tolerance)):
        for where, texts in claims.items():
            out[f"{prefix}.{where}"] = sorted(set(texts))
    return dict(sorted(out.items()))


def _normalised(contract: Contract) -> dict[str, Any]:
    """The contract as data with every order-free list sorted: what ``deployment`` hashes."""
    data = contract.model_dump(mode="json")
    data["cases"] = sorted(set(data["cases"]))
    data["composition"] = sorted(data["composition"], key=lambda e: (region_order(e["region"]), e["case"]))
    data["claims"] = sorted(data["claims"], key=lambda c: canonical_json(c))
    for claim in data["claims"]:
        for name in ("regions", "cases"):
            if name in claim:
                claim[name] = sorted(set(claim[name]))
    data["deployment"]["hosts"] = sorted(data["deployment"]["hosts"])
    return data


def identities(contract: Contract) -> ContractIdentities:
    """The three SHA-256 identities (hex) of ``contract``; see the module docstring for their fields."""
    return ContractIdentities(
        semantic=_sha256(semantic_fields(contract)),
        numerical_policy=policy_identity(numerical_policy_fields(contract)),
        deployment=_sha256(_normalised(contract)),
    )


def policy_identity(fields: dict[str, Any]) -> str:
    """The ``numerical_policy`` identity of a fields dict (as carried by a Manifest)."""
    return _sha256(fields)


def manifest_fields(contract: Contract) -> dict[str, Any]:
    """What a collector puts into its Manifest: ``Manifest(..., **manifest_fields(contract))``."""
    return {"contract": identities(contract), "numerical_policy": numerical_policy_fields(contract)}


# ----------------------------------------------------------------------------- validation

_HEX = re.compile(r"^0x[0-9a-f]+$")


def validate(contract: Contract) -> list[str]:
    """Every problem of ``contract`` as ``"field: what is wrong"``; empty means valid.

    Checks: each (canonical region, case) pair is covered exactly once; constants are dtype-tagged
    bit patterns of the right width (never decimal floats); each route's requirements; claims
    name regions and cases the contract has.
    """
    problems: list[str] = []
    regions = canonical_regions(contract.model.num_layers)
    region_set = set(regions)
    cases = list(contract.cases)
    for case, count in Counter(cases).items():
        if count > 1:
            problems.append(f"cases: {case!r} listed {count} times")
    seen: dict[tuple[str, str], list[int]] = {}
    for i, entry in enumerate(contract.composition):
        where = f"composition[{i}]"
        if entry.region not in region_set:
            problems.append(
                f"{where}.region: {entry.region!r} is not a canonical region of a "
                f"{contract.model.num_layers}-layer model"
            )
        if entry.case not in cases:
            problems.append(f"{where}.case: {entry.case!r} is not one of the contract's cases {cases}")
        seen.setdefault((entry.region, entry.case), []).append(i)
        problems.extend(_constant_problems(entry, where))
    for region in regions:
        for case in dict.fromkeys(cases):
            hits = seen.get((region, case), [])
            if not hits:
                problems.append(f"composition: ({region}, {case}) is not covered")
            elif len(hits) > 1:
                problems.append(
                    f"composition: ({region}, {case}) is covered {len(hits)} times (entries {hits})"
                )
    problems.extend(_claim_problems(contract, regions))
    problems.extend(_route_problems(contract, seen))
    return problems


def _constant_problems(entry: CompositionEntry, where: str) -> list[str]:
    problems = []
    for name, value in entry.constants.items():
        at = f"{where}.constants.{name}"
        if isinstance(value, float):
            hint = constant(value, "float32")
            problems.append(
                f"{at}: decimal float {value!r}; store the bit pattern, e.g. "
                f'{{"dtype": "float32", "bits": "{hint.bits}"}}'
            )
        elif isinstance(value, int):
            problems.append(
                f'{at}: bare number {value!r}; tag it, e.g. {{"dtype": "int64", "bits": "0x{value & (2**64 - 1):016x}"}}'
            )
        elif isinstance(value, str):
            problems.append(
                f'{at}: untagged value {value!r}; a constant is {{"dtype": ..., "bits": "0x..."}}'
            )
        else:
            digits = CONSTANT_DTYPES[value.dtype] // 4
            if not _HEX.match(value.bits) or len(value.bits) != digits + 2:
                problems.append(
                    f"{at}.bits: {value.bits!r} is not {digits} lowercase hex digits after 0x (a {value.dtype} bit pattern)"
                )
            elif value.dtype == "bool" and int(value.bits, 16) > 1:
                problems.append(f"{at}.bits: a bool is 0x00 or 0x01, got {value.bits}")
    return problems


def _claim_problems(contract: Contract, regions: list[str]) -> list[str]:
    problems = []
    for i, claim in enumerate(contract.claims):
        where = f"claims[{i}]"
        if isinstance(claim, StateInvalidationClaim):
            continue
        for j, pattern in enumerate(claim.regions):
            if not any(fnmatchcase(r, pattern) for r in regions):
                problems.append(f"{where}.regions[{j}]: {pattern!r} matches no canonical region")
        for j, case in enumerate(claim.cases):
            if case not in contract.cases:
                problems.append(f"{where}.cases[{j}]: {case!r} is not one of the contract's cases")
        if isinstance(claim, TopologyClaim):
            for axis, span in claim.domain.items():
                if span.min > span.max:
                    problems.append(f"{where}.domain.{axis}: min {span.min} > max {span.max}")
                elif claim.mode == "pinned" and span.min != span.max:
                    problems.append(
                        f"{where}.domain.{axis}: a pinned axis holds one value (min == max), got {span.min}..{span.max}"
                    )
                elif claim.mode == "invariant" and span.min == span.max:
                    problems.append(
                        f"{where}.domain.{axis}: an invariant axis spans a range; one value is 'pinned'"
                    )
        elif claim.max_ulps is None and claim.min_agreeing_bits is None:
            problems.append(f"{where}: a tolerance gives max_ulps or min_agreeing_bits")
    return problems


def _claimed(
    contract: Contract,
    kind: type[TopologyClaim] | type[ToleranceClaim],
    region: str,
    case: str,
    mode: str | None = None,
) -> bool:
    for claim in contract.claims:
        if isinstance(claim, kind) and (mode is None or getattr(claim, "mode", None) == mode):
            if _covers(claim.regions, region) and case in (claim.cases or contract.cases):
                return True
    return False


def _route_problems(contract: Contract, seen: dict[tuple[str, str], list[int]]) -> list[str]:
    problems = []
    for i, entry in enumerate(contract.composition):
        where = f"composition[{i}]"
        impl = entry.implementation.id
        if entry.route != "fused" and entry.fused_into is not None:
            problems.append(f"{where}.fused_into: only a 'fused' route names the region that computes it")
        if entry.route in ("invariant", "reference") and not impl.startswith(KERNELS_PREFIX):
            problems.append(
                f"{where}.implementation.id: route {entry.route!r} needs a kernel of the registry "
                f"({KERNELS_PREFIX}*), got {impl!r}"
            )
        if entry.route == "invariant" and not _claimed(
            contract, TopologyClaim, entry.region, entry.case, "invariant"
        ):
            problems.append(
                f"{where}.route: 'invariant' needs a topology claim (mode 'invariant') covering "
                f"({entry.region}, {entry.case}) that says over which domain"
            )
        if entry.route == "native":
            if entry.arch == "any":
                problems.append(f"{where}.arch: a 'native' kernel's bits depend on the device; name the arch")
            if not (
                _claimed(contract, TopologyClaim, entry.region, entry.case, "pinned")
                or _claimed(contract, ToleranceClaim, entry.region, entry.case)
            ):
                problems.append(
                    f"{where}.route: 'native' needs a pinned topology claim or an admitted tolerance "
                    f"covering ({entry.region}, {entry.case})"
                )
        if entry.route == "fused":
            target = entry.fused_into
            if target is None:
                problems.append(
                    f"{where}.fused_into: route 'fused' names the region whose kernel computes it"
                )
            elif target == entry.region:
                problems.append(f"{where}.fused_into: a region cannot be fused into itself")
            elif (target, entry.case) not in seen:
                problems.append(f"{where}.fused_into: {target!r} has no entry for case {entry.case!r}")
            else:
                host = contract.composition[seen[(target, entry.case)][0]]
                if host.route == "fused":
                    problems.append(
                        f"{where}.fused_into: {target!r} is itself fused; name the region that computes it"
                    )
                elif host.implementation != entry.implementation:
                    problems.append(
                        f"{where}.implementation: a fused region carries its host's implementation "
                        f"({host.implementation.id}@{host.implementation.version})"
                    )
    return problems


# ----------------------------------------------------------------------------- files


def dump_contract(contract: Contract, path: str | Path) -> None:
    """Write ``contract`` as indented UTF-8 JSON in field order; :func:`load_contract` of the file and
    ``dump_contract`` again reproduce it byte for byte (list order is kept as written)."""
    Path(path).write_bytes(contract_bytes(contract))


def contract_bytes(contract: Contract) -> bytes:
    """The file form of ``contract`` (what :func:`dump_contract` writes)."""
    data = contract.model_dump(mode="json")
    return (json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = Counter(k for k, _ in pairs)
    repeated = [k for k, n in keys.items() if n > 1]
    if repeated:
        raise ContractError([f"{repeated[0]}: key repeated in one JSON object"])
    return dict(pairs)


def parse_contract(raw: bytes | str) -> Contract:
    """A valid contract from JSON text, or :class:`ContractError` naming the field(s) at fault."""
    try:
        data = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ContractError([f"<json>: line {exc.lineno} column {exc.colno}: {exc.msg}"]) from exc
    try:
        contract = Contract.model_validate(data)
    except ValidationError as exc:
        raise ContractError(
            [f"{_loc(err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors(include_url=False)]
        ) from exc
    problems = validate(contract)
    if problems:
        raise ContractError(problems)
    return contract


def load_contract(path: str | Path) -> Contract:
    """Read, parse and validate a contract file (:class:`ContractError` names the field)."""
    return parse_contract(Path(path).read_bytes())


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# ----------------------------------------------------------------------------- handshake


@dataclass(frozen=True)
class HandshakeResult:
    """Whether a trainer and an engine may be compared as one policy, and if not, why;
    ``differing_regions``: the canonical regions whose entries or claims differ, in forward order."""

    ok: bool
    reasons: list[str] = field(default_factory=list)
    differing_fields: list[str] = field(default_factory=list)
    differing_regions: list[str] = field(default_factory=list)


_CASE_NAMES = "|".join(get_args(Case))
_REGION_FIELD = re.compile(
    rf"^(?:composition|claims\.topology|claims\.tolerance)\.(.+)\.(?:{_CASE_NAMES})(?:\.|$)"
)


def policy_regions(fields: Iterable[str]) -> list[str]:
    """The regions that numerical-policy field names are about, in forward order (fields of the
    model, the cases or state claims name no region)."""
    found = {m.group(1) for name in fields if (m := _REGION_FIELD.match(name))}
    return sorted(found, key=region_order)


def diff_policy(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The numerical-policy fields whose values differ (or exist on one side only), sorted."""
    return sorted((k for k in a.keys() | b.keys() if a.get(k, _MISSING) != b.get(k, _MISSING)), key=str)


_MISSING = object()


#: Runtime facts that set the invariant kernels' bits beside the composition's implementations
#: (``collectors.manifest.kernel_facts``): ``gemm_split``, the GEMM's fixed split-K policy (which
#: weights (N, K) sum K in fixed spans, and how). Both sides state them while the kernels route;
#: the handshake refuses two that differ.
KERNEL_SETTINGS: Final = {
    "gemm_split": "the invariant GEMM's fixed split-K policy (it orders the sum over K); "
    "run both sides under one (isoaudit.kernels.gemm_policy.set_split_policy, or the same ISOAUDIT_GEMM_SPLIT_K)",
}


def kernel_setting_differences(trainer: Manifest, engine: Manifest) -> dict[str, tuple[Any, Any]]:
    """The :data:`KERNEL_SETTINGS` both manifests state with different values:
    ``{"runtime.<name>": (trainer's, engine's)}``."""
    a, b = trainer.runtime.model_extra or {}, engine.runtime.model_extra or {}
    return {
        f"runtime.{name}": (a[name], b[name])
        for name in KERNEL_SETTINGS
        if a.get(name) is not None and b.get(name) is not None and a[name] != b[name]
    }


def handshake(trainer: Manifest, engine: Manifest) -> HandshakeResult:
    """Refuse (with reasons naming fields) unless both manifests carry the same numerical policy
    and state the same :data:`KERNEL_SETTINGS`.

    The deployment identity may differ (it is logged, never keyed). A manifest's identity must also
    match the fields it carries, so a stale or hand-edited manifest cannot pass.
    """
    reasons: list[str] = []
    settings = kernel_setting_differences(trainer, engine)
    reasons.extend(
        f"{name}: trainer {mine!r} != engine {theirs!r}: {KERNEL_SETTINGS[name.removeprefix('runtime.')]}"
        for name, (mine, theirs) in settings.items()
    )
    if trainer.side != "trainer":
        reasons.append(f"trainer.side: expected 'trainer', got {trainer.side!r}")
    if engine.side != "rollout":
        reasons.append(f"engine.side: expected 'rollout', got {engine.side!r}")
    for label, manifest in (("trainer", trainer), ("engine", engine)):
        claimed = manifest.contract.numerical_policy
        if not claimed:
            reasons.append(f"{label}.contract.numerical_policy: missing (no contract declared)")
        elif manifest.numerical_policy and policy_identity(manifest.numerical_policy) != claimed:
            reasons.append(
                f"{label}.numerical_policy: fields do not hash to the manifest's identity {claimed[:12]}…"
            )
        cases = manifest.numerical_policy.get("cases")
        if isinstance(cases, list) and manifest.case not in cases:
            reasons.append(f"{label}.case: {manifest.case!r} is not among the contract's cases {cases}")
    differing: list[str] = []
    tp, ep = trainer.contract.numerical_policy, engine.contract.numerical_policy
    if tp and ep and tp != ep:
        if trainer.contract.semantic != engine.contract.semantic:
            reasons.append("contract.semantic: the sides compute different functions")
        silent = [label for label, m in (("trainer", trainer), ("engine", engine)) if not m.numerical_policy]
        if not silent:
            differing = diff_policy(trainer.numerical_policy, engine.numerical_policy)
        if silent:
            reasons.append(
                f"contract.numerical_policy: {tp[:12]}… != {ep[:12]}…; {' and '.join(silent)} "
                f"{'carries' if len(silent) == 1 else 'carry'} no numerical_policy fields, "
                "so the differing fields cannot be named"
            )
        elif differing:
            regions = policy_regions(differing)
            if regions:
                reasons.append(f"regions computed differently: {', '.join(regions)}")
            shown = differing[:20]
            reasons.extend(
                f"numerical_policy.{name}: trainer {trainer.numerical_policy.get(name, '<absent>')!r} "
                f"!= engine {engine.numerical_policy.get(name, '<absent>')!r}"
                for name in shown
            )
            if len(differing) > len(shown):
                reasons.append(f"numerical_policy: {len(differing) - len(shown)} more differing fields")
        else:
            reasons.append(
                f"contract.numerical_policy: {tp[:12]}… != {ep[:12]}… and the manifests carry no fields that differ"
            )
    return HandshakeResult(
        ok=not reasons,
        reasons=reasons,
        differing_fields=[*settings, *differing],
        differing_regions=policy_regions(differing),
    )
