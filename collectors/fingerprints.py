"""Per-token-row activation fingerprints computed on the activation's own device (DESIGN.md,
"Fingerprints"): the torch half of :mod:`isoaudit.audit.fingerprints`, which keeps the digest weights, the
sketch projection and the comparisons (numpy only, so the service never loads torch).

:func:`fingerprint_rows` gives digest, ladder, sketch, l2 and maxabs of every row as tensors on the
device; :func:`rows_to_host` brings any number of them (and a few other tensors) to the host in one
transfer, as :class:`HostRows`. The trainer's step packs its regions with :func:`pack_prints`: the
regions fingerprinted together travel as their group, not one by one. On CUDA the digest and ladder come from a fused pass:
``isoaudit.kernels.fingerprint`` (a Triton kernel, bitwise equal to the torch path) when it is installed and
imports, else a ``torch.compile``'d expression, else eager torch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from isoaudit.audit.fingerprints import ROW_FIELDS, SKETCH_DIM, digest_weights, sketch_matrix
from isoaudit.collectors.transfer import to_host


@dataclass(frozen=True)
class _Format:
    int_dtype: torch.dtype
    mantissa_bits: int
    ladder_bits: tuple[int, ...]


#: Per float dtype: the same-width integer view, the stored mantissa bits and the default ladder.
#: bf16 keeps 7 mantissa bits, so (6, 4, 2, 0) brackets 2**-6 .. 1; fp32's rung at 7 bits asks
#: "equal at bf16 precision?", the question a bf16 trainer against an fp32 engine raises.
FORMATS: dict[torch.dtype, _Format] = {
    torch.bfloat16: _Format(torch.int16, 7, (6, 4, 2, 0)),
    torch.float16: _Format(torch.int16, 10, (8, 6, 4, 2, 0)),
    torch.float32: _Format(torch.int32, 23, (16, 10, 7, 4, 0)),
    torch.float64: _Format(torch.int64, 52, (40, 23, 10, 7, 0)),
}


def default_ladder_bits(dtype: torch.dtype) -> tuple[int, ...]:
    """The ladder used when none is given: mantissa bits kept per rung, finest first."""
    return _format(dtype).ladder_bits


def _format(dtype: torch.dtype) -> _Format:
    try:
        return FORMATS[dtype]
    except KeyError:
        raise TypeError(
            f"x: unsupported dtype {dtype}; expected one of {sorted(map(str, FORMATS))}"
        ) from None


@lru_cache(maxsize=64)
def _device_weights(hidden: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(digest_weights(hidden).view(np.int64)).to(device)


@lru_cache(maxsize=64)
def _device_sketch(hidden: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(sketch_matrix(hidden)).to(device=device, dtype=dtype)


@lru_cache(maxsize=64)
def _device_masks(masks: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(masks, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class RowFingerprints:
    """Fingerprints of ``n`` rows, as torch tensors on the activation's device."""

    digest: torch.Tensor  # int64 [n], read as uint64
    ladder: torch.Tensor  # int64 [n, R], read as uint64
    sketch: torch.Tensor  # float32 [n, 16]
    l2: torch.Tensor  # float32 [n]
    maxabs: torch.Tensor  # float32 [n]
    ladder_bits: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.digest.shape[0])

    def select(self, index: Any) -> RowFingerprints:
        """A subset of rows (a slice, an index tensor or a mask), e.g. one sample's tokens."""
        return RowFingerprints(
            self.digest[index],
            self.ladder[index],
            self.sketch[index],
            self.l2[index],
            self.maxabs[index],
            self.ladder_bits,
        )

    def to_host(self) -> HostRows:
        """These rows on the host (one transfer), typed as the records store them."""
        return rows_to_host([self])[0]

    def span(self, start: int, stop: int) -> RowFingerprints:
        """Rows ``start:stop`` as a :class:`RowSpan`: a region's rows of a group fingerprinted in
        one call. Nothing is sliced until a field is read, and :func:`pack_prints` sends the
        group once for all its spans."""
        return RowSpan(self, start, stop)


_SPAN_FIELDS = frozenset(ROW_FIELDS)


class RowSpan(RowFingerprints):
    """Rows ``start:stop`` of ``parent``, whose fields are sliced on first read.

    A step with every region fingerprinted has hundreds of regions, each a slice of a group's
    fingerprints; slicing five tensors per region costs host time the collector never needs, since
    the step's transfer sends the group whole (:func:`pack_prints`)."""

    parent: RowFingerprints
    start: int
    stop: int

    def __init__(self, parent: RowFingerprints, start: int, stop: int) -> None:  # noqa: D107
        if isinstance(parent, RowSpan):  # a span of a span: one level, on the group itself
            start, stop, parent = parent.start + start, parent.start + stop, parent.parent
        # frozen: set in the instance's dict directly, all at once (hundreds of spans a step)
        vars(self).update(parent=parent, start=int(start), stop=int(stop), ladder_bits=parent.ladder_bits)

    def __getattr__(self, name: str) -> Any:
        # only called for what the instance lacks: the five tensors, until first read
        if name not in _SPAN_FIELDS:
            raise AttributeError(name)
        value = getattr(self.parent, name)[self.start : self.stop]
        object.__setattr__(self, name, value)
        return value

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"RowSpan(rows {self.start}:{self.stop} of {len(self.parent)}, ladder_bits={self.ladder_bits})"


RegionKey = tuple[str, int]


@dataclass(frozen=True)
class SpanPlan:
    """Where each region's rows lie among a few groups' rows (:class:`SpanPrints`): the same for
    every step of one batch shape and the same rungs, so it is built once and reused."""

    keys: tuple[RegionKey, ...]  # the regions, in order
    groups: tuple[tuple[int, ...], ...]  # each group's rungs
    spans: tuple[tuple[int, int, int], ...]  # per region: (group, start, stop)
    ladder_bits: tuple[tuple[int, ...], ...]  # per region: its rungs (its group's)
    rows: int  # rows of every span


class SpanPrints(MutableMapping[RegionKey, RowFingerprints]):
    """The prints of many regions as :class:`RowSpan`\\ s of a few groups, laid out by a
    :class:`SpanPlan`: a mapping region → prints like any other, whose spans are made only when
    read. :func:`pack_prints` sends the groups without making them: a step with every region
    fingerprinted has hundreds of regions, and a Python object apiece costs host time each step.
    Modified, it is a plain mapping from then on."""

    def __init__(self, groups: Sequence[RowFingerprints], plan: SpanPlan) -> None:
        self.groups = tuple(groups)
        self.plan: SpanPlan | None = plan
        self._spans: dict[RegionKey, RowFingerprints] | None = None

    def _made(self) -> dict[RegionKey, RowFingerprints]:
        if self._spans is None:
            assert self.plan is not None
            groups = self.groups
            self._spans = {
                key: RowSpan(groups[g], a, b)
                for key, (g, a, b) in zip(self.plan.keys, self.plan.spans, strict=True)
            }
        return self._spans

    def __getitem__(self, key: RegionKey) -> RowFingerprints:
        return self._made()[key]

    def __setitem__(self, key: RegionKey, value: RowFingerprints) -> None:
        self._made()[key] = value
        self.plan = None

    def __delitem__(self, key: RegionKey) -> None:
        del self._made()[key]
        self.plan = None

    def __iter__(self) -> Iterator[RegionKey]:
        return iter(self.plan.keys if self.plan is not None else self._made())

    def __len__(self) -> int:
        return len(self.plan.keys) if self.plan is not None else len(self._made())


def _check_ladder(ladder_bits: Sequence[int] | None, fmt: _Format) -> tuple[int, ...]:
    if ladder_bits is None:
        return fmt.ladder_bits
    bits = tuple(int(b) for b in ladder_bits)
    if any(b < 0 or b > fmt.mantissa_bits for b in bits):
        raise ValueError(
            f"ladder_bits: each rung keeps 0..{fmt.mantissa_bits} mantissa bits, got {list(bits)}"
        )
    if any(a <= b for a, b in zip(bits, bits[1:], strict=False)):
        raise ValueError(f"ladder_bits: must be strictly decreasing (finest rung first), got {list(bits)}")
    return bits


def _chunk_rows(hidden: int, device: torch.device) -> int:
    # CPU: keep each chunk's int64 temporaries in cache (2**18 elements = 2 MiB), which makes the
    # passes over it several times faster than over one big tensor. GPU: large chunks, few launches.
    budget = 1 << 18 if device.type == "cpu" else 1 << 24
    return max(1, budget // max(hidden, 1))


def _integer_sums_chunked(
    rows: torch.Tensor,
    int_dtype: torch.dtype,
    weights: torch.Tensor,
    masks: list[int],
    digest: torch.Tensor,
    ladder: torch.Tensor,
    step: int,
) -> None:
    """Digest and ladder in eager torch, a chunk of rows at a time, into ``digest``/``ladder``."""
    n, hidden = rows.shape
    # Scratch buffers allocated once per call: fresh allocations per chunk would page-fault.
    wide_buf = torch.empty(step, hidden, dtype=torch.int64, device=rows.device)
    scratch_buf = torch.empty_like(wide_buf)
    for start in range(0, n, step):
        stop = min(start + step, n)
        chunk = rows[start:stop]
        wide, scratch = wide_buf[: stop - start], scratch_buf[: stop - start]
        wide.copy_(chunk.view(int_dtype) if chunk.is_contiguous() else chunk.contiguous().view(int_dtype))
        torch.mul(wide, weights, out=scratch)
        torch.sum(scratch, dim=-1, out=digest[start:stop])
        for j, mask in enumerate(masks):
            torch.bitwise_and(wide, mask, out=scratch)
            scratch.mul_(weights)
            ladder[start:stop, j] = scratch.sum(dim=-1)


def _integer_sums(
    as_int: torch.Tensor, weights: torch.Tensor, masks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Digest and ladder in one expression, for the compiler to fuse into one pass over the rows
    (eagerly it would materialise [rows, rungs, hidden] int64)."""
    wide = as_int.to(torch.int64)
    digest = (wide * weights).sum(-1)
    ladder = ((wide.unsqueeze(1) & masks.unsqueeze(-1)) * weights).sum(-1)
    return digest, ladder


def _integer_sums_by_rung(
    as_int: torch.Tensor, weights: torch.Tensor, masks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_integer_sums` with one reduction per rung (the rungs a shape the compiler unrolls):
    on the CPU its loops vectorise better than over a [rows, rungs, hidden] broadcast."""
    wide = as_int.to(torch.int64)
    ladder = [((wide & masks[j]) * weights).sum(-1) for j in range(masks.shape[0])]
    return (wide * weights).sum(-1), torch.stack(ladder, -1)


_FUSED: dict[str, Any] = {}  # per device type: the compiled expression, or False (eager)
_PROBED: dict[tuple[str, torch.dtype], bool] = {}  # per (device type, integer dtype): bits checked


def _fused_integer_sums(device_type: str = "cuda", int_dtype: torch.dtype = torch.int16) -> Any:
    """The compiled :func:`_integer_sums` on ``device_type`` for ``int_dtype`` rows, or None to use
    the eager chunked path.

    Eager torch spends most of the time writing int64 temporaries; the fused kernel reads each
    activation once. Each (device type, integer dtype) is checked once against eager on a probe
    before it is used. ``ISOAUDIT_FINGERPRINT_COMPILE=0`` turns it off; a failed compile or a probe
    that disagrees falls back.
    """
    compiled: Any = _FUSED.get(device_type)
    if compiled is None:
        compiled = _FUSED[device_type] = False
        if os.environ.get("ISOAUDIT_FINGERPRINT_COMPILE", "1") != "0":
            try:
                expression = _integer_sums if device_type == "cuda" else _integer_sums_by_rung
                compiled = _FUSED[device_type] = torch.compile(expression, dynamic=True, fullgraph=True)
            except Exception as exc:  # noqa: BLE001 - any compiler failure means: use the eager path
                warnings.warn(
                    f"fingerprints: torch.compile unavailable ({exc!r:.200}); using eager", stacklevel=2
                )
    if compiled is False:
        return None
    key = (device_type, int_dtype)
    if key not in _PROBED:
        _PROBED[key] = False
        try:
            info = torch.iinfo(int_dtype)
            ends = torch.tensor([info.min, info.max], device=device_type)  # the extremes sign-extend
            span = torch.arange(-299, 299, dtype=torch.int64, device=device_type)
            probe = torch.cat([span, ends]).to(int_dtype).reshape(2, 300)
            w = torch.arange(1, 601, 2, dtype=torch.int64, device=device_type) * 0x9E3779B97F4A7C1
            m = torch.tensor([-4, -1], dtype=torch.int64, device=device_type)
            got, want = compiled(probe, w, m), _integer_sums(probe, w, m)
            _PROBED[key] = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
            if not _PROBED[key]:
                warnings.warn("fingerprints: compiled digest disagrees with eager; using eager", stacklevel=2)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: use the eager path
            warnings.warn(
                f"fingerprints: torch.compile unavailable ({exc!r:.200}); using eager", stacklevel=2
            )
    return compiled if _PROBED[key] else None


_TRITON: Any = None


def _triton_pass() -> Any:
    """``isoaudit.kernels.fingerprint`` (one fused Triton pass computing every field; digest, ladder and
    max-abs bit-identical to this module's, sketch and L2 to fp32 rounding) when it imports, else
    None. ``ISOAUDIT_FINGERPRINT_TRITON=0`` turns it off."""
    global _TRITON
    if _TRITON is None:
        _TRITON = False
        if os.environ.get("ISOAUDIT_FINGERPRINT_TRITON", "1") != "0":
            try:
                from isoaudit.kernels import fingerprint as fused

                if getattr(fused, "HAVE_TRITON", True) and callable(fused.fingerprint_rows):
                    _TRITON = fused
            except Exception:  # noqa: BLE001 - not installed, no Triton, ...: the torch path
                _TRITON = False
    return _TRITON or None


def fingerprint_rows(
    x: torch.Tensor, ladder_bits: Sequence[int] | None = None, *, compile_sums: bool = False
) -> RowFingerprints:
    """Fingerprint every row of ``x`` ([..., hidden]; rows = leading dims flattened) on x's device.

    ``compile_sums``: on the CPU too, the digest and ladder through the compiled expression (one
    fused pass, several times faster than the eager chunks, the same bits; compiled on first use,
    which takes seconds: for callers that fingerprint many rows again and again)."""
    fmt = _format(x.dtype)
    bits = _check_ladder(ladder_bits, fmt)
    hidden = int(x.shape[-1]) if x.dim() else 1
    rows = x.detach().reshape(-1, hidden)
    n, device = rows.shape[0], rows.device
    digest = torch.empty(n, dtype=torch.int64, device=device)
    ladder = torch.empty(n, len(bits), dtype=torch.int64, device=device)
    sketch = torch.empty(n, SKETCH_DIM, dtype=torch.float32, device=device)
    l2 = torch.empty(n, dtype=torch.float32, device=device)
    maxabs = torch.empty(n, dtype=torch.float32, device=device)
    out = RowFingerprints(digest, ladder, sketch, l2, maxabs, bits)
    if n == 0:
        return out
    if device.type == "cuda":
        triton_pass = _triton_pass()
        if triton_pass is not None and triton_pass.supported(rows):
            got = triton_pass.fingerprint_rows(rows, *_constants(hidden, device, fmt, bits))
            return RowFingerprints(got.digest, got.ladder, got.sketch, got.l2, got.maxabs, bits)
    _fill(rows, fmt, bits, out, compile_sums)
    return out


def packed_width(ladder_bits: Sequence[int]) -> int:
    """Columns of the int64 row buffer :func:`fingerprint_rows_into` writes: the digest, then the
    rungs rounded up to a power of two (the fused kernel's layout; the extra columns are scratch)."""
    r = max(len(ladder_bits), 1)
    return 1 + (1 << (r - 1).bit_length())


#: Columns of the float32 row buffer :func:`fingerprint_rows_into` writes: sketch, L2, max-abs.
FLOAT_WIDTH = SKETCH_DIM + 2


def fingerprint_rows_into(
    x: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    ladder_bits: Sequence[int] | None = None,
    as_float32: bool = False,
) -> RowFingerprints:
    """:func:`fingerprint_rows` written into preallocated row buffers, with no host sync and no
    allocation the caller sees: ``ints`` int64 ``[n, >= packed_width(bits)]`` (digest, rungs),
    ``floats`` float32 ``[n, >= FLOAT_WIDTH]`` (sketch, L2, max-abs), both with unit column stride.
    The same bits as :func:`fingerprint_rows` of the same rows; returns the fields as views.
    ``as_float32``: the fields of ``x.float()`` for bf16/fp16 ``x`` (the kernel widens each element
    as it reads it: no fp32 copy of a vocabulary's logits), ``ladder_bits`` then fp32's."""
    if as_float32 and x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x: as_float32 widens bf16, fp16 or fp32 rows exactly, not {x.dtype}")
    fmt = _format(torch.float32 if as_float32 else x.dtype)
    bits = _check_ladder(ladder_bits, fmt)
    hidden = int(x.shape[-1]) if x.dim() else 1
    rows = x.detach().reshape(-1, hidden)
    n, device = rows.shape[0], rows.device
    for name, buf, dtype, width in (
        ("ints", ints, torch.int64, packed_width(bits)),
        ("floats", floats, torch.float32, FLOAT_WIDTH),
    ):
        if buf.dtype != dtype or buf.dim() != 2 or buf.shape[0] != n or buf.shape[1] < width:
            raise ValueError(
                f"{name}: expected {dtype} [{n}, >= {width}] for {n} rows of {x.dtype}, "
                f"got {buf.dtype} {list(buf.shape)}"
            )
        if buf.device != device or buf.stride(-1) != 1:
            raise ValueError(f"{name}: must be on {device} with unit column stride")
    r = len(bits)
    out = RowFingerprints(
        ints[:, 0],
        ints[:, 1 : 1 + r],
        floats[:, :SKETCH_DIM],
        floats[:, SKETCH_DIM],
        floats[:, SKETCH_DIM + 1],
        bits,
    )
    if n == 0:
        return out
    if device.type == "cuda":
        triton_pass = _triton_pass()
        if triton_pass is not None and triton_pass.supported(rows):
            constants = _constants(hidden, device, fmt, bits)
            triton_pass.fingerprint_rows(rows, *constants, out=(ints, floats), as_float32=as_float32)
            return out
    _fill(rows.float() if as_float32 else rows, fmt, bits, out)
    return out


def _constants(
    hidden: int, device: torch.device, fmt: _Format, bits: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel's digest weights, fp32 sketch projection and rung masks (cached per device)."""
    return (
        _device_weights(hidden, device),
        _device_sketch(hidden, device, torch.float32),
        _device_masks(tuple(_masks(fmt, bits)), device),
    )


def _masks(fmt: _Format, bits: tuple[int, ...]) -> list[int]:
    # Clearing the low (mantissa - k) bits; as a negative int64 it also keeps the sign extension.
    return [-(1 << (fmt.mantissa_bits - k)) for k in bits]


def _fill(
    rows: torch.Tensor, fmt: _Format, bits: tuple[int, ...], out: RowFingerprints, compile_sums: bool = False
) -> None:
    """Every field of ``rows`` ([n >= 1, hidden]) in torch, into ``out``'s tensors (any strides);
    the integer sums compiled on CUDA, and with ``compile_sums`` on any device."""
    n, hidden = rows.shape
    device = rows.device
    digest, ladder, sketch, l2, maxabs = out.digest, out.ladder, out.sketch, out.l2, out.maxabs
    weights = _device_weights(hidden, device)
    wide = rows.dtype == torch.float64
    proj = _device_sketch(hidden, device, torch.float64 if wide else torch.float32)
    masks = _masks(fmt, bits)
    # (a single row or column would be a shape of its own to compile: eager, it costs little)
    compiled = device.type == "cuda" or (compile_sums and n > 1 and hidden > 1)
    fused = _fused_integer_sums(device.type, fmt.int_dtype) if compiled else None
    step = min(_chunk_rows(hidden, device), n)
    with torch.no_grad():
        if fused is not None:
            as_int = rows.contiguous().view(fmt.int_dtype)
            got_digest, got_ladder = fused(as_int, weights, _device_masks(tuple(masks), device))
            digest.copy_(got_digest)
            ladder.copy_(got_ladder)
        else:
            _integer_sums_chunked(rows, fmt.int_dtype, weights, masks, digest, ladder, step)
        # a copy, reused across chunks: the activation itself must never be written to
        values_buf = torch.empty(step, hidden, dtype=proj.dtype, device=device)
        for start in range(0, n, step):
            stop = min(start + step, n)
            values = values_buf[: stop - start]
            values.copy_(rows[start:stop])
            if device.type == "cuda" and rows.dtype == torch.float32:
                # TF32 matmuls would round fp32 inputs to 10 mantissa bits; bf16 parts are exact in
                # TF32, so sketch the exact high part and the small remainder separately.
                high = values.to(torch.bfloat16).float()
                sketch[start:stop] = high @ proj + (values - high) @ proj
            else:
                sketch[start:stop] = (values @ proj).float()
            l2[start:stop] = torch.linalg.vector_norm(values, dim=-1).float()
            maxabs[start:stop] = values.abs_().amax(dim=-1).float()


@dataclass(frozen=True)
class HostRows:
    """:class:`RowFingerprints` on the host, typed as the records store them: ``digest`` uint64
    [n], ``ladder`` uint64 [n, rungs], ``sketch`` float32 [n, 16], ``l2``/``maxabs`` float32 [n];
    ``row_index``: the flat row of each (``None``: every row of the forward, in order)."""

    digest: np.ndarray
    ladder: np.ndarray
    sketch: np.ndarray
    l2: np.ndarray
    maxabs: np.ndarray
    ladder_bits: tuple[int, ...]
    row_index: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.digest.shape[0])

    def fields(self) -> dict[str, np.ndarray]:
        """The per-row arrays by their record names (:data:`isoaudit.audit.fingerprints.ROW_FIELDS`)."""
        return {name: getattr(self, name) for name in ROW_FIELDS}


def device_tensors(prints: Sequence[RowFingerprints], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of ``prints`` keyed for one transfer (see :func:`host_rows`)."""
    out: dict[str, torch.Tensor] = {}
    for i, fp in enumerate(prints):
        for name in ROW_FIELDS:
            out[f"{prefix}{i}.{name}"] = getattr(fp, name)
    return out


#: One group's (or one print's) row arrays on the host, in :data:`ROW_FIELDS` order, typed as the
#: records store them: digest, ladder (uint64), sketch, l2, maxabs (float32).
HostFields = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _host_fields(host: dict[str, np.ndarray], key: str) -> HostFields:
    """The row arrays sent under ``key`` (``<key>.digest`` and the rest), typed as records store them."""
    return (
        host[f"{key}.digest"].view(np.uint64),
        host[f"{key}.ladder"].view(np.uint64),
        host[f"{key}.sketch"],
        host[f"{key}.l2"],
        host[f"{key}.maxabs"],
    )


def host_rows(
    host: dict[str, np.ndarray],
    ladder_bits: Sequence[tuple[int, ...]],
    prefix: str = "",
    row_index: np.ndarray | None = None,
) -> list[HostRows]:
    """The :class:`HostRows` of :func:`device_tensors` ``(prints, prefix)`` once they landed
    (``ladder_bits``: of each of those prints, in order)."""
    return [
        HostRows(*_host_fields(host, f"{prefix}{i}"), ladder_bits=tuple(bits), row_index=row_index)
        for i, bits in enumerate(ladder_bits)
    ]


@dataclass(frozen=True)
class PrintsLayout:
    """Where :func:`pack_prints` put each print: ``spans[i] = (group, start, stop)``, the rows of
    print ``i`` in group ``group``'s tensors; ``ladder_bits[i]``: its rungs."""

    prefix: str
    groups: int
    spans: tuple[tuple[int, int, int], ...]
    ladder_bits: tuple[tuple[int, ...], ...]


def pack_prints(
    prints: Sequence[RowFingerprints] | Mapping[Any, RowFingerprints], prefix: str = ""
) -> tuple[dict[str, torch.Tensor], PrintsLayout]:
    """The tensors of ``prints`` (or of a mapping's values, in order) keyed for one transfer, each
    group sent once: the spans of one group (:class:`RowSpan`, as the hooks make them) add no
    tensor, so a step's hundreds of regions travel as a few groups' five fields; a
    :class:`SpanPrints` is packed from its plan, no span made. :func:`unpack_prints` cuts them
    apart on the host."""
    if isinstance(prints, SpanPrints) and prints.plan is not None:
        plan = prints.plan
        tensors = {
            f"{prefix}{g}.{name}": getattr(group, name)
            for g, group in enumerate(prints.groups)
            for name in ROW_FIELDS
        }
        return tensors, PrintsLayout(prefix, len(prints.groups), plan.spans, plan.ladder_bits)
    if isinstance(prints, Mapping):
        prints = list(prints.values())
    tensors = {}
    group_of: dict[int, int] = {}
    keep: list[RowFingerprints] = []  # the ids above stay valid while these live
    spans = []
    for fp in prints:
        if isinstance(fp, RowSpan):
            base, start, stop = fp.parent, fp.start, fp.stop
        else:
            base, start, stop = fp, 0, len(fp)
        group = group_of.get(id(base))
        if group is None:
            group = group_of[id(base)] = len(keep)
            keep.append(base)
            for name in ROW_FIELDS:
                tensors[f"{prefix}{group}.{name}"] = getattr(base, name)
        spans.append((group, start, stop))
    layout = PrintsLayout(prefix, len(keep), tuple(spans), tuple(tuple(fp.ladder_bits) for fp in prints))
    return tensors, layout


def host_groups(host: dict[str, np.ndarray], layout: PrintsLayout) -> list[HostFields]:
    """The row arrays of each group :func:`pack_prints` sent, once they landed."""
    return [_host_fields(host, f"{layout.prefix}{g}") for g in range(layout.groups)]


@dataclass(frozen=True)
class PackedHostPrints:
    """:func:`pack_prints`'s prints on the host, left packed: ``keys[i]`` names print ``i``,
    whose rows are ``layout.spans[i]`` of its group's arrays (``row_index``: the flat row of each
    row, ``None``: every row of the forward). What :func:`unpack_prints` would cut into one
    :class:`HostRows` per print, for a reader that slices each print once anyway."""

    host: dict[str, np.ndarray]
    layout: PrintsLayout
    keys: Sequence[tuple[str, int]]
    row_index: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.keys)


def unpack_prints(
    host: dict[str, np.ndarray], layout: PrintsLayout, row_index: np.ndarray | None = None
) -> list[HostRows]:
    """The :class:`HostRows` of :func:`pack_prints`'s prints once their tensors landed, in order:
    row slices of their group's arrays (contiguous, no copy)."""
    groups = host_groups(host, layout)
    out = []
    new = HostRows.__new__
    for (group, a, b), bits in zip(layout.spans, layout.ladder_bits, strict=True):
        digest, ladder, sketch, l2, maxabs = groups[group]
        # HostRows(...) without the frozen dataclass's seven object.__setattr__ (hundreds a step)
        rows = new(HostRows)
        vars(rows).update(
            digest=digest[a:b],
            ladder=ladder[a:b],
            sketch=sketch[a:b],
            l2=l2[a:b],
            maxabs=maxabs[a:b],
            ladder_bits=bits,
            row_index=row_index,
        )
        out.append(rows)
    return out


def rows_to_host(prints: Sequence[RowFingerprints]) -> list[HostRows]:
    """``prints`` on the host, with one device-to-host transfer for all of them."""
    host = to_host(device_tensors(prints))
    return host_rows(host, [fp.ladder_bits for fp in prints])
