"""IsoExec-style invariant kernels: the remediation backend of isoaudit.

``kernels.enable()`` routes this process's models through kernels whose bits do not depend on
batch size, on prefill/decode split or on TP degree, so a trainer and a rollout engine that both
enable them compute the same logprobs bit for bit. Each kernel is Triton on CUDA with an exact
torch reference that defines its arithmetic (used where Triton cannot run).
"""

from __future__ import annotations

from types import TracebackType

from . import adapters, adapters_moe, routing
from ._triton import HAVE_TRITON
from .attention import attention
from .gdn import gdn_chunk, gdn_recurrent
from .gemm import gemm, linear
from .logprobs import log_softmax, token_logprobs
from .rmsnorm import rms_norm
from .routing import is_enabled
from .tree_gemm import tree_gemm, tree_plan

__all__ = [
    "HAVE_TRITON",
    "attention",
    "disable",
    "enable",
    "gdn_chunk",
    "gdn_recurrent",
    "gemm",
    "is_enabled",
    "linear",
    "log_softmax",
    "rms_norm",
    "token_logprobs",
    "tree_gemm",
    "tree_plan",
]


class _Switch:
    """The state change happens on construction; used as a context manager it is undone on exit."""

    def __init__(self, flag: bool) -> None:
        self._prev = routing.set_enabled(flag)
        _apply_patches(flag)

    def __enter__(self) -> _Switch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        routing.set_enabled(self._prev)
        _apply_patches(self._prev)


def _apply_patches(flag: bool) -> None:
    if flag:
        adapters.patch()
        adapters_moe.patch()
    else:
        adapters.unpatch()
        adapters_moe.unpatch()


def enable() -> _Switch:
    """Route this process's models through the invariant kernels (``with kernels.enable(): ...``
    restores the previous mode on exit)."""
    return _Switch(True)


def disable() -> _Switch:
    """Back to the native ops (also a context manager)."""
    return _Switch(False)
