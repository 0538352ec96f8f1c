"""The engine's side of the manifest: what its numerics depend on, read from the live worker, and
whether capturing regions inside it would be right at all.

Read in the worker (``vllm_config`` and the model runner live there), returned as plain data, and
turned into :class:`isoaudit.audit.records.RuntimeFacts` by the driver. A decoder compiled through
vLLM's ``@support_torch_compile`` is recorded by graph taps and recompiled per state
(:mod:`isoaudit.collectors.vllm.worker.graph`). Where that does not reach the forward (replayed CUDA
graphs, a model compiled whole by ``STOCK_TORCH_COMPILE``) or the row mapping would not hold
(speculative decoding verifies draft tokens), :func:`capture_refusal` says so: the collector then
records no regions and the manifest names the reason, instead of recording nothing and looking clean.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

import torch
from isoaudit.collectors.environment import process_environment
from isoaudit.collectors.vllm.worker.quant_facts import quant_facts

log = logging.getLogger("isoaudit.collectors")


def _name(value: Any) -> str | None:
    if value is None:
        return None
    name = getattr(value, "name", None)
    return str(name) if name is not None else str(value).removeprefix("torch.")


def _dtype(value: Any) -> str | None:
    return str(value).removeprefix("torch.") if value is not None else None


def _enum_is_none(value: Any) -> bool:
    return value is None or getattr(value, "name", str(value)).upper() == "NONE" or value == 0


def capture_refusal(vllm_config: Any, compiled_decoder: bool = False) -> str | None:
    """Why region capture would be silently wrong in this engine, or ``None`` when it is sound.
    ``compiled_decoder``: the model has a decoder compiled through ``@support_torch_compile``, which
    the graph taps reach."""
    compilation = vllm_config.compilation_config
    reasons = []
    mode = getattr(compilation, "mode", None)
    if not _enum_is_none(mode) and not compiled_decoder:
        reasons.append(
            f"the model runs torch.compile'd (compilation mode {_name(mode)}) without a "
            "@support_torch_compile decoder to recompile: module hooks inside its graph do not run"
        )
    cudagraph = getattr(compilation, "cudagraph_mode", None)
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda"))
    if not _enum_is_none(cudagraph) and not vllm_config.model_config.enforce_eager and device != "cpu":
        reasons.append(
            f"forwards replay CUDA graphs (cudagraph_mode {_name(cudagraph)}): hooks do not run on replay"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append(
            "speculative decoding verifies draft tokens: rows and logits do not map one-to-one to positions"
        )
    if reasons:
        return "regions not captured: " + "; ".join(reasons) + " (start the engine with enforce_eager=True)"
    return None


def _attention_backend(runner: Any) -> str | None:
    names = set()
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups:
            backend = getattr(group, "backend", None)
            if backend is not None:
                try:
                    names.add(str(backend.get_name()))
                except Exception:
                    names.add(getattr(backend, "__name__", str(backend)))
    return ",".join(sorted(names)) or None


def _arch(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor} {torch.cuda.get_device_name(device)}"
    return f"{platform.machine()} {platform.processor() or ''}".strip()


def engine_facts(vllm_config: Any, runner: Any, model: Any) -> dict[str, Any]:
    """The runtime facts of this worker's engine, as plain data for :class:`RuntimeFacts`. The
    kernels' launch settings depend on the mode the worker runs: its mode state carries them
    (:attr:`isoaudit.collectors.vllm.messages.ModeState.kernels`), read again at every switch."""
    import vllm
    from vllm import envs

    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    compilation = vllm_config.compilation_config
    device = getattr(runner, "device", None) or torch.device("cpu")
    device = torch.device(device)
    head = getattr(model, "lm_head", None)
    head_weight = getattr(head, "weight", None)
    cudagraph = getattr(compilation, "cudagraph_mode", None)
    speculative = getattr(vllm_config, "speculative_config", None)
    return {
        "framework": "vllm",
        "framework_version": str(vllm.__version__),
        "torch_version": torch.__version__,
        "device": str(device),
        "arch": _arch(device),
        "dtype": _dtype(model_config.dtype),
        "lm_head_dtype": _dtype(head_weight.dtype) if isinstance(head_weight, torch.Tensor) else None,
        "logprobs_mode": str(model_config.logprobs_mode),
        "prefix_caching": bool(cache.enable_prefix_caching),
        "async_scheduling": bool(scheduler.async_scheduling),
        "chunked_prefill": bool(scheduler.enable_chunked_prefill),
        "cuda_graphs": bool(
            not model_config.enforce_eager and not _enum_is_none(cudagraph) and device.type == "cuda"
        ),
        "batch_invariant": bool(envs.VLLM_BATCH_INVARIANT),
        "attention_backend": _attention_backend(runner),
        "tp_size": int(parallel.tensor_parallel_size),
        "pp_size": int(parallel.pipeline_parallel_size),
        "ep_size": int(parallel.tensor_parallel_size * parallel.data_parallel_size)
        if getattr(parallel, "enable_expert_parallel", False)
        else 1,
        # extras (RuntimeFacts allows them): the rest of what changes the path or the arithmetic
        "enforce_eager": bool(model_config.enforce_eager),
        "compilation_mode": _name(getattr(compilation, "mode", None)),
        "cudagraph_mode": _name(cudagraph),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": int(cache.block_size) if cache.block_size is not None else None,
        "max_num_batched_tokens": int(scheduler.max_num_batched_tokens),
        "max_num_seqs": int(scheduler.max_num_seqs),
        "speculative_decoding": speculative is not None,
        "quantization": model_config.quantization,
        "model_type": getattr(model_config.hf_config, "model_type", None),
        "seed": model_config.seed,
        "v1_multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
        **quant_facts(vllm_config),  # the "quant" mapping the comparator reads
    }


def engine_environment() -> dict[str, Any]:
    """This worker process's environment (``audit.records.Environment`` as plain data): its libraries,
    torch's switches, its pins and vLLM's batch-invariant switch, read where the forward runs."""
    try:
        from vllm import envs

        invariant = bool(envs.VLLM_BATCH_INVARIANT)
        return process_environment(batch_invariant=invariant).model_dump(mode="json")
    except Exception:  # the engine starts all the same; the manifest then says it was not recorded
        log.warning("isoaudit vllm worker: reading the environment failed", exc_info=True)
        return {}
