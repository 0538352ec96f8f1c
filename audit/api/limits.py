"""Request-size limit as ASGI middleware: a body over the limit answers 413 before the route runs,
whether the client announced its length or streamed it in chunks."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _detail(self) -> str:
        return f"body: larger than the limit of {self.max_body_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            # Refuse before reading a byte of it: the client is told at once.
            payload = json.dumps({"detail": self._detail()}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 413,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(payload)),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        received = 0

        async def limited_receive() -> Message:
            # A chunked body is counted as it arrives; the route's body read then fails with 413,
            # which the app's exception handling turns into the response.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, detail=self._detail())
            return message

        await self.app(scope, limited_receive, send)
