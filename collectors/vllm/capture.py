"""Fingerprints inside the engine: hooks on the vLLM model, rows mapped to (request, position).

One :class:`EngineCapture` lives in each worker. It wraps the model runner's ``execute_model`` (to
know a real step from a warm-up or dummy forward, and to see which requests finished), reads each
forward's layout (:mod:`collectors.vllm.rows`) in a pre-hook on the model, and in the region hooks
copies only the rows of the requests chosen for fingerprinting. After the step it fingerprints all
of them at once (one :func:`~audit.fingerprints.fingerprint_rows` call per row width, one transfer)
and files the results under each request, until the driver drains them.

It never raises into the engine: errors are counted and logged once. Its buffers are bounded
(requests and fingerprint rows); past a bound it evicts finished, never-drained requests first,
then drops new rows, counting both, so a collector that nobody drains cannot grow without limit.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from audit.fingerprints import RowFingerprints, fingerprint_rows
from collectors.regions import RegionSpec, Tap, read_tap
from collectors.transfer import to_host
from collectors.vllm.rows import ForwardRows, read_forward_rows
from collectors.vllm.selection import Selection

log = logging.getLogger(__name__)

#: Per-row fingerprint fields, as :class:`audit.records.RegionFingerprints` names them.
_FIELDS = ("digest", "ladder", "sketch", "l2", "maxabs")

#: vLLM makes request ids unique by appending "-" and 8 hex digits to the caller's id.
_SUFFIX = re.compile(r"^(?P<ext>.+)-[0-9a-f]{8}$")


def external_id(req_id: str) -> str:
    """The id the caller sees (``RequestOutput.request_id``) for vLLM's internal request id."""
    match = _SUFFIX.match(req_id)
    return match.group("ext") if match else req_id


@dataclass
class CaptureCounters:
    steps: int = 0
    forwards: int = 0
    fingerprinted_forwards: int = 0
    requests_seen: int = 0
    requests_selected: int = 0
    rows: int = 0
    dropped_rows: int = 0
    evicted_requests: int = 0
    recomputed_rows: int = 0
    skipped_logits: int = 0
    errors: int = 0


@dataclass
class RequestTrace:
    """What the engine knows of one request until the driver drains it."""

    req_id: str
    ext_id: str
    prompt_len: int
    temperature: float
    top_k: int | None
    top_p: float | None
    selected: bool
    first_version: str | None
    last_version: str | None
    # (region index, case, positions int64 [n], {field: array [n, ...]}) per forward
    chunks: list[tuple[int, str, np.ndarray, dict[str, np.ndarray]]] = field(default_factory=list)
    rows: int = 0
    finished: bool = False
    truncated: bool = False


@dataclass
class _Forward:
    """The selected rows of the forward in flight."""

    layout: ForwardRows
    members: list[tuple[RequestTrace, int, str]]  # (trace, batch index, case), selected only
    index: torch.Tensor | None  # flat rows of the selected requests, concatenated in batch order
    logits_index: torch.Tensor | None  # their batch indices (logits rows)
    positions: torch.Tensor | None  # the forward's own positions of those rows
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)


def _sampling(params: Any) -> tuple[float, int | None, float | None]:
    if params is None:
        return 1.0, None, None
    temperature = float(getattr(params, "temperature", 1.0) or 0.0)
    top_k = getattr(params, "top_k", None)
    top_k = int(top_k) if top_k is not None and int(top_k) > 0 else None
    top_p = getattr(params, "top_p", None)
    top_p = float(top_p) if top_p is not None else None
    return temperature, top_k, top_p


def _positions_arg(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    value = kwargs.get("positions")
    if value is None and len(args) > 1:
        value = args[1]
    return value if isinstance(value, torch.Tensor) and value.dim() == 1 else None


class EngineCapture:
    """Hooks one worker's model; :meth:`drain` hands over what it recorded per request."""

    def __init__(
        self,
        runner: Any,
        model: nn.Module,
        specs: Sequence[RegionSpec],
        selection: Selection,
        *,
        refusal: str | None = None,
        max_requests: int = 65536,
        max_rows: int = 1 << 20,
        fingerprinter: Callable[[torch.Tensor], RowFingerprints] = fingerprint_rows,
    ) -> None:
        if max_requests < 1 or max_rows < 0:
            raise ValueError(f"max_requests/max_rows: must be >= 1 / >= 0, got {max_requests}/{max_rows}")
        self.runner = runner
        self.model = model
        self.specs = list(specs)
        self.selection = selection
        self.refusal = refusal
        self.max_requests = max_requests
        self.max_rows = max_rows
        self.fingerprinter = fingerprinter
        self.version: str | None = None
        self.counters = CaptureCounters()
        self.traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self._by_ext: dict[str, list[str]] = {}
        self._buffered_rows = 0
        self._ordinal = 0
        self._in_step = False
        self._fwd: _Forward | None = None
        self._logged: set[str] = set()
        self._handles: list[RemovableHandle] = []
        self._original_execute: Callable[..., Any] | None = None
        self._install()

    # ------------------------------------------------------------ install / remove

    def _install(self) -> None:
        original = self.runner.execute_model
        self._original_execute = original

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._begin_step(scheduler_output)
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                self._end_step()

        self.runner.execute_model = execute_model  # an instance attribute: removed on detach
        self._handles.append(self.model.register_forward_pre_hook(self._open, with_kwargs=True))
        if self.refusal is None:
            for i, spec in enumerate(self.specs):
                module = self.model.get_submodule(spec.module)
                self._handles.append(module.register_forward_hook(self._region_hook(i, spec)))

    def remove(self) -> None:
        """Remove every hook and restore ``execute_model``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._original_execute is not None and "execute_model" in vars(self.runner):
            del self.runner.execute_model
        self._original_execute = None
        self._fwd = None

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------ step

    def _begin_step(self, scheduler_output: Any) -> None:
        self._in_step = True
        self._fwd = None
        try:
            self.counters.steps += 1
            for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
                trace = self.traces.get(req_id)
                if trace is not None:
                    trace.finished = True
        except Exception as exc:
            self._fail("step", exc)

    def _end_step(self) -> None:
        self._in_step = False
        fwd, self._fwd = self._fwd, None
        if fwd is None or not fwd.pending:
            return
        try:
            self._file(fwd)
        except Exception as exc:
            self._fail("fingerprint", exc)

    # ------------------------------------------------------------ hooks

    def _open(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._in_step or self._fwd is not None:
            return  # a warm-up/dummy forward, or a nested call of the root
        try:
            self.counters.forwards += 1
            layout = read_forward_rows(self.runner)
            members: list[tuple[RequestTrace, int, str]] = []
            for i, req_id in enumerate(layout.req_ids):
                trace = self.traces.get(req_id) or self._register(req_id)
                trace.last_version = self.version
                if trace.selected and self.refusal is None:
                    members.append((trace, i, layout.case(i, trace.prompt_len)))
            if not members:
                self._fwd = _Forward(layout, [], None, None, None)
                return
            rows = np.concatenate([np.arange(*layout.rows(i)) for _, i, _ in members])
            positions = _positions_arg(args, kwargs)
            device = positions.device if positions is not None else torch.device("cpu")
            index = torch.from_numpy(rows).to(device)
            self._fwd = _Forward(
                layout,
                members,
                index,
                torch.tensor([i for _, i, _ in members], dtype=torch.long, device=device),
                positions.index_select(0, index) if positions is not None and positions.numel() >= layout.num_tokens else None,
            )
        except Exception as exc:
            self._fail("layout", exc)
            self._fwd = None

    def _region_hook(self, i: int, spec: RegionSpec) -> Callable[[nn.Module, Any, Any], None]:
        logits = spec.tap is Tap.FP32 and spec.name == "logits"

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            fwd = self._fwd
            if fwd is None or fwd.index is None:
                return
            try:
                tensor = read_tap(output, spec.tap)
                if tensor is None:
                    return
                tensor = tensor.reshape(-1, tensor.shape[-1])
                if logits:
                    if tensor.shape[0] != len(fwd.layout.req_ids):
                        self.counters.skipped_logits += 1  # not one logits row per request: cannot map
                        return
                    rows = tensor.index_select(0, fwd.logits_index.to(tensor.device))  # type: ignore[union-attr]
                else:
                    rows = tensor.index_select(0, fwd.index.to(tensor.device))  # type: ignore[union-attr]
                # index_select copies: vLLM's fused norms later overwrite these tensors in place.
                fwd.pending.append((i, rows))
            except Exception as exc:
                self._fail(spec.name, exc)

        return hook

    # ------------------------------------------------------------ bookkeeping

    def _register(self, req_id: str) -> RequestTrace:
        state = getattr(self.runner, "requests", {}).get(req_id)
        prompt = getattr(state, "prompt_token_ids", None)
        prompt_len = len(prompt) if prompt is not None else int(getattr(state, "num_prompt_tokens", 0) or 0)
        temperature, top_k, top_p = _sampling(getattr(state, "sampling_params", None))
        ext = external_id(req_id)
        selected = self.selection.chooses(self._ordinal, ext)
        self._ordinal += 1
        trace = RequestTrace(req_id, ext, prompt_len, temperature, top_k, top_p, selected, self.version, self.version)
        self.traces[req_id] = trace
        self._by_ext.setdefault(ext, []).append(req_id)
        self.counters.requests_seen += 1
        self.counters.requests_selected += int(selected)
        while len(self.traces) > self.max_requests:
            self._evict()
        return trace

    def _evict(self) -> None:
        victim = next((t for t in self.traces.values() if t.finished), None) or next(iter(self.traces.values()))
        self._forget(victim)
        self.counters.evicted_requests += 1
        self._log_once("evict", "isoaudit vllm collector: request buffer full; evicted undrained requests (counted)")

    def _forget(self, trace: RequestTrace) -> None:
        self.traces.pop(trace.req_id, None)
        self._buffered_rows -= trace.rows
        siblings = self._by_ext.get(trace.ext_id, [])
        if trace.req_id in siblings:
            siblings.remove(trace.req_id)
        if not siblings:
            self._by_ext.pop(trace.ext_id, None)

    def _file(self, fwd: _Forward) -> None:
        """Fingerprint the step's pending rows (grouped by width and dtype) and file them per request."""
        groups: dict[tuple[torch.dtype, int], list[tuple[int, torch.Tensor]]] = {}
        for i, rows in fwd.pending:
            groups.setdefault((rows.dtype, int(rows.shape[-1])), []).append((i, rows))
        tensors: dict[str, torch.Tensor] = {}
        layout: list[tuple[int, int, int, tuple[int, ...]]] = []  # (region, group, offset, ladder bits)
        for g, items in enumerate(groups.values()):
            prints = self.fingerprinter(torch.cat([rows for _, rows in items]) if len(items) > 1 else items[0][1])
            tensors.update({f"{g}.d": prints.digest, f"{g}.l": prints.ladder, f"{g}.s": prints.sketch,
                            f"{g}.n": prints.l2, f"{g}.m": prints.maxabs})
            offset = 0
            for i, rows in items:
                layout.append((i, g, offset, prints.ladder_bits))
                offset += int(rows.shape[0])
        if fwd.positions is not None:
            tensors["pos"] = fwd.positions
        host = to_host(tensors)
        self.counters.fingerprinted_forwards += 1

        # Each selected request's rows within the concatenated selection, and its positions.
        spans, start = [], 0
        for trace, i, case in fwd.members:
            a, b = fwd.layout.rows(i)
            positions = host["pos"][start : start + b - a].astype(np.int64) if "pos" in host else fwd.layout.positions(i)
            spans.append((trace, case, start, b - a, positions))
            start += b - a
        for j, (trace, case, first, count, positions) in enumerate(spans):
            needed = sum(1 if self.specs[r].name == "logits" else count for r, *_ in layout)
            if not self._room_for(needed):
                trace.truncated = True
                self.counters.dropped_rows += needed
                continue
            for region, g, offset, bits in layout:
                logits = self.specs[region].name == "logits"
                sl = slice(offset + j, offset + j + 1) if logits else slice(offset + first, offset + first + count)
                arrays = {
                    "digest": host[f"{g}.d"][sl].view(np.uint64),
                    "ladder": host[f"{g}.l"][sl].view(np.uint64),
                    "sketch": host[f"{g}.s"][sl],
                    "l2": host[f"{g}.n"][sl],
                    "maxabs": host[f"{g}.m"][sl],
                    "bits": np.asarray(bits, dtype=np.int64),
                }
                pos = positions[-1:] if logits else positions
                trace.chunks.append((region, case, pos, arrays))
                trace.rows += int(pos.size)
                self._buffered_rows += int(pos.size)
                self.counters.rows += int(pos.size)

    def _room_for(self, rows: int) -> bool:
        while self._buffered_rows + rows > self.max_rows:
            finished = next((t for t in self.traces.values() if t.finished and t.rows), None)
            if finished is None:
                self._log_once("rows", "isoaudit vllm collector: fingerprint buffer full; dropping rows (counted)")
                return False
            self._forget(finished)
            self.counters.evicted_requests += 1
        return True

    # ------------------------------------------------------------ driver side

    def drain(self, ext_ids: Iterable[str]) -> dict[str, Any]:
        """Hand over (and forget) what the engine recorded for these requests, keyed by their
        external ids; the payload is plain data (bytes, numbers, strings) for ``collective_rpc``."""
        out: dict[str, Any] = {}
        missing: list[str] = []
        for ext in ext_ids:
            ids = self._by_ext.get(ext) or ([ext] if ext in self.traces else [])
            if not ids:
                missing.append(ext)
                continue
            trace = self.traces[ids[-1]]  # the latest request with that id
            out[ext] = self._payload(trace)
            self._forget(trace)
        return {"requests": out, "missing": missing, "counters": asdict(self.counters)}

    def _payload(self, trace: RequestTrace) -> dict[str, Any]:
        by_region: dict[int, list[tuple[str, np.ndarray, dict[str, np.ndarray]]]] = {}
        for region, case, positions, arrays in trace.chunks:
            by_region.setdefault(region, []).append((case, positions, arrays))
        prints = []
        for region, chunks in by_region.items():
            positions = np.concatenate([c[1] for c in chunks])
            cases = np.concatenate([np.full(c[1].size, c[0] == "engine_decode") for c in chunks])
            arrays = {name: np.concatenate([c[2][name] for c in chunks]) for name in _FIELDS}
            # A preempted request recomputes positions it already had: keep the latest computation
            # of each position (np.unique on the reversed order finds last occurrences, by position).
            _, first_in_reversed = np.unique(positions[::-1], return_index=True)
            keep = positions.size - 1 - first_in_reversed
            self.counters.recomputed_rows += int(positions.size - keep.size)
            for decode in (False, True):
                rows = keep[cases[keep] == decode]
                if rows.size == 0:
                    continue
                prints.append({
                    "region": self.specs[region].name,
                    "case": "engine_decode" if decode else "engine_prefill",
                    "ladder_bits": [int(b) for b in chunks[0][2]["bits"]],
                    "positions": positions[rows].astype("<i4").tobytes(),
                    **{name: np.ascontiguousarray(arrays[name][rows]).tobytes() for name in _FIELDS},
                })
        return {
            "req_id": trace.req_id,
            "prompt_len": trace.prompt_len,
            "temperature": trace.temperature,
            "top_k": trace.top_k,
            "top_p": trace.top_p,
            "selected": trace.selected,
            "truncated": trace.truncated,
            "first_version": trace.first_version,
            "last_version": trace.last_version,
            "prints": prints,
        }

    # ------------------------------------------------------------ errors

    def _fail(self, where: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self._log_once(
            f"fail:{where}",
            f"isoaudit vllm collector: {where} failed ({type(exc).__name__}: {exc}); counted, the engine goes on",
        )

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("%s", message)
