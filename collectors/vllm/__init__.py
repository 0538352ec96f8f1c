"""The rollout side: a collector inside a vLLM engine (DESIGN.md, "Data flow").

``Session.watch_vllm(llm)`` (or ``attach(llm, run=..., sink=...)``) hooks an offline ``vllm.LLM``
whose engine runs in this process, or one created with
``worker_extension_cls=isoaudit.collectors.vllm.EXTENSION`` (workers in other processes, reached
through ``LLM.collective_rpc``). ``load_weights(llm, named_tensors, version)`` performs an in-flight
weight update and records the new weight version and digest.

The folders follow the process boundary: :mod:`~isoaudit.collectors.vllm.worker` runs inside the
workers; ``collector``, ``link``, ``outputs`` and ``selection`` run in the driver (the process
holding ``vllm.LLM``); :mod:`~isoaudit.collectors.vllm.messages` holds every message between them,
and both sides import it. ``weights`` and ``engine_state`` pair a driver-side call with its
worker-side half; ``extension`` is the module vLLM imports by name inside each worker.

Importing this package does not import vLLM: vLLM stays an optional dependency, imported only by the
functions that talk to an engine.
"""

from isoaudit.collectors.vllm.collector import StepReport, VllmCollector, attach, attached
from isoaudit.collectors.vllm.selection import Selection, parse_selection
from isoaudit.collectors.vllm.weights import load_weights, weight_digest
from isoaudit.collectors.vllm.worker.calls import EXTENSION, IsoauditWorkerExtension

__all__ = [
    "EXTENSION",
    "IsoauditWorkerExtension",
    "Selection",
    "StepReport",
    "VllmCollector",
    "attach",
    "attached",
    "load_weights",
    "parse_selection",
    "weight_digest",
]
