"""A disk spool of serialized batches, kept while the destination is down and replayed in order.

Each batch is one file, written to a temporary name and renamed, so a crash leaves either a whole
batch or none. File names start with a sequence number, so replay is first-in first-out, also
across processes: a new sink over the same directory continues where the last one stopped. The
spool is bounded in bytes; a batch that would overflow it, or that the disk refuses (full, read-only),
is refused: nothing of it stays on disk, :attr:`Spool.refusal` says why, and the caller counts it
dropped and says so once (the spool itself logs nothing per batch).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(\d{16})-(\d+)-[0-9a-f]{8}\.batch$")

#: Where a service sink keeps batches while the service is down, unless told otherwise.
DEFAULT_SPOOL_DIR = Path("./isoaudit-spool")


@dataclass(frozen=True)
class SpoolEntry:
    path: Path
    seq: int
    n_records: int
    size: int = 0

    def read(self) -> bytes:
        return self.path.read_bytes()


class Spool:
    """FIFO of batch payloads in ``directory``, at most ``max_bytes`` in total."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int = 1 << 30) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be > 0, got {max_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        for stale in self.directory.glob("*.tmp"):  # half-written by a process that died
            stale.unlink(missing_ok=True)
        self._entries = sorted(self._scan(), key=lambda e: e.seq)
        self._bytes = sum(e.size for e in self._entries)
        self._next = (self._entries[-1].seq + 1) if self._entries else 0
        #: why the last refused batch was refused (``None`` until one is)
        self.refusal: str | None = None
        if self._entries:
            log.info(
                "isoaudit spool %s: %d batches left by an earlier run will be replayed",
                directory,
                len(self._entries),
            )

    def _scan(self) -> list[SpoolEntry]:
        entries = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                size = path.stat().st_size
                entries.append(SpoolEntry(path, int(match.group(1)), int(match.group(2)), size))
        return entries

    def put(self, payload: bytes, n_records: int) -> bool:
        """Append one batch; ``False`` (nothing written) when it would exceed ``max_bytes`` or the
        disk refuses it."""
        with self._lock:
            if self._bytes + len(payload) > self.max_bytes:
                self.refusal = f"over its bound of {self.max_bytes} bytes"
                return False
            seq = self._next
            self._next += 1
        name = f"{seq:016d}-{n_records}-{uuid.uuid4().hex[:8]}.batch"
        tmp = self.directory / (name + ".tmp")
        try:
            with open(tmp, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.directory / name)
        except OSError as exc:  # disk full, quota, read-only: the caller counts and says so, once
            tmp.unlink(missing_ok=True)
            self.refusal = f"cannot write to {self.directory}: {exc.strerror or exc}"
            return False
        with self._lock:
            self._entries.append(SpoolEntry(self.directory / name, seq, n_records, len(payload)))
            self._entries.sort(key=lambda e: e.seq)
            self._bytes += len(payload)
        return True

    def peek(self) -> SpoolEntry | None:
        """The oldest batch, left in place until :meth:`remove`."""
        with self._lock:
            return self._entries[0] if self._entries else None

    def peek_many(self, max_records: int, max_bytes: int) -> list[SpoolEntry]:
        """The oldest batches, in order, while they stay within ``max_records`` and ``max_bytes``
        together (the oldest always, whatever its size): one replay request."""
        with self._lock:
            out: list[SpoolEntry] = []
            records, size = 0, 0
            for entry in self._entries:
                if out and (records + entry.n_records > max_records or size + entry.size > max_bytes):
                    break
                out.append(entry)
                records, size = records + entry.n_records, size + entry.size
            return out

    def remove(self, entry: SpoolEntry) -> None:
        with self._lock:
            if entry in self._entries:
                self._entries.remove(entry)
                self._bytes -= entry.size
        entry.path.unlink(missing_ok=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def n_records(self) -> int:
        with self._lock:
            return sum(e.n_records for e in self._entries)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes
