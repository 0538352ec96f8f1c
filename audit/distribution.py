"""Full-distribution comparison at each sampled position (DESIGN.md, "Metrics": full-distribution drift).

Equal sampled-token logprobs do not prove equal distributions. On fingerprinted steps each side
records, per completion position, the distribution its logprobs come from (the side's own
semantics: raw, or after the sampler's transforms) in two compact forms:

* **top-k**: the k most likely token ids and their logprobs (``SampleLogprobs.topk_ids`` /
  ``topk_logprobs``, in rank order);
* **sketch** (``SampleLogprobs.dist_sketch``): ``Rᵀ √p`` for the full-vocabulary probability vector
  ``p``, with ``R`` a fixed ``[vocab, 32]`` matrix of ±1/√32 signs keyed by token id
  (:func:`sketch_projection`), computed on the device from the full log-probabilities.

Estimator: with ``s = Rᵀ√p`` and ``t = Rᵀ√q``, ``E ||s - t||² = ||√p - √q||²`` (the signs are
independent, zero-mean, variance 1/32), so ``Ĥ = ||s - t|| / √2`` estimates the Hellinger distance
``H(p, q) = ||√p - √q|| / √2``; the relative standard deviation of ``Ĥ²`` is at most ``√(2/32) = 0.25``
(``Ĥ`` within about ±13% of ``H`` for one standard deviation). Hellinger brackets total variation:
``H² ≤ TV ≤ H √(2 - H²)``. Equal inputs give equal sketches bit for bit on one device; across
devices or reduction orders the sketch is summed in float64 and stored in float32, so its floor is
about 1e-7 (:data:`SKETCH_FLOOR` is what counts as "differs").

On the top-k the metrics compare the two ranked lists (cut to the smaller k) and the two
distributions on the union ``U`` of the sets: each side's vector over ``U ∪ {rest}`` holds its
recorded probabilities; for a token of ``U`` it did not rank, its own k-th probability (the most it
can hold there); ``rest = max(0, 1 - Σ)``; renormalised to sum 1. TV and KL(trainer ‖ rollout) are
taken on those vectors (KL with a floor of :data:`KL_FLOOR` per entry), an estimate, exact (0) when
both sides recorded the same list with the same bits.

A position's distributions **differ** when the top-k sets differ, a shared token's logprob differs
in any bit, or the sketch distance exceeds :data:`SKETCH_FLOOR`. The metric the issue asks for is
the count of positions where the sampled token's logprob is equal bit for bit while the
distributions differ.

numpy only: the comparator path never loads torch (:mod:`collectors.distribution` is the device half).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from isoaudit.audit.diagnosis import Diagnosis

#: Width of the full-vocabulary sketch (float32 values per position).
SKETCH_DIM = 32
#: Seed of the sketch's sign matrix (changing it changes every sketch).
SKETCH_SEED = 0x15A0D17_D157
#: Sketch Hellinger estimates at or below this are "equal" (float32 storage of an O(1) sum).
SKETCH_FLOOR = 1e-5
#: Probability floor inside KL on the union (an entry of 0 on the rollout side would make it infinite).
KL_FLOOR = 1e-12

#: The per-sample and per-step figures this module defines, for ``isoaudit metrics list``, the API and alerts.
DISTRIBUTION_METRICS: dict[str, str] = {
    "dist_positions": "positions where both sides recorded a top-k (fingerprinted steps)",
    "dist_topk_overlap": "mean |A∩B|/k of the two sides' top-k token sets (k: the smaller side's)",
    "dist_topk_set_equal_fraction": "fraction of positions whose two top-k token sets are equal",
    "dist_topk_rank_agreement": "mean fraction of top-k rank slots holding the same token on both sides",
    "dist_union_tv_mean": "mean total variation on the union of the top-k sets (plus a rest bucket)",
    "dist_union_tv_max": "largest total variation on the union of the top-k sets at any position",
    "dist_union_kl_mean": "mean KL(trainer‖rollout) on the union of the top-k sets (plus a rest bucket)",
    "dist_union_kl_max": "largest KL(trainer‖rollout) on the union of the top-k sets at any position",
    "dist_sketch_hellinger_mean": "mean full-vocabulary Hellinger distance estimated from the sketches (NaN: a side has none)",
    "dist_sketch_hellinger_max": "largest full-vocabulary Hellinger distance estimated from the sketches",
    "dist_differs_positions": "positions whose distributions differ (top-k set, a shared logprob's bits, or the sketch)",
    "dist_sampled_equal_differs": "positions whose sampled-token logprob is bitwise equal but whose distributions differ",
    "dist_sampled_equal_differs_fraction": "dist_sampled_equal_differs / dist_positions",
    "dist_first_differs_position": "the first completion index whose distributions differ (NaN: none)",
}


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


#: The projection's entries: ±this (float32).
SKETCH_SCALE = np.float32(1.0 / np.sqrt(SKETCH_DIM))


def sketch_sign_bits(vocab: int) -> np.ndarray:
    """Each token id's ``SKETCH_DIM`` signs as the bits of one int32 (bit ``c`` set: column ``c``
    is ``+SKETCH_SCALE``), from a keyed hash of the id: the same on every device and side."""
    if vocab < 1:
        raise ValueError(f"vocab: must be >= 1, got {vocab}")
    keys = _splitmix64(np.arange(vocab, dtype=np.uint64) ^ np.uint64(SKETCH_SEED))
    return (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def sketch_projection(vocab: int) -> np.ndarray:
    """The ``[vocab, SKETCH_DIM]`` float32 sign matrix ±1/√SKETCH_DIM of :func:`sketch_sign_bits`."""
    bits = sketch_sign_bits(vocab).view(np.uint32)
    set_ = (bits[:, None] >> np.arange(SKETCH_DIM, dtype=np.uint32)[None, :]) & np.uint32(1)
    return np.where(set_ == 1, SKETCH_SCALE, -SKETCH_SCALE).astype(np.float32)


def sketch_hellinger(sketch_a: np.ndarray, sketch_b: np.ndarray) -> np.ndarray:
    """Per row: the estimated Hellinger distance ``||a - b|| / √2`` between two sketched distributions."""
    a = np.asarray(sketch_a, dtype=np.float64)
    b = np.asarray(sketch_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"dist_sketch: shapes {list(a.shape)} and {list(b.shape)} differ")
    return np.sqrt(np.sum((a - b) ** 2, axis=-1) / 2.0)


@dataclass(frozen=True)
class PositionDistances:
    """Per completion position of one sample (arrays of the positions both sides cover)."""

    k: int
    overlap: np.ndarray  # |A∩B| / k
    set_equal: np.ndarray  # bool
    rank_agreement: np.ndarray  # fraction of rank slots with the same token
    tv: np.ndarray
    kl: np.ndarray
    hellinger: np.ndarray  # NaN where a side has no sketch
    sampled_equal: np.ndarray  # bool: sampled-token logprob bitwise equal
    differs: np.ndarray  # bool

    @property
    def n(self) -> int:
        return int(self.overlap.size)


def _union_vectors(
    ids_t: np.ndarray, lp_t: np.ndarray, ids_r: np.ndarray, lp_r: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool, float]:
    """One position: the two probability vectors over union ∪ {rest}, whether every shared token's
    logprob is bitwise equal, and the set overlap count."""
    union = np.union1d(ids_t, ids_r)
    p = np.exp(lp_t.astype(np.float64))
    q = np.exp(lp_r.astype(np.float64))
    kth_t = float(p.min()) if p.size else 0.0
    kth_r = float(q.min()) if q.size else 0.0
    vec_t = np.full(union.size + 1, kth_t)
    vec_r = np.full(union.size + 1, kth_r)
    pos_t = np.searchsorted(union, ids_t)
    pos_r = np.searchsorted(union, ids_r)
    vec_t[pos_t] = p
    vec_r[pos_r] = q
    vec_t[-1] = vec_r[-1] = 0.0
    vec_t[-1] = max(0.0, 1.0 - float(vec_t.sum()))
    vec_r[-1] = max(0.0, 1.0 - float(vec_r.sum()))
    shared, at_t, at_r = np.intersect1d(ids_t, ids_r, return_indices=True)
    bits_equal = bool(np.array_equal(_bits(lp_t[at_t]), _bits(lp_r[at_r])))
    return vec_t / vec_t.sum(), vec_r / vec_r.sum(), bits_equal, float(shared.size)


def position_distances(trainer: Any, rollout: Any) -> PositionDistances | None:
    """The per-position comparison of two ``SampleLogprobs`` of one sample, or ``None`` when a side
    recorded no top-k. ``k`` is the smaller side's; each side's list is cut to it in rank order."""
    if trainer.topk_ids is None or rollout.topk_ids is None:
        return None
    k = int(min(trainer.topk_ids.shape[1], rollout.topk_ids.shape[1]))
    n = int(min(trainer.topk_ids.shape[0], rollout.topk_ids.shape[0]))
    if k == 0 or n == 0:
        return None
    ids_t, lp_t = _ranked(trainer.topk_ids, trainer.topk_logprobs, k)
    ids_r, lp_r = _ranked(rollout.topk_ids, rollout.topk_logprobs, k)
    overlap, tv, kl = np.empty(n), np.empty(n), np.empty(n)
    bits_equal = np.empty(n, dtype=bool)
    for i in range(n):
        vt, vr, equal, shared = _union_vectors(ids_t[i], lp_t[i], ids_r[i], lp_r[i])
        overlap[i] = shared / k
        bits_equal[i] = equal
        tv[i] = 0.5 * float(np.abs(vt - vr).sum())
        pt, pr = np.maximum(vt, KL_FLOOR), np.maximum(vr, KL_FLOOR)
        kl[i] = max(0.0, float(np.sum(vt * (np.log(pt) - np.log(pr)))))
    set_equal = overlap == 1.0
    rank_agreement = (ids_t[:n] == ids_r[:n]).mean(axis=1)
    hellinger = np.full(n, np.nan)
    sk_t, sk_r = getattr(trainer, "dist_sketch", None), getattr(rollout, "dist_sketch", None)
    if sk_t is not None and sk_r is not None and sk_t.shape[1] == sk_r.shape[1]:
        hellinger = sketch_hellinger(sk_t[:n], sk_r[:n])
    sampled_equal = _bits(trainer.logprobs[:n]) == _bits(rollout.logprobs[:n])
    differs = ~set_equal | ~bits_equal | (np.nan_to_num(hellinger, nan=0.0) > SKETCH_FLOOR)
    return PositionDistances(k, overlap, set_equal, rank_agreement, tv, kl, hellinger, sampled_equal, differs)


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def _ranked(ids: np.ndarray, logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first ``k`` entries by descending logprob (ties by token id), as recorded."""
    order = np.lexsort((ids, -logprobs.astype(np.float64)), axis=-1)[:, :k]
    return (
        np.take_along_axis(ids, order, axis=1).astype(np.int64),
        np.take_along_axis(logprobs, order, axis=1).astype(np.float32),
    )


def _figures(parts: Sequence[PositionDistances]) -> dict[str, float]:
    nan = float("nan")
    n = sum(p.n for p in parts)
    if n == 0:
        return {}

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    hellinger = cat("hellinger")
    differs = cat("differs")
    both = differs & cat("sampled_equal")
    first = [int(np.flatnonzero(p.differs)[0]) for p in parts if p.differs.any()]
    known = hellinger[~np.isnan(hellinger)]
    return {
        "dist_positions": float(n),
        "dist_topk_overlap": float(cat("overlap").mean()),
        "dist_topk_set_equal_fraction": float(cat("set_equal").mean()),
        "dist_topk_rank_agreement": float(cat("rank_agreement").mean()),
        "dist_union_tv_mean": float(cat("tv").mean()),
        "dist_union_tv_max": float(cat("tv").max()),
        "dist_union_kl_mean": float(cat("kl").mean()),
        "dist_union_kl_max": float(cat("kl").max()),
        "dist_sketch_hellinger_mean": float(known.mean()) if known.size else nan,
        "dist_sketch_hellinger_max": float(known.max()) if known.size else nan,
        "dist_differs_positions": float(differs.sum()),
        "dist_sampled_equal_differs": float(both.sum()),
        "dist_sampled_equal_differs_fraction": float(both.sum()) / n,
        "dist_first_differs_position": float(min(first)) if first else nan,
    }


def distribution_metrics(trainer: Any, rollout: Any) -> dict[str, float]:
    """One sample's ``dist_*`` figures (empty when a side recorded no top-k)."""
    found = position_distances(trainer, rollout)
    return _figures([found]) if found is not None else {}


def step_distribution_metrics(pairs: Sequence[tuple[Any, Any]]) -> dict[str, float]:
    """A step's ``dist_*`` figures over every position of its pairs (``dist_first_differs_position``:
    the earliest of any sample); empty when no pair has top-k on both sides."""
    found = [d for d in (position_distances(t, r) for t, r in pairs) if d is not None]
    return _figures(found)


#: The figures a distribution verdict carries as evidence (the rest are in the sample's metrics).
_EVIDENCE = (
    "dist_positions",
    "dist_differs_positions",
    "dist_sampled_equal_differs",
    "dist_first_differs_position",
)


def explain(diagnosis: Diagnosis, metrics: dict[str, Any]) -> Diagnosis:
    """``diagnosis`` unless it is ``clean`` while the recorded distributions differ: equal sampled
    logprobs then hide a difference the top-k or the sketch shows, and the sample is ``numerical``
    with the distribution figures as its evidence (other verdicts already explain more)."""
    differs = int(metrics.get("dist_differs_positions") or 0)
    if diagnosis.kind != "clean" or differs == 0:
        return diagnosis
    from isoaudit.audit.diagnosis import Diagnosis as _Diagnosis

    first = int(metrics["dist_first_differs_position"])
    positions = int(metrics["dist_positions"])
    sentence = (
        f"Every sampled token's logprob agrees bit for bit, but the full distributions differ at {differs} "
        f"of {positions} positions, first at completion token {first}: top-k overlap "
        f"{metrics['dist_topk_overlap']:.3g}, TV on the top-k union up to {metrics['dist_union_tv_max']:.3g}"
    )
    hellinger = metrics.get("dist_sketch_hellinger_max")
    if hellinger is not None and hellinger == hellinger:
        sentence += f", full-vocabulary Hellinger (sketch) up to {hellinger:.3g}"
    evidence = {
        **diagnosis.evidence,
        "cause": "distribution",
        **{name: metrics[name] for name in _EVIDENCE if name in metrics},
    }
    return _Diagnosis("numerical", sentence + ".", evidence)
