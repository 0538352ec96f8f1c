"""The compiled decoder: what isoaudit puts inside vLLM's torch.compile'd graph, and the recompile
that makes a change take effect at the next step.

vLLM compiles the decoder module marked ``@support_torch_compile`` (e.g. ``Qwen3Model``) once, with
every guard dropped, and then only runs the compiled function: forward hooks and swapped forwards
added afterwards are never called. Dynamo does trace hooks and instance-level forwards that are in
place when it traces, so isoaudit (1) installs what it needs as traceable code around opaque custom
ops (for regions the fingerprint op, :mod:`isoaudit.collectors.fingerprint_op`; the invariant layers'
ops in :mod:`isoaudit.collectors.vllm.worker.remediation`), then (2) hands vLLM a freshly compiled function
for that state (:class:`CompiledDecoder`): the decorator's ``__call__`` runs ``aot_compiled_fn`` when
set, so setting it on the instance replaces what the next forward runs, between two steps. Each
state (regions compiled in, remediation mode) is compiled once, on its first forward, and kept; the
state vLLM compiled itself is its own function, given back untouched. Variants are never written to
or read from vLLM's compile cache (they reference this worker's buffers). The decoder and the graph
taps' buffers (:class:`GraphTaps`) live on the worker across attaches: detaching gives vLLM its own
function back, and attaching again with the same regions runs the variant already compiled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from isoaudit.collectors.fingerprint_op import FingerprintBuffers, fingerprint_index_rows_, selected_rows
from torch import nn

#: The library of isoaudit's graph ops inside vLLM workers.
LIBRARY = "isoaudit_vllm"

#: Selected rows per forward that a CPU engine's taps stage for the batched pass after the step, at
#: most; more are fingerprinted in the forward. A fingerprint call costs about 100 us of fixed
#: overhead on a CPU, so one per region per decode step would cost more than the step of a small
#: model; a prefill of a few selected requests fits too.
CPU_STAGE_ROWS = 1024

#: The stage's memory bound: fewer rows than ``CPU_STAGE_ROWS`` when regions x hidden are large (a
#: 100-region model of hidden 4,096 in bf16 stages 81 rows, a decode batch's selection).
CPU_STAGE_BYTES = 64 << 20

#: What a CPU forward's taps hold for the op at its end, at most: the bytes of the held tensors at
#: the engine's largest batch (``max_num_batched_tokens`` rows each). Past it the op runs when the
#: bound is reached and holding starts again, so a large model's prefill keeps a bounded number of
#: activations alive.
CPU_HOLD_BYTES = 256 << 20

_lib = torch.library.Library(LIBRARY, "FRAGMENT")
_lib.define(
    "tap_rows(Tensor x, Tensor? residual, Tensor(a!) stage, int taps, int slot, bool stageable) -> ()"
)
_lib.define("tap_held(Tensor[] xs, Tensor(a!) stage, int taps, int[] slots, int[] kinds) -> ()")

#: ``tap_held``'s kinds, per region: its residual follows it in ``xs`` (a SUM tap); its rows fit the stage.
_RESIDUAL, _STAGEABLE = 1, 2

#: The live :class:`GraphTaps` by registry id: the compiled taps name theirs by this id, so each call
#: passes six arguments and reads the forward's selection from the host's Python state (no tensor
#: read, no slicing in the op).
_TAPS: dict[int, GraphTaps] = {}


def _tap_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    stage: torch.Tensor,
    taps: int,
    slot: int,
    stageable: bool,
) -> None:
    """One region's selected rows for the forward the taps ``taps`` were set for
    (:meth:`GraphTaps.tap`). CPU engines only (the host's selection is read here, not captured by a
    graph)."""
    tap = _TAPS[taps]
    if tap.selected:
        tap.tap(x, residual, slot, stageable)


_lib.impl("tap_rows", _tap_rows, "CompositeExplicitAutograd")


def _tap_held(
    xs: list[torch.Tensor], stage: torch.Tensor, taps: int, slots: list[int], kinds: list[int]
) -> None:
    """Every region a forward held (:meth:`GraphTaps.hold`), in one call at its end: region ``k``
    is ``xs``' next tensor, then its residual when ``kinds[k]`` says so. Nothing selected: returns
    at once."""
    tap = _TAPS[taps]
    if tap.selected:
        tap.tap_held(xs, slots, kinds)


_lib.impl("tap_held", _tap_held, "CompositeExplicitAutograd")


def tap_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    stage: torch.Tensor,
    taps: int,
    slot: int,
    stageable: bool,
) -> None:
    """The graph op :func:`_tap_rows` (``torch.ops.isoaudit_vllm.tap_rows``), inputs detached."""
    torch.ops.isoaudit_vllm.tap_rows(
        x.detach(), None if residual is None else residual.detach(), stage, taps, slot, stageable
    )


@torch.library.register_fake(f"{LIBRARY}::tap_rows")
def _tap_rows_fake(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    stage: torch.Tensor,
    taps: int,
    slot: int,
    stageable: bool,
) -> None:
    return None


@torch.library.register_fake(f"{LIBRARY}::tap_held")
def _tap_held_fake(
    xs: list[torch.Tensor], stage: torch.Tensor, taps: int, slots: list[int], kinds: list[int]
) -> None:
    return None


def compiled_decoder_module(model: nn.Module) -> nn.Module | None:
    """The submodule vLLM compiles (``@support_torch_compile`` and not ``do_not_compile``), or ``None``
    when the engine runs its model eagerly."""
    for module in model.modules():
        if hasattr(module, "do_not_compile") and hasattr(module, "_compiled_callable"):
            return None if module.do_not_compile else module
    return None


@dataclass
class GraphTaps:
    """What the graph taps of a compiled decoder read and write, kept for the decoder's life (the
    compiled variants hold these tensors): the fingerprint buffers (one slot per region, ``rows``
    rows), the ladder they are written with, the row index and count the host sets before each
    forward, whether the index is padded to its length (no count read: devices other than the CPU),
    ``stage``: on a CPU, ``[regions, stage rows, hidden]`` (``CPU_STAGE_ROWS`` at most, within
    ``CPU_STAGE_BYTES``) for the selections that fit it
    (:func:`_tap_rows`; ``None`` elsewhere); and ``signature``: the regions and slots the tapped
    variants were compiled with."""

    prints: FingerprintBuffers
    bits: tuple[int, ...]
    index: torch.Tensor
    count: torch.Tensor
    padded: bool
    stage: torch.Tensor | None = None
    signature: tuple[Any, ...] = ()
    # The forward in flight, as the CPU taps read it (set_rows): its selected row count, their
    # index, and when they fit the stage, each slot's first rows of it (their destination).
    selected: int = 0
    rows: torch.Tensor | None = None
    outs: list[torch.Tensor] = field(default_factory=list)
    outs_rows: int = -1
    count_value: int = 0  # what ``count`` holds
    last_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ident: int = -1
    # A CPU forward being traced with its taps held to its end (hold): the regions held so far, and
    # how many tensors may be held before the op runs (CPU_HOLD_BYTES).
    held: list[tuple[torch.Tensor, torch.Tensor | None, int, bool]] | None = None
    hold_limit: int = 1 << 30
    # the forward's stage rows when tap_held gathered them at once ([slots, rows, hidden]; else None)
    picked: torch.Tensor | None = None
    plans: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, int]] | None] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self.ident = id(self)
        _TAPS[self.ident] = self

    def set_rows(self, rows: np.ndarray, same: bool = False) -> None:
        """Select ``rows`` (flat token rows) for the next forward: the index and count the graph
        reads, and the selection the CPU taps read (``same``: the rows of the last call, known so)."""
        n = int(rows.size)
        if n > self.index.numel():
            raise ValueError(f"rows: {n} selected rows exceed the graph taps' {self.index.numel()}")
        same = same or (
            n == self.count_value and n == self.last_rows.size and np.array_equal(rows, self.last_rows)
        )
        if not same:  # a decode step repeats the last step's rows: nothing to write
            self.index[:n].copy_(torch.from_numpy(rows))
            if self.padded:  # rows past the count fingerprint row 0, a row every forward has
                self.index[n:].zero_()
            self.last_rows = rows.copy()
        if n != self.count_value:
            self.count[0] = n
            self.count_value = n
        stage = self.stage
        if stage is None or n > int(stage.shape[1]):
            self.outs = []
        elif n != self.outs_rows or not self.outs:  # decode steps keep their row count: views reused
            self.outs = list(stage[:, :n].unbind(0))
            self.outs_rows = n
        if not same or self.rows is None:
            self.rows = self.index[:n]
        self.selected = n
        self.picked = None

    def tap(self, x: torch.Tensor, residual: torch.Tensor | None, slot: int, stageable: bool) -> None:
        """Rows ``index[:n]`` of ``x`` (+ ``residual``'s, added after selection) for the forward in
        flight (:meth:`set_rows`; some selected): copied into ``stage[slot]`` when they fit it,
        otherwise fingerprinted into the slot's rows of the fingerprint buffers
        (:func:`~isoaudit.collectors.fingerprint_op.fingerprint_index_rows_`)."""
        rows = self.rows
        if stageable and self.outs and rows is not None:
            selected_rows(x, residual, rows, out=self.outs[slot])
            return
        prints = self.prints
        fingerprint_index_rows_(
            x, residual, self.index, self.count, prints.ints[slot], prints.floats[slot], self.bits
        )

    def tap_held(self, xs: list[torch.Tensor], slots: list[int], kinds: list[int]) -> None:
        """:meth:`tap` for every region a forward held (``tap_held``'s arguments). A forward whose
        regions fill every slot of the stage, all of the stage's width and dtype, gathers into a
        fresh ``[slots, rows, hidden]`` (:attr:`picked`, handed to the host as is, no stage copy)."""
        self.picked = None
        rows, stage = self.rows, self.stage
        plan = self._stack_plan(slots, kinds)
        if plan is not None and self.outs and rows is not None and stage is not None:
            width, dtype = int(stage.shape[-1]), stage.dtype
            picked = torch.empty(len(plan), rows.numel(), width, dtype=dtype)
            outs = picked.unbind(0)
            for slot, (a, b) in enumerate(plan):
                x = xs[a]
                if x.dim() != 2 or x.shape[1] != width or x.dtype != dtype:
                    break
                torch.index_select(x, 0, rows, out=outs[slot])  # the selected rows only are read
                if b >= 0:
                    added = xs[b]
                    if added.dim() != 2 or added.shape[1] != width or added.dtype != dtype:
                        break
                    outs[slot].add_(added.index_select(0, rows))  # the residual, added after selection
            else:
                self.picked = picked
                return
        i = 0
        for slot, kind in zip(slots, kinds, strict=True):
            residual = xs[i + 1] if kind & _RESIDUAL else None
            self.tap(xs[i], residual, slot, bool(kind & _STAGEABLE))
            i += 2 if residual is not None else 1

    def _stack_plan(self, slots: list[int], kinds: list[int]) -> list[tuple[int, int]] | None:
        """For held regions filling every stage slot once, all stageable: per slot, the index in
        ``xs`` of its tensor and of its residual (-1: none); otherwise ``None`` (kept per call)."""
        key = (tuple(slots), tuple(kinds))
        if key in self.plans:
            return self.plans[key]
        stage = self.stage
        plan: list[tuple[int, int]] | None = None
        if stage is not None and sorted(slots) == list(range(int(stage.shape[0]))):
            where: dict[int, tuple[int, int]] = {}
            i = 0
            for slot, kind in zip(slots, kinds, strict=True):
                where[slot] = (i, i + 1 if kind & _RESIDUAL else -1)
                i += 2 if kind & _RESIDUAL else 1
            if all(kind & _STAGEABLE for kind in kinds):
                plan = [where[slot] for slot in range(len(slots))]
        self.plans[key] = plan
        return plan

    def open_held(self) -> None:
        """Traced at a CPU forward's start: its taps hold their regions for :meth:`close_held`."""
        self.held = []

    def hold(self, x: torch.Tensor, residual: torch.Tensor | None, slot: int, stageable: bool) -> bool:
        """Traced in a region's hook: hold the region for the op at the forward's end (``False``:
        not holding, the region's own op is to run now). Every ``hold_limit`` tensors the op runs
        on those held so far."""
        held = self.held
        if held is None:
            return False
        held.append((x, residual, slot, stageable))
        if sum(1 if r is None else 2 for _, r, _, _ in held) >= self.hold_limit:
            self.close_held()
            self.held = []
        return True

    def close_held(self) -> None:
        """Traced at a CPU forward's end: one op over every region held (``tap_held``)."""
        held, self.held = self.held, None
        if not held or self.stage is None:
            return
        xs: list[torch.Tensor] = []
        slots: list[int] = []
        kinds: list[int] = []
        for x, residual, slot, stageable in held:
            xs.append(x.detach())
            if residual is not None:
                xs.append(residual.detach())
            slots.append(slot)
            kinds.append((_RESIDUAL if residual is not None else 0) | (_STAGEABLE if stageable else 0))
        torch.ops.isoaudit_vllm.tap_held(xs, self.stage, self.ident, slots, kinds)

    def clear_rows(self) -> None:
        """No row selected: the taps of a forward outside a step do nothing (the CPU taps read
        ``selected`` first; elsewhere the index is padded and no count is read)."""
        self.selected = 0
        self.picked = None

    @classmethod
    def allocate(
        cls,
        slots: int,
        rows: int,
        bits: tuple[int, ...],
        device: torch.device,
        hidden: int,
        dtype: torch.dtype,
    ) -> GraphTaps:
        padded = device.type != "cpu"
        element = torch.empty(0, dtype=dtype).element_size()
        row_bytes = slots * hidden * element
        stage_rows = min(rows, CPU_STAGE_ROWS, CPU_STAGE_BYTES // max(1, row_bytes))
        stage = None if padded else torch.zeros(slots, stage_rows, hidden, dtype=dtype)
        return cls(
            FingerprintBuffers(slots, rows, device),
            bits,
            torch.zeros(rows, dtype=torch.long, device=device if padded else "cpu"),
            torch.zeros(1, dtype=torch.long),
            padded,
            stage,
            hold_limit=max(1, CPU_HOLD_BYTES // max(1, rows * hidden * element)),
        )

    def fits(self, slots: int, rows: int, device: torch.device) -> bool:
        return (self.prints.slots, self.prints.rows, self.prints.ints.device) == (slots, rows, device)

    @property
    def nbytes(self) -> int:
        """Device memory of the fingerprint buffers and the stage."""
        stage = self.stage
        return self.prints.nbytes + (int(stage.nbytes) if stage is not None else 0)

    def staged(self, selected: int) -> bool:
        """Whether a forward's ``selected`` rows went to the stage (not fingerprinted in the graph)."""
        return self.stage is not None and selected <= int(self.stage.shape[1])


@dataclass
class Variant:
    """One compiled state of the decoder: compiled on its first forward."""

    key: tuple[Any, ...]
    fn: Callable[..., Any] | None = None
    compile_s: float | None = None


class CompiledDecoder:
    """Switches what vLLM's compiled decoder runs between states (``key``: whatever the caller's
    state is, e.g. ``(regions, mode)``); ``native`` is the state vLLM compiled itself."""

    def __init__(self, module: nn.Module, native: tuple[Any, ...]) -> None:
        self.module = module
        self.native = native
        self.key = native
        self._original = getattr(module, "aot_compiled_fn", None)
        self._variants: dict[tuple[Any, ...], Variant] = {}
        self.last_compile_s: float | None = None
        self.compiles = 0
        self.taps: GraphTaps | None = None

    def select(self, key: tuple[Any, ...]) -> None:
        """Run the state ``key`` from the next forward on (compiling it then, if it is new). Call it
        after the hooks and forwards of that state are in place."""
        self.key = key
        if key == self.native:
            object.__setattr__(self.module, "aot_compiled_fn", self._original)
            return
        variant = self._variants.get(key)
        if variant is None:
            variant = self._variants[key] = Variant(key)
        object.__setattr__(self.module, "aot_compiled_fn", self._runner(variant))

    def drop(self) -> None:
        """Forget every compiled variant and give vLLM its own function back."""
        self._variants.clear()
        self.key = self.native
        object.__setattr__(self.module, "aot_compiled_fn", self._original)

    def release(self) -> None:
        """Give vLLM its own function back, keeping the variants whose remediation is native (they
        hold only the taps, which stay: a later attach with the same regions reuses them; the
        invariant ones hold the remediation's layer ops, rebuilt at the next switch)."""
        self._variants = {k: v for k, v in self._variants.items() if k[1:] == self.native[1:]}
        self.key = self.native
        object.__setattr__(self.module, "aot_compiled_fn", self._original)

    def retap(self, taps: GraphTaps, signature: tuple[Any, ...]) -> None:
        """The taps of the next tapped state: variants compiled with other buffers or regions are
        forgotten (compiled again on first use)."""
        if taps is not self.taps or signature != taps.signature:
            self._variants = {k: v for k, v in self._variants.items() if not k[0]}
            self.taps = taps
            taps.signature = signature

    def facts(self) -> dict[str, Any]:
        """What the manifest says of the compiled graph: the state compiled in and the last
        recompile's cost."""
        return {
            "compiled_state": list(self.key),
            "recompile_s": self.last_compile_s,
            "compiled_variants": len(self._variants),
            "compiles": self.compiles,
        }

    def _runner(self, variant: Variant) -> Callable[..., Any]:
        def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if variant.fn is None:
                start = time.perf_counter()
                taps = self.taps if variant.key[0] else None
                variant.fn = _compile(
                    module, args, kwargs, taps if taps is not None and not taps.padded else None
                )
                variant.compile_s = self.last_compile_s = time.perf_counter() - start
                self.compiles += 1
            return variant.fn(module, *args, **kwargs)

        return run


def _holding(forward: Callable[..., Any], taps: GraphTaps) -> Callable[..., Any]:
    """``forward`` with the CPU taps held to its end: one op per forward (:meth:`GraphTaps.close_held`)
    instead of one per region, each a Python call. In the traced graph the op reads every region's
    value as of its tap (functional semantics), whatever later writes the buffer in place."""

    def held_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        taps.open_held()
        out = forward(self, *args, **kwargs)
        taps.close_held()
        return out

    return held_forward


def _compile(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], held: GraphTaps | None = None
) -> Callable[..., Any]:
    """Compile ``module``'s forward as vLLM does (its backend and options, full graph, guards dropped,
    the dynamic dims it declares), ahead of time, without vLLM's cache. ``held``: a CPU engine's
    taps, held to the forward's end (:func:`_holding`)."""
    import inspect

    from vllm.config import set_current_vllm_config

    config: Any = module.vllm_config
    compilation = config.compilation_config
    with set_current_vllm_config(config):
        backend = compilation.init_backend(config)
    options: dict[str, Any] = dict(compilation.inductor_compile_config) if backend == "inductor" else {}
    options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    for name, dims in (getattr(module, "_dynamic_arg_dims", None) or {}).items():
        value = bound.arguments.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        for dim in [dims] if isinstance(dims, int) else list(dims):
            torch._dynamo.mark_dynamic(value, dim if dim >= 0 else value.ndim + dim)
    with set_current_vllm_config(config), torch._dynamo.config.patch(enable_aot_compile=True):
        forward = type(module).forward
        compiled = torch.compile(
            forward if held is None else _holding(forward, held),
            fullgraph=True,
            dynamic=False,
            backend=backend,
            options=options,
        )
        fn = compiled.aot_compile(((module, *args), kwargs))  # type: ignore[attr-defined]  # torch >= 2.10's AOT compile
    return fn
