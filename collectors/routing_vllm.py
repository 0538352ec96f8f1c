"""MoE routing inside vLLM: the experts each of vLLM's fused-MoE layers chose per token,
attached to the vLLM collector's sample records like the trainer's (:mod:`isoaudit.collectors.routing`).

vLLM's routers call a capture function with the logical expert ids of every forward
(``BaseRouter.set_capture_fn``, the hook behind its own routed-experts output); a pre-hook on the
model reads the forward's layout (:func:`isoaudit.collectors.vllm.worker.rows.read_forward_rows`), so each
flat row is filed under its request at its absolute position. Only the ids are kept: one byte per choice
for up to 256 experts. vLLM's own routed-experts output (``enable_return_routed_experts``) needs
its model runner V2, which needs Triton, so the CPU build cannot return it; these hooks work with
either runner.

The capture lives in each worker (:class:`WorkerRoutes`) and the driver reaches it the way the
other worker facts travel: through :class:`isoaudit.collectors.vllm.link.EngineLink`, i.e. ``collective_rpc``
with the worker-side functions of :mod:`isoaudit.collectors.vllm.worker.calls` (``routing_start``, ``routing_take``,
``routing_stop``) in an in-process engine, or the worker extension's ``isoaudit_routing_*`` methods
when the workers are other processes. Routes cross as msgpack-native dicts (:func:`routes_to_wire`),
a few bytes a token and layer; the driver asks once per batch of records, by sample key.

Only tensor-parallel rank 0 captures (every TP rank routes the same tokens the same way); pipeline
stages each answer their own layers, merged by the driver (:func:`merge_routes`).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from isoaudit.audit.records import Record, Routes, SampleLogprobs, sample_key
from isoaudit.collectors.counting import Counters, LogOnce
from isoaudit.collectors.vllm.worker.rows import ForwardRows, read_forward_rows
from torch import nn

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class VllmRoutingCounters(Counters):
    NAMES = ("forwards", "requests", "attached", "unmatched", "evicted", "errors")


@dataclass
class _Request:
    state: Any  # vLLM's CachedRequestState (its token lists grow as the request decodes)
    positions: list[np.ndarray] = field(default_factory=list)
    experts: list[np.ndarray] = field(default_factory=list)  # [rows, layers x k] per forward

    def tokens(self) -> np.ndarray:
        return np.asarray(
            list(self.state.prompt_token_ids or []) + list(self.state.output_token_ids), dtype=np.int32
        )


def moe_routers(model: nn.Module) -> list[tuple[int, Any]]:
    """(decoder layer, router) of each fused-MoE layer of a vLLM model, in layer order."""
    found = []
    for name, module in model.named_modules():
        router = getattr(module, "router", None)
        match = _LAYER.search(name + ".")
        if router is not None and hasattr(router, "set_capture_fn") and match is not None:
            found.append((int(match.group(1)), router))
    return sorted(found, key=lambda pair: pair[0])


class WorkerRoutes:
    """Lives in one worker: the routers' capture functions and the per-request routes."""

    def __init__(self, runner: Any, model: nn.Module, *, max_requests: int = 65536) -> None:
        routers = moe_routers(model)
        if not routers:
            raise LookupError("model: no vLLM fused-MoE layer with a router to capture")
        self.runner = runner
        self.layers = [i for i, _ in routers]
        self.top_k = int(routers[0][1].top_k)
        self.num_experts = int(routers[0][1].global_num_experts)
        self.dtype = np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)
        self.max_requests = max_requests
        self.requests: OrderedDict[str, _Request] = OrderedDict()
        self.counters = VllmRoutingCounters()
        self._warn = LogOnce(log)
        self._layout: ForwardRows | None = None
        self._calls: dict[int, torch.Tensor] = {}
        self._routers = routers
        for index, (_, router) in enumerate(routers):
            router.set_capture_fn(self._capture(index))
        self._handles = [
            model.register_forward_pre_hook(self._open),
            model.register_forward_hook(self._close, always_call=True),
        ]

    def _capture(self, index: int) -> Any:
        def capture(topk_ids: torch.Tensor) -> None:
            if self._layout is not None:
                self._calls[index] = topk_ids.detach()

        return capture

    def _open(self, _module: nn.Module, _args: Any) -> None:
        try:
            layout = read_forward_rows(self.runner)
            self._layout = layout if layout.req_ids else None  # warm-up / dummy forwards: not ours
            self._calls = {}
        except Exception as exc:
            self._fail("layout", exc)
            self._layout = None

    def _close(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        layout, self._layout = self._layout, None
        if layout is None:
            return
        try:
            if len(self._calls) != len(self.layers):
                self._fail(
                    "capture", RuntimeError(f"{len(self._calls)} of {len(self.layers)} MoE layers reported")
                )
                return
            n = layout.num_tokens
            stacked = torch.cat([self._calls[i][:n] for i in range(len(self.layers))], dim=1)
            host = stacked.to("cpu").numpy().astype(self.dtype, copy=False)  # one transfer a forward
            self.counters.forwards += 1
            for i, req_id in enumerate(layout.req_ids):
                request = self.requests.get(req_id) or self._register(req_id)
                if request is None:
                    continue
                a, b = layout.rows(i)
                request.positions.append(layout.positions(i))
                request.experts.append(host[a:b])
        except Exception as exc:
            self._fail("forward", exc)
        finally:
            self._calls = {}

    def _register(self, req_id: str) -> _Request | None:
        state = getattr(self.runner, "requests", {}).get(req_id)
        if state is None:
            return None
        request = self.requests[req_id] = _Request(state)
        self.counters.requests += 1
        while len(self.requests) > self.max_requests:
            self.requests.popitem(last=False)
            self.counters.evicted += 1
        return request

    def take(self, keys: Sequence[str]) -> dict[str, Routes]:
        """The routes of the requests whose whole sequence has one of these sample keys (each
        forgotten once taken; the latest request of a key wins)."""
        wanted = set(keys)
        found: dict[str, Routes] = {}
        for req_id, request in reversed(list(self.requests.items())):
            if not wanted or not request.positions:
                continue
            key = sample_key(request.tokens())
            if key not in wanted:
                continue
            wanted.discard(key)
            del self.requests[req_id]
            positions = np.concatenate(request.positions)
            experts = np.concatenate(request.experts)
            # A recomputed position (preemption) keeps its first routing.
            _, first = np.unique(positions, return_index=True)
            found[key] = Routes.model_construct(
                layers=list(self.layers),
                top_k=self.top_k,
                num_experts=self.num_experts,
                positions=positions[first].astype(np.int32),
                experts=experts[first],
                replayed=None,
            )
        return found

    def remove(self) -> None:
        for _, router in self._routers:
            router.set_capture_fn(None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _fail(self, where: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self._warn.warn(
            f"fail:{where}", f"isoaudit vllm routing: {where} failed ({type(exc).__name__}: {exc}); counted"
        )


# ---------------------------------------------------------------- the wire (collective_rpc)


def routes_to_wire(routes: Routes) -> dict[str, Any]:
    """``routes`` as msgpack-native data (what ``collective_rpc`` carries between processes)."""
    return {
        "layers": list(routes.layers),
        "top_k": int(routes.top_k),
        "num_experts": int(routes.num_experts),
        "positions": np.ascontiguousarray(routes.positions, dtype="<i4").tobytes(),
        "experts": np.ascontiguousarray(routes.experts).tobytes(),
        "dtype": np.dtype(routes.experts.dtype).str,
    }


def routes_from_wire(data: dict[str, Any]) -> Routes:
    """The :class:`Routes` of :func:`routes_to_wire`'s dict."""
    layers = [int(i) for i in data["layers"]]
    positions = np.frombuffer(data["positions"], dtype="<i4").astype(np.int32)
    experts = np.frombuffer(data["experts"], dtype=np.dtype(data["dtype"]))
    return Routes.model_construct(
        layers=layers,
        top_k=int(data["top_k"]),
        num_experts=int(data["num_experts"]),
        positions=positions,
        experts=experts.reshape(positions.size, len(layers) * int(data["top_k"])).copy(),
        replayed=None,
    )


def merge_routes(parts: Sequence[Routes]) -> Routes | None:
    """One sample's routes from the workers that answered for it: pipeline stages hold disjoint
    layers (joined in layer order, on the positions all of them routed); a repeated layer (another
    TP rank) keeps the first answer."""
    kept: list[Routes] = []
    seen: set[int] = set()
    for part in parts:
        if not seen.intersection(part.layers):
            kept.append(part)
            seen.update(part.layers)
    if len(kept) <= 1:
        return kept[0] if kept else None
    common = kept[0].positions
    for part in kept[1:]:
        common = np.intersect1d(common, part.positions)
    columns = []
    for part in kept:
        rows = np.searchsorted(part.positions, common)
        k = part.top_k
        for j, layer in enumerate(part.layers):
            columns.append((layer, part.experts[rows, j * k : (j + 1) * k]))
    columns.sort(key=lambda pair: pair[0])
    return Routes.model_construct(
        layers=[layer for layer, _ in columns],
        top_k=kept[0].top_k,
        num_experts=kept[0].num_experts,
        positions=common.astype(np.int32),
        experts=np.concatenate([c for _, c in columns], axis=1),
        replayed=None,
    )


# ---------------------------------------------------------------- the worker's side


def start_worker(worker: Any, tp_rank: int = 0) -> dict[str, Any]:
    """Install this worker's capture (replacing an earlier one). Answers the MoE layout, or
    ``{"skipped": reason}`` (a TP rank past 0, or a model without fused-MoE routers)."""
    stop_worker(worker)
    if tp_rank != 0:
        return {"skipped": f"tensor-parallel rank {tp_rank}: rank 0 records the routes"}
    runner = worker.model_runner
    try:
        routes = WorkerRoutes(runner, runner.get_model())
    except LookupError as exc:
        return {"skipped": str(exc), "dense": True}
    worker._isoaudit_routes = routes
    return {"layers": routes.layers, "top_k": routes.top_k, "num_experts": routes.num_experts}


def take_worker(worker: Any, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """This worker's routes of these samples (by sample key), in wire form, handed over and
    forgotten; ``{"counters": ...}`` rides along under the key ``""``."""
    routes: WorkerRoutes | None = getattr(worker, "_isoaudit_routes", None)
    if routes is None:
        return {}
    out: dict[str, dict[str, Any]] = {k: routes_to_wire(r) for k, r in routes.take(keys).items()}
    out[""] = routes.counters.as_dict()
    return out


def stop_worker(worker: Any) -> dict[str, int]:
    """Remove this worker's capture; answers its counters (empty when none was installed)."""
    routes: WorkerRoutes | None = getattr(worker, "_isoaudit_routes", None)
    if routes is None:
        return {}
    routes.remove()
    worker._isoaudit_routes = None
    return routes.counters.as_dict()


# ---------------------------------------------------------------- the driver's side


class VllmRoutes:
    """The driver's side: routes from every worker (in this process or in worker processes, through
    the collector's :class:`~isoaudit.collectors.vllm.link.EngineLink`), attached to the vLLM collector's
    sample records just before they are queued (one ``collective_rpc`` per batch of records)."""

    side = "rollout"

    def __init__(self, collector: Any) -> None:
        self.collector = collector
        self.link = collector.link
        replies = self.link.call("routing_start")
        layouts = [r for r in replies if "skipped" not in r]
        if not layouts:
            if any(r.get("dense") for r in replies):
                raise LookupError(next(r["skipped"] for r in replies if r.get("dense")))
            raise LookupError(
                "llm: no worker could record routing: " + "; ".join(r["skipped"] for r in replies)
            )
        self._layers = sorted({i for r in layouts for i in r["layers"]})
        self.counters = VllmRoutingCounters()
        self.worker_counters: list[dict[str, int]] = []
        self._detached = False
        collector.before_send(self.attach)
        collector.on_detach(self.detach)

    @property
    def layers(self) -> list[int]:
        return list(self._layers)

    def attach(self, records: Sequence[Record]) -> None:
        wanted = [
            r for r in records if isinstance(r, SampleLogprobs) and r.side == self.side and r.routes is None
        ]
        if not wanted or self._detached:
            return
        keys = [str(r.sample_key or sample_key(r.token_ids)) for r in wanted]
        try:
            replies = self.link.call("routing_take", keys)
        except Exception as exc:  # never break the sender
            self.counters.errors += 1
            log.warning("isoaudit vllm routing: asking the workers failed (%s: %s)", type(exc).__name__, exc)
            return
        self.worker_counters = [reply.pop("", {}) for reply in replies if reply]
        for record, key in zip(wanted, keys, strict=True):
            try:
                routes = merge_routes([routes_from_wire(reply[key]) for reply in replies if key in reply])
            except Exception as exc:
                self.counters.errors += 1
                log.warning(
                    "isoaudit vllm routing: attaching routes failed (%s: %s)", type(exc).__name__, exc
                )
                continue
            if routes is None:
                self.counters.unmatched += 1
                continue
            record.routes = routes
            self.counters.attached += 1

    def detach(self) -> None:
        """Remove the workers' capture functions (idempotent; never raises)."""
        if self._detached:
            return
        self._detached = True
        try:
            self.worker_counters = [c for c in self.link.call("routing_stop") if c]
        except Exception as exc:
            self.counters.errors += 1
            log.warning("isoaudit vllm routing: detach could not reach the engine (%s)", exc)

    def stats(self) -> dict[str, Any]:
        return {**self.counters.as_dict(), "workers": list(self.worker_counters)}
