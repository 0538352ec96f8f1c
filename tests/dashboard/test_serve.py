"""``isoaudit dashboard`` serves the app over HTTP through gunicorn (``--workers`` processes), behind
basic auth when given credentials; ``--dev`` serves it with Flask's development server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.service.processes import alive, children, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def dashboard(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, http: bool = True
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """``isoaudit dashboard`` over a fresh SQLite file as its own process, once it answers HTTP
    (``http=False``: once its port accepts connections, with no request made); yields the process,
    its port and the file its output goes to. Stopped with SIGTERM."""
    port = _free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{tmp_path / 'isoaudit.db'}"
    log = tmp_path / f"dashboard-{port}.log"
    command = [sys.executable, "-m", "isoaudit.cli", "dashboard", "--database-url", url, "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, *args],
            env={"PATH": "/usr/bin:/bin", **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http:
                    httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
                else:
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except (httpx.TransportError, OSError):
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the dashboard did not start"
                time.sleep(0.3)
        yield process, port, log
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def test_the_command_serves_the_dashboard_behind_basic_auth(tmp_path):
    with dashboard(
        tmp_path, "--host", "0.0.0.0", "--workers", "1", env={"ISOAUDIT_DASHBOARD_AUTH": "ops:s3cret"}
    ) as (
        _,
        port,
        log,
    ):
        response = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
        assert response.status_code == 401
        ok = httpx.get(f"http://127.0.0.1:{port}/_dash-layout", auth=("ops", "s3cret"), timeout=5)
        assert ok.status_code == 200 and "isoaudit" in ok.text
        assert "gunicorn with 1 worker x 4 threads" in log.read_text()


def test_gunicorn_serves_with_the_workers_asked_for_and_takes_them_down(tmp_path):
    with dashboard(tmp_path, "--workers", "2", "--threads", "2") as (process, port, log):
        wait_for(lambda: len(children(process.pid)) == 2, 30, "two gunicorn workers")
        workers = children(process.pid)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=10) as http:
            # Fresh connections: the master hands each to whichever worker accepts it first.
            answers = [httpx.get(f"{base}/_dash-layout", timeout=10) for _ in range(12)]
            assert all(r.status_code == 200 and "isoaudit" in r.text for r in answers)
            assert http.get("/_dash-dependencies").status_code == 200
            assert http.get("/alerts").status_code == 200
        text = log.read_text()
        assert "Starting gunicorn" in text and text.count("Booting worker with pid") == 2
        assert "development server" not in text.lower()
    assert process.returncode == 0  # SIGTERM: a graceful stop
    wait_for(lambda: not any(alive(w) for w in workers), 10, "the workers gone with the master")


def test_dev_serves_with_flasks_development_server(tmp_path):
    with dashboard(tmp_path, "--dev") as (process, port, log):
        response = httpx.get(f"http://127.0.0.1:{port}/_dash-layout", timeout=5)
        assert response.status_code == 200 and "isoaudit" in response.text
        assert children(process.pid) == []  # one process: no gunicorn workers
        text = log.read_text()
        assert "Flask's development server (--dev)" in text and "gunicorn" not in text


def test_a_bad_database_is_said_before_anything_serves(tmp_path):
    """gunicorn would boot workers that each fail; the command says what is wrong and exits 1."""
    port = _free_port()
    done = subprocess.run(
        [sys.executable, "-m", "isoaudit.cli", "dashboard", "--port", str(port)]
        + ["--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/none"],
        env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "database: cannot open" in done.stdout, done.stdout + done.stderr


def test_a_fresh_worker_serves_concurrent_first_requests(tmp_path):
    """Dash sets itself up on its first request; without that done before serving, requests arriving
    at once on a fresh worker's threads found its scripts half registered (500, a blank page)."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    with dashboard(tmp_path / "a", "--workers", "1") as (_, port, _log):
        index = httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text
    scripts = sorted(set(re.findall(r'src="(/_dash-component-suites/[^"]+)"', index)))
    assert len(scripts) >= 5
    for attempt in range(3):
        with dashboard(tmp_path / f"b{attempt}", "--workers", "1", "--threads", "8", http=False) as (
            _,
            port,
            log,
        ):
            # The port accepts before the worker serves: these wait in the backlog, then land at once.
            with ThreadPoolExecutor(len(scripts)) as pool:
                codes = list(
                    pool.map(
                        lambda s: httpx.get(f"http://127.0.0.1:{port}{s}", timeout=60).status_code, scripts
                    )
                )
            assert codes == [200] * len(scripts), (codes, log.read_text()[-2000:])
