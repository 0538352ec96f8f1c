"""The vLLM routing capture's wire form and the driver's merge of several workers' answers (pure
numpy: what crosses ``collective_rpc`` between worker processes and the driver)."""

from __future__ import annotations

import msgpack
import numpy as np
from isoaudit.audit.records import Routes
from isoaudit.collectors.routing_vllm import merge_routes, routes_from_wire, routes_to_wire


def _routes(layers: list[int], positions: list[int], k: int, experts: int, seed: int) -> Routes:
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((len(positions), len(layers), experts)), axis=-1)[..., :k]
    return Routes(
        layers=layers,
        top_k=k,
        num_experts=experts,
        positions=np.asarray(positions, np.int32),
        experts=ids.reshape(len(positions), -1).astype(np.uint8 if experts <= 256 else np.uint16),
    )


def test_wire_round_trip_through_msgpack() -> None:
    for experts in (8, 300):
        routes = _routes([0, 2, 5], [0, 1, 2, 7], 2, experts, seed=experts)
        wire = msgpack.unpackb(msgpack.packb(routes_to_wire(routes)))  # what the RPC carries
        back = routes_from_wire(wire)
        back.check(None)
        assert back.layers == routes.layers and back.top_k == 2 and back.num_experts == experts
        assert back.experts.dtype == routes.experts.dtype
        assert np.array_equal(back.positions, routes.positions)
        assert np.array_equal(back.experts, routes.experts)


def test_pipeline_stages_join_in_layer_order_on_common_positions() -> None:
    late = _routes([2, 3], [0, 1, 2, 3], 2, 8, seed=1)
    early = _routes([0, 1], [0, 1, 2], 2, 8, seed=2)
    again = _routes([0, 1], [0, 1, 2], 2, 8, seed=3)  # another TP rank's answer: the first is kept
    merged = merge_routes([late, early, again])
    assert merged is not None
    merged.check(None)
    assert merged.layers == [0, 1, 2, 3] and merged.positions.tolist() == [0, 1, 2]
    per = merged.experts.reshape(3, 4, 2)
    assert np.array_equal(per[:, :2].reshape(3, -1), early.experts)
    assert np.array_equal(per[:, 2:].reshape(3, -1), late.experts[:3])
    assert merge_routes([early]) is early and merge_routes([]) is None
