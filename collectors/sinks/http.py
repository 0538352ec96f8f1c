"""Records to the isoaudit service: ``POST {url}/v1/ingest`` with a bearer token.

The reply carries the run's desired remediation mode (``control``), handed to ``on_control`` (the
session's :class:`isoaudit.collectors.control.ServiceControl`), and the records it refused one by one
(``rejected``), counted here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Unpack

import httpx
from isoaudit.collectors.control import Control, service_base
from isoaudit.collectors.sinks.base import DeliveryError, Sink, SinkOptions, _Item
from isoaudit.collectors.sinks.spool import DEFAULT_SPOOL_DIR

#: Statuses worth retrying: the request may succeed later unchanged.
_RETRY_STATUSES = {408, 425, 429, 500, 502, 503, 504}


def ingest_url(url: str) -> str:
    """The ingest endpoint of a service base URL (given with or without ``/v1/ingest``)."""
    return f"{service_base(url)}/v1/ingest"


class HttpSink(Sink):
    """Posts batches from a background thread; spools to ``spool_dir`` while the service is down.

    ``token``: a bearer token (``isoaudit tokens create --project NAME``). ``spool_dir=None`` turns
    the spool off (records are then dropped, counted, after the retries). ``timeout``: seconds per
    request.
    """

    _wire = True

    def __init__(
        self,
        url: str,
        token: str,
        *,
        spool_dir: str | Path | None = DEFAULT_SPOOL_DIR,
        timeout: float = 10.0,
        **options: Unpack[SinkOptions],
    ) -> None:
        if not token:
            raise ValueError("token: empty; create one with `isoaudit tokens create --project NAME`")
        self.url = ingest_url(url)
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._client = httpx.Client(timeout=timeout)
        options.setdefault("name", "http-sink")
        super().__init__(spool_dir=spool_dir, **options)

    def _deliver(self, item: _Item) -> int:
        try:
            response = self._client.post(self.url, content=item.payload, headers=self._headers)
        except httpx.HTTPError as exc:  # connection refused, reset, timeout, ...
            raise DeliveryError(f"{type(exc).__name__}: {exc}", retry=True) from exc
        if response.status_code == 413:
            raise DeliveryError("413: batch over the service's body limit", retry=False, too_large=True)
        if response.status_code in _RETRY_STATUSES:
            raise DeliveryError(f"{response.status_code}: {response.text[:200]}", retry=True)
        if response.status_code >= 400:
            raise DeliveryError(f"{response.status_code}: {response.text[:500]}", retry=False)
        try:
            body = response.json()
        except json.JSONDecodeError:
            return 0
        self._add("duplicates", sum((body.get("duplicates") or {}).values()))
        control = body.get("control")
        if isinstance(control, dict) and "mode" in control:
            self._control(Control.model_validate({"version": 0, **control}))
        rejected = body.get("rejected") or ()
        return self._rejected(rejected, item.records if rejected else ())

    def _close_destination(self) -> None:
        self._client.close()
