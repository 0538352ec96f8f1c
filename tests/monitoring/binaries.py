"""Debian's real ``prometheus`` and ``prometheus-alertmanager`` as plain child processes on 127.0.0.1
(free ports, a data directory of the test's own), for the monitoring tests. ``make test`` installs
them (``make system-deps``); elsewhere the tests that need them skip, naming the missing binary."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from isoaudit.audit.api.live import free_port

PROMETHEUS = "prometheus"
PROMTOOL = "promtool"
ALERTMANAGER = "prometheus-alertmanager"
AMTOOL = "amtool"


def binary(name: str) -> str:
    """The path of a Debian monitoring binary, or skip the test naming the package to install."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(
            f"{name} is not installed (make system-deps installs prometheus, prometheus-alertmanager)"
        )
    return path


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``promtool ARGS`` (``check metrics`` reads ``stdin``); the caller checks ``returncode``."""
    return subprocess.run(
        [binary(PROMTOOL), *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    """``amtool ARGS`` (Alertmanager's own checker, shipped with it); the caller checks ``returncode``."""
    return subprocess.run([binary(AMTOOL), *args], capture_output=True, text=True, timeout=60, check=False)


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready within {timeout}s:\n{log.read_text()[-4000:]}")


@contextmanager
def _process(args: list[str], ready_url: str, workdir: Path, name: str) -> Iterator[None]:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        _wait_ready(ready_url, process, log)
        yield
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


class Alertmanager:
    """A running Alertmanager: ``url`` (its base URL) and ``alerts()`` (what it holds, API v2)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts``; ``filters`` as label matchers (``alertname="kl"``)."""
        params = [("filter", f'{k}="{v}"') for k, v in filters.items()]
        response = httpx.get(f"{self.url}/api/v2/alerts", params=params, timeout=5.0)
        response.raise_for_status()
        return list(response.json())


@contextmanager
def alertmanager(
    workdir: Path, config: dict[str, Any] | None = None, *, port: int | None = None, cluster: bool = True
) -> Iterator[Alertmanager]:
    """Alertmanager on ``port`` (default: a free one), its state in ``workdir``; ``config`` defaults
    to one receiver that does nothing (alerts are read back through the API), grouped and repeated
    quickly for tests. ``cluster=False`` runs it alone: a clustered one holds its notifications until
    gossip settles (several seconds), a lone one notifies its receivers at once."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = config or {
        "route": {
            "receiver": "null",
            "group_wait": "1s",
            "group_interval": "1s",
            "repeat_interval": "1m",
        },
        "receivers": [{"name": "null"}],
    }
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port, cluster_port = port or free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        binary(ALERTMANAGER),
        f"--config.file={workdir / 'alertmanager.yml'}",
        f"--storage.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--cluster.listen-address=127.0.0.1:{cluster_port}" if cluster else "--cluster.listen-address=",
    ]
    if cluster:
        args.append(f"--cluster.advertise-address=127.0.0.1:{cluster_port}")
    with _process(args, f"{url}/-/ready", workdir, "alertmanager"):
        yield Alertmanager(url)


class Prometheus:
    """A running Prometheus: ``url``, ``query(expr)`` (instant query, the result vector) and
    ``wait_for(expr)`` (until the query returns data)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10.0)
        response.raise_for_status()
        body = response.json()
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.2)

    def targets(self) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/targets", timeout=10.0)
        response.raise_for_status()
        return list(response.json()["data"]["activeTargets"])


@contextmanager
def prometheus(
    workdir: Path, config: dict[str, Any], rule_files: Sequence[Path] = ()
) -> Iterator[Prometheus]:
    """Prometheus on a free port with ``config`` (``rule_files`` are copied beside it and listed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if rule_files:
        names = []
        for path in rule_files:
            shutil.copy(path, workdir / path.name)
            names.append(path.name)
        config["rule_files"] = names
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        binary(PROMETHEUS),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with _process(args, f"{url}/-/ready", workdir, "prometheus"):
        yield Prometheus(url)
