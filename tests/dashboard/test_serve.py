"""``isoaudit dashboard`` serves the app over HTTP, behind basic auth when given credentials."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_serves_the_dashboard_behind_basic_auth(tmp_path):
    port = _free_port()
    url = f"sqlite:///{tmp_path / 'isoaudit.db'}"
    command = [sys.executable, "-m", "isoaudit.cli", "dashboard", "--database-url", url, "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--host", "0.0.0.0"],
        env={"PATH": "/usr/bin:/bin", "ISOAUDIT_DASHBOARD_AUTH": "ops:s3cret"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except httpx.TransportError:
                assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                assert time.monotonic() < deadline, "the dashboard did not start"
                time.sleep(0.3)
        assert response.status_code == 401
        ok = httpx.get(f"http://127.0.0.1:{port}/_dash-layout", auth=("ops", "s3cret"), timeout=5)
        assert ok.status_code == 200 and "isoaudit" in ok.text
    finally:
        process.terminate()
        process.wait(10)
