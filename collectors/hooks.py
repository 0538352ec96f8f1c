"""Fingerprint region outputs on the model's device during a forward.

One :class:`ForwardCapture` owns what it installs. A root pre-hook opens a *capture* for each
top-level forward and a root post-hook closes it, keeping a reference to the logits. Each region's
module is *watched*: its class is swapped for a subclass (same name) whose ``__call__`` runs the
module's own (forward and hooks) and then reports the region (:func:`_watch`); Dynamo's type guards
see a class change, where a forward hook is seen only with hook guards on for every module of
every compiled model. Regions only act while a capture is open, so activation-checkpointing
recomputation during backward (which re-runs layers outside the root forward) is ignored. Nothing
here modifies outputs or raises: a failure is counted and logged once, and the forward goes on.

Under ``torch.compile`` Dynamo traces the watched calls into the compiled graph, so there they do
no Python bookkeeping at all: each region keeps its rows, and the region that fires last (learned
from an eager forward) calls the multi-region fingerprint op
(:mod:`isoaudit.collectors.fingerprint_regions`) once on all of them, writing each into the slot of
its region in buffers :meth:`ForwardCapture.prepare_compiled` allocated before the step for its
batch shape (the graph's own storage; it guards only on whether buffers are set);
:meth:`ForwardCapture.take_compiled` turns them into a :class:`Capture` after the step. The op
runs inside the model's graph, not in the root post-hook: ``torch.compile(model)`` runs the root's
hooks outside that graph, so rows held for them would leave it as extra outputs aliasing its
intermediates (the logits among them), whose view replay after the graph breaks in a training
step; for the same reason the op is given each tap's tensor itself, not a view of its rows. Before an eager forward has shown the order, and for a region whose output an eager forward
saw written in place after its tap (Dynamo cannot read version counters), each region goes through
the per-region op at its tap instead.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from isoaudit.collectors.fingerprint_op import FingerprintBuffers
from isoaudit.collectors.fingerprint_regions import record_regions
from isoaudit.collectors.fingerprints import (
    FLOAT_WIDTH,
    RegionKey,
    RowFingerprints,
    SpanPlan,
    SpanPrints,
    default_ladder_bits,
    fingerprint_rows,
)
from isoaudit.collectors.regions import RegionSpec, Tap, read_tap
from isoaudit.collectors.transfer import to_device
from isoaudit.kernels import dispatch
from isoaudit.kernels.adapters import REGIONS_ATTRIBUTE
from torch import nn
from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)

Fingerprinter = Callable[[torch.Tensor], RowFingerprints]


@dataclass
class Capture:
    """What one top-level forward left behind: its inputs, logits and per-region row fingerprints."""

    input_ids: torch.Tensor | None
    fingerprinting: bool
    rows: torch.Tensor | None = None  # flat indices of the rows fingerprinted (None: every row)
    prints: MutableMapping[RegionKey, RowFingerprints] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    complete: bool = False

    def matches(self, input_ids: torch.Tensor) -> bool:
        """Was this forward run over exactly ``input_ids``? (Same tensor, or equal shape and values.)"""
        mine = self.input_ids
        if mine is None or mine.shape != input_ids.reshape(mine.shape[0], -1).shape:
            return False
        if mine is input_ids or (mine.data_ptr() == input_ids.data_ptr() and mine.device == input_ids.device):
            return True
        return bool(torch.equal(mine, input_ids.to(mine.device).reshape(mine.shape)))


def _first_tensor(args: Sequence[Any], kwargs: dict[str, Any], name: str) -> torch.Tensor | None:
    value = kwargs.get(name)
    if value is None and args and isinstance(args[0], torch.Tensor):
        value = args[0]
    return value if isinstance(value, torch.Tensor) else None


def _logits_of(output: Any) -> torch.Tensor | None:
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return read_tap(output, Tap.FIRST)


class _Staging:
    """Rows of several regions of one width and dtype, copied into one buffer and fingerprinted in a
    single call: a large model has hundreds of regions, and one call per region would spend the
    forward on kernel launches and Python. The buffer is bounded (``group_bytes``), reused, and
    flushed when full and at the end of the forward, so it never holds more than that."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(rows, hidden, dtype=dtype, device=device)
        self.used = 0
        self.parts: list[tuple[tuple[str, int], int, int]] = []

    def fits(self, n: int) -> bool:
        return self.used + n <= self.buffer.shape[0]

    def add(self, key: tuple[str, int], rows: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Stage ``rows`` (``index``: only those rows of it, gathered straight into the buffer: one
        launch per region, not a gather and then a copy)."""
        n = rows.shape[0] if index is None else index.shape[0]
        out = self.buffer[self.used : self.used + n]
        if index is None:
            out.copy_(rows)
        else:
            torch.index_select(rows, 0, index, out=out)
        self.parts.append((key, self.used, n))
        self.used += n


class _CompiledTarget:
    """Where compiled forwards write: the buffers of one batch shape, and the rungs each region
    slot was written with (``None``: not written since :meth:`ForwardCapture.prepare_compiled`)."""

    def __init__(self, shape: tuple[int, ...], names: Sequence[str], rows: int, device: torch.device) -> None:
        self.shape = shape
        self.names = tuple(names)
        self.buffers = FingerprintBuffers(len(self.names), rows, device)
        self.bits: list[tuple[int, ...] | None] = [None] * len(self.names)
        self.logits: torch.Tensor | None = None
        # per (rungs written, rows): the plan and each group's slots, in the order of its rows
        self._plans: dict[
            tuple[tuple[tuple[int, ...] | None, ...], int], tuple[SpanPlan, tuple[tuple[int, ...], ...]]
        ] = {}
        # per group's slots: (real rows or None, the flat buffer rows to take)
        self._take: dict[tuple[int, ...], tuple[torch.Tensor | None, torch.Tensor]] = {}

    def take_index(self, slots: tuple[int, ...], real: torch.Tensor | None) -> torch.Tensor:
        """The flat buffer rows of ``real`` (the batch's real rows, on the host; ``None``: every
        row) in each of ``slots``, slot after slot, on the buffers' device: made again only when
        the real rows change (a training loop's batches often keep one layout)."""
        kept = self._take.get(slots)
        if kept is not None:
            was = kept[0]
            if (was is None and real is None) or (
                was is not None and real is not None and was.shape == real.shape and torch.equal(was, real)
            ):
                return kept[1]
        device = self.buffers.ints.device
        rows = self.buffers.rows
        picked = torch.tensor(slots, device=device)
        within = torch.arange(rows, device=device) if real is None else to_device(real, device)
        take = (picked[:, None] * rows + within[None, :]).reshape(-1)
        self._take[slots] = (None if real is None else real.clone(), take)
        return take

    def plan(self, rows: int | None = None) -> tuple[SpanPlan, tuple[tuple[int, ...], ...]]:
        """Where the regions written (``bits``) lie in the groups' rows, grouped by rungs: one
        group per ladder holding its own regions' slots only, each region ``rows`` rows (default:
        every row of the buffers) at its place among them; and each group's slots (made once per
        set of rungs written and row count)."""
        written = tuple(self.bits)
        rows = self.buffers.rows if rows is None else rows
        made = self._plans.get((written, rows))
        if made is None:
            groups: dict[tuple[int, ...], list[int]] = {}
            keys, spans, ladders = [], [], []
            for slot, bits in enumerate(written):
                if bits is not None:
                    members = groups.setdefault(bits, [])
                    keys.append((self.names[slot], 0))
                    spans.append((list(groups).index(bits), len(members) * rows, (len(members) + 1) * rows))
                    ladders.append(bits)
                    members.append(slot)
            plan = SpanPlan(tuple(keys), tuple(groups), tuple(spans), tuple(ladders), rows)
            made = self._plans[(written, rows)] = (plan, tuple(tuple(members) for members in groups.values()))
        return made


class _CompiledForward:
    """What a compiled forward's hooks read and write (Dynamo traces every method here): the
    buffers of this step's batch shape, the rows held for the multi-region op, and what eager
    forwards taught (which region fires last, which are written in place after their tap). It
    holds nothing of the model, so the global that reaches it does not keep one alive."""

    def __init__(self, max_held_bytes: int) -> None:
        #: the buffers compiled forwards write into this step (None: they fingerprint nothing)
        self.target: _CompiledTarget | None = None
        #: a compiled forward ran through these hooks (buffers are allocated only then)
        self.seen = False
        #: region slots whose output an eager forward saw written in place after the tap: compiled
        #: forwards fingerprint them at their tap, the others together at the forward's end
        self.mutated: set[int] = set()
        #: the region slot whose hook fires last in an eager forward (None: no eager forward yet):
        #: a compiled forward calls the multi-region op at that region's tap, inside its own graph
        self.last_slot: int | None = None
        #: bound on the activation bytes a compiled forward holds for the multi-region op (rows x
        #: width x element size, summed over regions): reaching it calls the op on what is held
        self.max_held_bytes = max_held_bytes
        self.pending: list[tuple[int, torch.Tensor]] | None = None  # held (slot, tap) pairs
        self.pending_bytes = 0
        self.flushed = False  # this forward's op ran at the last region's tap

    def open(self) -> None:
        self.seen = True  # replayed by every compiled call: buffers from the next step
        self.pending, self.pending_bytes, self.flushed = None, 0, False

    def close(self, output: Any) -> None:
        if self.target is not None:  # the logits, for the collector's logprobs and distribution
            self.target.logits = _logits_of(output)
        self.flush()

    def flush(self) -> None:
        """The rows this forward's region hooks held, through the multi-region op at once."""
        pending, self.pending, self.pending_bytes = self.pending, None, 0
        target = self.target
        if pending and target is not None:
            rows = [r for _, r in pending]
            record_regions(rows, [slot for slot, _ in pending], target.buffers.ints, target.buffers.floats)

    def region(self, slot: int, name: str, tap: Tap, module: nn.Module, inputs: Any, output: Any) -> None:
        """A region inside a traced forward: every row held for the multi-region op, which the
        last region to fire (:attr:`last_slot`) calls in this graph, into its slot (rows are picked
        on the host after the step). The held rows stay under :attr:`max_held_bytes`: a region that
        would pass it first sends what is held through the op at its own tap. The per-region op
        takes a region seen written in place after its tap, one larger than the cap alone, and
        any before the order is known. No try/except: Dynamo traces this."""
        target = self.target
        if target is None:
            return
        with torch.no_grad():
            if name == "logits" and dispatch.is_enabled() and isinstance(module, nn.Linear):
                tensor = _invariant_head_logits(module, inputs, None)
            else:  # an fp32 tap's cast is left to the op where it goes alone (below)
                tensor = read_tap(output, Tap.FIRST if tap is Tap.FP32 else tap)
            if tensor is None:
                return
            rows = tensor.reshape(-1, tensor.shape[-1])
            if rows.shape[0] != target.buffers.rows:
                return
            fp32_tap = tap is Tap.FP32  # fingerprinted as fp32, whatever the rows' dtype
            bits = default_ladder_bits(torch.float32 if fp32_tap else rows.dtype)
            size = rows.numel() * (4 if fp32_tap else rows.element_size())
            if self.last_slot is None or self.flushed or slot in self.mutated or size > self.max_held_bytes:
                # alone (a vocabulary's logits, say): bf16/fp16 rows of an fp32 tap are widened as
                # the kernel reads them, the fields of their fp32 copy without one
                widen = fp32_tap and rows.dtype in (torch.bfloat16, torch.float16)
                if fp32_tap and not widen:
                    rows = rows.float()  # fp64, say: the rounding cast the eager path makes
                target.buffers.write(slot, rows, bits, as_float32=widen)
            else:
                if fp32_tap:
                    tensor = rows = rows.float()  # held with the other fp32 rows of the forward
                if self.pending_bytes + size > self.max_held_bytes:
                    # the cap reached: what is held goes through the op here, and holding starts
                    # anew (a long batch's regions in a few launches, none of them alone)
                    self.flush()
                # the tap itself (the op views its rows), in a new list: a list that existed
                # before this frame and was appended to here would have to be rebuilt after the
                # graph, every held tap an extra output of it
                self.pending = [*(self.pending or ()), (slot, tensor)]
                self.pending_bytes += size
            target.bits[slot] = bits
            if slot == self.last_slot:  # the op inside this graph: no held row leaves it
                self.flush()
                self.flushed = True


#: Each capture's compiled-forward state by its key: the one source every traced hook reads it from.
_COMPILED: dict[int, _CompiledForward] = {}
_KEYS = itertools.count()


def _region_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A watched module's ``__call__`` (:func:`_watch`): the module's own call (its forward and its
    hooks, so a hook that replaces the output is seen), then each of its regions. Traced, it reads
    only its class's constants and :data:`_COMPILED`."""
    cls: Any = type(self)
    output = cls.isoaudit_call(self, *args, **kwargs)
    for key, slot, name, tap_name in getattr(cls, REGIONS_ATTRIBUTE):
        if torch.compiler.is_compiling():
            _COMPILED[key].region(slot, name, getattr(Tap, tap_name), self, args, output)
        else:
            owner = cls.isoaudit_owners[key]
            owner._eager_region(owner.specs[slot], slot, self, args, output)
    return output


def _watched_class(
    base: type[nn.Module], regions: tuple[tuple[int, int, str, str], ...], owners: dict[int, ForwardCapture]
) -> type[nn.Module]:
    """A subclass of ``base`` (same name) whose ``__call__`` is :func:`_region_call` over
    ``regions``. It keeps ``base.__call__`` as a function, not ``base``: a class reached from
    several watched classes would cost a Python identity guard per pair."""
    namespace = {
        "__call__": _region_call,
        "isoaudit_base": base,
        "isoaudit_call": base.__call__,
        "isoaudit_owners": owners,
        REGIONS_ATTRIBUTE: regions,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    }
    return type(base.__name__, (base,), namespace)


def _watch(module: nn.Module, owner: ForwardCapture, slot: int, spec: RegionSpec) -> None:
    """Make ``module`` report region ``slot`` to ``owner`` after each call: its class becomes a
    subclass whose ``__call__`` runs the module's own and then its regions' (every watcher's, one
    class level however many watch it).

    Not a forward hook: Dynamo guards a compiled forward on modules' hook dictionaries only with
    ``skip_nnmodule_hook_guards`` off, which costs every compiled model in the process a guard per
    module and call; by default it would keep running a graph traced before the hook was added. A
    class change is seen by the type guard Dynamo checks anyway."""
    entry = (owner._key, slot, spec.name, spec.tap.name)
    cls: Any = _watched_in(type(module))
    if cls is None:
        module.__class__ = _watched_class(type(module), (entry,), {owner._key: owner})
        return
    base, regions = cls.isoaudit_base, (*getattr(cls, REGIONS_ATTRIBUTE), entry)
    owners = {**cls.isoaudit_owners, owner._key: owner}
    if type(module) is cls:
        module.__class__ = _watched_class(base, regions, owners)
    else:  # another subclass on top (FSDP2's, say): the watched class below it takes the region
        setattr(cls, REGIONS_ATTRIBUTE, regions)
        cls.isoaudit_owners = owners


def _watched_in(cls: type) -> type | None:
    """The watched class (:func:`_watched_class`) in ``cls``'s MRO, if any."""
    return next((c for c in cls.__mro__ if REGIONS_ATTRIBUTE in vars(c)), None)


def _unwatch(module: nn.Module, key: int) -> None:
    """Undo :func:`_watch` for every region of capture ``key`` on ``module``: its class back to the
    original once no capture watches it (or, if something swapped the class again since, the
    watched class left in place with ``key``'s regions dropped)."""
    cls: Any = _watched_in(type(module))
    if cls is None:
        return
    base = cls.isoaudit_base
    regions = tuple(r for r in getattr(cls, REGIONS_ATTRIBUTE) if r[0] != key)
    owners = {k: v for k, v in cls.isoaudit_owners.items() if k != key}
    if type(module) is not cls:  # another subclass on top (FSDP2's, say): keep the chain
        setattr(cls, REGIONS_ATTRIBUTE, regions)
        cls.isoaudit_owners = owners
    elif regions:
        module.__class__ = _watched_class(base, regions, owners)
    else:
        module.__class__ = base


class ForwardCapture:
    """Registers the hooks; ``last`` is the most recent completed capture."""

    def __init__(
        self,
        model: nn.Module,
        specs: Sequence[RegionSpec],
        *,
        fingerprinter: Fingerprinter = fingerprint_rows,
        should_fingerprint: Callable[[], bool] = lambda: True,
        group_bytes: int = 64 << 20,
        max_held_bytes: int = 256 << 20,
    ) -> None:
        if group_bytes < 0:
            raise ValueError(
                f"group_bytes: must be >= 0 (0 fingerprints each region alone), got {group_bytes}"
            )
        self.model = model
        self.group_bytes = group_bytes
        self._staging: dict[tuple[int, torch.dtype, torch.device], _Staging] = {}
        self.specs = list(specs)
        self.fingerprinter = fingerprinter
        self.should_fingerprint = should_fingerprint
        self.force: bool | None = None  # overrides should_fingerprint (the collector's own forwards)
        self.row_hint: tuple[tuple[int, ...], torch.Tensor] | None = (
            None  # (input shape, rows) announced ahead
        )
        self.current: Capture | None = None
        self.last: Capture | None = None
        self.errors = 0
        self._depth = 0
        self._handles: list[RemovableHandle] = []
        self._logged: set[str] = set()
        self._targets: dict[tuple[tuple[int, ...], torch.device], _CompiledTarget] = {}
        #: what compiled forwards read and write, reached from their hooks through one global
        #: (:data:`_COMPILED`): Dynamo guards an object reached through many closures with a Python
        #: identity check per pair, a millisecond of host time per call at a hundred regions
        self.compiled = _CompiledForward(max_held_bytes)
        self._key = next(_KEYS)
        _COMPILED[self._key] = self.compiled
        weakref.finalize(model, _COMPILED.pop, self._key, None)  # the state holds no model
        self._watched: set[int] = set()  # slots an eager forward has checked
        self._watching: list[tuple[int, torch.Tensor, int]] = []  # (slot, tap tensor, its version)
        self._firing: int | None = None  # the last slot fired in the open eager forward
        _ATTACHED.setdefault(model, weakref.WeakSet()).add(self)
        self._handles.append(model.register_forward_pre_hook(self._open, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._close, always_call=True))
        self._watched_modules: list[nn.Module] = []
        for slot, spec in enumerate(self.specs):
            module = model.get_submodule(spec.module)
            _watch(module, self, slot, spec)
            self._watched_modules.append(module)

    @property
    def mutated(self) -> set[int]:
        """Region slots whose output an eager forward saw written in place after the tap."""
        return self.compiled.mutated

    @property
    def max_held_bytes(self) -> int:
        """Bound on the activation bytes a compiled forward holds for the multi-region op."""
        return self.compiled.max_held_bytes

    @max_held_bytes.setter
    def max_held_bytes(self, value: int) -> None:
        self.compiled.max_held_bytes = value

    # ---------------------------------------------------------------- hooks

    def _open(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():  # traced: the region hooks hold rows, nothing else
            _COMPILED[self._key].open()
            return
        self.compiled.flushed = False
        self._depth += 1
        if self._depth > 1:  # a nested call of the root (rare) belongs to the outer capture
            return
        try:
            fingerprinting = self._due()
            input_ids = _first_tensor(args, kwargs, "input_ids")
            rows = self._rows(input_ids, kwargs.get("attention_mask")) if fingerprinting else None
            self.current = Capture(input_ids, fingerprinting and bool(self.specs), rows)
        except Exception as exc:  # never break the forward
            self._fail("open", exc)
            self.current = None

    def _rows(self, input_ids: torch.Tensor | None, mask: Any) -> torch.Tensor | None:
        """Rows worth fingerprinting: the real tokens, when that is known without a device sync
        (a mask on the CPU, or rows announced by ``begin_step``); otherwise every row."""
        if input_ids is None:
            return None
        if self.row_hint is not None and self.row_hint[0] == tuple(input_ids.shape):
            return to_device(self.row_hint[1], input_ids.device)
        if isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and mask.dim() == 2:
            flat = mask.reshape(-1)
            if bool(flat.all()):
                return None
            return to_device(torch.nonzero(flat).squeeze(1), input_ids.device)
        return None

    def _close(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        if torch.compiler.is_compiling():
            _COMPILED[self._key].close(output)
            return
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        self.compiled.flush()  # compiled regions under an eager root: their op runs here
        self._check_watched()
        if self._firing is not None:
            self.compiled.last_slot, self._firing = self._firing, None
        if self.current is None:
            return
        try:
            if self.current.fingerprinting:
                with torch.no_grad():
                    self._flush_all(self.current)
        except Exception as exc:
            self._fail("flush", exc)
            self._flush_all_quietly(self.current)
        try:
            self.current.logits = _logits_of(output)
            self.current.complete = True
            self.last = self.current
        except Exception as exc:
            self._fail("close", exc)
        finally:
            self.current = None

    def _eager_region(
        self, spec: RegionSpec, slot: int, _module: nn.Module, _inputs: Any, output: Any
    ) -> None:
        """A region's hook in an eager forward: its rows fingerprinted (staged with others of its
        width) while a capture is open."""
        capture = self.current
        if capture is None:
            return
        self._firing = slot
        if slot not in self._watched:
            self._watch(spec, slot, output)
        if not capture.fingerprinting:
            return
        try:
            # no_grad: nothing here may join the autograd graph (activation checkpointing counts
            # the tensors a forward saves, and recomputation runs without these hooks).
            with torch.no_grad():
                alone = spec.tap is Tap.FP32
                rows = None  # rows still to pick: the staging buffer gathers them itself
                if spec.name == "logits" and dispatch.is_enabled() and isinstance(_module, nn.Linear):
                    tensor = _invariant_head_logits(_module, _inputs, capture.rows)
                elif alone or capture.rows is None:
                    tensor = read_tap(output, spec.tap, capture.rows)  # rows picked before a cast
                else:
                    tensor = read_tap(output, spec.tap)
                    if tensor is not None and self._stages(tensor):
                        rows = capture.rows
                    elif tensor is not None:
                        tensor = tensor.reshape(-1, tensor.shape[-1]).index_select(0, capture.rows)
                if tensor is None:
                    return
                index = 0
                while (spec.name, index) in capture.prints:
                    index += 1
                self._fingerprint(capture, (spec.name, index), tensor.detach(), alone, rows)
        except Exception as exc:
            self._fail(spec.name, exc)

    def _watch(self, spec: RegionSpec, slot: int, output: Any) -> None:
        """Note the version of a region's tap in an eager forward, checked at its end
        (:meth:`_check_watched`): which regions compiled forwards may hold until their end."""
        if spec.tap is Tap.FP32:  # a fresh cast: nothing else writes it
            self._watched.add(slot)
            return
        try:
            tensor = read_tap(output, spec.tap)
            if tensor is not None:
                self._watching.append((slot, tensor, tensor._version))
        except Exception as exc:
            self._fail(spec.name, exc)

    def _check_watched(self) -> None:
        for slot, tensor, version in self._watching:
            self._watched.add(slot)
            if tensor._version != version:
                self.compiled.mutated.add(slot)
        self._watching.clear()

    def prepare_compiled(self, input_shape: tuple[int, ...], device: torch.device | None) -> None:
        """Before a step whose forward may be compiled: the buffers its region hooks write into,
        one set per batch shape and device, allocated once (``device=None``: fingerprint nothing).
        Only once a compiled forward has run through the hooks: an eager model allocates nothing."""
        if device is None or not self.specs or not self.compiled.seen:
            self.compiled.target = None
            return
        key = (tuple(input_shape), torch.device(device))
        target = self._targets.get(key)
        if target is None:
            rows = 1
            for d in input_shape:
                rows *= int(d)
            target = self._targets[key] = _CompiledTarget(
                key[0], [spec.name for spec in self.specs], rows, key[1]
            )
        target.bits = [None] * len(self.specs)
        target.logits = None
        self.compiled.target = target

    def take_compiled(self, input_ids: torch.Tensor) -> Capture | None:
        """The capture a compiled forward over ``input_ids`` left in the buffers (a copy of them:
        the next step writes the same storage), or None when none ran since
        :meth:`prepare_compiled`."""
        target = self.compiled.target
        if (
            target is None
            or target.bits.count(None) == len(target.bits)
            or tuple(input_ids.shape) != target.shape
        ):
            return None
        # one group per ladder, each region a span of its group (the plan of this shape and these
        # rungs, made once), so the step's transfer sends a few tensors, not 5 per region; each
        # field a gather of the group's own slots into a contiguous copy (the next step writes
        # the same storage), which is also the layout the transfer sends: copied once, not twice.
        # With the real rows known (``begin_step``'s batch), only those rows of each slot: padding
        # never leaves the device, and each sample's rows lie side by side on the host
        ints = target.buffers.ints.reshape(-1, target.buffers.ints.shape[-1])
        floats = target.buffers.floats.reshape(-1, FLOAT_WIDTH)
        real = self.row_hint[1] if self.row_hint is not None and self.row_hint[0] == target.shape else None
        plan, slots_of = target.plan(None if real is None else int(real.numel()))
        groups = []
        for bits, slots in zip(plan.groups, slots_of, strict=True):
            take = target.take_index(slots, real)  # this group's slots only: each row copied once
            groups.append(
                RowFingerprints(
                    ints[:, 0].index_select(0, take),
                    ints[:, 1 : 1 + len(bits)].index_select(0, take),
                    floats[:, : FLOAT_WIDTH - 2].index_select(0, take),
                    floats[:, FLOAT_WIDTH - 2].index_select(0, take),
                    floats[:, FLOAT_WIDTH - 1].index_select(0, take),
                    bits,
                )  # fmt: skip
            )
        capture = Capture(input_ids, rows=real, fingerprinting=True, logits=target.logits, complete=True)
        capture.prints = SpanPrints(groups, plan)
        target.logits = None
        target.bits = [None] * len(self.specs)
        return capture

    def _stages(self, tensor: torch.Tensor) -> bool:
        """Will :meth:`_fingerprint` stage ``tensor``'s rows (all of them, at most) for a group?"""
        if self.group_bytes == 0 or not tensor.dim():
            return False
        return tensor.numel() * tensor.element_size() <= self.group_bytes

    def _fingerprint(
        self,
        capture: Capture,
        key: tuple[str, int],
        tensor: torch.Tensor,
        alone: bool,
        index: torch.Tensor | None = None,
    ) -> None:
        """Fingerprint now (``alone``: logits, whose width is the vocabulary) or stage for a group
        (``index``: the rows of ``tensor`` to keep, gathered as they are staged; only when
        :meth:`_stages` said so)."""
        rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() else tensor.reshape(1, 1)
        row_bytes = rows.shape[1] * rows.element_size()
        n = rows.shape[0] if index is None else index.shape[0]
        if alone or self.group_bytes == 0 or n * row_bytes > self.group_bytes:
            capture.prints[key] = self.fingerprinter(rows if index is None else rows.index_select(0, index))
            return
        slot = (rows.shape[1], rows.dtype, rows.device)
        staging = self._staging.get(slot)
        if staging is None:
            staging = self._staging[slot] = _Staging(
                self.group_bytes // row_bytes, rows.shape[1], rows.dtype, rows.device
            )
        if not staging.fits(n):
            self._flush(capture, staging)
        capture.prints[key] = None  # type: ignore[assignment]  # keeps forward order; filled by _flush
        staging.add(key, rows, index)

    def _flush(self, capture: Capture, staging: _Staging) -> None:
        if not staging.parts:
            return
        try:
            prints = self.fingerprinter(staging.buffer[: staging.used])
            for key, start, n in staging.parts:
                capture.prints[key] = prints.span(start, start + n)  # sliced only if read
        finally:
            staging.used = 0
            staging.parts.clear()

    def _flush_all(self, capture: Capture) -> None:
        for staging in self._staging.values():
            self._flush(capture, staging)
        for key in [k for k, v in capture.prints.items() if v is None]:
            del capture.prints[key]  # a failed flush: those regions are simply not recorded

    def _flush_all_quietly(self, capture: Capture) -> None:
        for staging in self._staging.values():
            staging.used = 0
            staging.parts.clear()
        for key in [k for k, v in capture.prints.items() if v is None]:
            del capture.prints[key]

    def _fail(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if where not in self._logged:
            self._logged.add(where)
            log.warning(
                "isoaudit collector: hook %s failed (%s: %s); counted, the forward goes on",
                where,
                type(exc).__name__,
                exc,
            )

    # ---------------------------------------------------------------- control

    def _due(self) -> bool:
        return self.force if self.force is not None else bool(self.should_fingerprint())

    def fingerprints_next(self) -> bool:
        """Whether the next top-level forward will be fingerprinted (its region hooks then read
        every row of their outputs, the lm_head's logits among them)."""
        return self.attached and bool(self.specs) and self._due()

    def take(self) -> Capture | None:
        """Hand over the last capture (and forget it, so its tensors can be freed)."""
        capture, self.last = self.last, None
        return capture

    def remove(self) -> None:
        """Remove every hook this capture registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._watched_modules:
            _unwatch(module, self._key)
        self._watched_modules.clear()
        self._staging.clear()
        self._targets.clear()
        self._watching.clear()
        self.compiled.pending = None
        self.compiled.target = None
        _COMPILED.pop(self._key, None)
        self.current = self.last = None

    @property
    def attached(self) -> bool:
        return bool(self._handles)


#: The captures hooked on each model (weakly held: a model or a capture dropped leaves nothing).
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[ForwardCapture]] = weakref.WeakKeyDictionary()


def fingerprints_next_forward(model: nn.Module) -> bool:
    """Whether a capture hooked on ``model`` will fingerprint its next top-level forward: a caller
    that would trim the forward's output (HF's ``logits_to_keep``) keeps it whole then."""
    return any(capture.fingerprints_next() for capture in list(_ATTACHED.get(model, ())))


def _invariant_head_logits(head: nn.Linear, inputs: Any, rows: torch.Tensor | None) -> torch.Tensor | None:
    """With the invariant kernels on, a side's logprobs come from the fp32 head
    (:func:`isoaudit.kernels.dispatch.logits_fp32` over the lm_head's input, as the engines compute theirs),
    not from the model-dtype ``lm_head`` module's own output: fingerprint those logits."""
    hidden = read_tap(inputs, Tap.FIRST, rows)
    if hidden is None:
        return None
    return dispatch.logits_fp32(hidden.reshape(-1, hidden.shape[-1]), head.weight)
