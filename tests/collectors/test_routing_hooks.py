"""The collectors' public hook API that routing recorders ride on (``Collector.before_send``,
``on_detach``, ``add_runtime_facts``), on a real trainer collector and a shared sink."""

from __future__ import annotations

from collections.abc import Sequence

import isoaudit.collectors.trainer as trainer
from isoaudit.audit.records import Record
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model


def test_hooks_on_a_shared_sink_come_and_go_in_any_order(tmp_path) -> None:
    path = make_tiny_model("qwen3", tmp_path / "m", num_layers=1, hidden=32, heads=2, kv_heads=1)
    sink = MemorySink()
    a = trainer.attach(load_tiny_model(path)[0], run="hooks", sink=sink, async_transfer=False)
    b = trainer.attach(load_tiny_model(path)[0], run="hooks", sink=sink, async_transfer=False)
    seen: list[str] = []

    def hook(name: str):
        def fn(records: Sequence[Record]) -> None:
            seen.append(name)

        return fn

    remove_a = a.before_send(hook("a"))
    b.before_send(hook("b"))
    a.publish()
    a.weights_changed(1)
    assert seen == ["a", "b"]
    remove_a()
    remove_a()  # idempotent
    b.weights_changed(1)
    assert seen == ["a", "b", "b"]
    order: list[str] = []
    b.on_detach(lambda: order.append("first registered"))
    b.on_detach(lambda: order.append("last registered"))
    b.detach()
    assert order == ["last registered", "first registered"]
    assert "send" not in vars(sink)  # the sink's own method again
    facts = {"router_replay": "off"}
    a.add_runtime_facts(lambda: dict(facts))
    a.publish()
    assert a.manifest.runtime.router_replay == "off"
    facts["router_replay"] = "verl"
    a.publish()  # a changed fact is a new manifest
    assert a.manifest.runtime.router_replay == "verl"
    a.detach()
