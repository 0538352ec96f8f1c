"""Shared by the framework-integration tests: one tiny local model per session, and a guard that
puts back the process-wide state an in-process vLLM engine and ``torch.distributed`` change."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# The vLLM tests' tiny bf16 Qwen3 (head_dim 32, as vLLM's CPU attention needs), one per session for both suites.
from tests.vllm.conftest import tiny_qwen3  # noqa: F401


@contextmanager
def process_state() -> Iterator[None]:
    """Run a block that starts an in-process vLLM engine and a process group, then undo what they
    leave behind: the environment (TRL sets RANK/WORLD_SIZE/MASTER_*), torch's thread count (vLLM's
    CPU worker pins it), the frozen GC, vLLM's parallel state and the default process group."""
    environ = dict(os.environ)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        try:
            from vllm.distributed import parallel_state

            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
        except Exception:
            pass
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        try:
            from vllm import envs

            envs.disable_envs_cache()
        except Exception:
            pass
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        gc.unfreeze()
        gc.collect()
