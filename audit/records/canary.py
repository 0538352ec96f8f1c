"""The canary: a fixed prompt each side runs through its real forward after every weight version
change, carried in the side's manifest (``Manifest.canary``).

Held-weight digests say what a side *holds*; a canary says what its forward *reads*. Equal held
weights with a forward that reads something else (CUDA graphs captured over freed weights, packed
or kept copies not refreshed by a reload, an engine serving before its weights arrived) show up as
a canary that differs where it should not (:mod:`isoaudit.audit.stale_state`).

What is digested, on every side alike: the canary's token ids, then the top-:data:`CANARY_TOP_K`
log-probabilities (fp32) of the next token after the whole prompt, as (token id, fp32 bits) pairs in
the order value descending, id ascending. Every side computes these from the fp32 logits of its own
head and a log-softmax over the full vocabulary, at temperature 1, so two sides that hold the same
weights and run the same arithmetic produce the same digest, and any change of any weight the last
position depends on changes it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import numpy as np
from isoaudit.audit.records.checks import check_text
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: How many of the last position's log-probabilities the canary keeps (vLLM returns at most 20).
CANARY_TOP_K = 8
#: The longest canary prompt a manifest may carry.
MAX_CANARY_TOKENS = 256


def canary_digest(tokens: Sequence[int], top_ids: Sequence[int], top_logprobs: Sequence[float]) -> str:
    """The canary digest (32 hex digits) of a prompt and its last position's top log-probabilities,
    taken in canonical order (value descending, id ascending) as fp32 bits."""
    ids = np.asarray(top_ids, dtype=np.int64)
    values = np.asarray(top_logprobs, dtype=np.float32)
    if ids.shape != values.shape:
        raise ValueError(f"top_ids and top_logprobs differ in length ({ids.size} != {values.size})")
    order = np.lexsort((ids, -values.astype(np.float64)))
    h = hashlib.sha256()
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    h.update(b"|")
    for i in order:
        h.update(np.asarray(ids[i], dtype="<i4").tobytes() + np.asarray(values[i], dtype="<f4").tobytes())
    return h.hexdigest()[:32]


def held_digest(weight_tensor_digests: Mapping[str, str]) -> str | None:
    """One digest (32 hex digits) of a side's per-tensor held-weight digests, order-free; ``None``
    when it holds none."""
    if not weight_tensor_digests:
        return None
    h = hashlib.sha256()
    for name in sorted(weight_tensor_digests):
        h.update(f"{name}={weight_tensor_digests[name]};".encode())
    return h.hexdigest()[:32]


class CanaryOutput(BaseModel):
    """What one forward path gave for the canary: the path, its digest and the values digested."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(max_length=256, description="which forward ran the canary, in words")
    digest: str = Field(max_length=64)
    top_ids: list[int] = Field(default_factory=list, max_length=64)
    top_logprobs: list[float] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _check(self) -> CanaryOutput:
        check_text(self.path, "canary.path")
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError("canary: top_ids and top_logprobs must have one entry each")
        if not all(math.isfinite(v) for v in self.top_logprobs):
            raise ValueError("canary.top_logprobs: every value must be finite")
        return self


class Canary(BaseModel):
    """A side's canary after a weight version change.

    ``output``: through the forward the side really runs (the engine's graph/compiled path, vLLM's
    generate, the trainer's model forward). ``reference``: the same canary recomputed by this side
    with the same arithmetic straight from the parameters it holds, where its real path runs
    derived state (captured graphs): the two must agree. ``arithmetic``: an identity of the kernels
    that computed it (the side's numerical-policy identity, when it has one): canaries of equal
    arithmetic and equal held weights must agree across sides. ``held_digest``:
    :func:`held_digest` of the weights held when it ran. ``error``: why it could not run (then no
    output)."""

    model_config = ConfigDict(extra="forbid")

    weight_version: str | None = Field(default=None, max_length=256)
    held_digest: str | None = Field(default=None, max_length=64)
    tokens: list[int] = Field(default_factory=list, max_length=MAX_CANARY_TOKENS)
    output: CanaryOutput | None = None
    reference: CanaryOutput | None = None
    arithmetic: str | None = Field(default=None, max_length=256)
    seconds: float | None = Field(default=None, ge=0)
    error: str | None = Field(default=None, max_length=1024)

    @model_validator(mode="after")
    def _check(self) -> Canary:
        for name in ("weight_version", "held_digest", "arithmetic", "error"):
            value = getattr(self, name)
            if value is not None:
                check_text(value, f"canary.{name}")
        return self
