"""MoE routing on a sample record: the experts each layer chose per token (``SampleLogprobs.routes``).

Routes are 55x the bytes of tokens and logprobs at a 48-layer top-8 shape; their check is one
reduction, one transposing copy and k(k-1)/2 plane comparisons, run once per validation
(``bench/records.py`` times it against the same sample without routes).
"""

from __future__ import annotations

import numpy as np
from isoaudit.audit.arrays import ExpertIdMatrix, Int32Array, UInt8Array
from isoaudit.audit.records.checks import (
    INT32_VECTOR,
    UINT8_VECTOR,
    IntRange,
    RecordError,
    array_max,
    check_non_negative,
)
from pydantic import BaseModel, ConfigDict, Field, model_validator


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
ROUTES_TOP_K = IntRange(1, MAX_TOP_K)
NUM_EXPERTS = IntRange(1, MAX_EXPERTS)


class Routes(BaseModel):
    """The experts each MoE layer chose for each token of one sample on one side.

    ``experts[j, l * top_k + s]`` is the expert that layer ``layers[l]`` put in slot ``s`` for the
    token at absolute position ``positions[j]``: slot order as the router produced it (the combine
    order), one byte per choice for up to 256 experts. ``replayed[j]`` (trainer side, routing replay
    R3) is 1 where the route was taken from the rollout instead of computed by the router.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    layers: list[int] = Field(description="decoder layer index of each MoE layer recorded, ascending")
    top_k: int = ROUTES_TOP_K.field()
    num_experts: int = NUM_EXPERTS.field()
    positions: Int32Array
    experts: ExpertIdMatrix
    replayed: UInt8Array | None = None

    @model_validator(mode="after")
    def _check(self) -> Routes:
        self.check(None)
        return self

    def check_within(self, n_tokens: int | None) -> None:
        """The one check that needs the sample: the last position inside its ``n_tokens`` tokens
        (for Routes that :meth:`check` has already passed, e.g. just built by pydantic)."""
        positions = self.positions
        if n_tokens is not None and positions.size and int(positions[-1]) >= n_tokens:
            raise RecordError(
                "routes.positions", f"{int(positions[-1])} is past the sample's {n_tokens} tokens"
            )

    def check(self, n_tokens: int | None) -> None:
        """Shapes, bounds and distinctness, in vectorised reductions; ``n_tokens``: the sample's
        sequence length (positions must fall inside it). Raises RecordError naming ``routes.<field>``."""
        layers = self.layers
        if type(layers) is not list or not all(type(i) is int and 0 <= i <= MAX_MOE_LAYERS for i in layers):
            raise RecordError("routes.layers", f"expected a list of layer indices in 0..{MAX_MOE_LAYERS}")
        if not layers or any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
            raise RecordError("routes.layers", "expected at least one layer, strictly ascending")
        top_k = ROUTES_TOP_K.check(self.top_k, "routes.top_k")
        num_experts = NUM_EXPERTS.check(self.num_experts, "routes.num_experts")
        if top_k > num_experts:
            raise RecordError("routes.top_k", f"{top_k} exceeds num_experts {num_experts}")
        positions = INT32_VECTOR.check(self.positions, "routes.positions")
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
            and int(array_max(experts)) >= num_experts
        ):
            raise RecordError("routes.experts", f"an expert id is not below num_experts {num_experts}")
        if positions.size:
            check_non_negative(positions, "routes.positions", "position")
            if positions.size > 1 and not (positions[1:] > positions[:-1]).all():
                raise RecordError("routes.positions", "must be strictly ascending")
            self.check_within(n_tokens)
            if top_k > 1 and _repeats(experts.reshape(positions.size * len(layers), top_k)):
                raise RecordError("routes.experts", "one layer chose the same expert twice for a token")
        if self.replayed is not None:
            replayed = UINT8_VECTOR.check(self.replayed, "routes.replayed")
            if replayed.size != positions.size:
                raise RecordError("routes.replayed", f"{replayed.size} values for {positions.size} positions")
            if replayed.size and int(array_max(replayed)) > 1:
                raise RecordError("routes.replayed", "values must be 0 (computed) or 1 (replayed)")

    def layer_experts(self) -> np.ndarray:
        """``experts`` as ``[positions, layers, top_k]``."""
        return self.experts.reshape(self.positions.size, len(self.layers), self.top_k)
