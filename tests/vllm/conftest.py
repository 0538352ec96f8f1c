"""The real vLLM engine (CPU build) on a tiny local Qwen3, and the HF trainer on the same weights.

Engines are expensive (seconds to start, more for worker processes): each test module shares one
through a module-scoped fixture. vLLM is imported only inside these helpers, so collecting the
suite without vLLM installed skips these modules instead of failing.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from isoaudit.collectors.sinks import MemorySink

from tests.conftest import flask_proxies_bound

#: The tiny model: 2 layers, hidden 128, 4 heads of 32 (vLLM's CPU attention needs head_dim % 32 == 0).
NUM_LAYERS = 2
HIDDEN = 128
RUN = "vllm-test"

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 512,
    "gpu_memory_utilization": 0.3,
    "kv_cache_memory_bytes": 64 << 20,  # on the CPU backend: host memory for the KV cache
    "enforce_eager": True,
    "seed": 0,
    "logprobs_mode": "processed_logprobs",
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
}


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from isoaudit.collectors.tiny_models import make_tiny_model

    return make_tiny_model(
        "qwen3",
        tmp_path_factory.mktemp("vllm-tiny") / "qwen3",
        num_layers=NUM_LAYERS,
        hidden=HIDDEN,
        heads=4,
        kv_heads=2,
        vocab=512,
        seed=7,
        dtype="bfloat16",
    )


@contextmanager
def engine(path: Path, *, processes: bool = False, **overrides: Any) -> Iterator[Any]:
    """A ``vllm.LLM`` in this process (``processes=False``) or in worker processes with the isoaudit
    worker extension; shut down on exit."""
    from isoaudit.collectors import heap
    from isoaudit.collectors.vllm import EXTENSION
    from isoaudit.collectors.vllm.worker.remediation import keep_raw_weights
    from vllm import LLM, envs

    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    # An in-process engine changes process-wide state the rest of the suite must not inherit: its CPU
    # worker pins torch to fewer threads (and replaces torch.set_num_threads), its core freezes the GC.
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if processes else "0"
    envs.disable_envs_cache()  # an earlier engine froze vLLM's view of the environment
    kwargs = {**ENGINE_DEFAULTS, **overrides}
    if processes:
        kwargs["worker_extension_cls"] = EXTENSION
    else:
        # what a user of an in-process engine without the extension does (the remediation's reason
        # says so): keep the raw linear weights vLLM-CPU's packing removes, whatever was imported first
        keep_raw_weights()
    llm = None
    # What the suite holds leaves the collector's walk while the engine starts and runs: starting
    # one allocates enough to bring several full collections due, each walking every object the
    # suite's process holds (``steady_heap`` in tests/conftest.py says why that is long).
    held = heap.hold()
    try:
        with flask_proxies_bound():  # the dashboard tests import Dash in this process
            llm = LLM(model=str(path), **kwargs)
        yield llm
    finally:
        try:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
            else:
                # An engine that failed to start left vLLM's process-wide parallel groups up (a
                # dense model's: no expert-parallel group), which the next module's engine would
                # reuse; a MoE model then fails to build.
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
        finally:
            del llm
            gc.collect()
            if previous is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
            envs.disable_envs_cache()
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            if held:  # unfreezes ours and the engine core's freeze, unless another holder's
                heap.release()


def prompts_of(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def generate(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float = 0.7,
    max_tokens: int = 12,
    seed: int | None = 0,
    **params: Any,
) -> list[Any]:
    """Sampled completions with logprobs, each request seeded (the same tokens on any engine).
    ``seed=None``: unseeded (vLLM-CPU cannot rewind a request's generator under chunked prefill)."""
    from vllm import SamplingParams

    sampling = [
        SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            min_tokens=max_tokens,
            logprobs=0,
            seed=None if seed is None else seed + i,
            **params,
        )
        for i in range(len(prompts))
    ]
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)


def perturbed_weights(path: Path, seed: int = 1, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors plus noise: "the trainer's next weights"."""
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(seed)
    base = load_file(str(path / "model.safetensors"))
    return {
        name: (t.float() + scale * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in base.items()
    }


def trainer_side(
    path: Path,
    outputs: Sequence[Any],
    *,
    temperature: float = 0.7,
    step: int = 0,
    weights: Mapping[str, torch.Tensor] | None = None,
    version: str | None = None,
    contract: Any = None,
) -> MemorySink:
    """The HF trainer collector's records of the same samples (its own forward, processed logprobs)."""
    from isoaudit.collectors import trainer
    from isoaudit.collectors.layout import StepBatch
    from isoaudit.collectors.tiny_models import load_tiny_model

    model, _ = load_tiny_model(path, dtype=torch.bfloat16)
    if weights is not None:
        model.load_state_dict(dict(weights))
    sink = MemorySink()
    handle = trainer.attach(model, run=RUN, sink=sink, strict=True, contract=contract)
    prompts = [list(o.prompt_token_ids) for o in outputs]
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    handle.record_step(
        step, StepBatch.padded(prompts, completions, temperature=temperature), weight_version=version
    )
    assert sink.flush(30)
    handle.detach()
    return sink


def by_key(sink: MemorySink, kind: str, step: int | None = None) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for record in sink.of_kind(kind):
        if step is None or record.step == step:
            out.setdefault(record.sample_key, []).append(record)
    return out


def compare(trainer: MemorySink, rollout: MemorySink, step: int = 0) -> dict[str, Any]:
    """``audit.compare.compare_sample`` for every sample of ``step`` present on both sides."""
    from isoaudit.audit.compare import compare_sample

    t_samples, r_samples = by_key(trainer, "sample", step), by_key(rollout, "sample", step)
    t_prints, r_prints = by_key(trainer, "fingerprints", step), by_key(rollout, "fingerprints", step)
    return {
        key: compare_sample(
            t_samples[key][0],
            r_samples[key][0],
            t_prints.get(key, []),
            r_prints.get(key, []),
            trainer.of_kind("manifest"),
            rollout.of_kind("manifest"),
        )
        for key in t_samples.keys() & r_samples.keys()
    }


def rows_of(records: Sequence[Any], region: str, case: str | None = None) -> dict[int, int]:
    """position -> digest of one region, over the records of one sample."""
    out: dict[int, int] = {}
    for record in records:
        if record.region == region and (case is None or record.case == case):
            out.update(zip(record.positions.tolist(), record.digest.tolist(), strict=True))
    return out
