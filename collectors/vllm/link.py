"""How the driver reaches the workers: ``LLM.collective_rpc``, by method name when the engine was
started with the isoaudit worker extension (the only way into worker processes), or with the
worker-side functions themselves when the engine runs in this process. Either way the same
functions of :mod:`isoaudit.collectors.vllm.worker.calls` run on the same wire-form messages
(:mod:`isoaudit.collectors.vllm.messages`), so both modes produce the same records.
"""

from __future__ import annotations

from typing import Any

from isoaudit.collectors.vllm.worker import calls as worker_side


def _uses_extension(llm: Any) -> bool:
    name = getattr(llm.llm_engine.vllm_config.parallel_config, "worker_extension_cls", "") or ""
    if not name:
        return False
    if name == worker_side.EXTENSION:
        return True
    try:
        from vllm.utils.import_utils import resolve_obj_by_qualname
    except ImportError:  # older layout
        from vllm.utils import resolve_obj_by_qualname  # type: ignore[attr-defined,no-redef]  # vLLM moved this helper between releases; the fallback import
    try:
        cls = resolve_obj_by_qualname(name)
    except Exception:
        return False
    return isinstance(cls, type) and issubclass(cls, worker_side.IsoauditWorkerExtension)


def _in_process(llm: Any) -> bool:
    return type(getattr(llm.llm_engine, "engine_core", None)).__name__ == "InprocClient"


class EngineLink:
    """Calls into every worker of one ``vllm.LLM``; results come back one per worker."""

    def __init__(self, llm: Any, *, timeout: float | None = 120.0) -> None:
        engine = getattr(llm, "llm_engine", None)
        if engine is None or not hasattr(llm, "collective_rpc"):
            raise TypeError(f"llm: expected a vllm.LLM, got {type(llm).__name__}")
        self.llm = llm
        # A bounded wait: if a worker never answers, the driver gets a TimeoutError (counted by the
        # collector) instead of hanging the RL loop.
        self.timeout = timeout
        self.by_name = _uses_extension(llm)
        self.in_process = _in_process(llm)
        if not self.by_name and not self.in_process:
            raise ValueError(
                "llm: the engine runs in worker processes, which hooks can only reach through the worker "
                f"extension; create it with LLM(..., worker_extension_cls={worker_side.EXTENSION!r}) "
                "(or set VLLM_ENABLE_V1_MULTIPROCESSING=0 to keep the engine in-process)"
            )

    @property
    def mode(self) -> str:
        return "worker_extension" if self.by_name else "in_process"

    def call(self, name: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Run the worker-side function ``name`` on every worker."""
        timeout = self.timeout if timeout is None else timeout
        if self.by_name:
            return list(self.llm.collective_rpc(f"isoaudit_{name}", timeout=timeout, args=args))
        return list(self.llm.collective_rpc(getattr(worker_side, name), timeout=timeout, args=args))
