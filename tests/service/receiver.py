"""A real local HTTP receiver for webhook tests: records every POSTed JSON body and answers with the
statuses it is told to (e.g. two 500s, then 200s)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    def __init__(self, statuses: Iterable[int] = ()) -> None:
        self.messages: list[dict[str, Any]] = []
        self.attempts = 0
        self._statuses = list(statuses)
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.attempts += 1
                    status = receiver._statuses.pop(0) if receiver._statuses else 200
                    if status == 200:
                        receiver.messages.append(json.loads(body))
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hooks/slack"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def events(self) -> list[tuple[str, int]]:
        """(event, step) of each message received."""
        return [(m["isoaudit"]["event"], m["isoaudit"]["step"]) for m in self.messages]
