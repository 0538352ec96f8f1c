"""Kernel tests run twice over: on the CPU in fp32 under Triton's interpreter (structure), and on
CUDA in bf16 with the shapes the claims name (bits, `gpu`-marked)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of `kernels`: its @triton.jit helper functions pick interpreter
    # or compiler when they are decorated (the root tests/conftest.py sets it first already).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from isoaudit.kernels._triton import HAVE_TRITON  # noqa: E402
from isoaudit.kernels.bits import bits_equal  # noqa: E402, F401  (the tests import it from here)

CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def gpu(fn):
    """Mark a test `gpu` and skip it cleanly where CUDA is absent."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs CUDA")(fn))


@pytest.fixture
def dev() -> str:
    """Where the structural tests run: CUDA if present, else the CPU under the interpreter."""
    return "cuda" if CUDA else "cpu"


@pytest.fixture
def split_k():
    """The GEMM's default split policy for one test, whatever the process started with (the previous
    policy is restored after)."""
    import importlib

    policy = importlib.import_module("isoaudit.kernels.gemm_policy")
    previous = policy.set_split_policy(policy.DEFAULT_SPLIT)
    yield
    policy.set_split_policy(previous)
