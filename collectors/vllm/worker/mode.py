"""The worker's remediation mode: a requested mode waits for the engine's next step boundary, then
the worker's switch applies it and the mode it runs is reported as it is.

The driver's request (:class:`~isoaudit.collectors.vllm.messages.SetMode`) never switches the
engine mid-step: :meth:`ModeSwitcher.at_step_boundary` runs at the start of the next
``execute_model``. A switch that fails leaves the engine in the mode it had and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from isoaudit.collectors.vllm.messages import ModeState, SetMode

#: ``switch(mode) -> (applied, reason)``: how a worker switches its engine's remediation mode.
ModeSwitch = Callable[[str], tuple[str, str | None]]

#: ``ops() -> {op: implementation}``: what runs each op now, as the worker's remediation says.
ModeOps = Callable[[], dict[str, str]]

#: ``kernels() -> facts``: the kernels' launch settings in the mode the worker runs now
#: (:func:`isoaudit.collectors.manifest.kernel_facts`), read again at every switch.
ModeKernels = Callable[[], dict[str, Any]]

#: ``fail(where, exc)``: count and log a failure once; the engine goes on.
Fail = Callable[[str, BaseException], None]


class ModeSwitcher:
    """The mode one worker runs (:attr:`state`) and the request waiting for the next step."""

    def __init__(
        self, switch: ModeSwitch | None, ops: ModeOps | None, fail: Fail, kernels: ModeKernels | None = None
    ) -> None:
        self.switch = switch
        self.ops = ops
        self.kernels = kernels
        self._fail = fail
        self._pending: SetMode | None = None
        self.state = ModeState(ops=self._ops(), kernels=self._kernels())

    def request(self, request: SetMode) -> None:
        """Switch to ``request.mode`` at the next step boundary."""
        self._pending = request

    def at_step_boundary(self, step: int) -> None:
        """Apply the pending request, if any (``step``: the steps the engine ran before it)."""
        request, self._pending = self._pending, None
        if request is None:
            return
        applied: str
        reason: str | None
        try:
            if self.switch is None:
                applied, reason = "native", "this worker has no way to switch modes"
            else:
                applied, reason = self.switch(request.mode)
        except Exception as exc:  # the engine goes on in the mode it had
            self._fail("mode switch", exc)
            applied, reason = self.state.applied, f"switching failed ({type(exc).__name__}: {exc})"
        self.state = ModeState(
            requested=request.mode,
            applied=applied,
            reason=reason,
            version=request.version,
            step=step,
            ops=self._ops(),
            kernels=self._kernels(),
        )

    def _kernels(self) -> dict[str, Any]:
        """The kernels' launch settings in the mode run now (empty when the worker cannot say)."""
        if self.kernels is None:
            return {}
        try:
            return dict(self.kernels())
        except Exception as exc:
            self._fail("mode kernels", exc)
            return {}

    def _ops(self) -> dict[str, str]:
        """What runs each op now, as the worker's remediation says (empty when it cannot)."""
        if self.ops is None:
            return {}
        try:
            return dict(self.ops())
        except Exception as exc:
            self._fail("mode ops", exc)
            return {}
