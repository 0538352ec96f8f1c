"""Run the real service over real HTTP in a background thread of this process: for the demo, notebooks
and tests of the API and of its clients (the collectors' ``HttpSink``).

    server = LiveServer(create_app(store, Settings(run_worker=False)))
    url = server.start()          # http://127.0.0.1:<free port>
    ...
    server.stop()                 # the port goes quiet: clients see connection errors (an outage)
    server.start()                # the same app again, on the same port
    server.stop()

or ``url, stop = serve_in_thread(app)`` when one start is enough.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn
from fastapi import FastAPI


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread; ``start``/``stop`` as often as needed
    (the port is kept, so a restart is the same URL)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.app = app
        self.host = host
        self.port = port or free_port(host)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> str:
        """Start serving and return the base URL once ``/healthz`` answers."""
        if self._thread is not None:
            return self.url
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on port {self.port} exited during start-up")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"the server on port {self.port} did not answer /healthz within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (runs the app's shutdown); a later ``start`` reuses the port."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout)
        self._server = None
        self._thread = None

    def __enter__(self) -> LiveServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int | None = None
) -> tuple[str, Callable[[], None]]:
    """Serve ``app`` over real HTTP; return (base URL, stop function)."""
    server = LiveServer(app, host, port)
    return server.start(), server.stop
