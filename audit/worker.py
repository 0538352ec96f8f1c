"""The comparison worker: compares every sample whose two sides are stored, in the background of the
ingest path, and saves per-sample and per-step results. Workers sharing a database claim whole
steps under a lease (``Store.claim_steps``), so each step is compared by one of them, and a crashed
worker's steps are retaken when its lease runs out; comparing again replaces results with identical
ones, so even a retaken step costs time, never correctness.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Any

from isoaudit.audit.compare import (
    ONE_PASS_TOKENS,
    ComparedPrints,
    SampleComparison,
    StepOutcome,
    compare_samples,
)
from isoaudit.audit.db import StepClaim, Store
from isoaudit.audit.frameworks import Declaration, declaration_of
from isoaudit.audit.metrics.block_pool import BlockPool, measuring_in
from isoaudit.audit.metrics.blocks import idle_threads
from isoaudit.audit.quantization_growth import note_growth
from isoaudit.audit.records import Manifest, OffPolicy, RegionFingerprints, SampleLogprobs, off_policy_of
from isoaudit.audit.routing import step_routing
from isoaudit.audit.since_clean import note_changes_since_clean
from isoaudit.audit.summaries import summarize

log = logging.getLogger(__name__)

#: Called after a step's results are saved: (run_id, step, step metrics). Alert evaluation plugs in here.
StepCallback = Callable[[str, int, Mapping[str, Any]], object]


def pair_by_key(samples: list[SampleLogprobs]) -> dict[str, tuple[SampleLogprobs, SampleLogprobs]]:
    """(trainer, rollout) per sample_key, for keys stored on both sides."""
    sides: dict[str, dict[str, SampleLogprobs]] = defaultdict(dict)
    for sample in samples:
        assert sample.sample_key is not None
        sides[sample.sample_key][sample.side] = sample
    return {key: (s["trainer"], s["rollout"]) for key, s in sides.items() if len(s) == 2}


class _Later:
    """The claimed steps' fingerprints, read and compared (:class:`ComparedPrints`, per step) on
    another thread, waited for where they are first needed."""

    def __init__(self, reading: Future[dict[tuple[str, int], ComparedPrints]]) -> None:
        self.reading = reading

    def get(self) -> dict[tuple[str, int], ComparedPrints]:
        return self.reading.result()


def _claimed_prints(
    records: dict[tuple[str, int], list[RegionFingerprints]], claims: list[StepClaim]
) -> dict[tuple[str, int], ComparedPrints]:
    """Each claimed step's fingerprint records of its claimed samples, by key, with their grids."""
    out = {}
    for claim in claims:
        wanted = set(claim.sample_keys)
        by_key: dict[str, tuple[list[RegionFingerprints], list[RegionFingerprints]]] = defaultdict(
            lambda: ([], [])
        )
        for record in records.get((claim.run_id, claim.step), ()):
            if record.sample_key in wanted:
                by_key[record.sample_key][0 if record.side == "trainer" else 1].append(record)
        out[(claim.run_id, claim.step)] = ComparedPrints.of(dict(by_key))
    return out


def _declaration(run_id: str, config: Mapping[str, Any]) -> Declaration | None:
    """The run's declared framework; None (with a warning) for a config stored before isoaudit read
    the ``framework`` key, whose value it does not understand: figures then follow the newest code."""
    try:
        return declaration_of(config)
    except ValueError as exc:
        log.warning("run %s: %s; its framework figures follow each framework's newest code", run_id, exc)
        return None


def worker_name() -> str:
    """``host:pid:nonce``: tells the comparison workers sharing one database apart."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class ComparisonWorker:
    """Drains the store's comparison queue; ``run_once`` for a synchronous pass, ``start`` for a thread.

    Several workers (in several ``isoaudit serve`` replicas) may share one database: each pass
    claims a batch of whole steps (``Store.claim_steps``: a lease of ``lease_s`` seconds per step,
    retaken once it runs out, so a killed worker's steps are compared by another), reads the batch's
    samples, fingerprints, manifests and run configs in a few queries, compares it, and saves every
    result of the batch in one transaction that first gives the claims back: a worker whose lease
    was retaken saves nothing, so each step's results are written once (``StepResultRow.revision``
    counts the times a step was compared; it grows only when records of it arrive afterwards).
    ``max_pairs`` bounds a batch (memory, and the time it must fit into the lease). ``run_id``: the
    background thread compares only that run's steps (a job's own comparer; it backfills nothing)."""

    def __init__(
        self,
        store: Store,
        *,
        on_step: StepCallback | None = None,
        interval: float = 0.5,
        clip_eps: float = 0.2,
        lease_s: float = 60.0,
        max_pairs: int = 1024,
        name: str | None = None,
        run_id: str | None = None,
        processes: int = 0,
    ) -> None:
        self.store = store
        #: processes measuring a step's token blocks beside the worker's thread when a core is idle
        #: (audit.metrics.block_pool; started at the first step big enough, stopped by ``stop`` or
        #: ``close_pool``; 0: none, the default of a worker made for one ``run_once``)
        self.processes = processes
        self._pool: BlockPool | None = None
        self.run_id = run_id
        self.on_step = on_step
        self.interval = interval
        self.clip_eps = clip_eps
        self.lease_s = lease_s
        self.max_pairs = max_pairs
        self.name = name or worker_name()
        self.compared = 0
        self.steps_compared = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, run_id: str | None = None) -> int:
        """Compare everything ready now that no other worker holds (only ``run_id``'s samples if
        given), batch after batch; return how many samples. A step that fails keeps its claim until
        the lease runs out, then is tried again (by any worker); one bad step never stops the others."""
        done = 0
        while not self._stop.is_set():
            claims = self.store.claim_steps(
                self.name, lease_s=self.lease_s, max_pairs=self.max_pairs, run_id=run_id
            )
            if not claims:
                break
            try:
                done += self._compare_batch(claims)
            except Exception:  # the save failed (database trouble): give the steps back, retry later
                self.failures += 1
                log.exception("saving a comparison batch of %d steps failed", len(claims))
                try:
                    self.store.release_claims(self.name, claims)
                except Exception:
                    log.exception("releasing the claims failed; they lapse after %.0f s", self.lease_s)
                break
        self.compared += done
        return done

    def _compare_batch(self, claims: list[StepClaim]) -> int:
        empty = [c for c in claims if not c.sample_keys]  # another worker finished them just now
        self.store.release_claims(self.name, empty)
        claims = [c for c in claims if c.sample_keys]
        steps = [(c.run_id, c.step) for c in claims]
        samples, arrived = self.store.samples_and_arrivals(steps)
        idle = idle_threads()
        tokens = sum(s.logprobs.size for step in samples.values() for s in step)
        pool = self.block_pool() if idle > 1 and tokens >= 2 * ONE_PASS_TOKENS else None
        with measuring_in(pool):
            if idle < 2 or not self.store.threads_share_the_database:
                done: Future[dict[tuple[str, int], ComparedPrints]] = Future()
                done.set_result(self._read_prints(steps, claims))
                return self._compare_read(claims, samples, arrived, _Later(done), idle)
            # With a core idle, the fingerprints are read and their grids compared on a thread while
            # the samples' tokens are measured (the read waits on the database, numpy releases the
            # interpreter lock in its loops). A second thread of the pass only takes turns with the
            # read on the interpreter lock, so without the pool's processes the pass takes the cores
            # the read leaves.
            with ThreadPoolExecutor(1, thread_name_prefix="isoaudit-read") as reader:
                reading = reader.submit(self._read_prints, steps, claims)
                lanes = idle if pool is not None else idle - 1
                return self._compare_read(claims, samples, arrived, _Later(reading), lanes)

    def _read_prints(
        self, steps: list[tuple[str, int]], claims: list[StepClaim]
    ) -> dict[tuple[str, int], ComparedPrints]:
        return _claimed_prints(self.store.fingerprints_of_steps(steps), claims)

    def block_pool(self) -> BlockPool | None:
        """The processes measuring token blocks, started on first use (None: ``processes`` is 0)."""
        if self.processes > 0 and self._pool is None:
            self._pool = BlockPool(self.processes)
        return self._pool

    def _compare_read(
        self,
        claims: list[StepClaim],
        samples: dict[tuple[str, int], list[SampleLogprobs]],
        arrived: dict[tuple[str, int], datetime],
        prints: _Later,
        threads: int,
    ) -> int:
        runs = sorted({c.run_id for c in claims})
        manifests = {
            r: (self.store.manifests(r, "trainer"), self.store.manifests(r, "rollout")) for r in runs
        }
        # A declared lag is off_policy, not weights.
        configs = {r: self.store.run_config(r) or {} for r in runs}
        policies = {r: off_policy_of(configs[r]) for r in runs}
        frameworks = {r: _declaration(r, configs[r]) for r in runs}
        computed: list[tuple[StepClaim, StepOutcome]] = []
        for run in runs:
            mine = [c for c in claims if c.run_id == run]
            try:  # one comparison over the run's whole batch: the per-sample metrics are vectorised
                computed += self._compare_steps(
                    mine, samples, prints, manifests[run], policies[run], frameworks[run], threads
                )
            except Exception:  # find the bad step: compare them one by one
                prints.get()  # a failed read is the database's trouble, not the steps': it raises here
                for claim in mine:
                    try:
                        computed += self._compare_steps(
                            [claim], samples, prints, manifests[run], policies[run], frameworks[run], threads
                        )
                    except Exception:  # stays claimed until the lease runs out, then is tried again
                        self.failures += 1
                        log.exception("comparison of run %s step %s failed", claim.run_id, claim.step)

        prints.get()  # the fingerprints were read (a failed read raises here: nothing is saved)
        try:  # what changed since the last clean step: named in the verdicts, never in the way of them
            note_changes_since_clean(
                self.store, [o for _, o in computed], {r: [*manifests[r][0], *manifests[r][1]] for r in runs}
            )
        except Exception:
            log.exception("naming the environment changes of %d steps failed", len(computed))
        note_growth(self.store, [o for _, o in computed])  # the quantization steps' trend; never raises
        saved = self.store.save_outcomes(
            self.name, [claim for claim, _ in computed], [o for _, o in computed], arrived
        )
        n = 0
        for claim, outcome in computed:
            run, step = claim.run_id, claim.step
            if (run, step) not in saved:
                log.warning(
                    "run %s step %s: its lease went to another worker, whose results stand", run, step
                )
                continue
            n += len(outcome.comparisons)
            self.steps_compared += 1
            if self.on_step is not None:
                try:
                    self.on_step(run, step, outcome.metrics)
                except Exception:  # alerting must never stop comparison
                    log.exception("step callback failed for run %s step %s", run, step)
        return n

    def _compare_steps(
        self,
        claims: list[StepClaim],
        samples: dict[tuple[str, int], list[SampleLogprobs]],
        prints: _Later,
        manifests: tuple[list[Manifest], list[Manifest]],
        policy: OffPolicy | None,
        framework: Declaration | None,
        threads: int,
    ) -> list[tuple[StepClaim, StepOutcome]]:
        """Compare the claimed samples of some steps of one run in one call (the token pass on
        ``threads`` threads), then each step's outcome."""
        pairs = {(c.run_id, c.step): pair_by_key(samples[(c.run_id, c.step)]) for c in claims}
        todo = [
            pairs[(c.run_id, c.step)][k]
            for c in claims
            for k in c.sample_keys
            if k in pairs[(c.run_id, c.step)]
        ]
        wanted = {(c.run_id, c.step, k) for c in claims for k in c.sample_keys}
        if len(claims) > 1 and len({k for _, _, k in wanted}) < len(wanted):
            # One sequence sampled at two steps: fingerprints are matched by key, so step by step.
            return [
                x
                for c in claims
                for x in self._compare_steps([c], samples, prints, manifests, policy, framework, threads)
            ]

        def fingerprints() -> ComparedPrints:
            read = [prints.get()[(claim.run_id, claim.step)] for claim in claims]
            if len(read) == 1:
                return read[0]
            return ComparedPrints(  # the claims' keys differ (checked above)
                {k: v for one in read for k, v in one.records.items()},
                {k: v for one in read for k, v in one.grids.items()},
            )

        comparisons = compare_samples(
            todo, fingerprints, manifests, clip_eps=self.clip_eps, policy=policy, threads=threads
        )
        per_step: dict[tuple[str, int], list[SampleComparison]] = defaultdict(list)
        for comparison in comparisons:
            per_step[(comparison.run_id, comparison.step)].append(comparison)
        out = []
        for claim in claims:
            step_pairs = pairs[(claim.run_id, claim.step)]
            # The step's figures cover every compared sample of the step, old and new.
            all_pairs = [step_pairs[k] for k in sorted(step_pairs)]
            mine = per_step[(claim.run_id, claim.step)]
            out.append((claim, StepOutcome.of(all_pairs, mine, clip_eps=self.clip_eps, framework=framework)))
        return out

    def backfill(self, limit: int = 1) -> int:
        """Write the dashboard's summaries of up to ``limit`` steps compared before they existed (a
        database from before migration 0004), from the stored samples and verdicts. The background
        thread does one step per idle pass, so old runs fill in without holding up new records."""
        todo = self.store.unsummarized_steps(limit)
        facts = self.store.step_facts(todo)
        summaries = []
        for run, step in todo:
            pairs = pair_by_key(self.store.samples(run, step))
            ordered = [pairs[k] for k in sorted(pairs)]
            verdicts = facts[(run, step)].verdicts
            summaries.append(
                summarize(run, step, ordered, verdicts, facts[(run, step)], step_routing(ordered))
            )
        self.store.save_summaries(summaries)
        return len(todo)

    # ------------------------------------------------------------------ background thread

    def start(self) -> ComparisonWorker:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="isoaudit-compare", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.close_pool()

    def close_pool(self) -> None:
        """Stop the block-measuring processes (started again by the next big step)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.run_once(self.run_id) > 0 or (self.run_id is None and self.backfill() > 0)
                self.store.apply_due_retention()  # each project's retention policy, once an hour
                if not busy:  # the saves leave SQLite's log to now, off the comparisons' path
                    self.store.checkpoint()
            except Exception:
                log.exception("comparison pass failed")
                busy = False
            if not busy:
                self._stop.wait(self.interval)

    def __enter__(self) -> ComparisonWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Set by :class:`WorkerProcess` in its child's environment: the pid the child must die with.
PARENT_ENV = "ISOAUDIT_WORKER_PARENT_PID"
#: ... and the pipe the child writes one byte to once it compares (:func:`tell_parent_ready`).
READY_FD_ENV = "ISOAUDIT_WORKER_READY_FD"


def tell_parent_ready() -> None:
    """In a child started by :class:`WorkerProcess`: say that the worker runs (the API waits for it
    before it answers, so a fresh ``serve`` compares from its first request)."""
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is None:
        return
    try:
        os.write(int(fd), b"1")
        os.close(int(fd))
    except (OSError, ValueError):
        pass


def die_with_parent() -> None:
    """In a child started by :class:`WorkerProcess`: ask Linux to SIGKILL this process when the
    supervising thread goes (the API SIGKILLed, say), so no orphaned worker keeps claiming steps;
    exit at once if the parent is gone already. Elsewhere (no variable, not Linux) a no-op."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.warning("cannot tie the worker's life to its parent here; it stops on SIGTERM only")
    if os.getppid() != int(parent):
        os._exit(0)


class WorkerProcess:
    """``isoaudit worker`` as a child process that ``isoaudit serve`` supervises: started with the
    API, restarted (backoff ``restart_s``, doubling to ``restart_max_s``) if it exits, stopped with
    SIGTERM (then SIGKILL after ``stop_timeout_s``) when the API stops, and killed by the kernel if
    the API dies (:func:`die_with_parent`). Comparison is CPU-bound Python: in the API's process it
    would share one GIL with request handling, which starves both under load.

    The child gets this process's environment with the database and webhook URLs in it (never on
    its command line, where ``ps`` would show their secrets); it installs no rules (the API did,
    before it started), it only compares and evaluates them.

    A session's own comparer (``isoaudit.session(..., compare="process")``) starts one with
    ``run_id`` (the child compares that run only), ``configure_alerts`` (the child installs the
    configured rules and reads every alerting setting from the environment it inherits, since the
    job set up nothing), ``quiet`` (its stdout, the worker's banner, goes nowhere; its log lines
    still reach the job's stderr), ``nice`` (the child lowers its own CPU priority by this much)
    and ``env`` (variables set for the child only, e.g. one BLAS thread)."""

    def __init__(
        self,
        database_url: str,
        *,
        webhook_url: str | None = None,
        alertmanager_url: str | None = None,
        run_id: str | None = None,
        configure_alerts: bool = False,
        quiet: bool = False,
        nice: int = 0,
        env: Mapping[str, str] | None = None,
        restart_s: float = 1.0,
        restart_max_s: float = 30.0,
        stop_timeout_s: float = 15.0,
    ) -> None:
        self.database_url = database_url
        self.webhook_url = webhook_url
        self.alertmanager_url = alertmanager_url
        self.run_id = run_id
        self.configure_alerts = configure_alerts
        self.quiet = quiet
        self.nice = nice
        self.env = dict(env or {})
        self.restart_s = restart_s
        self.restart_max_s = restart_max_s
        self.stop_timeout_s = stop_timeout_s
        self.restarts = 0
        self.start_failures = 0  # the child could not be started at all (retried with the same backoff)
        self.process: Any = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    def command(self) -> list[str]:
        import sys

        return [
            sys.executable,
            "-m",
            "isoaudit.cli",
            "worker",
            *(["--run", self.run_id] if self.run_id else []),
            *(["--nice", str(self.nice)] if self.nice else []),
        ]

    def start(self, timeout: float = 60.0) -> WorkerProcess:
        """Start the supervising thread (which starts the child) and wait until the child says it
        compares (at most ``timeout`` seconds; the API starts anyway, the worker catches up)."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._supervise, name="isoaudit-worker-supervisor", daemon=True
        )
        self._thread.start()
        self._started.wait(timeout)
        return self

    @property
    def pid(self) -> int | None:
        return None if self.process is None else int(self.process.pid)

    def _spawn(self) -> Any:
        import subprocess

        env = {
            **os.environ,
            **self.env,
            PARENT_ENV: str(os.getpid()),
            "ISOAUDIT_DATABASE_URL": self.database_url,
        }
        if not self.configure_alerts:
            env["ISOAUDIT_DEFAULT_ALERT_RULES"] = "0"
            env.pop("ISOAUDIT_ALERT_RULES", None)
            env.pop("ISOAUDIT_ALERT_WEBHOOK_URL", None)
            env.pop("ISOAUDIT_ALERTMANAGER_URL", None)
        if self.webhook_url:
            env["ISOAUDIT_ALERT_WEBHOOK_URL"] = self.webhook_url
        if self.alertmanager_url:
            env["ISOAUDIT_ALERTMANAGER_URL"] = self.alertmanager_url
        ready, tell = os.pipe()
        env[READY_FD_ENV] = str(tell)
        try:
            process = subprocess.Popen(
                self.command(),
                env=env,
                pass_fds=(tell,),
                stdout=subprocess.DEVNULL if self.quiet else None,
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(tell)
        threading.Thread(target=self._await_ready, args=(ready,), daemon=True).start()
        return process

    def _await_ready(self, ready: int) -> None:
        try:
            os.read(ready, 1)  # a byte once it runs; EOF if it died first
        finally:
            os.close(ready)
            self._started.set()

    def _supervise(self) -> None:
        """Spawned from this long-lived thread: the kernel's parent-death signal follows the thread
        that forked the child."""
        import time

        delay = self.restart_s
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.process = self._spawn()
            except OSError:
                self.start_failures += 1
                log.exception("cannot start the comparison worker process; retrying in %.0f s", delay)
                self._started.set()
                self._stop.wait(delay)
                delay = min(self.restart_max_s, delay * 2)
                continue
            while self.process.poll() is None and not self._stop.wait(0.2):
                pass
            if self._stop.is_set():
                break
            if time.monotonic() - started > 60:
                delay = self.restart_s  # it ran for a while: this is a new failure, not a crash loop
            log.error(
                "the comparison worker process exited (status %s); restarting it in %.1f s",
                self.process.returncode,
                delay,
            )
            self.restarts += 1
            if self._stop.wait(delay):
                break
            delay = min(self.restart_max_s, delay * 2)
        self._terminate()

    def _terminate(self) -> None:
        import subprocess

        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the comparison worker did not stop within %.0f s: killed", self.stop_timeout_s)
            process.kill()
            process.wait(5)

    def stop(self) -> None:
        """SIGTERM the child (it finishes its batch and exits), SIGKILL it if it takes too long."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.stop_timeout_s + 10)
        self._terminate()
