"""Why a sample's two sides disagree: the ordered classes of DESIGN.md, cheapest explanation first.

``contract`` → ``weights`` → ``semantics`` → ``inference_path`` → ``numerical`` → ``inconclusive``,
plus ``clean`` when the two sides agree bit for bit. Each verdict carries one plain sentence and the
evidence it rests on, so a user can check it without reading code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from audit.records import Manifest, RegionFingerprints, SampleLogprobs

if TYPE_CHECKING:
    from audit.compare import RegionGrid

DiagnosisKind = Literal[
    "clean", "contract", "weights", "semantics", "inference_path", "numerical", "inconclusive"
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


@dataclass
class Diagnosis:
    kind: DiagnosisKind
    sentence: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sentence": self.sentence, "evidence": self.evidence}


def _latest(manifests: Sequence[Manifest]) -> Manifest | None:
    return max(manifests, key=lambda m: m.created_at) if manifests else None


def _sampling_transforms(sample: SampleLogprobs) -> list[str]:
    """The ways the sampler reshaped the distribution (what makes raw and processed logprobs differ)."""
    found = []
    if sample.temperature not in (0.0, 1.0):
        found.append(f"temperature={sample.temperature:g}")
    if sample.top_k is not None and sample.top_k > 0:
        found.append(f"top_k={sample.top_k}")
    if sample.top_p is not None and sample.top_p < 1.0:
        found.append(f"top_p={sample.top_p:g}")
    return found


def _contract(trainer: Manifest | None, rollout: Manifest | None) -> Diagnosis | None:
    if trainer is None or rollout is None:
        return None
    a, b = trainer.contract.numerical_policy, rollout.contract.numerical_policy
    if a is None and b is None:
        return None
    if a == b:
        return None
    from audit.contract import handshake

    result = handshake(trainer, rollout)
    reasons = list(result.reasons) or [f"numerical_policy identity {a} != {b}"]
    return Diagnosis(
        "contract",
        "The two sides run under different numerical policies: " + "; ".join(reasons[:3]) + ".",
        {"trainer_policy": a, "rollout_policy": b, "reasons": reasons},
    )


def _weights(
    trainer: SampleLogprobs, rollout: SampleLogprobs, tm: Manifest | None, rm: Manifest | None
) -> Diagnosis | None:
    tv, rv = trainer.weight_version, rollout.weight_version
    if tv is not None and rv is not None and tv != rv:
        return Diagnosis(
            "weights",
            f"The rollout sampled with weight version {rv} but the trainer scored version {tv}: "
            "stale weights after an in-flight update.",
            {"trainer_weight_version": tv, "rollout_weight_version": rv},
        )
    td, rd = (tm.weight_digest if tm else None), (rm.weight_digest if rm else None)
    if td is not None and rd is not None and td != rd:
        return Diagnosis(
            "weights",
            "The two sides hold different weights (their weight digests differ).",
            {"trainer_weight_digest": td, "rollout_weight_digest": rd},
        )
    return None


def _semantics(trainer: SampleLogprobs, rollout: SampleLogprobs) -> Diagnosis | None:
    transforms = _sampling_transforms(rollout)
    if not transforms:
        return None
    if trainer.semantics != rollout.semantics:
        raw_side = "rollout" if rollout.semantics == "raw" else "trainer"
        return Diagnosis(
            "semantics",
            f"The {raw_side} returned raw logprobs while sampling applied {', '.join(transforms)}; "
            "the other side's are processed, so the two measure different distributions.",
            {
                "trainer_semantics": trainer.semantics,
                "rollout_semantics": rollout.semantics,
                "sampling": transforms,
            },
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
            {"mean_delta": mean, "standard_error": sem, "sampling": transforms},
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
        {"differing": differing, "trainer_path": dict(trainer.path), "rollout_path": dict(rollout.path)},
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
) -> Diagnosis:
    """The first class of DESIGN.md's order that explains this sample's mismatch."""
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
    for found in (
        _contract(tm, rm),
        _weights(trainer, rollout, tm, rm),
        _semantics(trainer, rollout),
        _inference_path(trainer, rollout, tm, rm),
    ):
        if found is not None:
            found.evidence.setdefault("logprob_abs_diff_mean", metrics.get("logprob_abs_diff_mean"))
            return found

    magnitude = {
        "logprob_abs_diff_mean": metrics.get("logprob_abs_diff_mean"),
        "logprob_abs_diff_max": metrics.get("logprob_abs_diff_max"),
        "bitwise_mismatch_count": metrics.get("bitwise_mismatch_count"),
    }
    missing = _unobserved_sides(prints, tm, rm)
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
    return Diagnosis(
        "numerical",
        f"Same inputs, different arithmetic: the first divergence is {region} at position {position} "
        f"({size}{agree}){caveat}.",
        {
            "first_divergence": {"region": region, "position": position},
            "rel_l2": rel if math.isfinite(rel) else None,
            "agreeing_mantissa_bits": bits if bits >= 0 else None,
            "origins": len(grid.origins),
            "not_observed_before": earlier_unobserved,
            **magnitude,
        },
    )
