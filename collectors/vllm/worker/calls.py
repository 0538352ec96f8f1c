"""The worker's entry points: what the driver calls inside each vLLM worker, wherever it lives.

The functions here take the worker as their first argument, so the driver can run them in two ways
with the same code: as callables through ``LLM.collective_rpc`` when the engine is in-process, or as
the methods of :class:`IsoauditWorkerExtension` (``worker_extension_cls``) when the workers are other
processes. Arguments and results are the typed messages of :mod:`isoaudit.collectors.vllm.messages` in their
wire form (msgpack-native data), which ``collective_rpc`` carries in either mode.

Remediation: :func:`set_mode` asks the worker's capture to switch at its next step boundary (the
next ``execute_model``), where :mod:`isoaudit.collectors.vllm.worker.remediation` moves the worker's layers
onto isoaudit's invariant kernels (or back); the mode it then runs, what stays native and why, and the
implementation of each op come back with the next drain
(:class:`~isoaudit.collectors.vllm.messages.ModeState`). Importing this module once vLLM is imported (as a
worker process does when it resolves the extension) makes linear layers keep their raw weights at load, which
the invariant GEMM needs.

Only tensor-parallel rank 0 of each pipeline stage captures: every TP rank sees the same full
hidden states after the all-reduce, and each pipeline stage sees its own layers.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
from isoaudit.collectors.fingerprints import fingerprint_rows
from isoaudit.collectors.vllm.messages import (
    ENVIRONMENT_KEY,
    Drain,
    Drained,
    LoadWeights,
    ModeState,
    Selection,
    SetMode,
    Start,
    Started,
    Stopped,
    WeightsLoaded,
    from_wire,
    to_wire,
)
from isoaudit.collectors.vllm.weights import WeightState, apply_weights, unpack_tensors
from isoaudit.collectors.vllm.worker.capture import EngineCapture
from isoaudit.collectors.vllm.worker.facts import (
    capture_refusal,
    engine_environment,
    engine_facts,
)
from isoaudit.collectors.vllm.worker.graph import CompiledDecoder, compiled_decoder_module
from isoaudit.collectors.vllm.worker.regions import resolve_engine_regions
from isoaudit.collectors.vllm.worker.remediation import keep_raw_weights, remediation_of

log = logging.getLogger(__name__)

#: The ``worker_extension_cls`` to start a multiprocess engine with.
EXTENSION = "isoaudit.collectors.vllm.extension.IsoauditWorkerExtension"  # importing it keeps raw weights

#: Why a worker whose model cannot be switched (no vLLM layers found) stays native.
NATIVE_IN_VLLM = (
    "this worker's layers cannot be routed through isoaudit's invariant kernels: matmuls, attention, "
    "norms and sampling stay vLLM's own"
)


def switch_engine_mode(mode: str) -> tuple[str, str | None]:
    """The switch of a worker without a switchable model: native whatever is asked, and why."""
    if mode == "native":
        return "native", None
    return "native", NATIVE_IN_VLLM


if "vllm" in sys.modules and os.environ.get("ISOAUDIT_VLLM_KEEP_WEIGHTS", "1") != "0":
    keep_raw_weights()  # a worker resolving the extension: before it loads the model


def _worker(obj: Any) -> Any:
    """The real worker behind vLLM's ``WorkerWrapperBase`` (which in-process callables receive)."""
    inner = obj.__dict__.get("worker") if hasattr(obj, "__dict__") else None
    return inner if inner is not None else obj


def _ranks() -> tuple[int, int]:
    try:
        from vllm.distributed import get_pp_group, get_tp_group

        return int(get_tp_group().rank_in_group), int(get_pp_group().rank_in_group)
    except Exception:
        return 0, 0


def _capture(worker: Any) -> EngineCapture | None:
    return getattr(worker, "_isoaudit_capture", None)


def _weights(worker: Any) -> WeightState:
    state = getattr(worker, "_isoaudit_weights", None)
    if state is None:
        state = WeightState()
        worker._isoaudit_weights = state
    return state


def compiled_decoder(worker: Any, module: Any) -> CompiledDecoder | None:
    """The worker's :class:`CompiledDecoder` of ``module`` (``None``: eager), kept on the worker
    across attaches with its compiled variants and taps."""
    if module is None:
        return None
    decoder = getattr(worker, "_isoaudit_decoder", None)
    if decoder is None or decoder.module is not module:
        decoder = CompiledDecoder(module, (False, "native"))
        worker._isoaudit_decoder = decoder
    return decoder


def start(obj: Any, message: Any) -> Any:
    """Hook this worker's model (replacing an earlier capture); answers :class:`Started`: the
    engine's facts, the regions hooked, what cannot be observed and why."""
    request = from_wire(message, Start)
    worker = _worker(obj)
    stop(worker)
    runner = worker.model_runner
    model = runner.get_model()
    config = worker.vllm_config
    tp_rank, pp_rank = _ranks()
    compiled = compiled_decoder_module(model)
    refusal = capture_refusal(config, compiled is not None)
    resolved = resolve_engine_regions(
        model, getattr(config.model_config.hf_config, "model_type", None), request.regions
    )
    weights = _weights(worker)
    if request.version is not None and weights.version is None:
        weights.version = request.version
    remediation = remediation_of(worker, graph=compiled is not None)
    capture = EngineCapture(
        runner,
        model,
        resolved.specs if tp_rank == 0 else [],
        request.selection,
        refusal=refusal,
        max_requests=request.max_requests,
        max_rows=request.max_rows,
        flush_bytes=request.flush_bytes,
        mode_switch=remediation.apply,
        mode_ops=remediation.ops,
        mode_kernels=remediation.kernel_facts,
        decoder=compiled_decoder(worker, compiled),
        graph_rows=int(config.scheduler_config.max_num_batched_tokens),
        # the batched passes over many steps' rows: on a CPU, the integer sums compiled
        fingerprinter=functools.partial(fingerprint_rows, compile_sums=True),
    )
    capture.version = weights.version
    worker._isoaudit_capture = capture
    unobserved = dict(resolved.unobserved)
    if refusal is not None:
        unobserved = {"*": refusal}
    return to_wire(
        Started(
            facts={**engine_facts(config, runner, model), ENVIRONMENT_KEY: engine_environment()},
            regions=[] if refusal is not None else resolved.names,
            unobserved=unobserved,
            refusal=refusal,
            family=resolved.family,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            weight_version=weights.version,
            weight_digest=weights.digest,
            mode=capture.mode,
        )
    )


def drain(obj: Any, message: Any) -> Any:
    """What this worker recorded for the requested ids (external ids), handed over and forgotten
    (:class:`Drained`)."""
    request = from_wire(message, Drain)
    capture = _capture(_worker(obj))
    if capture is None:
        return to_wire(Drained(missing=list(request.request_ids)))
    return to_wire(capture.drain(request.request_ids))


def select(obj: Any, message: Any) -> None:
    """Change which requests are fingerprinted from now on (requests already seen keep their choice)."""
    capture = _capture(_worker(obj))
    if capture is not None:
        capture.selection = from_wire(message, Selection)


def set_mode(obj: Any, message: Any) -> Any:
    """Switch to the requested mode at the next step boundary; answers the mode run until then."""
    capture = _capture(_worker(obj))
    if capture is None:
        return to_wire(ModeState())
    capture.request_mode(from_wire(message, SetMode))
    return to_wire(capture.mode)


def stop(obj: Any) -> Any:
    """Remove the hooks; the engine is then exactly as before :func:`start` (:class:`Stopped`)."""
    worker = _worker(obj)
    capture = _capture(worker)
    if capture is None:
        return to_wire(Stopped())
    capture.remove()
    worker._isoaudit_capture = None
    remediation = getattr(worker, "_isoaudit_remediation", None)
    if remediation is not None:
        remediation.restore()  # vLLM's own ops again: the engine runs exactly as before start
    return to_wire(Stopped(counters=capture.counters.as_dict()))


def load_weights(obj: Any, message: Any, local: Iterable[tuple[str, torch.Tensor]] | None = None) -> Any:
    """Load the message's tensors (checkpoint names; an in-process engine passes them as ``local``,
    uncopied) in place, keep the KV/prefix caches and every running request, and make the
    message's version the weight version of what is computed from now on (:class:`WeightsLoaded`)."""
    request = from_wire(message, LoadWeights)
    worker = _worker(obj)
    items = list(local) if local is not None else unpack_tensors(request.packed)
    loaded = apply_weights(worker.model_runner, items) if items else 0  # none: a version only
    state = _weights(worker)
    state.version, state.digest = request.version, request.digest
    capture = _capture(worker)
    if capture is not None:
        capture.version = state.version
    return to_wire(WeightsLoaded(loaded=loaded, weight_version=state.version, weight_digest=state.digest))


# ------------------------------------------------------------ held weights and per-request facts


def weight_digests(obj: Any) -> Any:
    """Digests of the weights this worker holds now, per trainer-named tensor (installs the
    post-load hooks on first use): ``{"digests", "unavailable", "errors"}``."""
    from isoaudit.collectors.vllm.weights import held_digests_reply

    return held_digests_reply(_worker(obj), _ranks()[0])


def track_requests(obj: Any) -> None:
    """Start keeping per-request facts (prefix-cache staleness, weight spans, min-p)."""
    from isoaudit.collectors.vllm.engine_state import worker_state

    worker_state(_worker(obj))


def request_facts(obj: Any, ext_ids: list[str]) -> Any:
    """The per-request facts of these requests, handed over and forgotten."""
    from isoaudit.collectors.vllm.engine_state import worker_state

    return worker_state(_worker(obj)).drain(ext_ids)


def release_facts(obj: Any) -> None:
    """Remove the held-weight and request-facts hooks."""
    from isoaudit.collectors.vllm.engine_state import release_state
    from isoaudit.collectors.vllm.weights import release_held

    worker = _worker(obj)
    release_held(worker)
    release_state(worker)


# ------------------------------------------------------------------------------- MoE routing


def routing_start(obj: Any) -> Any:
    """Capture the experts this worker's fused-MoE layers choose per token (replacing an earlier
    capture): the MoE layout, or ``{"skipped": reason}``
    (:func:`isoaudit.collectors.routing_vllm.start_worker`)."""
    from isoaudit.collectors.routing_vllm import start_worker

    return start_worker(_worker(obj), _ranks()[0])


def routing_take(obj: Any, keys: list[str]) -> Any:
    """The routes of these samples (by sample key), in wire form, handed over and forgotten."""
    from isoaudit.collectors.routing_vllm import take_worker

    return take_worker(_worker(obj), keys)


def routing_stop(obj: Any) -> Any:
    """Remove the routing capture; answers its counters."""
    from isoaudit.collectors.routing_vllm import stop_worker

    return stop_worker(_worker(obj))


class IsoauditWorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls=isoaudit.collectors.vllm.EXTENSION``; the
    driver calls these through ``LLM.collective_rpc`` by name, with wire-form messages."""

    def isoaudit_start(self, message: Any) -> Any:
        return start(self, message)

    def isoaudit_drain(self, message: Any) -> Any:
        return drain(self, message)

    def isoaudit_select(self, message: Any) -> None:
        select(self, message)

    def isoaudit_set_mode(self, message: Any) -> Any:
        return set_mode(self, message)

    def isoaudit_stop(self) -> Any:
        return stop(self)

    def isoaudit_load_weights(self, message: Any) -> Any:
        return load_weights(self, message)

    def isoaudit_weight_digests(self) -> Any:
        return weight_digests(self)

    def isoaudit_track_requests(self) -> None:
        track_requests(self)

    def isoaudit_request_facts(self, ext_ids: list[str]) -> Any:
        return request_facts(self, ext_ids)

    def isoaudit_release_facts(self) -> None:
        release_facts(self)

    def isoaudit_routing_start(self) -> Any:
        return routing_start(self)

    def isoaudit_routing_take(self, keys: list[str]) -> Any:
        return routing_take(self, keys)

    def isoaudit_routing_stop(self) -> Any:
        return routing_stop(self)
