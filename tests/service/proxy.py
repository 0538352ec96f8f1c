"""A TCP proxy the tests control, to cut a database connection at a chosen moment (mid-batch) and to
refuse new ones until told otherwise: the network fault between the service and PostgreSQL. With
``rate_bytes_per_s`` it is also a slow link: what goes upstream is paced to that rate per
connection (a service slower than its clients send)."""

from __future__ import annotations

import socket
import threading
import time

from isoaudit.audit.api.live import free_port


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``. :meth:`cut` closes every open connection and
    refuses new ones; :meth:`cut_after` does so once ``n`` more bytes went upstream (inside a
    statement); :meth:`restore` accepts again. ``rate_bytes_per_s``: pace each connection's
    upstream bytes to this rate."""

    def __init__(
        self, upstream_host: str, upstream_port: int, *, rate_bytes_per_s: float | None = None
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rate = rate_bytes_per_s
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._refusing = False
        self._budget: int | None = None  # bytes upstream until the cut, when armed
        self.cuts = 0
        self._stopped = False
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    # ---------------------------------------------------------------- control

    def cut(self) -> None:
        with self._lock:
            self._refusing = True
            self._budget = None
            self.cuts += 1
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _close(sock)

    def cut_after(self, n_bytes: int) -> None:
        with self._lock:
            self._budget = n_bytes

    def restore(self) -> None:
        with self._lock:
            self._refusing = False

    def stop(self) -> None:
        self._stopped = True
        self.cut()
        _close(self._listener)

    # ---------------------------------------------------------------- forwarding

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
            if refusing:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, upstream_bound: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            if upstream_bound:
                with self._lock:
                    budget = self._budget
                    if budget is not None:
                        self._budget = budget - len(data)
                if budget is not None and budget - len(data) <= 0:
                    if budget > 0:  # forward what fits, then cut inside the statement
                        target.sendall(data[:budget])
                    self.cut()
                    return
            try:
                target.sendall(data)
            except OSError:
                break
            if upstream_bound and self.rate:
                time.sleep(len(data) / self.rate)
        _close(source)
        _close(target)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
