"""``stale_engine_state``: a side holds the right weights but its forward reads others.

A weight reload can leave derived state on the old weights while the parameters themselves are
new: CUDA graphs captured over the storage a reload replaced, packed or kept copies of linear
weights the reload did not refresh, an engine that served before its weights arrived. The held
digests (``Manifest.weight_tensor_digests``) then agree with the trainer's and the ``weights``
diagnosis stays silent. The canary (:mod:`isoaudit.audit.records.canary`), run by each side
through its real forward after every weight version change, is the evidence, read three ways,
strongest first:

1. **own reference**: a side whose real path runs derived state also recomputes the canary with
   the same arithmetic straight from the parameters it holds (the reference engine: its CUDA-graph
   decode against the same decode run eagerly); the two differ, though they agreed bit for bit at
   another weight version (the proof that the two paths give equal bits on this setup).
2. **one arithmetic, equal weights**: both sides' canaries were computed under one numerical
   policy (equal ``arithmetic``, e.g. both on isoaudit's invariant kernels) whose canaries agreed
   bit for bit at another weight version (a shared policy identity is only a claim: this is the
   proof that the two really give equal bits), every held-weight digest both sides took agrees, and
   the canaries differ. Sides whose arithmetic differs legitimately give different canaries and
   are not compared this way.
3. **deaf to the update**: a side's held weights changed since its previous canary but its canary
   is bit for bit the same (same arithmetic): its forward never saw the new weights.

Only called after ``weights`` found nothing (held digests agree, versions agree), so a canary that
differs here is not a stale sync; and a canary that agrees leaves the verdict to the later classes
(``numerical`` when the arithmetic differs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from isoaudit.audit.diagnosis import Diagnosis
from isoaudit.audit.records import Canary, CanaryOutput, Manifest

#: The words of the verdict: what holds the old weights.
HOLDERS = "captured graphs, caches or repacked/kept weight copies still hold old weights"


def canary_of(manifest: Manifest | None) -> Canary | None:
    """The manifest's canary when it ran and belongs to the manifest's weight version."""
    if manifest is None or manifest.canary is None:
        return None
    canary = manifest.canary
    if canary.output is None or canary.weight_version != manifest.weight_version:
        return None
    return canary


def max_gap(a: CanaryOutput, b: CanaryOutput) -> float | None:
    """The largest |Δ logprob| over the token ids both top lists hold (``None``: none in common)."""
    left = dict(zip(a.top_ids, a.top_logprobs, strict=True))
    right = dict(zip(b.top_ids, b.top_logprobs, strict=True))
    common = sorted(left.keys() & right.keys())
    if not common:
        return None
    return float(np.max(np.abs(np.array([left[i] - right[i] for i in common], dtype=np.float64))))


def held_agreement(tm: Manifest | None, rm: Manifest | None) -> int:
    """How many tensors both sides digested at the same dtype and shape with equal digests; 0 when
    none are comparable or any of them differs."""
    if tm is None or rm is None:
        return 0
    a, b = tm.weight_tensor_digests, rm.weight_tensor_digests
    compared = 0
    for name in a.keys() & b.keys():
        what_a, _, digest_a = a[name].rpartition(":")
        what_b, _, digest_b = b[name].rpartition(":")
        if what_a and what_b and what_a != what_b:
            continue
        if digest_a != digest_b:
            return 0
        compared += 1
    return compared


def _gap_text(gap: float | None) -> str:
    return f"max |Δ logprob| {gap:.3g} over the top tokens" if gap is not None else "no top token in common"


def agreed_with_reference(manifests: Sequence[Manifest], like: Canary) -> str | None:
    """A weight version other than ``like``'s at which this side's canary, through the same two
    paths, agreed with its own reference bit for bit: proof that the two paths give equal bits."""
    if like.output is None or like.reference is None:
        return None
    agreed = []
    for manifest in manifests:
        canary = canary_of(manifest)
        if canary is None or canary.output is None or canary.reference is None:
            continue
        if canary.weight_version == like.weight_version or canary.tokens != like.tokens:
            continue
        same_paths = (canary.output.path, canary.reference.path) == (like.output.path, like.reference.path)
        if same_paths and canary.output.digest == canary.reference.digest:
            agreed.append(canary.weight_version)
    return sorted(agreed, key=str)[-1] if agreed else None


def _own_reference(side: str, canary: Canary, manifests: Sequence[Manifest]) -> Diagnosis | None:
    out, ref = canary.output, canary.reference
    if out is None or ref is None or out.digest == ref.digest:
        return None
    proven = agreed_with_reference(manifests, canary)
    if proven is None:
        return None
    gap = max_gap(out, ref)
    return Diagnosis(
        "stale_engine_state",
        f"Stale engine state on the {side}: after the sync to weight version {canary.weight_version} its "
        f"canary through {out.path} differs from the same arithmetic recomputed over the weights it holds "
        f"({ref.path}; {_gap_text(gap)}), though the two agree bit for bit at weight version {proven}: {HOLDERS}.",
        {
            "cause": "canary_differs_from_own_reference",
            "side": side,
            "weight_version": canary.weight_version,
            "canary_path": out.path,
            "reference_path": ref.path,
            "canary_digest": out.digest,
            "reference_digest": ref.digest,
            "max_abs_logprob_diff": gap,
            "held_digest": canary.held_digest,
            "paths_agreed_at_version": proven,
        },
    )


def _digests_by_version(manifests: Sequence[Manifest], like: Canary) -> dict[str | None, str]:
    """Weight version -> canary digest of a side's canaries computed like ``like`` (same
    arithmetic, same prompt)."""
    found: dict[str | None, str] = {}
    for manifest in manifests:
        canary = canary_of(manifest)
        if canary is None or canary.output is None:
            continue
        if canary.arithmetic == like.arithmetic and canary.tokens == like.tokens:
            found[canary.weight_version] = canary.output.digest
    return found


def agreed_before(
    trainer_manifests: Sequence[Manifest], rollout_manifests: Sequence[Manifest], like: Canary
) -> str | None:
    """Another weight version than ``like``'s at which both sides' canaries, computed like
    ``like``, agreed bit for bit: proof that their arithmetic really gives equal bits (a shared
    numerical-policy identity is a claim; a contract can be declared on sides that differ)."""
    ours = _digests_by_version(trainer_manifests, like)
    theirs = _digests_by_version(rollout_manifests, like)
    agreed = [v for v in ours.keys() & theirs.keys() if v != like.weight_version and ours[v] == theirs[v]]
    return sorted(agreed, key=str)[-1] if agreed else None


def _across_sides(
    tm: Manifest | None,
    rm: Manifest | None,
    trainer_manifests: Sequence[Manifest],
    rollout_manifests: Sequence[Manifest],
) -> Diagnosis | None:
    ct, cr = canary_of(tm), canary_of(rm)
    if ct is None or cr is None or ct.output is None or cr.output is None:
        return None
    if ct.arithmetic is None or ct.arithmetic != cr.arithmetic or ct.tokens != cr.tokens:
        return None
    if ct.output.digest == cr.output.digest:
        return None
    agreeing = held_agreement(tm, rm)
    if not agreeing:
        return None
    proven = agreed_before(trainer_manifests, rollout_manifests, cr)
    if proven is None:
        return None
    gap = max_gap(ct.output, cr.output)
    return Diagnosis(
        "stale_engine_state",
        f"Stale engine state: both sides hold the same weights ({agreeing} tensor digests agree at weight "
        f"version {cr.weight_version}) under one numerical policy (their canaries agree bit for bit at "
        f"weight version {proven}), yet here their canaries differ ({_gap_text(gap)}; rollout through "
        f"{cr.output.path}, trainer through {ct.output.path}): the engine's forward reads other weights "
        f"than it holds; {HOLDERS}.",
        {
            "cause": "canaries_differ_under_one_arithmetic",
            "side": "rollout",
            "weight_version": cr.weight_version,
            "rollout_canary_path": cr.output.path,
            "trainer_canary_path": ct.output.path,
            "rollout_canary_digest": cr.output.digest,
            "trainer_canary_digest": ct.output.digest,
            "arithmetic": cr.arithmetic,
            "canaries_agreed_at_version": proven,
            "held_tensors_agreeing": agreeing,
            "max_abs_logprob_diff": gap,
        },
    )


def _previous(manifests: Sequence[Manifest], current: Manifest, canary: Canary) -> Canary | None:
    """The side's canary of the weight version before ``current``'s."""
    earlier = [
        c
        for m in manifests
        if m.created_at <= current.created_at and (c := canary_of(m)) is not None
        if c.weight_version != canary.weight_version
    ]
    return earlier[-1] if earlier else None


def _deaf(side: str, manifest: Manifest | None, manifests: Sequence[Manifest]) -> Diagnosis | None:
    canary = canary_of(manifest)
    if manifest is None or canary is None or canary.output is None:
        return None
    before = _previous(sorted(manifests, key=lambda m: m.created_at), manifest, canary)
    if before is None or before.output is None:
        return None
    if None in (before.held_digest, canary.held_digest) or before.held_digest == canary.held_digest:
        return None
    if before.arithmetic != canary.arithmetic or before.tokens != canary.tokens:
        return None
    if before.output.digest != canary.output.digest:
        return None
    return Diagnosis(
        "stale_engine_state",
        f"Stale engine state on the {side}: its held weights changed from version {before.weight_version} "
        f"to {canary.weight_version}, but its canary through {canary.output.path} is bit for bit what it "
        f"was before: its forward never saw the new weights; {HOLDERS}.",
        {
            "cause": "canary_unchanged_by_weight_update",
            "side": side,
            "weight_version": canary.weight_version,
            "previous_weight_version": before.weight_version,
            "canary_path": canary.output.path,
            "canary_digest": canary.output.digest,
            "held_digest": canary.held_digest,
            "previous_held_digest": before.held_digest,
        },
    )


def stale_engine_state(
    tm: Manifest | None,
    rm: Manifest | None,
    trainer_manifests: Sequence[Manifest] = (),
    rollout_manifests: Sequence[Manifest] = (),
) -> Diagnosis | None:
    """``stale_engine_state`` from the canaries of the manifests that describe the sample's weight
    versions (``tm``, ``rm``), or ``None`` when the canaries show nothing stale (or there are none)."""
    sides = (("rollout", rm, rollout_manifests), ("trainer", tm, trainer_manifests))
    for side, manifest, manifests in sides:
        canary = canary_of(manifest)
        found = _own_reference(side, canary, manifests) if canary is not None else None
        if found is not None:
            return found
    found = _across_sides(tm, rm, trainer_manifests, rollout_manifests)
    if found is not None:
        return found
    for side, manifest, manifests in (("rollout", rm, rollout_manifests), ("trainer", tm, trainer_manifests)):
        found = _deaf(side, manifest, manifests)
        if found is not None:
            return found
    return None
