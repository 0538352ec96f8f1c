"""The boundary's validation of a sample with MoE routes against the same sample without them, for
the code of a git revision (default ``cb822db``: before the routes check was made cheap) and the
working tree's, in one run on the same records, taking turns (best of ``--rounds``).

Three ways a record arrives: ``constructed`` (``model_construct`` then ``validate_record``, as
``Store.ingest`` gets collectors' records), ``dict`` (``validate_record`` of the JSON-mode dict, as
the HTTP ingest hands it on) and ``json`` (``model_validate_json`` of the body text). Shapes:
realistic (1,024 tokens, 48 MoE layers, top-8 of 128) and tiny (64 tokens, 2 layers, top-2 of 8).
Also the floors: what merely touching the route bytes costs (one reduction, the transposing copy
the distinct-ids check needs, decoding the ids' base64).

    python -m bench.records [--revision cb822db] [--rounds 7]
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import isoaudit.audit.records as current
import numpy as np
from isoaudit.audit.arrays import b64decode

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"realistic": (1024, 48, 8, 128), "tiny": (64, 2, 2, 8)}


def load_revision(revision: str) -> types.ModuleType:
    """``audit/records.py`` and ``audit/arrays.py`` of ``revision`` as modules of their own (the old
    records importing the old arrays), beside the working tree's."""
    sources = {
        path: subprocess.run(
            ["git", "show", f"{revision}:audit/{path}.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for path in ("arrays", "records")
    }
    modules = {}
    for path in ("arrays", "records"):
        name = f"_bench_{revision}_{path}"
        source = re.sub(
            r"from (isoaudit\.)?audit\.arrays import", f"from _bench_{revision}_arrays import", sources[path]
        )
        spec = importlib.util.spec_from_loader(name, loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        exec(compile(source, f"{revision}:audit/{path}.py", "exec"), module.__dict__)  # noqa: S102
        modules[path] = module
    return modules["records"]


def records(module: types.ModuleType, shape: tuple[int, int, int, int]) -> dict[str, Any]:
    """The same sample with and without routes, built by ``module``'s classes, on each arrival path."""
    tokens, layers, top_k, experts = shape
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((tokens * layers, experts)), axis=1)[:, :top_k].astype(np.uint8)
    fields = {
        "run_id": "bench",
        "step": 0,
        "side": "trainer",
        "prompt_len": tokens // 4,
        "token_ids": rng.integers(0, 150_000, tokens, dtype=np.int32),
        "logprobs": -rng.exponential(1.0, tokens - tokens // 4).astype(np.float32),
    }
    routes = module.Routes.model_construct(
        layers=list(range(layers)),
        top_k=top_k,
        num_experts=experts,
        positions=np.arange(tokens, dtype=np.int32),
        experts=ids.reshape(tokens, layers * top_k),
        replayed=None,
    )
    out: dict[str, Any] = {}
    for name, extra in (("without", {}), ("with", {"routes": routes})):
        constructed = module.SampleLogprobs.model_construct(**fields, **extra)
        out[name] = {
            "constructed": constructed,
            "dict": constructed.model_dump(mode="json"),
            "json": constructed.model_dump_json(),
        }
    return out


def actions(module: types.ModuleType, data: dict[str, Any]) -> dict[tuple[str, str], Callable[[], Any]]:
    validate, model = module.validate_record, module.SampleLogprobs
    out: dict[tuple[str, str], Callable[[], Any]] = {}
    for routed in ("without", "with"):
        d = data[routed]
        out[("constructed", routed)] = lambda r=d["constructed"]: validate(r)
        out[("dict", routed)] = lambda r=d["dict"]: validate(r)
        out[("json", routed)] = lambda r=d["json"]: model.model_validate_json(r)
    return out


def per_call_us(action: Callable[[], Any], budget_s: float = 0.05) -> float:
    action()
    start, n = time.perf_counter(), 0
    while (elapsed := time.perf_counter() - start) < budget_s:
        action()
        n += 1
    return elapsed / max(n, 1) * 1e6


def floors(shape: tuple[int, int, int, int]) -> dict[str, Callable[[], Any]]:
    tokens, layers, top_k, experts = shape
    ids = np.random.default_rng(1).integers(0, experts, (tokens * layers, top_k), dtype=np.uint8)
    text = base64.b64encode(ids.tobytes()).decode()
    return {
        "one max over the ids": lambda: np.maximum.reduce(ids, axis=None),
        "copying the ids (what storing them costs)": lambda: ids.tobytes(),
        "transposing copy (slot planes)": lambda: np.ascontiguousarray(ids.T),
        "base64 of the ids (stdlib)": lambda: base64.b64decode(text, validate=True),
        "base64 of the ids (isoaudit.audit.arrays)": lambda: b64decode(text),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--revision", default="cb822db")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    old = load_revision(args.revision)
    for shape_name, shape in SHAPES.items():
        versions = {
            args.revision: actions(old, records(old, shape)),
            "now": actions(current, records(current, shape)),
        }
        best: dict[tuple[str, str, str], float] = {}
        for _ in range(args.rounds):  # take turns: old and new see the same machine load
            for version, acts in versions.items():
                for key, action in acts.items():
                    t = per_call_us(action)
                    best[(version, *key)] = min(best.get((version, *key), float("inf")), t)
        t, layers, k, e = shape
        print(
            f"\n{shape_name}: {t} tokens, {layers} MoE layers, top-{k} of {e} (best of {args.rounds}, us a record)"
        )
        print(f"{'path':<12} {'version':<9} {'without':>9} {'with':>10} {'with/without':>13}")
        for path in ("constructed", "dict", "json"):
            for version in versions:
                a, b = best[(version, path, "without")], best[(version, path, "with")]
                print(f"{path:<12} {version:<9} {a:9.1f} {b:10.1f} {b / a:12.1f}x")
            gain = best[(args.revision, path, "with")] / best[("now", path, "with")]
            print(f"{'':<12} {'':<9} with routes: {args.revision} / now = {gain:.1f}x")
        print("floors (us):", ", ".join(f"{n} {per_call_us(f):.1f}" for n, f in floors(shape).items()))


if __name__ == "__main__":
    main()
