"""Recorded steps on their way from the device to the sink, in step order, without stalling training.

A recorded step's arrays leave the device in one asynchronous copy
(:class:`~isoaudit.collectors.transfer.HostCopy`); its records can be built only once the copy has
landed, and building them (about a thousand records for a step with every region fingerprinted) is
host work. :class:`StepPipeline` keeps the steps in order and finishes each one as late as it can:

- a step is *built* once its copy has landed, or when more than a bound of steps wait; by the
  training thread, or, with ``background=True`` (or from :meth:`StepPipeline.start` on), by one
  helper thread that waits for each copy and builds while the training thread runs its backward
  (which releases the GIL);
- built steps are *handed back* to the training thread, oldest first, which sends them: the sink's
  send hooks run where they always do, and a failed build is counted (or raised) there.

A step is built exactly once, by whichever thread claims it first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from isoaudit.audit.records import Record

T = TypeVar("T")


@dataclass
class BuiltStep:
    """One recorded step's records, built from its landed copy."""

    keys: list[str]  # the sample keys, in batch order
    n_fingerprint_records: int
    records: list[Record]


#: What building gives: the records, or the exception that stopped it (counted where it is sent).
Outcome = BuiltStep | BaseException


@dataclass
class _Entry(Generic[T]):
    item: T
    outcome: Outcome | None = None
    claimed: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class StepPipeline(Generic[T]):
    """Steps (``item``\\ s) in order; ``build(item)`` waits for the item's copy and builds it,
    ``ready(item)`` says without blocking whether the copy has landed."""

    def __init__(
        self, build: Callable[[T], BuiltStep], ready: Callable[[T], bool], *, background: bool = False
    ) -> None:
        self._build = build
        self._ready = ready
        self._entries: deque[_Entry[T]] = deque()
        self._lock = threading.Lock()
        self._todo: queue.Queue[_Entry[T] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self.start()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def background(self) -> bool:
        """Does a helper thread build the steps (and is it still running)?"""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the helper thread (if none was started): it builds the steps waiting and those
        pushed from now on."""
        if self._thread is not None:
            return
        self._todo = queue.Queue()
        for entry in self._entries:  # unclaimed ones: the helper claims what nobody has
            self._todo.put(entry)
        self._thread = threading.Thread(target=self._run, name="isoaudit-trainer-records", daemon=True)
        self._thread.start()

    def push(self, item: T, *, room: int, timeout: float) -> bool:
        """Queue a step. With a helper thread, at most ``room`` steps wait (without one, the bound
        is ``take``'s ``block_beyond``): beyond that this waits
        up to ``timeout`` seconds for the oldest to be built; ``False``: it was not, the step is not
        queued (the caller builds it itself, the helper being stuck)."""
        if self.background and len(self._entries) >= room:
            if not self._entries[0].done.wait(timeout):
                return False
        entry = _Entry(item)
        self._entries.append(entry)
        if self._todo is not None and self.background:
            self._todo.put(entry)
        return True

    def take(self, block_beyond: int | None) -> list[tuple[T, Outcome]]:
        """The built steps, oldest first, up to the first not built yet. A step whose copy has
        landed is built here unless a helper thread builds them; while more than ``block_beyond``
        steps wait, the oldest is finished now (``None``: never)."""
        out: list[tuple[T, Outcome]] = []
        while self._entries:
            entry = self._entries[0]
            if entry.outcome is None:
                beyond = block_beyond is not None and len(self._entries) > block_beyond
                landed = not self.background and self._ready(entry.item)
                if not (beyond or landed):
                    break
                self._finish(entry, None)
            self._entries.popleft()
            assert entry.outcome is not None
            out.append((entry.item, entry.outcome))
        return out

    def take_all(self, timeout: float) -> tuple[list[tuple[T, Outcome]], bool]:
        """Finish every step (waiting for copies and for the helper thread, ``timeout`` seconds in
        all) and hand them back, oldest first; ``False``: some were not finished in time (they
        stay, for a later call)."""
        deadline = time.monotonic() + timeout
        complete = True
        for entry in list(self._entries):
            if not self._finish(entry, max(0.0, deadline - time.monotonic())):
                complete = False
                break
        return self.take(None), complete

    def build_now(self, item: T) -> Outcome:
        """Build a step outside the queue (the helper thread being stuck): its outcome, at once."""
        entry = _Entry(item, claimed=True)
        self._build_entry(entry)
        assert entry.outcome is not None
        return entry.outcome

    def stop(self, timeout: float) -> None:
        """End the helper thread (the steps still queued stay, built by the training thread)."""
        if self._todo is not None and self._thread is not None:
            self._todo.put(None)
            self._thread.join(timeout)
        self._todo = None

    # ------------------------------------------------------------------ internals

    def _claim(self, entry: _Entry[T]) -> bool:
        with self._lock:
            if entry.claimed:
                return False
            entry.claimed = True
            return True

    def _finish(self, entry: _Entry[T], timeout: float | None) -> bool:
        """Build ``entry`` here if nobody has claimed it, else wait for the thread that did."""
        if self._claim(entry):
            self._build_entry(entry)
            return True
        return entry.done.wait(timeout)

    def _build_entry(self, entry: _Entry[T]) -> None:
        try:
            entry.outcome = self._build(entry.item)
        except Exception as exc:  # handed to the training thread, which counts it
            entry.outcome = exc
        entry.done.set()

    def _run(self) -> None:
        assert self._todo is not None
        todo = self._todo
        while True:
            entry = todo.get()
            if entry is None:
                return
            if self._claim(entry):
                self._build_entry(entry)
