"""Keep a full garbage collection from holding a training step.

CPython's cyclic garbage collector walks every tracked object in a full (oldest-generation) pass,
and no Python thread runs meanwhile. A job that has imported torch, transformers and its framework
and holds its model tracks about a million objects: a full pass takes 0.3-2.5 s of a loaded core.
The pass runs wherever an allocation makes it due, and a collector allocates on the job's thread
(each step's records), so now and then one lands in a collector call and holds the step for that
long.

What the job holds when a collector attaches (modules, the model, the framework) lives as long as
the job, so the collector moves it out of the garbage collector's walk (``gc.freeze()``, as vLLM
does once its engine is up): a full pass then walks only what was allocated since, milliseconds.
Reference counting still frees frozen objects; only a reference cycle among them that dies during
the run waits until the heap is unfrozen.

:func:`hold` is taken by each attached collector and :func:`release`\\ d when it detaches; the last
release unfreezes, unless the heap was already frozen when the first hold came (vLLM's engine in
the same process: its own shutdown unfreezes). ``ISOAUDIT_FREEZE_HEAP=0`` leaves the garbage
collector alone.
"""

from __future__ import annotations

import gc
import os
import threading

#: The environment variable that turns freezing off (``0``, ``false``, ``no`` or ``off``).
ENV_FREEZE = "ISOAUDIT_FREEZE_HEAP"

_lock = threading.RLock()  # a finalizer run by a collection while it is held may release a holder
_holders = 0
_owned = False  # whether the last release unfreezes (nobody else had frozen the heap)


def enabled() -> bool:
    """Whether collectors freeze the heap (``ISOAUDIT_FREEZE_HEAP``, on unless set to a no)."""
    return os.environ.get(ENV_FREEZE, "1").strip().lower() not in ("0", "false", "no", "off")


def hold() -> bool:
    """Freeze what the process holds now (after a young collection, so that fresh garbage is not
    kept). Returns whether it froze (then :func:`release` once, when the holder detaches)."""
    global _holders, _owned
    if not enabled():
        return False
    gc.collect(1)  # the young generations only: milliseconds, whatever the heap's size
    with _lock:
        if _holders == 0:
            _owned = gc.get_freeze_count() == 0
        _holders += 1
        gc.freeze()
    return True


def release() -> None:
    """One holder is gone; the last one unfreezes the heap if freezing it was ours."""
    global _holders, _owned
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _owned:
            _owned = False
            gc.unfreeze()


def holders() -> int:
    """How many collectors hold the heap frozen now."""
    return _holders
