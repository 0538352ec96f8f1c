"""Processes that measure some of a step's token blocks beside the calling thread (DESIGN.md,
"Metrics"; docs/scale.md, "Comparison").

A pass over a step's blocks is a few hundred numpy calls per block, each on about 64k tokens, with
Python between them: threads of one process take turns on the interpreter lock at every call, so a
second thread does not shorten the pass. A second *process* does. :class:`BlockPool` keeps
``processes`` of them started; :meth:`BlockPool.measure` hands them the last samples of the step,
whose tokens they read from a memory-mapped file, while the caller measures the first ones. Each
block is measured by the same code wherever it runs
(:meth:`~audit.metrics.blocks.TokenBlocks.measure_spans`), so the result is the same bits.

The processes are plain ``python -c`` children importing this module alone, talking over a pipe
each (:class:`multiprocessing.connection.Connection`): ``multiprocessing``'s own spawn and
forkserver start methods import the caller's ``__main__`` script in every child, which inside a
user's training script (the embedded worker runs there) would run the script again. A child exits
when its pipe closes (its parent gone). A pool that fails (a process killed, stuck or busy, a file
that cannot be written) never fails the pass: the caller measures those blocks itself, and the pool
counts and logs it, then starts a fresh process.

A pool is used only where it is made active (:func:`measuring_in`): the comparison worker does,
around its comparisons; a library caller of :func:`~audit.compare.compare_samples` starts no process.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import pairwise
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from isoaudit.audit.metrics.blocks import Request, TokenBlocks

log = logging.getLogger("isoaudit.metrics")

#: The most seconds a process's share of a pass may take before the caller measures it itself.
TIMEOUT_S = 120.0
#: The parent's ``sys.path``, handed to a child so that it imports the same isoaudit.
_PATH_ENV = "ISOAUDIT_BLOCK_POOL_PATH"


class _Child:
    """One measuring process and its two pipe ends."""

    def __init__(self) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        code = (
            "import json, os, sys; sys.path[:0] = json.loads(os.environ.pop('ISOAUDIT_BLOCK_POOL_PATH')); "
            f"from isoaudit.audit.metrics.block_pool import serve; serve({to_child}, {from_child})"
        )
        env = {**os.environ, _PATH_ENV: json.dumps([p for p in sys.path if p])}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code],
                pass_fds=(to_child, from_child),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(to_child)
            os.close(from_child)
        self.send = Connection(from_parent, readable=False)
        self.receive = Connection(to_parent, writable=False)
        self.lock = threading.Lock()  # one job at a time
        #: the tokens handed over, rows trainer and rollout, a memory-mapped file both processes keep
        #: mapped (grown when a share outgrows it): a fresh file a pass cost its page faults each time
        self.tokens: np.memmap | None = None
        #: the file's path while it is still on disk (removed once the child has it mapped)
        self.path: str | None = None

    def buffer(self, directory: str, dtype: np.dtype, n: int) -> np.memmap:
        """The shared tokens, room for ``n`` a row of ``dtype``."""
        if self.tokens is None or self.tokens.dtype != dtype or self.tokens.shape[1] < n:
            self._unlink()
            capacity = max(n + n // 4, 1)
            fd, path = tempfile.mkstemp(prefix="isoaudit-blocks-", dir=directory)
            try:
                # reserved, not only sized: a page of a sparse file that a full /dev/shm cannot back
                # would kill this process with SIGBUS when written; a full one fails here instead
                _reserve(fd, 2 * capacity * dtype.itemsize)
            except OSError:
                os.close(fd)
                _remove(path)
                raise
            os.close(fd)
            self.path = path
            self.tokens = np.memmap(path, dtype, "r+", shape=(2, capacity))
        return self.tokens

    def mapped(self) -> None:
        """The child answered: it has the file mapped, so the path can go (no file outlives both)."""
        self._unlink()

    def _unlink(self) -> None:
        if self.path is not None:
            _remove(self.path)
            self.path = None

    def close(self) -> None:
        self._unlink()
        self.tokens = None
        for end in (self.send, self.receive):
            end.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


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
        #: the caller's share of a pass's tokens (the processes share the rest), balanced pass by pass
        self.caller_share = 1 / (processes + 1)
        #: shares of a pass the caller measured itself (a process failed or was busy), and why the last
        self.failures = 0
        self.last_failure: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._children: list[_Child | None] = [None] * processes
        for i in range(processes):
            self._children[i] = self._start()

    def _start(self) -> _Child | None:
        try:
            return _Child()
        except OSError as exc:
            self._failed(exc)
            return None

    @property
    def pids(self) -> list[int]:
        """The processes' ids (those running)."""
        return [c.process.pid for c in self._children if c is not None]

    def close(self) -> None:
        """Stop the processes (a pass under way finishes its share first)."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, [None] * self.processes
        for child in children:
            if child is not None:
                with child.lock:
                    child.close()

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def measure(
        self, blocks: TokenBlocks, spans: Sequence[tuple[int, int]], todo: list[Request]
    ) -> list[list[Any]]:
        """``blocks.measure_spans(spans, todo)``, the last blocks measured by the pool's processes,
        the first ones here, at the same time. The caller's share of the tokens
        (:attr:`caller_share`) follows the lanes' speeds in the passes before: a caller that also
        reads the fingerprints on a thread measures fewer tokens a second than a process."""
        shares = _cut(blocks.offsets, spans, self.caller_share, self.processes)
        mine = list(spans[: shares[1]])
        theirs = [list(spans[a:b]) for a, b in pairwise(shares[1:])]
        sent: list[tuple[list[tuple[int, int]], int | None]] = []
        try:
            for i, part in enumerate(theirs):
                sent.append((part, i if part and self._send(i, blocks, part, todo) else None))
            started = time.perf_counter()
            parts = blocks.measure_spans(mine, todo)
            here = time.perf_counter() - started
            elsewhere: list[float] = []
            while sent:
                part, index = sent.pop(0)
                parts += self._receive(index, blocks, part, todo, elsewhere)
            self._balance(_tokens(blocks, mine), here, [_tokens(blocks, p) for p in theirs], elsewhere)
            return parts
        finally:
            for _, index in sent:  # an error here before their answers came: those processes are replaced
                if index is not None:
                    child = self._children[index]
                    if child is not None:
                        child.lock.release()
                        self._replace(index, child, RuntimeError("the pass stopped before its answer came"))

    def _balance(self, mine: int, here: float, theirs: list[int], elsewhere: list[float]) -> None:
        """Move :attr:`caller_share` halfway to the share that would have ended every lane of this
        pass at once, from each lane's tokens a second (a pass with a failed process says nothing)."""
        if len(elsewhere) != len(theirs) or not mine or here <= 0 or any(t <= 0 for t in elsewhere):
            return
        rate_here = mine / here
        rates = [n / t for n, t in zip(theirs, elsewhere, strict=True) if n]
        if not rates:
            return
        balanced = rate_here / (rate_here + sum(rates) / len(rates) * self.processes)
        self.caller_share = min(0.9, max(0.1, (self.caller_share + balanced) / 2))

    def _send(self, i: int, blocks: TokenBlocks, part: list[tuple[int, int]], todo: list[Request]) -> bool:
        """Write ``part``'s tokens where process ``i`` reads them and hand it the blocks; False: it
        cannot take them (closed, failed or busy with another caller's pass), they are measured here."""
        with self._lock:
            child = None if self._closed else self._children[i]
            if child is None and not self._closed:
                child = self._children[i] = self._start()
        if child is None or not child.lock.acquire(blocking=False):
            self._failed(RuntimeError("the pool is closed" if self._closed else f"process {i} is not free"))
            return False
        lo, hi = part[0][0], part[-1][1]
        a, b = int(blocks.offsets[lo]), int(blocks.offsets[hi])
        try:
            tokens = child.buffer(self.directory, np.result_type(blocks.trainer, blocks.rollout), b - a)
        except OSError as exc:  # no room for the tokens (a full /dev/shm): the process is fine
            child.lock.release()
            self._failed(exc)
            return False
        try:
            tokens[0, : b - a] = blocks.trainer[a:b]
            tokens[1, : b - a] = blocks.rollout[a:b]
            offsets = blocks.offsets[lo : hi + 1] - a
            rebased = [(x - lo, y - lo) for x, y in part]
            where = (child.path, tokens.dtype.str, tokens.shape[1], b - a)
            child.send.send(
                ("measure", (where, offsets, blocks.finite_only, blocks.all_finite, rebased, todo))
            )
            return True
        except Exception as exc:  # noqa: BLE001 — a pool's trouble is the pool's: measured here instead
            child.lock.release()
            self._replace(i, child, exc)
            return False

    def _receive(
        self,
        i: int | None,
        blocks: TokenBlocks,
        part: list[tuple[int, int]],
        todo: list[Request],
        seconds: list[float],
    ) -> list[list[Any]]:
        """Process ``i``'s answer for ``part`` (its seconds appended to ``seconds``), or ``part``
        measured here if it failed."""
        if not part:
            return []
        if i is not None:
            child = self._children[i]
            assert child is not None  # set when sent, replaced only under its lock
            try:
                if not child.receive.poll(TIMEOUT_S):
                    raise TimeoutError(f"process {i} took over {TIMEOUT_S:.0f} s")
                status, value = child.receive.recv()
                if status != "ok":
                    raise RuntimeError(f"process {i}: {value}")
                parts, took, count = value
                child.mapped()
                self.blocks += count
                seconds.append(took)
                child.lock.release()
                return list(parts)
            except Exception as exc:  # noqa: BLE001 — a killed or stuck process: measured here
                child.lock.release()
                self._replace(i, child, exc)
        return blocks.measure_spans(part, todo)

    def _replace(self, i: int, child: _Child, exc: BaseException) -> None:
        """Process ``i`` failed: counted, stopped, and a fresh one started for the next pass."""
        self._failed(exc)
        with child.lock:
            child.process.kill()
            child.close()
        with self._lock:
            if self._children[i] is child:
                self._children[i] = None if self._closed else self._start()

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_failure = f"{type(exc).__name__}: {exc}"
        log.warning("block pool: %s; those blocks were measured in this process", self.last_failure)


def _cut(offsets: np.ndarray, spans: Sequence[tuple[int, int]], first: float, others: int) -> list[int]:
    """Span indices ``0 = c_0 <= c_1 <= ... <= c_(others+1) = len(spans)`` cutting the blocks into a
    first run of about ``first`` of the tokens and ``others`` runs sharing the rest equally."""
    ends = np.array([offsets[hi] - offsets[spans[0][0]] for _, hi in spans], dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    bounds = [first + (1 - first) * k / others for k in range(others)]
    cuts = [0]
    for bound in bounds:
        cuts.append(max(cuts[-1], int(np.searchsorted(ends, total * bound, side="left")) + 1))
    cuts = [min(c, len(spans)) for c in cuts]
    return [*cuts, len(spans)]


def _tokens(blocks: TokenBlocks, part: list[tuple[int, int]]) -> int:
    return int(blocks.offsets[part[-1][1]] - blocks.offsets[part[0][0]]) if part else 0


def serve(receive_fd: int, send_fd: int) -> None:
    """A pool process's loop: each job's blocks measured and sent back, until the pipe closes."""
    from isoaudit.audit.metrics.blocks import TokenBlocks, merge_parts

    receive = Connection(receive_fd, writable=False)
    send = Connection(send_fd, readable=False)
    mapped: tuple[str | None, np.memmap | None] = (None, None)
    while True:
        try:
            kind, job = receive.recv()
        except (EOFError, OSError):  # the parent closed the pool or is gone
            return
        if kind != "measure":
            continue
        (path, dtype, capacity, n), offsets, finite_only, all_finite, spans, todo = job
        try:
            if path is not None and path != mapped[0]:  # a new file (the first, or a larger one)
                mapped = (path, np.memmap(path, np.dtype(dtype), "r", shape=(2, capacity)))
            tokens = mapped[1]
            assert tokens is not None, "no tokens were handed over"
            started = time.perf_counter()
            blocks = TokenBlocks(tokens[0, :n], tokens[1, :n], offsets, finite_only=finite_only)
            blocks.__dict__["all_finite"] = all_finite  # the step's, not this share's: the same choices
            parts = merge_parts(blocks.measure_spans(spans, todo))  # one array a request to send
            reply: tuple[str, Any] = ("ok", (parts, time.perf_counter() - started, len(spans)))
            del blocks
        except Exception as exc:  # noqa: BLE001 — reported to the parent, which measures it itself
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            send.send(reply)
        except (BrokenPipeError, OSError):
            return


def _reserve(fd: int, size: int) -> None:
    """The file ``fd`` made ``size`` bytes with its space allocated (ENOSPC raised where there is
    none), where the platform can; else sized, after a check of the free space."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
        return
    free = os.fstatvfs(fd)
    if free.f_bavail * free.f_frsize < size:
        raise OSError(errno.ENOSPC, f"{size} bytes for the tokens do not fit in the pool's directory")
    os.ftruncate(fd, size)


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
