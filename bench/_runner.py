"""What the benches that load a running service share: clients as threads for a fixed window, and
the service's processes stopped after it."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterable


def run_clients(
    client: Callable[[int], None], clients: int, seconds: float, stop: threading.Event, *, join_s: float
) -> float:
    """Run ``client(i)`` for each of ``clients`` in a thread of its own for ``seconds``, then set
    ``stop`` (the clients' cue to finish) and wait up to ``join_s`` for each. Returns the seconds from
    the first start to the last join: the window the clients' work is measured over."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(join_s)
    return time.monotonic() - started


def stop_processes(processes: Iterable[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM each process (a service or worker the bench started) and wait up to ``timeout_s`` for it."""
    for process in processes:
        process.terminate()
        process.wait(timeout_s)
