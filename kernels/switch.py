"""The process-wide on/off switch of the invariant kernels: ``enable()`` / ``disable()``.

Turning it on sets :mod:`isoaudit.kernels.dispatch`'s flag (which every model op checks) and
patches the HF model adapters onto the dispatched ops; turning it off undoes both. Either call
also works as a context manager that restores the previous mode on exit.
"""

from __future__ import annotations

from types import TracebackType

from . import adapters, adapters_moe, dispatch


class Switch:
    """The state change happens on construction; used as a context manager it is undone on exit."""

    def __init__(self, flag: bool, fp8: bool = False) -> None:
        self._prev = dispatch.set_enabled(flag)
        self._prev_fp8 = dispatch.set_fp8(fp8 and flag)
        _apply_patches(flag)

    def __enter__(self) -> Switch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        dispatch.set_enabled(self._prev)
        dispatch.set_fp8(self._prev_fp8)
        _apply_patches(self._prev)


def _apply_patches(flag: bool) -> None:
    if flag:
        adapters.patch()
        adapters_moe.patch()
    else:
        adapters.unpatch()
        adapters_moe.unpatch()


def enable(fp8: bool = False) -> Switch:
    """Route this process's models through the invariant kernels (``with enable(): ...`` restores
    the previous mode on exit). ``fp8=True``: the ``invariant-fp8`` mode, the linear layers in
    invariant W8A8 (:mod:`isoaudit.kernels.fp8`), everything else as in ``invariant``."""
    return Switch(True, fp8)


def disable() -> Switch:
    """Back to the native ops (also a context manager)."""
    return Switch(False)
