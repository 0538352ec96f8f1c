"""``GET /v1/runs/{id}/environment-diff``: the planted library and backend change between two runs
over HTTP, scoped to the caller's project like every read."""

from __future__ import annotations

import httpx
from isoaudit.audit.db import Store

from tests.audit.environment_records import BASE_ATTENTION, PLANTED_ATTENTION, PLANTED_VLLM, planted_runs


def test_the_planted_change_over_http(store: Store, api: httpx.Client, other_token: str) -> None:
    planted_runs(store, project="alpha")
    body = api.get("/v1/runs/env-b/environment-diff", params={"against": "env-a@0"}).json()
    rollout = next(d for d in body["diffs"] if d["title"] == "rollout")
    assert {
        "group": "versions",
        "key": "vllm",
        "old": PLANTED_VLLM,
        "new": rollout["changes"]["versions"][0]["new"],
    } in rollout["changes"]["versions"]
    assert {
        "group": "backends",
        "key": "attention",
        "old": PLANTED_ATTENTION,
        "new": BASE_ATTENTION,
    } in rollout["changes"]["backends"]
    assert body["n_changes"] == 2
    sides = api.get("/v1/runs/env-b/environment-diff", params={"sides": True, "step": 0}).json()
    assert sides["diffs"][0]["title"] == "trainer → rollout" and sides["n_changes"] >= 3
    assert api.get("/v1/runs/env-b/environment-diff", params={"against": "env-a@x"}).status_code == 422
    missing = api.get("/v1/runs/env-b/environment-diff", params={"step": 9})
    assert missing.status_code == 404 and missing.json()["detail"].startswith("step: ")
    with httpx.Client(
        base_url=str(api.base_url), headers={"Authorization": f"Bearer {other_token}"}
    ) as other:
        assert other.get("/v1/runs/env-b/environment-diff").status_code == 404  # another project's run
    unknown = api.get("/v1/runs/env-b/environment-diff", params={"against": "nope"})
    assert unknown.status_code == 404 and unknown.json()["detail"].startswith("against: ")
    no_step = api.get("/v1/runs/env-b/environment-diff", params={"against": "env-b@9"})
    assert no_step.status_code == 404 and no_step.json()["detail"].startswith("against: ")
