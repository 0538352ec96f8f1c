"""What every collector part shares to stay quiet and accountable: named counters and warnings
logged once.

A collector never raises into the job, so what goes wrong must show somewhere else: every refusal,
drop and error is counted (:class:`Counters`, read by ``stats()`` and the session's summary) and
logged the first time it happens (:class:`LogOnce`), never once per step.
"""

from __future__ import annotations

import logging
import threading
from typing import ClassVar


class Counters:
    """Integer counters whose names a subclass declares in ``NAMES``: ``counters.errors += 1``,
    ``counters.add("sent", 5)`` (thread-safe), ``counters.as_dict()``. A name not declared is an
    ``AttributeError``, so a typo fails in tests instead of counting into nothing."""

    NAMES: ClassVar[tuple[str, ...]] = ()

    __slots__ = ("_values", "_lock")
    _values: dict[str, int]
    _lock: threading.Lock

    def __init__(self, **initial: int) -> None:
        values = dict.fromkeys(self.NAMES, 0)
        unknown = set(initial) - set(values)
        if unknown:
            raise AttributeError(f"{type(self).__name__}: no counters {sorted(unknown)}")
        values.update(initial)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_lock", threading.Lock())

    def __getattr__(self, name: str) -> int:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no counter {name!r}") from None

    def __setattr__(self, name: str, value: int) -> None:
        if name not in self._values:
            raise AttributeError(f"{type(self).__name__} has no counter {name!r}")
        self._values[name] = int(value)

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (safe from several threads)."""
        with self._lock:
            setattr(self, name, self._values[name] + n)

    def as_dict(self) -> dict[str, int]:
        return dict(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counters) and self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # unhashable on purpose, like a mutable dataclass

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in self._values.items())
        return f"{type(self).__name__}({body})"


class LogOnce:
    """``warn(key, message)`` logs ``message`` the first time ``key`` is seen, then stays silent
    (``forget(key)`` re-arms it, e.g. once a destination is back)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, key: str, message: str) -> bool:
        """Log ``message`` if ``key`` is new; returns whether it was logged."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        self.logger.warning("%s", message)
        return True

    def forget(self, key: str) -> None:
        with self._lock:
            self._seen.discard(key)

    def __contains__(self, key: str) -> bool:
        return key in self._seen
