"""``isoaudit serve`` (the API with its supervised comparison worker) and ``isoaudit worker``."""

from __future__ import annotations

import gc
import signal
from typing import Annotated

import typer

from isoaudit.cli.common import (
    AlertmanagerOption,
    DatabaseOption,
    RulesOption,
    WebhookOption,
    console,
    open_store,
)

app = typer.Typer()


@app.command("serve")
def serve(
    database: DatabaseOption = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    open_reads: Annotated[
        bool,
        typer.Option(
            "--open-reads", help="Let GET endpoints answer without a token (ingest always needs one)."
        ),
    ] = False,
    rules: RulesOption = None,
    webhook: WebhookOption = None,
    alertmanager: AlertmanagerOption = None,
    no_worker: Annotated[
        bool, typer.Option("--no-worker", help="Do not run the comparison worker here.")
    ] = False,
    worker_thread: Annotated[
        bool,
        typer.Option(
            "--worker-thread",
            help="Run the comparison worker as a thread of the API process instead of a child process "
            "(it then shares the GIL with request handling: slower under load; for comparison).",
        ),
    ] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the ingest, query and control API (FastAPI under uvicorn) and, unless --no-worker, the
    comparison worker with alert evaluation as a child process it supervises: restarted if it
    exits, stopped with the API, killed by the kernel if the API dies."""
    import uvicorn

    from isoaudit.audit.alerts.setup import install_configured_rules
    from isoaudit.audit.api import create_app
    from isoaudit.audit.settings import Settings
    from isoaudit.audit.worker import WorkerProcess

    overrides: dict[str, object] = {
        "database_url": database,
        "alert_rules_file": rules,
        "webhook_url": webhook,
        "alertmanager_url": alertmanager,
    }
    if open_reads:
        overrides["require_token_for_reads"] = False
    if no_worker:
        overrides["run_worker"] = False
    settings = Settings.from_env(**overrides)
    child = None
    if settings.run_worker and not worker_thread:
        store = open_store(settings.database_url)  # rules first, so the child only evaluates them
        try:
            install_configured_rules(store, settings)
            url = store.engine.url.render_as_string(hide_password=False)
        finally:
            store.dispose()
        child = WorkerProcess(
            url, webhook_url=settings.webhook_url, alertmanager_url=settings.alertmanager_url
        ).start()
        settings = settings.model_copy(update={"run_worker": False})
    if child is None:
        uvicorn.run(create_app(settings=settings), host=host, port=port, log_level=log_level)
        return
    # uvicorn shuts down gracefully on SIGTERM, then raises it again with the handler it found:
    # this one, so the worker is stopped before the process ends as SIGTERM says.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    terminated = False
    try:
        uvicorn.run(create_app(settings=settings), host=host, port=port, log_level=log_level)
    except _Terminated:
        terminated = True
    finally:
        child.stop()
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


class _Terminated(Exception):
    """SIGTERM reached ``serve`` after uvicorn's own shutdown."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


@app.command("worker")
def worker(
    database: DatabaseOption = None,
    rules: RulesOption = None,
    webhook: WebhookOption = None,
    alertmanager: AlertmanagerOption = None,
    run: Annotated[
        str | None, typer.Option("--run", help="Compare only this run's steps.", show_default=False)
    ] = None,
    once: Annotated[
        bool,
        typer.Option(
            "--once", help="Compare what is ready now, deliver its alert notices, then exit (no waiting)."
        ),
    ] = False,
    nice: Annotated[
        int,
        typer.Option(
            "--nice",
            min=0,
            max=19,
            help="Lower this worker's CPU priority by N, so a job on the same machine wins the CPU.",
        ),
    ] = 0,
) -> None:
    """Run a comparison worker and alert evaluation without the API, until SIGTERM or Ctrl-C (or, with
    --once, until what is ready now is compared). Start as many as the queue needs, beside `isoaudit
    serve --no-worker` replicas: they share one queue (each step is claimed by one worker under a
    lease, ISOAUDIT_WORKER_LEASE_S)."""
    import os
    import signal
    import threading

    from isoaudit.audit.alerts.setup import default_alert_engine, install_configured_rules
    from isoaudit.audit.settings import Settings
    from isoaudit.audit.trackers.setup import compose_steps, tracker_channels, worker_trackers
    from isoaudit.audit.worker import PARENT_ENV, ComparisonWorker, die_with_parent, tell_parent_ready

    die_with_parent()  # a child of `isoaudit serve` or of a job's session goes with it
    if nice:
        os.nice(nice)
    parent = os.environ.get(PARENT_ENV)
    settings = Settings.from_env(
        database_url=database, alert_rules_file=rules, webhook_url=webhook, alertmanager_url=alertmanager
    )
    store = open_store(settings.database_url)
    install_configured_rules(store, settings)
    trackers = worker_trackers(store)  # ISOAUDIT_WANDB_*, ISOAUDIT_MLFLOW_*: None when unset
    engine = default_alert_engine(store, settings, tracker_channels(trackers)).start()
    comparison = ComparisonWorker(
        store,
        on_step=compose_steps(engine.evaluate, trackers.on_step if trackers else None),
        interval=settings.worker_interval_s,
        lease_s=settings.worker_lease_s,
        run_id=run,
        processes=settings.worker_processes,
    )
    where = store.engine.url.render_as_string()
    if once:
        comparison.run_once(run)
    else:
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        # What start-up made (imports, the store, the rules) lives as long as the process: frozen,
        # the collector's full passes no longer scan it (a step's comparison made them 50-90 ms).
        gc.freeze()
        comparison.start()
        console.print(f"comparison worker {comparison.name} on {where}" + (f", run {run}" if run else ""))
        tell_parent_ready()
        # Where the kernel cannot tie this process to its parent (not Linux), look for the parent.
        while not stop.wait(1.0):
            if parent and os.getppid() != int(parent):
                break
        comparison.stop()
    engine.close()
    if trackers is not None:
        trackers.close()
    store.dispose()
    console.print(f"compared {comparison.compared} samples in {comparison.steps_compared} steps")
