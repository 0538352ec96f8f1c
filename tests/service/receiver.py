"""A real local HTTP receiver for webhook tests: records every POSTed JSON body and answers with the
statuses it is told to (e.g. two 500s, then 200s). :meth:`Receiver.hang` makes it a slow endpoint
(requests get no answer until :meth:`Receiver.answer`); closing it and opening another on the same
``port`` makes an endpoint that is down, then back."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    def __init__(self, statuses: Iterable[int] = (), *, port: int = 0) -> None:
        self.messages: list[dict[str, Any]] = []
        self.attempts = 0
        self.hung = 0  # requests that got no answer (while hanging)
        self._hanging = False
        self._released = threading.Event()
        self._statuses = list(statuses)
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.attempts += 1
                    hanging = receiver._hanging
                    receiver.hung += hanging
                if hanging:  # no answer, nothing recorded: the client times out or is cut off
                    receiver._released.wait(120)
                    self.close_connection = True
                    return
                with receiver._lock:
                    status = receiver._statuses.pop(0) if receiver._statuses else 200
                    if status == 200:
                        receiver.messages.append(json.loads(body))
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hooks/slack"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def hang(self) -> None:
        """From now on, hold every request open without answering (a slow or stuck endpoint)."""
        with self._lock:
            self._released.clear()
            self._hanging = True

    def answer(self) -> None:
        """Cut the held requests off (no answer) and answer the next ones again."""
        with self._lock:
            self._hanging = False
            self._released.set()

    def __exit__(self, *exc: object) -> None:
        self.answer()
        self._server.shutdown()
        self._server.server_close()

    def events(self) -> list[tuple[str, int]]:
        """(event, step) of each message received."""
        return [(m["isoaudit"]["event"], m["isoaudit"]["step"]) for m in self.messages]
