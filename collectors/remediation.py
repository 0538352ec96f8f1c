"""Applying the remediation mode the service asks for (DESIGN.md, "Remediation").

The dashboard sets a run's desired mode; the collector's control channel (:mod:`isoaudit.collectors.control`)
learns it; the collector calls a :data:`RemediationHook` at its next step boundary, then reports the
applied mode in a new manifest.
The default hook switches this process onto (or off) the invariant kernels of :mod:`isoaudit.kernels`; a
trainer with its own way (e.g. a different kernel library, or a restart) passes its own hook.
"""

from __future__ import annotations

from collections.abc import Callable

from isoaudit.collectors.base import ModeReport
from isoaudit.collectors.control import MODES
from torch import nn

#: ``hook(model, mode)``: make ``model``'s next forward run in ``mode``; raise if it cannot.
RemediationHook = Callable[[nn.Module, str], None]


def apply_kernels_mode(model: nn.Module, mode: str) -> None:
    """Route the process through :mod:`isoaudit.kernels` (``invariant``; ``invariant-fp8``: with the
    linear layers in invariant W8A8) or back to native ops."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    from isoaudit import kernels

    if mode == "invariant":
        kernels.enable()
    elif mode == "invariant-fp8":
        kernels.enable(fp8=True)
    else:
        kernels.disable()
        return
    compiled_keeps_roundings()


def compiled_keeps_roundings() -> None:
    """Make inductor round each bf16/fp16 intermediate as eager torch does
    (``emulate_precision_casts``): the invariant kernels are opaque ops in a compiled model, but the
    elementwise ops between them (RoPE, residual adds) are fused by inductor, which otherwise keeps
    their intermediates in fp32 and gives other bits than the engine's eager arithmetic. A switch
    recompiles anyway (Dynamo guards on the mode), so the next compiled step picks it up."""
    try:
        import torch._inductor.config as inductor_config
    except Exception:  # noqa: BLE001 - no inductor in this torch: nothing compiles through it
        return
    inductor_config.emulate_precision_casts = True


def switch_with(hook: RemediationHook | None, model: nn.Module, mode: str, what: str) -> ModeReport:
    """Switch ``model`` (the ``what`` of a collector: "trainer", "engine") to ``mode`` through
    ``hook``; without a hook only ``native`` can be honoured, and the report says why."""
    if hook is None:
        if mode == "native":
            return ModeReport(mode, mode)
        return ModeReport(mode, "native", f"no remediation_hook: this {what} cannot switch modes")
    hook(model, mode)
    return ModeReport(mode, mode)
