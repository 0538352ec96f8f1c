"""Every message between the driver (the process holding ``vllm.LLM``) and the isoaudit code inside
vLLM's workers, and the host-side form of what the workers computed on the device.

Both sides import this module, as vLLM's front end and engine core share ``vllm.v1.engine``. The
messages are ``msgspec.Struct``\\ s: the driver sends :func:`to_wire` of one, the worker reads it back
with :func:`from_wire` (and answers the same way), so what crosses ``LLM.collective_rpc`` is
msgpack-native data (dicts, lists, strings, numbers, bytes) in either engine mode: vLLM's channel
to worker processes refuses anything else, and a refused result would kill the engine's output
thread. Arrays travel as little-endian bytes.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

M = TypeVar("M", bound=msgspec.Struct)

#: How the driver names its canary requests (:mod:`isoaudit.collectors.vllm.canary`): workers never
#: select them for fingerprints nor count them in "one in N".
CANARY_REQUEST_PREFIX = "isoaudit-canary-"


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the messages: keyword-only, unknown fields refused (a version skew fails loudly)."""


def to_wire(message: msgspec.Struct) -> Any:
    """``message`` as plain msgpack-native data (bytes kept as bytes; any odd scalar as its str)."""
    return msgspec.to_builtins(message, builtin_types=(bytes,), enc_hook=_scalar)


def from_wire(data: Any, kind: type[M]) -> M:
    """The message of type ``kind`` that :func:`to_wire` made (a ``kind`` already passes through)."""
    if isinstance(data, kind):
        return data
    return msgspec.convert(data, kind)


def _scalar(value: Any) -> Any:
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tobytes()
    return str(value)  # a TorchVersion, an enum, ...


# ---------------------------------------------------------------- driver -> worker


class Selection(Message, frozen=True):  # type: ignore[misc]  # msgspec freezes a Struct over an unfrozen base
    """Which requests the engine fingerprints (see :mod:`isoaudit.collectors.vllm.selection`)."""

    mode: Literal["all", "every", "ids", "none"] = "all"
    every: int = 1
    ids: frozenset[str] = frozenset()

    def chooses(self, ordinal: int, request_id: str) -> bool:
        """Is the ``ordinal``-th request the engine sees (0-based), with this external id, selected?"""
        if self.mode == "all":
            return True
        if self.mode == "every":
            return ordinal % self.every == 0
        if self.mode == "ids":
            return request_id in self.ids
        return False


class Start(Message):
    """Hook the worker's model. ``regions``: ``"auto"``, canonical names, a canonical → module
    map, or ``None``; the buffers' bounds; the weight version the engine starts with."""

    regions: str | list[str] | dict[str, str] | None = "auto"
    selection: Selection = Selection()
    max_requests: int = 65536
    max_rows: int = 1 << 20
    flush_bytes: int = 64 << 20
    version: str | None = None


class Drain(Message):
    """Hand over (and forget) what the worker recorded for these external request ids."""

    request_ids: list[str]


class SetMode(Message):
    """Apply remediation ``mode`` at the worker's next step boundary (``version``: the control
    version it answers)."""

    mode: str
    version: int | None = None


class PackedTensor(Message, array_like=True):
    """A named tensor as bytes: what crosses process boundaries intact (vLLM's RPC decodes
    tensors onto message buffers that its worker hop cannot pickle)."""

    name: str
    dtype: str
    shape: list[int]
    data: bytes


class LoadWeights(Message):
    """New weights (checkpoint names), their version and digest. In-process engines get the
    tensors themselves beside the message (no copy); worker processes get ``packed``."""

    version: str
    digest: str | None = None
    packed: list[PackedTensor] = []


# ---------------------------------------------------------------- worker -> driver


class ModeState(Message):
    """What a worker runs: ``applied`` for ``requested``; ``reason`` names what stays native;
    ``version``: the control version answered; ``step``: the worker's step counter when it switched
    (0: never switched); ``ops``: each op of the decoder → the ``id@version`` running it now
    (:mod:`isoaudit.collectors.policy`'s vocabulary; empty when the worker cannot say); ``graph``: in a
    compiled engine, the state compiled into its decoder, the last recompile's seconds and the
    graph taps' buffers (:meth:`isoaudit.collectors.vllm.worker.graph.CompiledDecoder.facts`; empty
    when eager); ``kernels``: the launch settings of isoaudit's kernels in the mode it runs
    (:func:`isoaudit.collectors.manifest.kernel_facts`, e.g. ``gemm_split``; empty when native)."""

    requested: str = "native"
    applied: str = "native"
    reason: str | None = None
    version: int | None = None
    step: int = 0
    ops: dict[str, str] = {}
    graph: dict[str, Any] = {}
    kernels: dict[str, Any] = {}


#: The key under which a worker's ``Started.facts`` carry its environment (``audit.records.Environment``
#: as plain data); the driver takes it out before the rest become ``RuntimeFacts``.
ENVIRONMENT_KEY = "environment"


class Started(Message):
    """The worker's engine facts, regions hooked, what it cannot observe and why."""

    facts: dict[str, Any]
    regions: list[str]
    unobserved: dict[str, str]
    refusal: str | None
    family: str | None
    tp_rank: int
    pp_rank: int
    weight_version: str | None
    weight_digest: str | None
    mode: ModeState


class RegionPrints(Message):
    """One region's fingerprints of one request in one case, rows sorted by position; arrays as
    little-endian bytes (positions int32, digest/ladder uint64, sketch/l2/maxabs float32)."""

    region: str
    case: Literal["engine_prefill", "engine_decode"]
    ladder_bits: list[int]
    positions: bytes
    digest: bytes
    ladder: bytes
    sketch: bytes
    l2: bytes
    maxabs: bytes

    def arrays(self) -> dict[str, np.ndarray]:
        """The fields as numpy arrays of their record shapes."""
        positions = np.frombuffer(self.positions, dtype="<i4")
        n = positions.size
        return {
            "positions": positions,
            "digest": np.frombuffer(self.digest, dtype="<u8"),
            "ladder": np.frombuffer(self.ladder, dtype="<u8").reshape(n, len(self.ladder_bits)),
            "sketch": np.frombuffer(self.sketch, dtype="<f4").reshape(n, -1),
            "l2": np.frombuffer(self.l2, dtype="<f4"),
            "maxabs": np.frombuffer(self.maxabs, dtype="<f4"),
        }


class RequestRecord(Message):
    """What the engine kept of one request: sampling as applied, the weight versions it ran
    under, and its region fingerprints. ``prefill_forwards``: forwards that computed prompt
    positions (more than one: a chunked prefill), known for fingerprinted requests."""

    req_id: str
    prompt_len: int
    temperature: float
    top_k: int | None
    top_p: float | None
    selected: bool
    truncated: bool
    prefill_forwards: int | None
    first_version: str | None
    last_version: str | None
    prints: list[RegionPrints] = []


class Drained(Message):
    """A worker's answer to :class:`Drain`: the requests it knew, the ids it did not, its
    counters and the mode it runs."""

    requests: dict[str, RequestRecord] = {}
    missing: list[str] = []
    counters: dict[str, int] = {}
    mode: ModeState | None = None


class WeightsLoaded(Message):
    """How many tensors a worker loaded, and the version/digest it computes with now."""

    loaded: int
    weight_version: str | None
    weight_digest: str | None


class Stopped(Message):
    """The worker's final counters (hooks removed)."""

    counters: dict[str, int] = {}
