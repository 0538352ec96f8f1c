"""Read back what W&B wrote in offline mode: the run directory's ``.wandb`` file.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic, version), then LevelDB-log
records in 32 KiB blocks (each chunk: CRC32, length, type full/first/middle/last), each record a
``wandb.proto.wandb_internal_pb2.Record``. The installed wandb ships no Python reader of it (its
core writes and syncs it), so this one follows the format and parses each record with wandb's own
protobuf classes: what `wandb sync` would upload, read as it was written.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """Every record of a ``.wandb`` file, in order, as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _magic, _version = HEADER.unpack_from(data)
    assert ident == b":W&B", f"{path}: not a W&B transaction log"
    pos, pending = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if (crc, length, kind) == (0, 0, 0):  # zero padding up to the next block
            pos += left
            continue
        chunk = data[pos + CHUNK.size : pos + CHUNK.size + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}: bad checksum at {pos}"
        pos += CHUNK.size + length
        if kind == FULL:
            pending = chunk
        elif kind == FIRST:
            pending = chunk
            continue
        elif kind == MIDDLE:
            pending += chunk
            continue
        else:
            pending += chunk
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        yield record


@dataclass
class OfflineRun:
    """What the offline run directories of one W&B run id hold, in the order written."""

    run_id: str
    rows: list[dict[str, Any]] = field(default_factory=list)  # history rows, values decoded from JSON
    alerts: list[dict[str, str]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # define_metric records
    config: dict[str, Any] = field(default_factory=dict)
    directories: int = 0

    def isoaudit_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if "isoaudit/step" in row]


def offline_run(wandb_dir: Path, run_id: str) -> OfflineRun:
    """Every record W&B wrote offline for ``run_id`` under ``wandb_dir`` (a resumed run has a
    directory per process that wrote it)."""
    run = OfflineRun(run_id)
    for directory in sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}")):
        run.directories += 1
        for record in records(directory / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                run.rows.append({_key(item): json.loads(item.value_json) for item in record.history.item})
            elif kind == "alert":
                a = record.alert
                run.alerts.append({"title": a.title, "text": a.text, "level": a.level})
            elif kind == "metric":
                m = record.metric
                run.metrics.append({"name": m.name, "glob_name": m.glob_name, "step_metric": m.step_metric})
            elif kind in ("run", "config"):
                update = record.run.config.update if kind == "run" else record.config.update
                for item in update:
                    run.config[_key(item)] = json.loads(item.value_json)
    return run


def _key(item: Any) -> str:
    """A history or config item's name (W&B keeps a name in ``key`` or, split at nesting, in ``nested_key``)."""
    return item.key or ".".join(item.nested_key)
