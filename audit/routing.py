"""MoE routing agreement: which experts each side chose per token and layer, and whether
a routing flip explains a sample's logprob gap.

Published MoE RL runs show about 10% of router decisions differing between rollout and training and
most tokens differing in at least one layer; no framework logs it. Both sides record the experts of
every MoE layer per token (``SampleLogprobs.routes``, a few bytes a token); here they are compared at
the positions both sides routed:

* **set agreement**: the fraction of (token, layer) cells whose top-k *sets* are equal;
* **flip rate**: the fraction of router decisions (token, layer, slot) whose expert the other side
  did not choose, i.e. ``1 - |A ∩ B| / k`` averaged over cells;
* **Jaccard**: ``|A ∩ B| / |A ∪ B|`` averaged over cells;
* **token flip fraction**: the fraction of tokens whose routing differs in at least one layer;
* **first flip**: per token, the first MoE layer whose set differs.

A flip at position p changes the hidden state at p from that layer on, so the logprob of the token
at p + 1 (predicted from p) is the first it can move. :func:`explain` turns a ``numerical`` (or
locatable ``inconclusive``) verdict into the ``routing`` sub-cause when the flips account for the
gap. With routing replay (R3) the trainer reuses the rollout's routes; the audit then reports the
replayed fraction and the tokens whose routes were missing (computed afresh instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from isoaudit.audit.arrays import from_bytes, to_bytes
from isoaudit.audit.records import Manifest, Routes, SampleLogprobs

if TYPE_CHECKING:
    from isoaudit.audit.diagnosis import Diagnosis

#: The step metrics this module defines (also each sample's), for the API, /metrics and alert rules.
ROUTING_METRICS: dict[str, str] = {
    "routing_set_agreement": "fraction of (token, MoE layer) cells whose top-k expert sets agree",
    "routing_flip_rate": "fraction of router decisions (token, layer, slot) the other side did not make",
    "routing_jaccard_mean": "mean Jaccard index |A∩B|/|A∪B| of the two sides' expert sets per (token, layer)",
    "routing_token_flip_fraction": "fraction of tokens whose routing differs in at least one MoE layer",
    "routing_flipped_tokens": "tokens whose routing differs in at least one MoE layer",
    "routing_tokens": "tokens routed on both sides",
    "routing_first_flip_layer": "the first MoE layer where any token's routing flips (NaN: none)",
    "routing_replayed_fraction": "fraction of the trainer's routed tokens whose routes were replayed from the rollout",
    "routing_missing_routes": "tokens the trainer had to route itself although routing replay was on",
}

#: A flip explains a sample's gap when the token right after a flip holds the sample's largest |Δ|,
#: or the tokens right after flips carry at least this share of the summed |Δ|.
EXPLAINED_SHARE = 0.5


# ---------------------------------------------------------------------- storage


def routes_columns(routes: Routes | None) -> dict[str, Any]:
    """The ``samples`` columns of a record's routes: metadata as JSON, arrays in one blob
    (positions int32 ‖ experts uint8/uint16 ‖ replayed uint8)."""
    if routes is None:
        return {"routes": None, "routes_data": None}
    parts = [to_bytes(routes.positions.astype(np.int32, copy=False)), to_bytes(routes.experts)]
    if routes.replayed is not None:
        parts.append(to_bytes(routes.replayed.astype(np.uint8, copy=False)))
    meta = {
        "layers": list(routes.layers),
        "top_k": int(routes.top_k),
        "num_experts": int(routes.num_experts),
        "dtype": "uint8" if routes.experts.dtype.itemsize == 1 else "uint16",
        "n_positions": int(routes.positions.size),
        "replayed": routes.replayed is not None,
    }
    return {"routes": meta, "routes_data": b"".join(parts)}


def routes_from_columns(meta: dict[str, Any] | None, data: bytes | None) -> Routes | None:
    """Inverse of :func:`routes_columns` (stored rows were validated on the way in: not again)."""
    if not meta or data is None:
        return None
    n, width = int(meta["n_positions"]), len(meta["layers"]) * int(meta["top_k"])
    dtype = np.dtype("<u2") if meta["dtype"] == "uint16" else np.dtype(np.uint8)
    cut = 4 * n
    end = cut + n * width * dtype.itemsize
    experts = np.frombuffer(data[cut:end], dtype=dtype).reshape(n, width)
    return Routes.model_construct(
        layers=list(meta["layers"]),
        top_k=int(meta["top_k"]),
        num_experts=int(meta["num_experts"]),
        positions=from_bytes(data[:cut], "<i4"),
        experts=experts.astype(np.uint16, copy=False) if dtype.itemsize == 2 else experts,
        replayed=np.frombuffer(data[end : end + n], dtype=np.uint8) if meta.get("replayed") else None,
    )


# ---------------------------------------------------------------------- comparison


#: The per-layer counts of a comparison, in this order (:meth:`RoutingComparison.layer_arrays`).
COUNTS = ("tokens", "agree", "flipped_decisions", "jaccard_sum", "first_flips", "decisions")


@dataclass
class RoutingComparison:
    """Both sides' routes of one sample at the positions and layers both recorded.

    ``overlap[j, l]`` is ``|A ∩ B|`` at ``positions[j]`` in MoE layer ``layers[l]``; ``top_k`` the
    experts per token (the larger, if the sides differ). What is derived from ``overlap`` (the
    agreement mask, the per-layer counts) is computed once and kept."""

    layers: list[int]
    positions: np.ndarray
    overlap: np.ndarray
    top_k: int
    trainer: np.ndarray  # [positions, layers, k] expert ids
    rollout: np.ndarray
    trainer_positions: int = 0  # tokens the trainer routed that need a route (compared or not)
    trainer_replayed: int | None = None  # of those, replayed from the rollout (None: no replay)
    missing: np.ndarray | None = None  # trainer positions routed afresh although replay was on
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def agree(self) -> np.ndarray:
        """[positions, layers]: the two sets are equal."""
        if "agree" not in self._cache:
            self._cache["agree"] = self.overlap == self.top_k
        return self._cache["agree"]

    def _token_flipped(self) -> np.ndarray:
        if "token_flipped" not in self._cache:
            self._cache["token_flipped"] = ~self.agree.all(axis=1)
        return self._cache["token_flipped"]

    def flipped_tokens(self) -> np.ndarray:
        """Positions whose routing differs in at least one layer."""
        return self.positions[self._token_flipped()] if self.positions.size else self.positions

    def first_flip_layers(self) -> np.ndarray:
        """Per position: the first MoE layer (its decoder index) whose set differs, -1 where none."""
        flips = ~self.agree
        first = np.argmax(flips, axis=1)
        layers = np.asarray(self.layers, dtype=np.int64)
        return np.where(self._token_flipped(), layers[first] if layers.size else -1, -1)

    def first_flip(self) -> tuple[int, int] | None:
        """(layer, position) of the earliest flip in forward order: lowest layer, then position."""
        flips = ~self.agree
        layers_hit = flips.any(axis=0)
        if not layers_hit.any():
            return None
        col = int(np.argmax(layers_hit))
        row = int(np.argmax(flips[:, col]))
        return int(self.layers[col]), int(self.positions[row])

    def layer_arrays(self) -> np.ndarray:
        """``[len(COUNTS), layers]`` float64: per MoE layer the tokens, tokens whose set agrees,
        flipped decisions, summed Jaccard, tokens whose *first* flip is in this layer (where routing
        first breaks) and decisions; one reduction over [tokens, layers] each."""
        if "counts" not in self._cache:
            k, n = self.top_k, int(self.positions.size)
            overlap = self.overlap
            out = np.empty((len(COUNTS), len(self.layers)), dtype=np.float64)
            out[0] = n
            out[1] = self.agree.sum(axis=0)
            out[2] = n * k - overlap.sum(axis=0)
            out[3] = (
                _JACCARD[k][overlap].sum(axis=0)
                if k in _JACCARD
                else (overlap / np.maximum(2 * k - overlap, 1)).sum(axis=0)
            )
            flipped = self._token_flipped()
            first_col = np.argmax(~self.agree[flipped], axis=1)
            out[4] = np.bincount(first_col, minlength=len(self.layers))
            out[5] = n * k
            self._cache["counts"] = out
        return self._cache["counts"]

    def layer_counts(self) -> dict[int, dict[str, float]]:
        """:meth:`layer_arrays` as ``{layer: {count name: value}}`` (integers but the Jaccard sum)."""
        counts = self.layer_arrays()
        rows = [
            c.tolist() if name == "jaccard_sum" else c.astype(np.int64).tolist()
            for name, c in zip(COUNTS, counts, strict=True)
        ]
        return {
            layer: {name: row[i] for name, row in zip(COUNTS, rows, strict=True)}
            for i, layer in enumerate(self.layers)
        }

    def metrics(self) -> dict[str, float | int]:
        """This sample's ``routing_*`` figures (from :meth:`layer_arrays`, as :func:`routing_metrics`)."""
        c = self.layer_arrays()
        hit = np.flatnonzero(c[4])
        return _figures(
            cells=float(c[0].sum()),
            agree=float(c[1].sum()),
            jaccard=sum(c[3].tolist()),  # layer by layer, as routing_metrics sums: the same bits
            first_layer=self.layers[int(hit[0])] if hit.size else float("nan"),
            decisions=float(c[5].sum()),
            flipped_decisions=float(c[2].sum()),
            counts=self.token_counts(),
        )

    def token_counts(self) -> tuple[int, int, int, int | None, int]:
        """(tokens, flipped tokens, trainer routed tokens, replayed tokens or None, missing routes)."""
        return (
            int(self.positions.size),
            int(self._token_flipped().sum()) if self.positions.size else 0,
            self.trainer_positions,
            self.trainer_replayed,
            int(self.missing_routes().size),
        )

    def missing_routes(self) -> np.ndarray:
        """Trainer positions not replayed although replay was on (their route was missing, so the
        trainer's router chose afresh)."""
        return self.missing if self.missing is not None else np.zeros(0, np.int64)


#: Jaccard ``o / (2k - o)`` by overlap o = 0..k, for the usual k (a table lookup per cell).
_JACCARD = {k: np.arange(k + 1) / np.maximum(2 * k - np.arange(k + 1), 1) for k in range(1, 65)}


def routing_metrics(
    layers: dict[int, dict[str, float]],
    tokens: int,
    flipped: int,
    trainer_positions: int = 0,
    replayed: int | None = None,
    missing: int = 0,
) -> dict[str, float | int]:
    """The ``routing_*`` figures from per-layer counts (:meth:`RoutingComparison.layer_counts`,
    summed over samples) and token counts. A figure over zero cells is NaN, never 0."""
    return _figures(
        cells=sum(c["tokens"] for c in layers.values()),
        agree=sum(c["agree"] for c in layers.values()),
        jaccard=sum(c["jaccard_sum"] for c in layers.values()),
        first_layer=min((layer for layer, c in layers.items() if c["first_flips"]), default=float("nan")),
        decisions=sum(c.get("decisions", 0) for c in layers.values()),
        flipped_decisions=sum(c["flipped_decisions"] for c in layers.values()),
        counts=(tokens, flipped, trainer_positions, replayed, missing),
    )


def _figures(
    *,
    cells: float,
    agree: float,
    jaccard: float,
    first_layer: float,
    decisions: float,
    flipped_decisions: float,
    counts: tuple[int, int, int, int | None, int],
) -> dict[str, float | int]:
    tokens, flipped, trainer_positions, replayed, missing = counts
    nan = float("nan")
    out: dict[str, float | int] = {
        "routing_tokens": tokens,
        "routing_flipped_tokens": flipped,
        "routing_set_agreement": agree / cells if cells else nan,
        "routing_jaccard_mean": jaccard / cells if cells else nan,
        "routing_token_flip_fraction": flipped / tokens if tokens else nan,
        "routing_first_flip_layer": first_layer,
    }
    out["routing_flip_rate"] = flipped_decisions / decisions if decisions else nan
    if replayed is not None:
        out["routing_replayed_fraction"] = replayed / trainer_positions if trainer_positions else nan
        out["routing_missing_routes"] = missing
    return out


def _common_layers(a: Routes, b: Routes) -> tuple[list[int], list[int], list[int]]:
    common = sorted(set(a.layers) & set(b.layers))
    return common, [a.layers.index(i) for i in common], [b.layers.index(i) for i in common]


def _cell_keys(x: np.ndarray) -> np.ndarray | None:
    """Each cell's k ids (slot order) as one unsigned integer, where they fit in 8 bytes."""
    width = x.shape[-1] * x.dtype.itemsize
    if width not in (1, 2, 4, 8):
        return None
    return np.ascontiguousarray(x).view(f"<u{width}").reshape(x.shape[:-1])


def _planes_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|A ∩ B|`` of ``[cells, k]`` arrays: one comparison of contiguous slot planes per pair of
    slots (k_a x k_b elementwise passes over all cells)."""
    planes_a = np.ascontiguousarray(a.T)
    planes_b = np.ascontiguousarray(b.T)
    overlap = np.zeros(a.shape[0], dtype=np.uint8)  # k <= 64: a count fits a byte
    hit = np.empty(a.shape[0], dtype=bool)
    for x in planes_a:
        for y in planes_b:
            np.equal(x, y, out=hit)
            overlap += hit
    return overlap


def set_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|A ∩ B|`` per cell of two ``[..., k]`` arrays of distinct expert ids (k_a and k_b may
    differ). Cells whose ids are equal slot for
    slot (most, where the sides agree) are found by one comparison of each cell's ids read as one
    integer; only the others are counted slot pair by slot pair, over all such cells at once: no
    loop over tokens or layers."""
    cells = a.shape[:-1]
    ka, kb = a.shape[-1], b.shape[-1]
    flat_a, flat_b = a.reshape(-1, ka), b.reshape(-1, kb)
    overlap = np.full(flat_a.shape[0], min(ka, kb), dtype=np.int64)
    keys_a = _cell_keys(flat_a) if ka == kb and a.dtype == b.dtype else None
    keys_b = _cell_keys(flat_b) if keys_a is not None else None
    if keys_a is not None and keys_b is not None:
        differ = keys_a != keys_b
        rest = np.flatnonzero(differ)
        if rest.size > differ.size // 4:  # mostly different: counting all beats gathering them
            overlap[differ] = _planes_overlap(flat_a, flat_b)[differ]
        elif rest.size:
            overlap[rest] = _planes_overlap(flat_a[rest], flat_b[rest])
    else:
        overlap[:] = _planes_overlap(flat_a, flat_b)
    return overlap.reshape(cells)


def set_overlap_pairwise(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """:func:`set_overlap` by one comparison per pair of slots (the reference it is tested against)."""
    overlap = np.zeros(a.shape[:-1], dtype=np.int64)
    for s in range(a.shape[-1]):
        for t in range(b.shape[-1]):
            overlap += a[..., s] == b[..., t]
    return overlap


def _rows(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``array[index]`` for a sorted index, as a view where it is one contiguous run (the usual case:
    the rollout's positions are the trainer's but the last)."""
    if index.size and int(index[-1]) - int(index[0]) + 1 == index.size:
        return array[int(index[0]) : int(index[-1]) + 1]
    return array[index]


def _columns(array: np.ndarray, index: list[int]) -> np.ndarray:
    return array if index == list(range(array.shape[1])) else array[:, index]


def compare_routes(
    trainer: Routes | None, rollout: Routes | None, *, n_tokens: int | None = None
) -> RoutingComparison | None:
    """The two sides' routes at the positions and MoE layers both recorded; ``None`` when either
    side sent none. Where the trainer marks replayed routes (R3), every trainer token not marked
    counts as a missing route, except the sequence's last (``n_tokens - 1``), whose output predicts
    nothing and which the engine never runs."""
    if trainer is None or rollout is None:
        return None
    layers, ia, ib = _common_layers(trainer, rollout)
    common, ja, jb = np.intersect1d(
        trainer.positions, rollout.positions, assume_unique=True, return_indices=True
    )
    a = _columns(_rows(trainer.layer_experts(), ja), ia)
    b = _columns(_rows(rollout.layer_experts(), jb), ib)
    k = max(trainer.top_k, rollout.top_k)
    overlap = set_overlap(a, b)
    if trainer.top_k != rollout.top_k:  # sets of different sizes never agree; shared experts still count
        overlap = np.minimum(overlap, k - 1)
    result = RoutingComparison(
        layers=layers,
        positions=common.astype(np.int64),
        overlap=overlap,
        top_k=k,
        trainer=a,
        rollout=b,
        # Tokens that need a route: all but the sequence's last, whose output predicts nothing.
        trainer_positions=int((trainer.positions < n_tokens - 1).sum())
        if n_tokens is not None
        else int(trainer.positions.size),
    )
    if trainer.replayed is not None:
        # Replay on: every trainer token not marked replayed had no route to replay.
        marks = trainer.replayed
        needed = trainer.positions < n_tokens - 1 if n_tokens is not None else np.ones(marks.size, bool)
        result.trainer_replayed = int(marks[needed].sum())
        unreplayed = trainer.positions[marks == 0].astype(np.int64)
        result.missing = unreplayed[unreplayed < n_tokens - 1] if n_tokens is not None else unreplayed
    return result


def compare_sample_routes(trainer: SampleLogprobs, rollout: SampleLogprobs) -> RoutingComparison | None:
    """:func:`compare_routes` of a (trainer, rollout) pair of one sample."""
    return compare_routes(trainer.routes, rollout.routes, n_tokens=int(trainer.token_ids.size))


def replay_on(manifests: Sequence[Manifest]) -> bool:
    """Whether the latest of a side's manifests declares routing replay (R3)."""
    if not manifests:
        return False
    latest = max(manifests, key=lambda m: m.created_at)
    mode = latest.runtime.router_replay
    return mode not in (None, "", "off", "none")


# ---------------------------------------------------------------------- step aggregates


def step_routing(
    pairs: Sequence[tuple[SampleLogprobs, SampleLogprobs]],
    known: Mapping[str, RoutingComparison] | None = None,
) -> dict[str, Any] | None:
    """What the run page and the step metrics need of a step's routing: per MoE layer the summed
    counts (tokens, agreeing sets, flipped decisions, Jaccard sum, first flips) and the sample with
    the most flips there, and the token counts; ``None`` when no sample has routes on both sides.
    ``known``: comparisons already made, by sample key (not made again). Samples are summed as
    ``[counts, layers]`` arrays (one addition per sample, not per layer)."""
    sums: dict[tuple[int, ...], np.ndarray] = {}  # layer set -> summed layer_arrays
    best: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}  # -> most flips per layer, its sample
    totals: dict[str, int] = {"tokens": 0, "flipped": 0, "trainer_positions": 0, "missing": 0}
    replayed_total: int | None = None
    missing_examples: list[dict[str, Any]] = []
    found = False
    for trainer, rollout in pairs:
        key = trainer.sample_key
        comparison = known.get(key) if known and key is not None else None
        comparison = comparison or compare_sample_routes(trainer, rollout)
        if comparison is None:
            continue
        found = True
        counts = comparison.layer_arrays()
        layer_set = tuple(comparison.layers)
        if layer_set not in sums:
            sums[layer_set] = np.zeros_like(counts)
            best[layer_set] = (np.zeros(len(layer_set)), np.full(len(layer_set), None, dtype=object))
        sums[layer_set] += counts
        most, example = best[layer_set]
        flips = counts[0] - counts[1]
        better = flips > most  # the first sample with the most flips in a layer is its example
        most[better], example[better] = flips[better], key
        tokens, flipped, trained, replayed, missing = comparison.token_counts()
        totals["tokens"] += tokens
        totals["flipped"] += flipped
        totals["trainer_positions"] += trained
        totals["missing"] += missing
        if replayed is not None:
            replayed_total = (replayed_total or 0) + replayed
        if missing and len(missing_examples) < 16:
            missing_examples.append(
                {"sample_key": trainer.sample_key, "positions": comparison.missing_routes()[:32].tolist()}
            )
    if not found:
        return None
    layers: dict[int, dict[str, Any]] = {}
    for layer_set, counts in sums.items():
        for i, layer in enumerate(layer_set):
            entry = layers.setdefault(layer, {name: 0 for name in COUNTS} | {"jaccard_sum": 0.0})
            for j, name in enumerate(COUNTS):
                entry[name] += float(counts[j, i]) if name == "jaccard_sum" else int(counts[j, i])
        most, example = best[layer_set]
        for i, layer in enumerate(layer_set):
            entry = layers[layer]
            if int(most[i]) > entry.get("example_flips", 0):
                entry["example"], entry["example_flips"] = example[i], int(most[i])
            entry.setdefault("example", None)
            entry.setdefault("example_flips", 0)
    return {
        "layers": {str(layer): layers[layer] for layer in sorted(layers)},
        "tokens": totals["tokens"],
        "flipped": totals["flipped"],
        "trainer_positions": totals["trainer_positions"],
        "replayed": replayed_total,
        "missing": totals["missing"],
        "missing_examples": missing_examples,
    }


def step_routing_metrics(summary: dict[str, Any] | None) -> dict[str, float | int]:
    """The step's ``routing_*`` figures from :func:`step_routing` (empty for a dense model)."""
    if summary is None:
        return {}
    layers = {int(k): v for k, v in summary["layers"].items()}
    return routing_metrics(
        layers,
        summary["tokens"],
        summary["flipped"],
        summary["trainer_positions"],
        summary["replayed"],
        summary["missing"],
    )


# ---------------------------------------------------------------------- diagnosis


def _directly_affected(comparison: RoutingComparison, sample: SampleLogprobs) -> np.ndarray:
    """Completion-token mask: the token is predicted from a position whose routing flipped."""
    flipped = comparison.flipped_tokens()
    n_completion = sample.logprobs.size
    predicted_from = sample.prompt_len + np.arange(n_completion) - 1
    return np.isin(predicted_from, flipped)


def explain(
    diagnosis: Diagnosis,
    comparison: RoutingComparison | None,
    trainer: SampleLogprobs,
    rollout: SampleLogprobs,
) -> Diagnosis:
    """``diagnosis`` refined to the ``routing`` sub-cause of ``numerical`` when an upstream numerical
    difference flipped a routing decision and the flip explains the logprob gap: the token right after
    a flip holds the largest |Δ|, or the tokens right after flips carry at least half of the summed
    |Δ|. Verdicts that explain the gap before any kernel (contract, weights, semantics, path) stand."""
    if comparison is None or diagnosis.kind not in ("numerical", "inconclusive"):
        return diagnosis
    first = comparison.first_flip()
    if first is None:
        return diagnosis
    delta = np.abs(trainer.logprobs.astype(np.float64) - rollout.logprobs.astype(np.float64))
    delta = np.where(np.isfinite(delta), delta, 0.0)
    affected = _directly_affected(comparison, trainer)
    total = float(delta.sum())
    share = float(delta[affected].sum()) / total if total > 0 else 0.0
    worst = int(np.argmax(delta)) if delta.size else -1
    worst_after_flip = bool(worst >= 0 and affected[worst] and delta[worst] > 0)
    if not (worst_after_flip or share >= EXPLAINED_SHARE):
        return diagnosis
    from isoaudit.audit.diagnosis import Diagnosis as _Diagnosis

    layer, position = first
    row = int(np.searchsorted(comparison.positions, position))
    col = comparison.layers.index(layer)
    trainer_set = sorted(int(e) for e in comparison.trainer[row, col])
    rollout_set = sorted(int(e) for e in comparison.rollout[row, col])
    upstream = diagnosis.evidence.get("first_divergence")
    where = (
        f"first divergence {upstream['region']} at position {upstream['position']}"
        if isinstance(upstream, dict)
        else "not located: no fingerprints"
    )
    token = position + 1 - trainer.prompt_len
    metrics = comparison.metrics()
    sentence = (
        f"A numerical difference upstream ({where}) flipped the routing of MoE layer {layer} at position "
        f"{position}: the trainer chose the expert set {_as_set(trainer_set)}, the rollout "
        f"{_as_set(rollout_set)}. The flip explains "
        f"the logprob gap: {share:.0%} of the summed |Δ| is on tokens right after a flip"
        + (f", including the largest (completion token {worst})" if worst_after_flip else "")
        + f"; {comparison.flipped_tokens().size} of {comparison.positions.size} tokens flip in some layer."
    )
    evidence = {
        **diagnosis.evidence,
        "cause": "routing",
        "upstream_cause": diagnosis.evidence.get("cause"),
        "routing": {
            "layer": layer,
            "position": position,
            "completion_token": token if token >= 0 else None,
            "trainer_experts": trainer_set,
            "rollout_experts": rollout_set,
            "share_after_flip": share,
            "largest_gap_after_flip": worst_after_flip,
            "flipped_tokens": int(comparison.flipped_tokens().size),
            "set_agreement": metrics["routing_set_agreement"],
        },
    }
    return _Diagnosis("numerical", sentence, evidence)


def _as_set(experts: list[int]) -> str:
    """A top-k choice written as a set (the page's routing table lists the same experts in slot order)."""
    return "{" + ", ".join(map(str, experts)) + "}"
