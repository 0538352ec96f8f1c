"""Per-request facts only the engine's scheduler state knows: which weight version computed the
prefix-cache blocks a request reused, where its tokens changed weight version, and its min-p.

A weight sync loads new weights in place and keeps the prefix cache: a request that hits blocks
computed before the sync attends to KV from the old weights while computing the rest with the new
ones. Each worker watches ``_update_states`` (the model runner's per-step bookkeeping of the
scheduler's output, before the forward) and keeps, per KV-cache block, the weight version that
wrote its first token; a new request's cache hits (its first ``num_computed_tokens``) are then
counted against the version sampling it. Running requests across a sync (in-flight updates) get a
new weight span at the completion index of their next sampled token.

The driver reads them per request with :func:`drain` and records them on the sample:
``path["prefix_cache_stale_tokens"]`` (and ``prefix_cache_weight_version``), ``weight_spans`` and
``min_p``. Never raises into the engine; bounded (finished requests nobody drains are evicted).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from isoaudit.collectors.counting import LogOnce
from isoaudit.collectors.vllm.worker.requests import external_id

log = logging.getLogger(__name__)

#: A block written before tracking began: its version is unknown (never counted as stale).
_UNKNOWN = object()


@dataclass
class RequestFacts:
    """What the scheduler state says about one request."""

    cached_tokens: int = 0
    stale_tokens: int = 0
    stale_version: str | None = None
    min_p: float | None = None
    spans: list[tuple[int, str | None]] = field(default_factory=list)  # (completion index, version)

    def as_wire(self) -> dict[str, Any]:
        return {
            "cached_tokens": self.cached_tokens,
            "stale_tokens": self.stale_tokens,
            "stale_version": self.stale_version,
            "min_p": self.min_p,
            "spans": [[start, version] for start, version in self.spans],
        }


class EngineState:
    """Watches one worker's model runner; ``version()`` is the weight version computing now."""

    def __init__(self, runner: Any, version: Callable[[], str | None], *, max_requests: int = 65536) -> None:
        self.runner = runner
        self.version = version
        self.max_requests = max_requests
        cache = getattr(runner, "cache_config", None)
        self.block_size = int(getattr(cache, "block_size", 0) or 0)
        # block versions only matter to prefix-cache hits: without a prefix cache none are followed
        self.prefix_caching = bool(getattr(cache, "enable_prefix_caching", True))
        self.blocks: dict[int, Any] = {}  # block id -> weight version of its first written token
        self.requests: OrderedDict[str, RequestFacts] = OrderedDict()
        self._by_ext: dict[str, list[str]] = {}  # the caller's id -> engine request ids
        self._spanless: set[str] = set()  # tracked requests whose last span is not the current version
        self._version_seen: Any = _UNKNOWN
        self.errors = 0
        self._warn = LogOnce(log)
        self._original = runner._update_states

        def _update_states(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = self._original(scheduler_output, *args, **kwargs)
            try:
                self._observe(scheduler_output)
            except Exception as exc:  # the engine goes on; the facts are then incomplete
                self.errors += 1
                self._warn.warn("observe", f"isoaudit vllm collector: request facts failed ({exc}); counted")
            return result

        runner._update_states = _update_states  # an instance attribute: removed by remove()

    def remove(self) -> None:
        if "_update_states" in vars(self.runner):
            del self.runner._update_states
        self.requests.clear()
        self._by_ext.clear()
        self._spanless.clear()
        self.blocks.clear()

    def _observe(self, out: Any) -> None:
        """One step's scheduler output. Per step the work is set arithmetic, not a loop over the
        batch: a request starts a weight span only when first scheduled after a version change,
        and blocks are followed only where a prefix cache can hit them."""
        version = self.version()
        if version != self._version_seen:  # each known request starts a span when next scheduled
            self._version_seen = version
            self._spanless = set(self.requests)
        size = self.block_size if self.prefix_caching else 0
        for new in getattr(out, "scheduled_new_reqs", ()) or ():
            facts = RequestFacts(cached_tokens=int(new.num_computed_tokens or 0))
            params = getattr(new, "sampling_params", None)
            min_p = getattr(params, "min_p", None)
            facts.min_p = float(min_p) if min_p else None
            if size and facts.cached_tokens and new.block_ids:
                blocks = new.block_ids[0]
                for j in range(min(facts.cached_tokens // size, len(blocks))):
                    written = self.blocks.get(blocks[j], _UNKNOWN)
                    if written is not _UNKNOWN and written != version:
                        facts.stale_tokens += size
                        facts.stale_version = facts.stale_version or written
            self._track(new.req_id, facts)
        states = getattr(self.runner, "requests", {})
        scheduled = getattr(out, "num_scheduled_tokens", None) or {}
        for req_id in scheduled.keys() - self.requests.keys():  # running before tracking began
            if req_id in states:
                self._track(req_id, RequestFacts())
        for req_id in self._spanless & scheduled.keys():
            state = states.get(req_id)
            if state is None:
                continue
            facts = self.requests[req_id]
            if not facts.spans or facts.spans[-1][1] != version:
                facts.spans.append((len(state.output_token_ids), version))
            self._spanless.discard(req_id)
        if size:
            for req_id, count in scheduled.items():
                state = states.get(req_id)
                if state is None or not state.block_ids:
                    continue
                blocks = state.block_ids[0]
                first = int(state.num_computed_tokens)
                for j in range(first // size, (first + int(count) - 1) // size + 1):
                    if j < len(blocks) and j * size >= first:  # this step writes the block's first token
                        self.blocks[blocks[j]] = version
        while len(self.requests) > self.max_requests:  # finished requests nobody drained go first
            self._forget(next(iter(self.requests)))

    def _track(self, req_id: str, facts: RequestFacts) -> RequestFacts:
        if req_id not in self.requests:
            self._by_ext.setdefault(external_id(req_id), []).append(req_id)
        self.requests[req_id] = facts
        if not facts.spans:
            self._spanless.add(req_id)
        self.requests.move_to_end(req_id)
        return facts

    def _forget(self, req_id: str) -> RequestFacts | None:
        facts = self.requests.pop(req_id, None)
        self._spanless.discard(req_id)
        ext = external_id(req_id)
        siblings = self._by_ext.get(ext, [])
        if req_id in siblings:
            siblings.remove(req_id)
        if not siblings:
            self._by_ext.pop(ext, None)
        return facts

    def drain(self, ext_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The facts of these requests (by the caller's ids; the latest request of an id), handed
        over and forgotten."""
        out = {}
        for ext in ext_ids:
            ids = list(self._by_ext.get(ext, ()))
            if ids:
                latest = self.requests[ids[-1]]
                for req_id in ids:
                    self._forget(req_id)
                out[ext] = latest.as_wire()
        return out


def worker_state(worker: Any) -> EngineState:
    """This worker's :class:`EngineState`, installed on first use."""
    state = getattr(worker, "_isoaudit_state", None)
    if state is None:

        def version() -> str | None:
            weights = getattr(worker, "_isoaudit_weights", None)
            return getattr(weights, "version", None)

        state = EngineState(worker.model_runner, version)
        cache = worker.vllm_config.cache_config
        if not state.block_size:
            state.block_size = int(getattr(cache, "block_size", 0) or 0)
        if getattr(worker.model_runner, "cache_config", None) is None:
            state.prefix_caching = bool(getattr(cache, "enable_prefix_caching", True))
        worker._isoaudit_state = state
    return state


def release_state(worker: Any) -> None:
    state = getattr(worker, "_isoaudit_state", None)
    if state is not None:
        state.remove()
        worker._isoaudit_state = None


# ---------------------------------------------------------------- the driver's side


def drain_facts(link: Any, ext_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Every worker's facts of these requests (the first worker that knows a request wins: tensor-
    parallel ranks see the same scheduler output)."""
    merged: dict[str, dict[str, Any]] = {}
    for reply in link.call("request_facts", ext_ids):
        for ext, facts in (reply or {}).items():
            merged.setdefault(ext, facts)
    return merged


def sample_fields(facts: dict[str, Any] | None, *, n_completion: int, prefix_caching: bool) -> dict[str, Any]:
    """The SampleLogprobs fields these facts give: ``min_p``, ``weight_spans`` (only when the
    sample spans several versions) and the path facts of a prefix-cache hit."""
    from isoaudit.audit.diagnosis import PREFIX_CACHE_STALE, PREFIX_CACHE_STALE_VERSION
    from isoaudit.audit.records import WeightSpan

    if not facts:
        return {}
    out: dict[str, Any] = {}
    if facts.get("min_p"):
        out["min_p"] = float(facts["min_p"])
    by_start: dict[int, str | None] = {}
    for start, version in facts.get("spans") or []:
        if 0 <= int(start) < max(n_completion, 1):
            by_start[int(start)] = version  # two syncs before one token: the later version
    spans = sorted(by_start.items())
    if len(spans) > 1 and spans[0][0] == 0 and all(v is not None for _, v in spans):
        out["weight_spans"] = [WeightSpan(start=s, version=str(v)) for s, v in spans]
    path: dict[str, Any] = {}
    if prefix_caching:
        path[PREFIX_CACHE_STALE] = int(facts.get("stale_tokens") or 0)
        if facts.get("stale_version") is not None:
            path[PREFIX_CACHE_STALE_VERSION] = str(facts["stale_version"])
    if path:
        out["path"] = path
    return out
