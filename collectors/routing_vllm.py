"""MoE routing inside vLLM (issue 19): the experts each of vLLM's fused-MoE layers chose per token,
attached to the vLLM collector's sample records like the trainer's (:mod:`collectors.routing`).

vLLM's routers call a capture function with the logical expert ids of every forward
(``BaseRouter.set_capture_fn``, the hook behind its own routed-experts output); a pre-hook on the
model reads the forward's layout (:func:`collectors.vllm.rows.read_forward_rows`), so each flat row
is filed under its request at its absolute position. Only the ids are kept: one byte per choice
for up to 256 experts. vLLM's own routed-experts output (``enable_return_routed_experts``) needs
its model runner V2, which needs Triton, so the CPU build cannot return it; these hooks work with
either runner.

The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): worker processes
would need a worker-extension method to drain the routes (not built yet).
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
from torch import nn

from audit.records import Record, Routes, SampleLogprobs, sample_key
from collectors.counting import Counters, LogOnce
from collectors.routing import before_send, on_detach
from collectors.vllm.rows import ForwardRows, read_forward_rows

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

    def take(self, tokens: np.ndarray) -> Routes | None:
        """The routes of the request whose whole sequence is ``tokens`` (forgotten once taken)."""
        key = sample_key(tokens)
        for req_id, request in reversed(self.requests.items()):
            if not request.positions or sample_key(request.tokens()) != key:
                continue
            del self.requests[req_id]
            positions = np.concatenate(request.positions)
            experts = np.concatenate(request.experts)
            # A recomputed position (preemption) keeps its first routing.
            _, first = np.unique(positions, return_index=True)
            return Routes.model_construct(
                layers=list(self.layers),
                top_k=self.top_k,
                num_experts=self.num_experts,
                positions=positions[first].astype(np.int32),
                experts=experts[first],
                replayed=None,
            )
        return None

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


def _install(worker: Any) -> WorkerRoutes:
    runner = worker.model_runner
    return WorkerRoutes(runner, runner.get_model())


class VllmRoutes:
    """The driver's side: routes from every (in-process) worker, attached to the vLLM collector's
    sample records just before they are queued."""

    side = "rollout"

    def __init__(self, collector: Any) -> None:
        link = collector.link
        if not link.in_process:
            raise ValueError(
                "llm: routing capture reaches the workers in this process only "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0); worker processes need a worker-extension method (not built)"
            )
        self.collector = collector
        self.workers: list[WorkerRoutes] = list(link.llm.collective_rpc(_install))
        self.counters = VllmRoutingCounters()
        self._undo = before_send(collector, self.attach)
        on_detach(collector, self.detach)

    @property
    def layers(self) -> list[int]:
        return self.workers[0].layers

    def attach(self, records: Sequence[Record]) -> None:
        for record in records:
            if (
                not isinstance(record, SampleLogprobs)
                or record.side != self.side
                or record.routes is not None
            ):
                continue
            try:
                routes = next((r for w in self.workers if (r := w.take(record.token_ids)) is not None), None)
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
        for worker in self.workers:
            worker.remove()
        self._undo()

    def stats(self) -> dict[str, Any]:
        return {**self.counters.as_dict(), "workers": [w.counters.as_dict() for w in self.workers]}
