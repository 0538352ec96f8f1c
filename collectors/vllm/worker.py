"""The worker side: what runs inside each vLLM worker, wherever the worker lives.

The functions here take the worker as their first argument, so the driver can run them in two ways
with the same code: as callables through ``LLM.collective_rpc`` when the engine is in-process, or as
the methods of :class:`IsoauditWorkerExtension` (``worker_extension_cls``) when the workers are other
processes. Arguments and results are plain data (dicts, lists, strings, numbers, bytes, tensors for
weights), which ``collective_rpc`` carries in either mode.

Only tensor-parallel rank 0 of each pipeline stage captures: every TP rank sees the same full
hidden states after the all-reduce, and each pipeline stage sees its own layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from collectors.vllm.capture import EngineCapture
from collectors.vllm.facts import capture_refusal, engine_facts
from collectors.vllm.regions import resolve_engine_regions
from collectors.vllm.selection import Selection
from collectors.vllm.weights import WeightState, apply_weights

log = logging.getLogger(__name__)

#: The ``worker_extension_cls`` to start a multiprocess engine with.
EXTENSION = "collectors.vllm.worker.IsoauditWorkerExtension"


def _worker(obj: Any) -> Any:
    """The real worker behind vLLM's ``WorkerWrapperBase`` (which in-process callables receive)."""
    inner = obj.__dict__.get("worker") if hasattr(obj, "__dict__") else None
    return inner if inner is not None else obj


def plain(value: Any) -> Any:
    """``value`` as exactly the builtin types ``collective_rpc`` can carry between processes.

    vLLM's msgpack channel refuses anything else (a ``TorchVersion``, a numpy scalar, an enum), and a
    refused result kills the engine's output thread: the driver would then wait forever. So every
    result of this module passes through here.
    """
    if value is None or type(value) in (bool, int, float, bytes):
        return value
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tobytes()
    return str(value)


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


def start(obj: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Hook this worker's model (replacing an earlier capture) and return the engine's facts, the
    regions hooked, what cannot be observed and why."""
    worker = _worker(obj)
    stop(worker)
    runner = worker.model_runner
    model = runner.get_model()
    config = worker.vllm_config
    tp_rank, pp_rank = _ranks()
    refusal = capture_refusal(config)
    resolved = resolve_engine_regions(
        model, getattr(config.model_config.hf_config, "model_type", None), options.get("regions", "auto")
    )
    weights = _weights(worker)
    if options.get("version") is not None and weights.version is None:
        weights.version = str(options["version"])
    capture = EngineCapture(
        runner,
        model,
        resolved.specs if tp_rank == 0 else [],
        Selection.from_wire(options["selection"]),
        refusal=refusal,
        max_requests=int(options.get("max_requests", 65536)),
        max_rows=int(options.get("max_rows", 1 << 20)),
        flush_bytes=int(options.get("flush_bytes", 64 << 20)),
    )
    capture.version = weights.version
    worker._isoaudit_capture = capture
    unobserved = dict(resolved.unobserved)
    if refusal is not None:
        unobserved = {"*": refusal}
    return plain(
        {
            "facts": engine_facts(config, runner, model),
            "regions": [] if refusal is not None else resolved.names,
            "unobserved": unobserved,
            "refusal": refusal,
            "family": resolved.family,
            "tp_rank": tp_rank,
            "pp_rank": pp_rank,
            "weight_version": weights.version,
            "weight_digest": weights.digest,
        }
    )


def drain(obj: Any, request_ids: Sequence[str]) -> dict[str, Any]:
    """What this worker recorded for ``request_ids`` (external ids), handed over and forgotten."""
    capture = _capture(_worker(obj))
    if capture is None:
        return {"requests": {}, "missing": plain(list(request_ids)), "counters": {}}
    return plain(capture.drain(request_ids))


def select(obj: Any, selection: dict[str, Any]) -> None:
    """Change which requests are fingerprinted from now on (requests already seen keep their choice)."""
    capture = _capture(_worker(obj))
    if capture is not None:
        capture.selection = Selection.from_wire(selection)


def counters(obj: Any) -> dict[str, Any]:
    capture = _capture(_worker(obj))
    return plain(asdict(capture.counters)) if capture is not None else {}


def stop(obj: Any) -> dict[str, Any]:
    """Remove the hooks; the engine is then exactly as before :func:`start`."""
    worker = _worker(obj)
    capture = _capture(worker)
    if capture is None:
        return {}
    capture.remove()
    worker._isoaudit_capture = None
    return plain(asdict(capture.counters))


def load_weights(
    obj: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str, digest: str | None
) -> dict[str, Any]:
    """Load ``named_tensors`` (checkpoint names) in place, keep the KV/prefix caches and every
    running request, and make ``version`` the weight version of what is computed from now on."""
    worker = _worker(obj)
    loaded = apply_weights(worker.model_runner, named_tensors)
    state = _weights(worker)
    state.version, state.digest = str(version), digest
    capture = _capture(worker)
    if capture is not None:
        capture.version = state.version
    return plain({"loaded": loaded, "weight_version": state.version, "weight_digest": state.digest})


class IsoauditWorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls=collectors.vllm.worker.EXTENSION``; the
    driver calls these through ``LLM.collective_rpc`` by name."""

    def isoaudit_start(self, options: dict[str, Any]) -> dict[str, Any]:
        return start(self, options)

    def isoaudit_drain(self, request_ids: Sequence[str]) -> dict[str, Any]:
        return drain(self, request_ids)

    def isoaudit_select(self, selection: dict[str, Any]) -> None:
        select(self, selection)

    def isoaudit_counters(self) -> dict[str, Any]:
        return counters(self)

    def isoaudit_stop(self) -> dict[str, Any]:
        return stop(self)

    def isoaudit_load_weights(
        self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: str, digest: str | None
    ) -> dict[str, Any]:
        return load_weights(self, named_tensors, version, digest)
