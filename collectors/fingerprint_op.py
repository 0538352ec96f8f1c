"""Region fingerprints as a registered torch custom op, so they survive ``torch.compile`` and
CUDA-graph capture (DESIGN.md, "Fingerprints"; docs/design.md, "Fingerprints in compiled graphs").

Forward hooks are Python: a replayed CUDA graph never calls them, and a compiled model runs what
Dynamo traced. ``torch.ops.isoaudit.fingerprint_rows_`` is an op Dynamo records as a node and a
graph capture records as kernels: given a region's rows and preallocated row buffers it writes
every row's digest, ladder, sketch, L2 and max-abs into them (the bits of
:func:`isoaudit.collectors.fingerprints.fingerprint_rows` for the same rows), syncs nothing with the
host and returns nothing. It declares that it mutates its two buffers, so the compiler keeps it
(its effect is the buffers') and keeps it in program order.

:class:`FingerprintBuffers` holds the buffers of a whole forward: one int64 and one float32 tensor
``[regions, rows, width]``, allocated once per row count (an engine's decode bucket, a trainer's
batch shape); region ``k`` writes its rows into slot ``k``. After the step the host reads the two
tensors in one transfer and files the rows under requests from the batch layout it already knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from isoaudit.collectors.fingerprints import (
    FLOAT_WIDTH,
    FORMATS,
    HostRows,
    default_ladder_bits,
    fingerprint_rows_into,
    packed_width,
)
from isoaudit.collectors.transfer import to_host

#: The op's qualified name (namespace ``isoaudit``).
OP_NAME = "isoaudit::fingerprint_rows_"

#: Columns of the int64 slot rows: wide enough for every dtype's default ladder (and any ladder of
#: at most 8 rungs), so one buffer serves a forward whose regions differ in dtype.
INT_WIDTH = max(packed_width(fmt.ladder_bits) for fmt in FORMATS.values())


# Registered through ``torch.library.Library`` rather than ``custom_op``: a compiled forward calls
# it once per region too large to hold, and this dispatch costs a few microseconds where
# ``custom_op``'s wrapper costs tens on a CPU (hundreds of microseconds of host time a step).
_lib = torch.library.Library("isoaudit", "FRAGMENT")
_lib.define(
    "fingerprint_rows_(Tensor x, Tensor(a!) ints, Tensor(b!) floats, int[] ladder_bits, bool as_float32=False) -> ()"
)


def fingerprint_rows_(
    x: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    ladder_bits: Sequence[int],
    as_float32: bool = False,
) -> None:
    """Write the fingerprints of every row of ``x`` ([..., hidden], rows = leading dims flattened)
    into ``ints`` (int64 ``[n, >= 1 + R']``: digest, then the ``R`` rungs of ``ladder_bits``) and
    ``floats`` (float32 ``[n, >= 18]``: 16 sketch values, L2, max-abs). No host sync.
    ``as_float32``: those of ``x.float()``, with no fp32 copy made."""
    fingerprint_rows_into(x, ints, floats, ladder_bits, as_float32)


_lib.impl("fingerprint_rows_", fingerprint_rows_, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME)
def _fingerprint_rows_fake(
    x: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    ladder_bits: Sequence[int],
    as_float32: bool = False,
) -> None:
    """Shapes only: the op writes its buffers in place and returns nothing."""
    return None


#: The row-index variant's qualified name: fingerprints of selected rows only.
INDEX_OP_NAME = "isoaudit::fingerprint_index_rows_"


# The same registration: the taps call it once per region per forward, often with nothing selected.
_lib.define(
    "fingerprint_index_rows_(Tensor x, Tensor? residual, Tensor index, Tensor? count, "
    "Tensor(a!) ints, Tensor(b!) floats, int[] ladder_bits) -> ()"
)


def fingerprint_index_rows_(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    count: torch.Tensor | None,
    ints: torch.Tensor,
    floats: torch.Tensor,
    ladder_bits: Sequence[int],
) -> None:
    """Fingerprint rows ``index[:n]`` of ``x`` (rows = leading dims flattened; plus the same rows of
    ``residual``, added after selection: elementwise the bits of the sum) into rows ``[0, n)`` of
    ``ints``/``floats`` (shaped as for :func:`fingerprint_rows_`, at least ``n`` rows). ``count``:
    a one-element int tensor holding ``n``, read by the op (a host read on a GPU: not for CUDA-graph
    capture); ``None``: ``n`` is ``index``'s length, a fixed amount of work that capture and replay
    repeat (pad ``index`` with any valid row and ignore the rows past the real count)."""
    n = int(index.numel()) if count is None else int(count.reshape(-1)[0])
    if n == 0:
        return
    picked = selected_rows(x, residual, index[:n].to(x.device))
    fingerprint_rows_into(picked, ints[:n], floats[:n], ladder_bits)


def selected_rows(
    x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``rows`` of ``x`` (rows = leading dims flattened) plus the same rows of ``residual``,
    added after selection (elementwise the bits of the sum), into ``out`` when given."""
    width = int(x.shape[-1]) if x.dim() else 1
    flat = x if x.dim() == 2 else x.reshape(-1, width)  # a decoder's [tokens, hidden]: no op call
    picked = flat.index_select(0, rows) if out is None else torch.index_select(flat, 0, rows, out=out)
    if residual is not None:
        extra = residual if residual.dim() == 2 else residual.reshape(-1, width)
        picked.add_(extra.index_select(0, rows))
    return picked


_lib.impl("fingerprint_index_rows_", fingerprint_index_rows_, "CompositeExplicitAutograd")


@torch.library.register_fake(INDEX_OP_NAME)
def _fingerprint_index_rows_fake(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    count: torch.Tensor | None,
    ints: torch.Tensor,
    floats: torch.Tensor,
    ladder_bits: Sequence[int],
) -> None:
    """Shapes only: the op writes its buffers in place and returns nothing."""
    return None


def record_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    count: torch.Tensor | None,
    ints: torch.Tensor,
    floats: torch.Tensor,
    ladder_bits: Sequence[int] | None = None,
) -> None:
    """Call the row-index op (inputs detached); ``ladder_bits`` defaults to ``x``'s dtype's ladder."""
    bits = list(default_ladder_bits(x.dtype) if ladder_bits is None else ladder_bits)
    torch.ops.isoaudit.fingerprint_index_rows_(
        x.detach(), None if residual is None else residual.detach(), index, count, ints, floats, bits
    )


def record(
    x: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    ladder_bits: Sequence[int] | None = None,
    as_float32: bool = False,
) -> None:
    """Call the op on ``x`` (detached: a fingerprint never joins the autograd graph); ``ladder_bits``
    defaults to the dtype's ladder (fp32's with ``as_float32``: the fields of ``x.float()``)."""
    dtype = torch.float32 if as_float32 else x.dtype
    bits = list(default_ladder_bits(dtype) if ladder_bits is None else ladder_bits)
    torch.ops.isoaudit.fingerprint_rows_(x.detach(), ints, floats, bits, as_float32)


@dataclass(frozen=True)
class SlotPrints:
    """The rows one slot of :class:`FingerprintBuffers` holds, on the host."""

    key: tuple[str, int]
    rows: HostRows


class FingerprintBuffers:
    """Preallocated device buffers for ``slots`` regions of ``rows`` rows each.

    Allocate once per row count, before a graph is captured or a compiled step first runs (the
    buffers are then the graph's own storage); call :meth:`write` (or :func:`record` with
    :meth:`views`) for each region inside the forward; read everything after the step with
    :meth:`to_host`.
    """

    def __init__(self, slots: int, rows: int, device: torch.device | str) -> None:
        if slots < 1 or rows < 0:
            raise ValueError(f"slots/rows: need slots >= 1 and rows >= 0, got {slots}, {rows}")
        self.rows = rows
        self.ints = torch.zeros(slots, rows, INT_WIDTH, dtype=torch.int64, device=device)
        self.floats = torch.zeros(slots, rows, FLOAT_WIDTH, dtype=torch.float32, device=device)

    @property
    def slots(self) -> int:
        return int(self.ints.shape[0])

    def views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s ``(ints, floats)`` row buffers, as :func:`record` takes them."""
        return self.ints[slot], self.floats[slot]

    def write(
        self, slot: int, x: torch.Tensor, ladder_bits: Sequence[int] | None = None, as_float32: bool = False
    ) -> None:
        """Fingerprint ``x``'s rows (exactly :attr:`rows` of them) into slot ``slot`` (``as_float32``:
        those of ``x.float()``, no copy made)."""
        record(x, self.ints[slot], self.floats[slot], ladder_bits, as_float32)

    def write_rows(
        self,
        slot: int,
        x: torch.Tensor,
        index: torch.Tensor,
        count: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        ladder_bits: Sequence[int] | None = None,
    ) -> None:
        """Fingerprint rows ``index[:count]`` of ``x`` (+ ``residual``'s) into slot ``slot``'s first
        rows (:func:`fingerprint_index_rows_`)."""
        record_rows(x, residual, index, count, self.ints[slot], self.floats[slot], ladder_bits)

    @property
    def nbytes(self) -> int:
        """The device memory both buffers hold."""
        return int(self.ints.nbytes + self.floats.nbytes)

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """Both buffers on the host, in one transfer: (int64 [slots, rows, w], float32 [...])."""
        got = to_host({"ints": self.ints, "floats": self.floats})
        return got["ints"], got["floats"]

    def to_host(self, ladder_bits: Sequence[Sequence[int]]) -> list[HostRows]:
        """Every slot's rows on the host (``ladder_bits[k]``: slot ``k``'s rungs, as written)."""
        ints, floats = self.host()
        return [slot_rows(ints[k], floats[k], bits) for k, bits in enumerate(ladder_bits)]


def slot_rows(ints: np.ndarray, floats: np.ndarray, ladder_bits: Sequence[int]) -> HostRows:
    """One slot's host rows (``ints``/``floats`` as :meth:`FingerprintBuffers.host` returns a slot
    of them) as :class:`~isoaudit.collectors.fingerprints.HostRows`."""
    r = len(ladder_bits)
    sk = FLOAT_WIDTH - 2
    return HostRows(
        digest=np.ascontiguousarray(ints[:, 0]).view(np.uint64),
        ladder=np.ascontiguousarray(ints[:, 1 : 1 + r]).view(np.uint64),
        sketch=np.ascontiguousarray(floats[:, :sk]),
        l2=np.ascontiguousarray(floats[:, sk]),
        maxabs=np.ascontiguousarray(floats[:, sk + 1]),
        ladder_bits=tuple(int(b) for b in ladder_bits),
    )
