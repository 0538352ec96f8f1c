"""Processes that measure some of a step's token blocks beside the calling thread (DESIGN.md,
"Metrics"; docs/scale.md, "Comparison").

A pass over a step's blocks is a few hundred numpy calls per block, each on about 64k tokens, with
Python between them: threads of one process take turns on the interpreter lock at every call, so a
second thread does not shorten the pass. A second *process* does. :class:`BlockPool` keeps
``processes`` of them started (forkserver: nothing of the caller's threads or locks is inherited);
:meth:`BlockPool.measure` hands them the last samples of the step, whose tokens they read from a
memory-mapped file, while the caller measures the first ones. Each block is measured by the same
code wherever it runs (:meth:`~audit.metrics.blocks.TokenBlocks.measure_spans`), so the result is
the same bits. A pool that fails (a process killed, a file that cannot be written) never fails
the pass: the caller measures those blocks itself, and the pool counts and logs it.

A pool is used only where it is made active (:func:`measuring_in`): the comparison worker does,
around its comparisons; a library caller of :func:`~audit.compare.compare_samples` starts no process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from isoaudit.audit.metrics.blocks import Request, TokenBlocks

log = logging.getLogger("isoaudit.metrics")

#: The most seconds a pool's share of a pass may take before the caller measures it itself.
TIMEOUT_S = 120.0


class BlockPool:
    """``processes`` started processes measuring token blocks (:meth:`measure`); :meth:`close`
    stops them. ``directory``: where the step's tokens are written for them (default: ``/dev/shm``
    where it exists, memory rather than disk; else the temporary directory)."""

    def __init__(self, processes: int = 1, directory: str | None = None) -> None:
        if processes < 1:
            raise ValueError(f"processes: expected at least 1, got {processes}")
        self.processes = processes
        self.directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        #: blocks its processes measured
        self.blocks = 0
        #: passes whose pool share the caller measured itself (the pool failed), and why the last did
        self.failures = 0
        self.last_failure: str | None = None
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        self._warm: Future[None] | None = None
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("forkserver")
        self._executor = ProcessPoolExecutor(self.processes, mp_context=context)
        self._warm = self._executor.submit(_import_blocks)  # the first pass pays no import

    def close(self) -> None:
        """Stop the processes (a pass under way finishes first)."""
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def measure(
        self, blocks: TokenBlocks, spans: Sequence[tuple[int, int]], todo: list[Request]
    ) -> list[list[Any]]:
        """``blocks.measure_spans(spans, todo)``, the last blocks (the pool's share of the tokens,
        ``processes / (processes + 1)``) measured by the pool's processes, the others here, at
        the same time."""
        shares = _cut(blocks.offsets, spans, self.processes + 1)
        mine = list(spans[: shares[1]])
        theirs = [list(spans[a:b]) for a, b in pairwise(shares[1:])]
        pending: list[tuple[list[tuple[int, int]], Future[list[list[Any]]] | None]] = []
        paths: list[str] = []
        try:
            for part in theirs:
                future = None
                if part:
                    future, path = self._submit(blocks, part, todo)
                    if path is not None:
                        paths.append(path)
                pending.append((part, future))
            parts = blocks.measure_spans(mine, todo)
            for part, future in pending:
                parts += self._collect(blocks, part, todo, future)
            return parts
        finally:
            for path in paths:
                _remove(path)

    def _submit(
        self, blocks: TokenBlocks, part: list[tuple[int, int]], todo: list[Request]
    ) -> tuple[Future[list[list[Any]]] | None, str | None]:
        """Write ``part``'s tokens to a file and hand them to a process (None: the pool failed)."""
        lo, hi = part[0][0], part[-1][1]
        a, b = int(blocks.offsets[lo]), int(blocks.offsets[hi])
        path = None
        try:
            with self._lock:
                if self._executor is None:
                    raise RuntimeError("the pool is closed")
                dtype = np.result_type(blocks.trainer.dtype, blocks.rollout.dtype)
                fd, path = tempfile.mkstemp(prefix="isoaudit-blocks-", dir=self.directory)
                os.close(fd)
                tokens = np.lib.format.open_memmap(path, "w+", dtype, (2, b - a))
                tokens[0] = blocks.trainer[a:b]
                tokens[1] = blocks.rollout[a:b]
                tokens.flush()
                del tokens
                offsets = blocks.offsets[lo : hi + 1] - a
                rebased = [(x - lo, y - lo) for x, y in part]
                future = self._executor.submit(
                    _measure_file, path, offsets, blocks.finite_only, blocks.all_finite, rebased, todo
                )
            return future, path
        except Exception as exc:  # noqa: BLE001 — a pool's trouble is the pool's: measured here instead
            self._failed(exc)
            self._restart()
            return None, path

    def _collect(
        self,
        blocks: TokenBlocks,
        part: list[tuple[int, int]],
        todo: list[Request],
        future: Future[list[list[Any]]] | None,
    ) -> list[list[Any]]:
        if not part:
            return []
        if future is not None:
            try:
                parts = future.result(TIMEOUT_S)
                self.blocks += len(parts)
                return parts
            except Exception as exc:  # noqa: BLE001 — a killed or stuck process: measured here
                self._failed(exc)
                self._restart()
        return blocks.measure_spans(part, todo)

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_failure = f"{type(exc).__name__}: {exc}"
        log.warning("block pool failed (%s); its blocks were measured in this process", self.last_failure)

    def _restart(self) -> None:
        """A broken pool (a process died) is replaced, so the next pass has processes again."""
        with self._lock:
            if self._executor is None:
                return
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._start()


def _cut(offsets: np.ndarray, spans: Sequence[tuple[int, int]], lanes: int) -> list[int]:
    """Span indices ``0 = c_0 <= c_1 <= ... <= c_lanes = len(spans)`` cutting the blocks into
    ``lanes`` runs of about equal tokens."""
    ends = np.array([offsets[hi] - offsets[spans[0][0]] for _, hi in spans], dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    cuts = [0]
    for lane in range(1, lanes):
        cuts.append(max(cuts[-1], int(np.searchsorted(ends, total * lane / lanes, side="left")) + 1))
    cuts = [min(c, len(spans)) for c in cuts]
    return [*cuts, len(spans)]


def _import_blocks() -> None:
    import isoaudit.audit.metrics.blocks  # noqa: F401 — warms a new process


def _measure_file(
    path: str,
    offsets: np.ndarray,
    finite_only: bool,
    all_finite: bool,
    spans: list[tuple[int, int]],
    todo: list[Request],
) -> list[list[Any]]:
    """In a pool process: the blocks ``spans`` of the tokens in ``path`` (rows trainer, rollout)."""
    from isoaudit.audit.metrics.blocks import TokenBlocks

    tokens = np.load(path, mmap_mode="r")
    blocks = TokenBlocks(tokens[0], tokens[1], offsets, finite_only=finite_only)
    blocks.__dict__["all_finite"] = all_finite  # the step's, not this share's: the same Block choices
    return blocks.measure_spans(spans, todo)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_ACTIVE: ContextVar[BlockPool | None] = ContextVar("isoaudit_block_pool", default=None)


def active_pool() -> BlockPool | None:
    """The pool :func:`measuring_in` made active here, if any."""
    return _ACTIVE.get()


@contextmanager
def measuring_in(pool: BlockPool | None) -> Iterator[None]:
    """Passes over token blocks in this context (on more than one lane) use ``pool``."""
    token = _ACTIVE.set(pool)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
