"""Invalid records, however they were built (``model_construct`` skips pydantic), are refused one by
one through every sink: counted as ``rejected``, logged once naming the field, not stored, while the
rest of their batch is stored."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from isoaudit.audit.db import Store
from isoaudit.audit.records import SampleLogprobs
from isoaudit.collectors.sinks import DirectSink, HttpSink, MemorySink, Sink

from tests import factories

RUN = "reject-run"


def _batch() -> tuple[list, list[str], list[str]]:
    """A run, two good samples and three bad ones between them: (records, good keys, bad keys)."""
    good = [factories.sample(run_id=RUN, seed=s) for s in (1, 2)]
    base = factories.sample(run_id=RUN, seed=3)
    nan = base.logprobs.copy()
    nan[2] = np.nan
    positive = factories.sample(run_id=RUN, seed=4).logprobs.copy()
    positive[0] = 0.5
    bad = [
        SampleLogprobs.model_construct(**{**dict(base), "logprobs": nan}),
        SampleLogprobs.model_construct(
            **{**dict(factories.sample(run_id=RUN, seed=4)), "logprobs": positive}
        ),
        SampleLogprobs.model_construct(**{**dict(factories.sample(run_id=RUN, seed=5)), "prompt_len": 99}),
    ]
    records = [factories.run(RUN), good[0], *bad, good[1]]
    return records, [g.sample_key for g in good], [b.sample_key for b in bad]


def _check(sink: Sink, caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    records, good, bad = _batch()
    with caplog.at_level(logging.WARNING):
        sink.send(records)
        assert sink.flush(30)
    assert sink.counters.rejected == 3 and sink.counters.sent == len(records) - 3
    assert sink.counters.dropped == 0
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "rejected a record: logprobs" in text and "prompt_len" in text  # named, logged once per field
    assert sum("rejected a record: logprobs" in r.getMessage() for r in caplog.records) == 1
    return good, bad


def test_memory_sink_refuses_what_the_store_would(caplog: pytest.LogCaptureFixture) -> None:
    sink = MemorySink()
    good, _ = _check(sink, caplog)
    assert sorted(r.sample_key for r in sink.of_kind("sample")) == sorted(good)
    sink.close()


def test_direct_sink(database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    sink = DirectSink(database_url, project="p")
    good, _ = _check(sink, caplog)
    sink.close()
    store = Store(database_url)
    try:
        assert sorted(s.sample_key for s in store.samples(RUN, 0)) == sorted(good)  # the rest stored
    finally:
        store.dispose()


def test_http_sink(store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from isoaudit.audit.api.app import create_app
    from isoaudit.audit.api.live import LiveServer
    from isoaudit.audit.auth import create_token
    from isoaudit.audit.settings import Settings

    token = create_token(store, "p")
    server = LiveServer(create_app(store, Settings(run_worker=False, default_alert_rules=False)))
    url = server.start()
    try:
        sink = HttpSink(url, token, spool_dir=tmp_path / "spool")
        good, _ = _check(sink, caplog)
        sink.close()
        assert sorted(s.sample_key for s in store.samples(RUN, 0)) == sorted(good)
    finally:
        server.stop()
