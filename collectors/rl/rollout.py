"""The two rollout engines the recipe can drive, behind one small interface.

Each holds its *own* copy of the policy's weights, as a real rollout engine does, so the weight
sync after an update is a real transfer with a version, not a shared tensor:

* :class:`VllmRollout`: the real vLLM engine (``vllm.LLM``; the CPU build in tests), weights
  pushed with :func:`isoaudit.collectors.vllm.load_weights` between two ``generate`` calls: the synchronous
  ``LLM``'s equivalent of ``pause_generation(mode="keep", clear_cache=False)`` → ``collective_rpc``
  → ``resume_generation`` (``LLM`` has no pause: nothing runs between two ``generate`` calls, and
  the in-place reload keeps the caches). Remediation reaches inside it through the isoaudit worker
  extension (:mod:`isoaudit.collectors.vllm.worker.remediation`);
* :class:`ReferenceRollout`: isoaudit's reference engine (:class:`isoaudit.kernels.engine.RolloutEngine`:
  batched prefill, then incremental decode with a KV cache) over a deep copy of the policy.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from isoaudit.collectors.base import Collector
from isoaudit.collectors.sessions import Session
from torch import nn

if TYPE_CHECKING:
    from isoaudit.collectors.engine_capture import EngineCollector
    from isoaudit.collectors.vllm.collector import VllmCollector
    from vllm.config.model import ModelDType


@dataclass(frozen=True)
class Sampled:
    """One completion: its tokens and the engine's logprob of each."""

    tokens: list[int]
    logprobs: list[float]


class Rollout(ABC):
    """A rollout engine the loop samples from and pushes weights into."""

    name: str
    collector: Collector | None = None

    @abstractmethod
    def watch(self, audit: Session) -> Collector:
        """Attach this engine's collector to ``audit``."""

    @abstractmethod
    def generate(
        self, step: int, prompts: list[list[int]], max_new: int, temperature: float, seed: int
    ) -> list[Sampled]:
        """Sample one completion per prompt and record the step through the collector."""

    @abstractmethod
    def sync(self, policy: nn.Module, version: int) -> None:
        """Load ``policy``'s current weights as weight version ``version``."""

    def close(self) -> None:  # noqa: B027 - most engines need nothing released
        """Release the engine."""


class ReferenceRollout(Rollout):
    """isoaudit's reference engine over its own copy of the policy."""

    name = "reference"
    collector: EngineCollector | None = None

    def __init__(self, policy: nn.Module, *, max_len: int = 256) -> None:
        from isoaudit.kernels.adapters import HFCausalLM
        from isoaudit.kernels.engine import RolloutEngine

        self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.engine = RolloutEngine(HFCausalLM(self.model), max_len=max_len)

    def watch(self, audit: Session) -> Collector:
        self.collector = audit.watch_engine(self.engine, weight_version=0)
        return self.collector

    def generate(
        self, step: int, prompts: list[list[int]], max_new: int, temperature: float, seed: int
    ) -> list[Sampled]:
        completions = self.engine.generate(
            prompts, [max_new] * len(prompts), seed=seed, temperature=temperature
        )
        if self.collector is not None:
            self.collector.record_step(step, completions)
        return [Sampled(list(c.tokens), list(c.logprobs)) for c in completions]

    @torch.no_grad()
    def sync(self, policy: nn.Module, version: int) -> None:
        held = dict(self.model.named_parameters())
        for name, tensor in policy.named_parameters():
            held[name].copy_(tensor.detach())


class VllmRollout(Rollout):
    """The real vLLM engine, started from the policy's saved directory."""

    name = "vllm"
    collector: VllmCollector | None = None

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: ModelDType = "bfloat16",
        seed: int = 0,
        max_model_len: int = 512,
        **engine: object,
    ) -> None:
        from isoaudit.collectors.vllm import EXTENSION
        from isoaudit.collectors.vllm.worker.remediation import keep_raw_weights
        from vllm import LLM

        keep_raw_weights()  # before the engine loads: vLLM-CPU packs and drops the raw linear weights
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=True,  # hooks and remediation see every layer (no torch.compile, no CUDA graphs)
            gpu_memory_utilization=0.3,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
            worker_extension_cls=EXTENSION,  # reaches worker processes too (VLLM_ENABLE_V1_MULTIPROCESSING=1)
            **cast(dict[str, Any], engine),  # vllm.LLM's other keyword arguments, checked by vLLM
        )

    def watch(self, audit: Session) -> Collector:
        self.collector = audit.watch_vllm(self.llm, weight_version=0)
        return self.collector

    def generate(
        self, step: int, prompts: list[list[int]], max_new: int, temperature: float, seed: int
    ) -> list[Sampled]:
        from vllm import SamplingParams

        if self.collector is not None:
            self.collector.begin_step(step)  # a new remediation mode applies to this step's forwards
        params = [
            SamplingParams(max_tokens=max_new, temperature=temperature, logprobs=0, seed=seed * 100_003 + i)
            for i in range(len(prompts))
        ]
        requests: list[Any] = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if self.collector is not None:
            self.collector.record_step(step, outputs)
        sampled = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            assert (
                completion.logprobs is not None
            )  # asked for (logprobs=0): the sampled token's, each position
            logprobs = []
            for t, entry in zip(tokens, completion.logprobs, strict=True):
                assert entry is not None
                logprobs.append(float(entry[t].logprob))
            sampled.append(Sampled(tokens, logprobs))
        return sampled

    def sync(self, policy: nn.Module, version: int) -> None:
        """Between two ``generate`` calls nothing runs (paused), the in-place reload updates every
        worker keeping its KV cache (``clear_cache=False``), the version is recorded, and the next
        ``generate`` resumes on the new weights. The reload re-runs the layers' post-load processing,
        so the raw weights the invariant GEMM reads are the new ones too."""
        from isoaudit.collectors.vllm import load_weights

        load_weights(self.llm, [(n, p.detach()) for n, p in policy.named_parameters()], version)

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()  # worker processes, if any, exit now
        except Exception:
            pass
        del self.llm


def vllm_available() -> bool:
    """Whether the real vLLM engine is installed here (found, not imported: importing takes seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False
