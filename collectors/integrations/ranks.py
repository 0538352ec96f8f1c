"""Which rank a process records as, and stamping it on the samples it sends.

A data-parallel job runs one trainer per rank (``torch.distributed``) and often one engine worker
per data-parallel rank; each opens its own :func:`isoaudit.session` for the same run. The
comparator needs no rank (both sides derive a sample's key from its tokens, so the trainer rank
that recomputed a sample need not be the engine rank that sampled it), but the service counts
samples per rank, so a rank that stopped sending shows (``GET /v1/runs/{id}/ranks``, the dashboard's
run page). The session stamps its rank on every :class:`~isoaudit.audit.records.SampleLogprobs` it sends;
manifests already carry ``host:pid/rank`` as their ``process``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from isoaudit.audit.records import Record, SampleLogprobs
from isoaudit.collectors.sinks.base import Sink

#: The variables launchers set for each rank: torchrun/torch.distributed, then Open MPI and Slurm.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def detect_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank: ``torch.distributed``'s when a process group is up, else the launcher's
    (``RANK``, ``OMPI_COMM_WORLD_RANK``, ``SLURM_PROCID``), else ``None`` (a single-process job)."""
    import sys

    torch = sys.modules.get("torch")  # never import torch for this: a process without it has no group
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    env = os.environ if environ is None else environ
    for name in RANK_VARIABLES:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def stamp_rank(sink: Sink, rank: int) -> Sink:
    """Make ``sink`` set ``rank`` on every sample record it is given that has none (the collectors of
    every side build samples; the rank is the session's, so it goes on where their records leave).
    Returns the sink."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank: expected an integer >= 0, got {rank!r}")
    send: Callable[[Sequence[Record]], None] = sink.send

    def send_with_rank(records: Sequence[Record]) -> None:
        try:
            for record in records:
                if isinstance(record, SampleLogprobs) and record.rank is None:
                    record.rank = rank
        except Exception:  # a collector must never raise into the training loop; send() counts the rest
            pass
        send(records)

    sink.send = send_with_rank  # type: ignore[method-assign]  # wraps this one sink's bound method to stamp the rank
    return sink


def rank_of(value: Any) -> int | None:
    """The rank at the end of a manifest's ``process`` (``host:pid/rank``), or None."""
    _, sep, tail = str(value).rpartition("/")
    return int(tail) if sep and tail.isdigit() else None
