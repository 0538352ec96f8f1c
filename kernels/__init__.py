"""IsoExec-style invariant kernels: the remediation backend of isoaudit.

``isoaudit.kernels.enable()`` routes this process's models through kernels whose bits do not depend on
batch size, on prefill/decode split or on TP degree, so a trainer and a rollout engine that both
enable them compute the same logprobs bit for bit. Each kernel is Triton on CUDA with an exact
torch reference that defines its arithmetic (used where Triton cannot run).
"""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder
from importlib.util import module_from_spec
from pathlib import Path


def _hand_over_the_bare_name(name: str) -> None:
    """Give the bare top-level ``name`` to the installed package that owns it.

    This folder installs as ``isoaudit.kernels``. Run from the checkout's root (``python -c``,
    ``python -m``), the root is first on ``sys.path`` and ``import kernels`` would find this folder,
    and transformers imports Hugging Face's ``kernels`` whenever that distribution is installed. So
    when this file runs under the bare name, it loads the package the rest of ``sys.path`` holds into
    ``sys.modules[name]``, which the import statement then returns (or says there is none).
    """
    checkout = Path(__file__).resolve().parent.parent
    search = [entry for entry in sys.path if Path(entry or ".").resolve() != checkout]
    spec = PathFinder.find_spec(name, search)
    if spec is None or spec.loader is None:
        del sys.modules[name]
        raise ModuleNotFoundError(
            f"No module named {name!r} (the checkout's {name}/ folder is isoaudit.{name})", name=name
        )
    module = module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


if __name__ != "isoaudit.kernels":
    _hand_over_the_bare_name(__name__)
else:
    # Submodules first: four function names below (gemm, attention, tree_gemm, ...) shadow their
    # modules as package attributes, and dispatch/moe import those modules by `from . import`.
    from . import dispatch, switch  # noqa: F401
    from ._triton import HAVE_TRITON
    from .attention import attention
    from .dispatch import is_enabled
    from .gdn import gdn_chunk, gdn_recurrent
    from .gemm import gemm, linear
    from .logprobs import log_softmax, token_logprobs
    from .rmsnorm import rms_norm
    from .switch import disable, enable
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
