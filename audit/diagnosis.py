"""Why a sample's two sides disagree: the ordered classes of DESIGN.md, cheapest explanation first.

``contract`` → ``weights`` / ``off_policy`` → ``stale_engine_state`` → ``semantics`` → ``inference_path`` → ``numerical`` →
``inconclusive``, plus ``clean`` when the two sides agree bit for bit. Each verdict carries one plain
sentence and the evidence it rests on (``evidence["cause"]`` names the case in a word), so a user can
check it without reading code.

``numerical`` names its sub-cause in ``evidence["cause"]``: ``arithmetic`` or ``precision`` here, and
for MoE models ``routing`` (:func:`audit.routing.explain`, applied by the comparator after this
module's verdict): an upstream numerical difference flipped a routing decision and the flip explains
the logprob gap, with the layer, the token and both sides' experts.

``off_policy`` is a weight-version gap the run declared (``Run.config["off_policy"]``: asynchronous
RL samples with older weights on purpose and its objective corrects for it); an undeclared or
out-of-bound gap, and weights that differ under the same claimed version, stay ``weights``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from isoaudit.audit.metrics import UNKNOWN_LAG
from isoaudit.audit.policy_lag import sampling_versions, token_lags
from isoaudit.audit.quantization import explain as explain_quantization
from isoaudit.audit.records import Manifest, OffPolicy, RegionFingerprints, SampleLogprobs

if TYPE_CHECKING:
    from isoaudit.audit.grid import RegionGrid

DiagnosisKind = Literal[
    "clean",
    "contract",
    "weights",
    "stale_engine_state",
    "off_policy",
    "semantics",
    "quantization",
    "inference_path",
    "numerical",
    "inconclusive",
]

#: Runtime facts that change the inference path (not the arithmetic of a kernel): taken by one side
#: only, they explain a mismatch before any kernel is blamed.
PATH_FACTS = ("prefix_caching", "async_scheduling", "chunked_prefill")

#: Per-sample evidence of whether a path fact was actually taken (``SampleLogprobs.path``). Where a
#: sample carries it, it overrides its side's manifest: an engine with prefix caching on that found
#: nothing cached for this sample computed it the ordinary way.
TAKEN_WHEN: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "prefix_caching": ("prefix_cached_tokens", lambda tokens: int(tokens) > 0),
    "chunked_prefill": ("prefill_chunks", lambda chunks: int(chunks) > 1),
}

#: A systematic logprob offset is "semantic" when it is this many standard errors from zero and
#: larger than SEMANTIC_OFFSET_MIN. Sampling from the processed distribution makes E[Δ] = ±KL(processed ‖ raw),
#: a bias of one sign; numerical noise of bf16 kernels centres on zero.
SEMANTIC_OFFSET_SIGMAS = 4.0
SEMANTIC_OFFSET_MIN = 1e-2

#: The path fact the vLLM collector sets (``SampleLogprobs.path``): prompt tokens served from prefix
#: cache blocks that were computed under an earlier weight version than the one sampling the request
#: (the cache was not invalidated at the weight sync). ``PREFIX_CACHE_STALE_VERSION`` optionally
#: names the version those blocks were computed with.
PREFIX_CACHE_STALE = "prefix_cache_stale_tokens"
PREFIX_CACHE_STALE_VERSION = "prefix_cache_weight_version"

#: Region whose output is a pure table lookup: where it differs, the weights differ.
EMBEDDING_REGION = "embed"

#: Precision facts of a side's manifest that change the arithmetic, most specific first.
PRECISION_FACTS = ("lm_head_dtype", "dtype")

#: Floating-point formats by precision (higher is more precise), to name the less precise side.
_PRECISION_RANK = {
    "float64": 6,
    "fp64": 6,
    "float32": 5,
    "fp32": 5,
    "tf32": 4,
    "bfloat16": 3,
    "bf16": 3,
    "float16": 3,
    "fp16": 3,
    "half": 3,
    "float8_e4m3fn": 1,
    "fp8": 1,
}


@dataclass
class Diagnosis:
    kind: DiagnosisKind
    sentence: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sentence": self.sentence, "evidence": self.evidence}


def _latest(manifests: Sequence[Manifest]) -> Manifest | None:
    return max(manifests, key=lambda m: m.created_at) if manifests else None


def _for_version(manifests: Sequence[Manifest], version: str | None) -> Manifest | None:
    """The latest manifest that describes weight ``version`` (what the side held then), else the latest."""
    matching = [m for m in manifests if version is not None and m.weight_version == version]
    return _latest(matching) or _latest(manifests)


def _sampling_transforms(sample: SampleLogprobs) -> list[str]:
    """The ways the sampler reshaped the distribution (what makes raw and processed logprobs differ)."""
    found = []
    if sample.temperature not in (0.0, 1.0):
        found.append(f"temperature={sample.temperature:g}")
    if sample.top_k is not None and sample.top_k > 0:
        found.append(f"top_k={sample.top_k}")
    if sample.top_p is not None and sample.top_p < 1.0:
        found.append(f"top_p={sample.top_p:g}")
    if sample.min_p is not None and sample.min_p > 0.0:
        found.append(f"min_p={sample.min_p:g}")
    return found


def sampling_parameters(sample: SampleLogprobs) -> dict[str, float | int | None]:
    """The sampler's transforms with "off" spelled one way (None): temperature 1, top_k <= 0,
    top_p 1 and min_p 0 all mean "not applied"."""
    return {
        "temperature": None if sample.temperature in (0.0, 1.0) else sample.temperature,
        "top_k": sample.top_k if sample.top_k is not None and sample.top_k > 0 else None,
        "top_p": sample.top_p if sample.top_p is not None and sample.top_p < 1.0 else None,
        "min_p": sample.min_p if sample.min_p is not None and sample.min_p > 0.0 else None,
    }


def _contract(trainer: Manifest | None, rollout: Manifest | None) -> Diagnosis | None:
    if trainer is None or rollout is None:
        return None
    a, b = trainer.contract.numerical_policy, rollout.contract.numerical_policy
    if a is None and b is None:
        return None
    if a == b:
        return None
    from isoaudit.audit.contract import handshake

    result = handshake(trainer, rollout)
    reasons = list(result.reasons) or [f"numerical_policy identity {a} != {b}"]
    return Diagnosis(
        "contract",
        "The two sides run under different numerical policies: " + "; ".join(reasons[:3]) + ".",
        {"trainer_policy": a, "rollout_policy": b, "reasons": reasons},
    )


def _version_gap(
    trainer: SampleLogprobs, rollout: SampleLogprobs, policy: OffPolicy | None
) -> Diagnosis | None:
    """Claimed versions that differ: ``off_policy`` when the run declared the lag, else ``weights``."""
    spans = sampling_versions(rollout)
    sampled = sorted({v for _, _, v in spans if v is not None})
    tv = trainer.weight_version
    if tv is None or not sampled or sampled == [tv]:
        return None
    lags = token_lags(trainer, rollout)
    known = lags[lags != UNKNOWN_LAG]
    versions = ", ".join(sampled)
    evidence: dict[str, Any] = {
        "trainer_weight_version": tv,
        "rollout_weight_version": rollout.weight_version,
        "sampling_versions": sampled,
        "policy_lag_max": int(known.max()) if known.size else None,
        "policy_lag_min": int(known.min()) if known.size else None,
        "declared": policy.model_dump() if policy is not None else None,
    }
    if not known.size or known.size < lags.size:
        return Diagnosis(
            "weights",
            f"The rollout sampled with weight version {versions} but the trainer scored version {tv}: "
            "stale weights after an in-flight update (versions are not steps, so the lag is unknown).",
            {**evidence, "cause": "version_mismatch"},
        )
    lag_max, lag_min = int(known.max()), int(known.min())
    lag = f"{lag_min}" if lag_min == lag_max else f"{lag_min}..{lag_max}"
    spans_versions = len(sampled) > 1
    reason = None
    if policy is None:
        reason = "the run declares no off-policy design (Run.config['off_policy'])"
    elif lag_min < 0:
        reason = "the rollout's weights are newer than the trainer's"
    elif lag_max > policy.max_staleness:
        reason = f"a lag of {lag_max} exceeds the run's declared max staleness {policy.max_staleness}"
    elif spans_versions and not policy.in_flight_updates:
        reason = "the sample spans several weight versions but the run declares no in-flight updates"
    if reason is None and policy is not None:
        return Diagnosis(
            "off_policy",
            f"Sampled with weights {lag} version(s) behind the trainer (rollout {versions}, trainer {tv}), "
            f"within the run's declared max staleness {policy.max_staleness}: off-policy by design; the "
            "objective's importance correction is for it.",
            {**evidence, "cause": "declared_lag"},
        )
    return Diagnosis(
        "weights",
        f"The rollout sampled with weight version {versions} but the trainer scored version {tv} "
        f"(lag {lag}) and {reason}: stale weights after an in-flight update.",
        {**evidence, "cause": "undeclared_lag" if policy is None else "lag_out_of_bounds"},
    )


def digest_parts(value: str) -> tuple[str | None, str]:
    """``"dtype[shape]:hex"`` (``collectors.held_weights``) as (what it is of, the digest); a bare
    digest has no label."""
    what, sep, digest = value.rpartition(":")
    return (what, digest) if sep else (None, value)


def _held_weights(tm: Manifest | None, rm: Manifest | None) -> Diagnosis | None:
    """Same claimed version, different weights actually held: name the tensors that differ. Tensors
    held in different dtypes or shapes are not compared (a precision difference is not a stale sync)."""
    if tm is None or rm is None:
        return None
    a, b = tm.weight_tensor_digests, rm.weight_tensor_digests
    common: list[str] = []
    not_comparable: list[str] = []
    for name in sorted(set(a) & set(b)):
        (what_a, _), (what_b, _) = digest_parts(a[name]), digest_parts(b[name])
        (not_comparable if what_a is not None and what_b is not None and what_a != what_b else common).append(
            name
        )
    differing = [name for name in common if digest_parts(a[name])[1] != digest_parts(b[name])[1]]
    version = tm.weight_version if tm.weight_version == rm.weight_version else None
    claim = f"both claim weight version {version}" if version is not None else "their claimed versions agree"
    if differing:
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        return Diagnosis(
            "weights",
            f"The two sides hold different weights though {claim}: {len(differing)} of {len(common)} "
            f"tensors differ ({shown}); the engine's weights were not (all) synced.",
            {
                "cause": "held_weights_differ",
                "differing_tensors": differing,
                "tensors_compared": len(common),
                "not_comparable": not_comparable,
                "weight_version": version,
            },
        )
    td, rd = tm.weight_digest, rm.weight_digest
    if td is not None and rd is not None and td != rd:
        return Diagnosis(
            "weights",
            f"The two sides hold different weights though {claim} (their weight digests differ).",
            {"cause": "weight_digest_differs", "trainer_weight_digest": td, "rollout_weight_digest": rd},
        )
    return None


def _embedding(grid: RegionGrid | None, tm: Manifest | None, rm: Manifest | None) -> Diagnosis | None:
    """The embedding is a table lookup with no arithmetic: if it differs anywhere (at the same
    precision), the two sides hold different embedding weights."""
    if grid is None or EMBEDDING_REGION not in grid.regions:
        return None
    td = tm.runtime.dtype if tm is not None else None
    rd = rm.runtime.dtype if rm is not None else None
    if td is not None and rd is not None and td != rd:
        return None  # a different precision changes the looked-up values without different weights
    row = grid.state[grid.regions.index(EMBEDDING_REGION)]
    cols = np.flatnonzero(row == 1)
    if not cols.size:
        return None
    positions = [int(p) for p in grid.positions[cols]]
    return Diagnosis(
        "weights",
        f"The embedding (a pure table lookup) differs at position {positions[0]}"
        f"{f' and {len(positions) - 1} more' if len(positions) > 1 else ''}: the two sides hold different "
        "embedding weights.",
        {"cause": "embedding_differs", "positions": positions[:64], "n_positions": len(positions)},
    )


def _weights(
    trainer: SampleLogprobs,
    rollout: SampleLogprobs,
    tm: Manifest | None,
    rm: Manifest | None,
    grid: RegionGrid | None = None,
    policy: OffPolicy | None = None,
) -> Diagnosis | None:
    return _version_gap(trainer, rollout, policy) or _held_weights(tm, rm) or _embedding(grid, tm, rm)


def _stale_engine_state(
    tm: Manifest | None,
    rm: Manifest | None,
    trainer_manifests: Sequence[Manifest],
    rollout_manifests: Sequence[Manifest],
) -> Diagnosis | None:
    """Held weights agree but a side's forward reads others (:mod:`isoaudit.audit.stale_state`)."""
    from isoaudit.audit.stale_state import stale_engine_state

    return stale_engine_state(tm, rm, trainer_manifests, rollout_manifests)


def _stale_prefix(trainer: SampleLogprobs, rollout: SampleLogprobs) -> Diagnosis | None:
    """A prefix-cache hit on KV blocks computed before a weight sync: the cached prompt positions
    come from the old weights while the rest of the sample uses the new ones."""
    for side, sample in (("rollout", rollout), ("trainer", trainer)):
        stale = sample.path.get(PREFIX_CACHE_STALE)
        if isinstance(stale, int | float) and not isinstance(stale, bool) and stale > 0:
            old = sample.path.get(PREFIX_CACHE_STALE_VERSION)
            computed = f" computed under weight version {old}" if old is not None else ""
            return Diagnosis(
                "inference_path",
                f"Prefix cache crossed a weight update: the {side} served {int(stale)} prompt tokens from "
                f"cache blocks{computed} before the sync to version {sample.weight_version}; reset the prefix "
                "cache at every weight sync.",
                {
                    "cause": "prefix_cache_crossed_weight_update",
                    "side": side,
                    "stale_tokens": int(stale),
                    "cached_weight_version": old,
                    "weight_version": sample.weight_version,
                },
            )
    return None


def _semantics(trainer: SampleLogprobs, rollout: SampleLogprobs) -> Diagnosis | None:
    transforms = _sampling_transforms(rollout)
    if not transforms:
        return None
    if trainer.semantics != rollout.semantics:
        raw_side = "rollout" if rollout.semantics == "raw" else "trainer"
        return Diagnosis(  # raw against processed: a different distribution, not a truncation detail
            "semantics",
            f"The {raw_side} returned raw logprobs while sampling applied {', '.join(transforms)}; "
            "the other side's are processed, so the two measure different distributions.",
            {
                "cause": "raw_vs_processed",
                "raw_side": raw_side,
                "trainer_semantics": trainer.semantics,
                "rollout_semantics": rollout.semantics,
                "sampling": transforms,
            },
        )
    if trainer.semantics == rollout.semantics == "processed":
        engine, applied = sampling_parameters(rollout), sampling_parameters(trainer)
        differing = {
            k: {"rollout": engine[k], "trainer": applied[k]} for k in engine if engine[k] != applied[k]
        }
        if differing:
            what = ", ".join(
                f"{k}={v['rollout']}" if v["rollout"] is not None else f"no {k}" for k, v in differing.items()
            )
            did = ", ".join(f"{k}={v}" for k, v in applied.items() if v is not None) or "no transform"
            truncation = [k for k in differing if k != "temperature"]
            cause = "truncation_mismatch" if truncation else "temperature_mismatch"
            return Diagnosis(
                "semantics",
                f"{'Truncation' if truncation else 'Temperature'} mismatch in the processed logprobs: the engine "
                f"sampled with {what} (renormalised over the kept set) but the trainer applied only {did}; "
                f"parameter at fault: {', '.join(differing)}.",
                {"cause": cause, "parameters": differing, "sampling": transforms},
            )
    delta = trainer.logprobs.astype(np.float64) - rollout.logprobs.astype(np.float64)
    delta = delta[np.isfinite(delta)]
    if delta.size < 8:
        return None
    mean, sem = float(delta.mean()), float(delta.std(ddof=1) / math.sqrt(delta.size))
    if abs(mean) > SEMANTIC_OFFSET_MIN and abs(mean) > SEMANTIC_OFFSET_SIGMAS * max(sem, 1e-12):
        return Diagnosis(
            "semantics",
            f"Logprobs differ by a systematic offset (mean Δ {mean:+.3g}, {abs(mean) / max(sem, 1e-12):.0f} standard "
            f"errors) under {', '.join(transforms)}: one side likely reports logprobs before the sampler's transforms.",
            {"cause": "systematic_offset", "mean_delta": mean, "standard_error": sem, "sampling": transforms},
        )
    return None


def _taken(name: str, sample: SampleLogprobs, manifest: Manifest | None) -> Any:
    """Whether this side took path ``name`` for this sample: the sample's own evidence if it has
    some, else its manifest's setting (None: unknown, counted as not taken)."""
    evidence = TAKEN_WHEN.get(name)
    if evidence is not None and evidence[0] in sample.path:
        return evidence[1](sample.path[evidence[0]])
    return getattr(manifest.runtime, name) if manifest is not None else None


def _inference_path(
    trainer: SampleLogprobs, rollout: SampleLogprobs, tm: Manifest | None, rm: Manifest | None
) -> Diagnosis | None:
    if (tm is None or rm is None) and not (trainer.path or rollout.path):
        return None
    differing = {}
    for name in PATH_FACTS:
        t, r = _taken(name, trainer, tm), _taken(name, rollout, rm)
        if bool(t) != bool(r):
            differing[name] = {"trainer": t, "rollout": r}
    if not differing:
        return None
    described = ", ".join(
        f"{name} on the {'rollout' if v['rollout'] else 'trainer'} only" for name, v in differing.items()
    )
    return Diagnosis(
        "inference_path",
        f"The two sides took different inference paths ({described}); the mismatch can come from the path "
        "rather than a kernel.",
        {
            "cause": "path_differs",
            "differing": differing,
            "trainer_path": dict(trainer.path),
            "rollout_path": dict(rollout.path),
        },
    )


def _quantization(
    trainer: SampleLogprobs, rollout: SampleLogprobs, tm: Manifest | None, rm: Manifest | None
) -> Diagnosis | None:
    """The sides quantize differently, or with batch-mate dependent scales (:mod:`audit.quantization`)."""
    found = explain_quantization(trainer, rollout, tm, rm)
    return Diagnosis("quantization", *found) if found is not None else None


def precision_difference(tm: Manifest | None, rm: Manifest | None) -> dict[str, Any] | None:
    """The first precision fact the two sides' manifests state differently, with the less precise
    side named: ``{"field": "runtime.lm_head_dtype", "trainer": ..., "rollout": ..., "side": ...}``."""
    if tm is None or rm is None:
        return None
    for name in PRECISION_FACTS:
        a, b = getattr(tm.runtime, name), getattr(rm.runtime, name)
        if a is not None and b is not None and str(a).replace("torch.", "") != str(b).replace("torch.", ""):
            ra = _PRECISION_RANK.get(str(a).replace("torch.", "").lower(), 0)
            rb = _PRECISION_RANK.get(str(b).replace("torch.", "").lower(), 0)
            side = "rollout" if rb < ra else "trainer" if ra < rb else None
            return {"field": f"runtime.{name}", "trainer": a, "rollout": b, "side": side}
    return None


def _precision_sentence(found: dict[str, Any]) -> str:
    what = "the lm_head/logits" if found["field"] == "runtime.lm_head_dtype" else "the model"
    side = found["side"]
    if side is None:
        return f"The two sides compute {what} in different precisions ({found['field']}: trainer {found['trainer']}, rollout {found['rollout']})"
    other = "trainer" if side == "rollout" else "rollout"
    return (
        f"The {side} computes {what} in {found[side]} while the {other} uses {found[other]} "
        f"({found['field']})"
    )


def _unobserved_sides(
    prints: tuple[Sequence[RegionFingerprints], Sequence[RegionFingerprints]],
    tm: Manifest | None,
    rm: Manifest | None,
) -> dict[str, str]:
    reasons = {}
    for side, records, manifest in (("trainer", prints[0], tm), ("rollout", prints[1], rm)):
        if not records:
            why = (
                manifest.unobserved.get("*") if manifest else None
            ) or "it sent no fingerprints for this sample"
            reasons[side] = why
    return reasons


def diagnose(
    trainer: SampleLogprobs,
    rollout: SampleLogprobs,
    metrics: dict[str, Any],
    grid: RegionGrid | None,
    trainer_manifests: Sequence[Manifest] = (),
    rollout_manifests: Sequence[Manifest] = (),
    prints: tuple[Sequence[RegionFingerprints], Sequence[RegionFingerprints]] = ((), ()),
    *,
    policy: OffPolicy | None = None,
) -> Diagnosis:
    """The first class of DESIGN.md's order that explains this sample's mismatch. ``policy`` is the
    run's declared off-policy design, if any."""
    logprobs_differ = int(metrics.get("bitwise_mismatch_count", 0)) > 0
    cells_differ = grid is not None and grid.has_differences()
    if not logprobs_differ and not cells_differ:
        observed = (
            "every fingerprinted region and every token" if grid is not None else "every token's logprob"
        )
        return Diagnosis(
            "clean", f"The two sides agree bit for bit on {observed}.", {"n_tokens": metrics.get("n_tokens")}
        )

    tm, rm = _latest(trainer_manifests), _latest(rollout_manifests)
    held_t = _for_version(trainer_manifests, trainer.weight_version)
    held_r = _for_version(rollout_manifests, rollout.weight_version)
    for check in (
        lambda: _contract(tm, rm),
        lambda: _weights(trainer, rollout, held_t, held_r, grid, policy),
        lambda: _stale_engine_state(held_t, held_r, trainer_manifests, rollout_manifests),
        lambda: _stale_prefix(trainer, rollout),
        lambda: _semantics(trainer, rollout),
        lambda: _inference_path(trainer, rollout, tm, rm),
        lambda: _quantization(trainer, rollout, tm, rm),
    ):
        found = check()
        if found is not None:
            found.evidence.setdefault("logprob_abs_diff_mean", metrics.get("logprob_abs_diff_mean"))
            return found
    precision = precision_difference(tm, rm)

    magnitude = {
        "logprob_abs_diff_mean": metrics.get("logprob_abs_diff_mean"),
        "logprob_abs_diff_max": metrics.get("logprob_abs_diff_max"),
        "bitwise_mismatch_count": metrics.get("bitwise_mismatch_count"),
    }
    missing = _unobserved_sides(prints, tm, rm)
    first_cell = grid.first_divergence if grid is not None else None
    if precision is not None and first_cell is None:
        return Diagnosis(
            "numerical",
            f"{_precision_sentence(precision)}: the mismatch comes from that precision difference.",
            {"cause": "precision", "precision": precision, **magnitude},
        )
    if grid is None or missing:
        sides = (
            "; ".join(f"the {side}: {why}" for side, why in missing.items())
            or "no fingerprints on either side"
        )
        return Diagnosis(
            "inconclusive",
            f"Logprobs differ but the divergence cannot be located: not observed on {sides}.",
            {"not_observed": missing, **magnitude},
        )
    first = grid.first_divergence
    if first is None:
        unobserved = grid.not_observed_regions()
        if cells_differ:
            sentence = "Regions differ but none has inputs known to agree"
        else:
            sentence = "Every fingerprinted region agrees yet logprobs differ: the divergence lies after the last one"
        return Diagnosis(
            "inconclusive",
            f"{sentence}; not observed: {', '.join(unobserved) or 'positions outside both sides'}.",
            {"not_observed_regions": unobserved, **magnitude},
        )
    region, position = first
    row = grid.regions.index(region)
    col = int(np.searchsorted(grid.positions, position))
    rel = float(grid.rel_l2[row, col])
    bits = int(grid.agreeing_bits[row, col])
    size = f"relative L2 ≈ {rel:.2g}" if math.isfinite(rel) else "size unknown"
    agree = f", agreeing to {bits} mantissa bits" if bits >= 0 else ""
    earlier_unobserved = [r for r in grid.not_observed_regions() if grid.regions.index(r) < row]
    caveat = f" (not observed before it: {', '.join(earlier_unobserved)})" if earlier_unobserved else ""
    lead = (
        f"{_precision_sentence(precision)}; the"
        if precision is not None
        else "Same inputs, different arithmetic: the"
    )
    return Diagnosis(
        "numerical",
        f"{lead} first divergence is {region} at position {position} ({size}{agree}){caveat}.",
        {
            "cause": "precision" if precision is not None else "arithmetic",
            "precision": precision,
            "first_divergence": {"region": region, "position": position},
            "rel_l2": rel if math.isfinite(rel) else None,
            "agreeing_mantissa_bits": bits if bits >= 0 else None,
            "origins": len(grid.origins),
            "not_observed_before": earlier_unobserved,
            **magnitude,
        },
    )
