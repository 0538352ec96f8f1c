"""Step time of a training loop with the trainer collector against without, in the same run.

Configurations, interleaved in rounds so drift and noise hit all of them alike:

* ``baseline``: no collector.
* ``logprobs``: collector with no regions; the trainer hands it the logprobs it computed.
* ``logprobs+fingerprints``: every canonical region fingerprinted at ``sample_every=1`` (the
  collector's defaults: the records built on the training thread).
* ``collector-logprobs`` (extra): no regions, and the collector computes the logprobs itself.
* ``fingerprints+background`` (with ``--background``): as ``logprobs+fingerprints``, the records
  built on the collector's helper thread (``background_records=True``).

A step is a real training step: forward, the trainer's processed logprobs, a policy-gradient-like
loss, backward, AdamW. Reported: median step time per configuration and the overhead against the
baseline. Targets on the CPU with a tiny model: logprobs <= 3 %, with fingerprints <= 25 %.

    python bench/collector_overhead.py                         # CPU, tiny Qwen3
    python bench/collector_overhead.py --device cuda --model 0.5b
    python bench/collector_overhead.py --model deep-tiny --hidden 16   # CPU, the 0.5b's 123 regions

``--scenario graphs`` times, in one run, what the graph citizens cost (docs/design.md,
"Fingerprints in compiled graphs and captured CUDA graphs"):

* ``engine``: the reference engine's decode replayed from CUDA graphs with every region
  fingerprinted (held by the taps, one multi-region launch per dtype at the step's end, inside the
  graph), against the same graphed decode without fingerprints (decode time = a generate of
  ``--new`` tokens minus one of 1 token, so prefill is left out); then, kernels on, the graphed
  fingerprints against the eager packed steps' bit for bit, the decode asserted replayed from the
  graph, and one mode switch's recapture timed. On the CPU the bucketed decode runs eagerly.
* ``compiled-trainer``: a ``torch.compile``'d training step with every region fingerprinted
  (one multi-region op at the forward's end, the collector's defaults) against the compiled step
  without a collector (two copies of one model, interleaved, warm-up left out), its ratio against
  the 1.10 target, ``record_step``'s host time and the syncs a step makes, and the recompile a
  switch to the invariant kernels costs. With ``--background``, a third copy whose collector
  builds its records on its helper thread (``background_records=True``). With
  ``--without-distribution``, one more copy without the distribution's top-k and sketch. The
  baseline is compiled before any collector attaches, as in a job without isoaudit.

    python bench/collector_overhead.py --scenario graphs --device cuda --model 0.5b   # the H200
    python bench/collector_overhead.py --scenario graphs --hidden 64 --rounds 3        # CPU check
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import qwen3_05b_config  # noqa: E402
from isoaudit.collectors.layout import StepBatch  # noqa: E402
from isoaudit.collectors.sinks.memory import MemorySink  # noqa: E402
from isoaudit.collectors.trainer import attach  # noqa: E402

TEMPERATURE = 0.8


def build_model(size: str, device: str, dtype: torch.dtype, hidden: int = 256) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    if size in ("tiny", "deep-tiny"):
        # tiny: a few million parameters, 4 layers, MLP 3x hidden, 1k vocab; deep-tiny: the 0.5b
        # model's 24 layers (and so its 123 regions) at tiny widths
        config = Qwen3Config(
            vocab_size=1024,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=4 if size == "tiny" else 24,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
    elif size == "0.5b":  # the shape of Qwen2.5-0.5B in the Qwen3 architecture: ~0.49B parameters
        config = qwen3_05b_config(max_positions=4096)
    else:
        raise ValueError(f"--model: expected tiny, deep-tiny or 0.5b, got {size!r}")
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a 0.5B init on the CPU takes long
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def make_batch(args: argparse.Namespace, vocab: int, device: str) -> StepBatch:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    completions = []
    for i in range(args.batch):  # varied completion lengths: padding matters
        n = max(1, args.completion - (i * args.completion) // (2 * args.batch))
        completions.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    return StepBatch.padded(prompts, completions, temperature=TEMPERATURE, device=device)


def train_step(
    model,
    optimizer,
    batch: StepBatch,
    mask: torch.Tensor,
    collector,
    step: int,
    pass_logprobs: bool,
    record_s: list[float] | None = None,
    phases: dict[str, list[float]] | None = None,
):
    """One training step; ``record_s``: gets the host seconds ``record_step`` took (it runs between
    the forward and the backward, so its host time adds to the step's unless the device is behind).
    ``phases``: gets each phase's host seconds appended under its name (begin_step, forward,
    logprobs, record_step, backward, optimizer)."""
    clock = _PhaseClock(phases)
    if collector is not None:
        collector.begin_step(step, batch)  # with the batch: padding rows are skipped on any device
    clock.lap("begin_step")
    logits = model(**batch.model_inputs()).logits
    clock.lap("forward")
    logprobs = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
    logprobs = logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # [rows, cols-1]
    clock.lap("logprobs")
    if collector is not None:
        t0 = time.perf_counter()
        collector.record_step(step, batch, logprobs=logprobs.detach() if pass_logprobs else None)
        if record_s is not None:
            record_s.append(time.perf_counter() - t0)
    clock.lap("record_step")
    loss = -(logprobs * mask).sum() / mask.sum()
    loss.backward()
    clock.lap("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    clock.lap("optimizer")


class _GcClock:
    """Host seconds Python's cyclic collector ran, by generation, added into ``into`` (``gc0``,
    ``gc1``, ``gc2``; None: not counted): a collection runs inside whichever phase allocated past
    the threshold, so the phases' times include it."""

    def __init__(self) -> None:
        self.into: dict[str, float] | None = None
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self.into is not None:
            name = f"gc{info['generation']}"
            self.into[name] = self.into.get(name, 0.0) + time.perf_counter() - self._started

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


class _PhaseClock:
    """Host seconds between laps, appended to ``into`` under each lap's name, and the training
    thread's own CPU seconds in them under ``<name> cpu`` (nothing when None): a phase whose wall
    time passes its CPU time waited (for a lock, the device, or autograd's device thread, where a
    CUDA backward runs)."""

    def __init__(self, into: dict[str, list[float]] | None) -> None:
        self.into = into
        self.last = time.perf_counter()
        self.last_cpu = time.thread_time()

    def lap(self, name: str) -> None:
        if self.into is not None:
            now, cpu = time.perf_counter(), time.thread_time()
            self.into.setdefault(name, []).append(now - self.last)
            self.into.setdefault(f"{name} cpu", []).append(cpu - self.last_cpu)
            self.last, self.last_cpu = now, cpu


#: What ``--phases`` times inside the collector: (where, attribute) pairs wrapped for the timed steps.
COLLECTOR_PHASES = (
    ("capture", "take_compiled"),
    ("trainer", "processed_logprob_rows"),
    ("trainer", "distribution_rows"),
    ("trainer", "pack_prints"),
    ("trainer", "HostCopy"),
    ("trainer", "fingerprint_blocks"),
    ("trainer", "sample_records"),
    ("collector", "_manifests"),
    ("collector", "_step_boundary"),
    ("pipeline", "_build"),
    ("regions_op", "run"),
)


def time_collector_phases(collector, into: dict[str, float]) -> None:
    """Wrap :data:`COLLECTOR_PHASES` so each call's host seconds add up in ``into`` (a bench-only
    instrument: a few perf_counter calls per phase, no profiler's per-call overhead)."""
    from isoaudit.collectors import fingerprint_regions
    from isoaudit.collectors import trainer as trainer_module

    owners = {
        "capture": collector._capture,
        "trainer": trainer_module,
        "collector": collector,
        "pipeline": collector._pipeline,
        "regions_op": fingerprint_regions._OpPlan,  # the multi-region op's work, inside the forward
    }
    for where, name in COLLECTOR_PHASES:
        owner = owners[where]
        inner = getattr(owner, name)
        if getattr(inner, "_timed", False):
            continue

        def timed(*args, _inner=inner, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                into[_name] = into.get(_name, 0.0) + time.perf_counter() - t0

        timed._timed = True  # type: ignore[attr-defined]
        setattr(owner, name, timed)


def completion_mask(batch: StepBatch) -> torch.Tensor:
    rows, cols = batch.shape
    mask = torch.zeros(rows, cols - 1)
    for span in batch.spans:
        mask[span.row, span.start + span.prompt_len - 1 : span.start + span.length - 1] = 1
    return mask.to(batch.input_ids.device)


def check_logprobs(model: torch.nn.Module, batch: StepBatch) -> dict[str, Any]:
    """The collector's own logprobs against the trainer's ``log_softmax(logits / T)`` on this device,
    and every region fingerprinted for every sample."""
    sink = MemorySink()
    collector = attach(
        model, run="bench-check", sink=sink, keep_records=True, strict=True, async_transfer=False
    )
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits
        report = collector.record_step(0, batch)
    collector.detach()
    sink.close()
    reference = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    equal, worst = 0, 0.0
    samples = [r for r in report.records if r.kind == "sample"]
    for span, record in zip(batch.spans, samples, strict=True):
        rows = reference[span.row, span.start + span.prompt_len - 1 : span.start + span.length - 1]
        tokens = batch.input_ids[span.row, span.start + span.prompt_len : span.start + span.length]
        want = rows.gather(-1, tokens[:, None]).squeeze(-1).clamp(max=0).cpu().numpy()
        equal += int((want == record.logprobs).all())
        worst = max(worst, float(abs(want - record.logprobs).max()))
    return {
        "samples_bitwise_equal": f"{equal}/{len(samples)}",
        "max_abs_diff": worst,
        "regions": len(collector.regions),
        "fingerprint_records": report.n_fingerprint_records,
    }


def _no_sync() -> None:
    return None


def _attach(model, sink, config: dict[str, Any] | None):
    """The collector of one configuration (None: the baseline, no collector)."""
    if config is None:
        return None
    return attach(
        model,
        run="bench",
        sink=sink,
        regions=config["regions"],
        sample_every=1,
        background_records=bool(config.get("background")),
    )


def count_syncs(model, optimizer, batch, mask, sink, configs, step: int) -> dict[str, int]:
    """Device synchronisations in one training step per configuration (CUDA): what
    ``torch.cuda.set_sync_debug_mode("warn")`` reports, after a warm step. The collector's
    configurations should report what the baseline does."""
    import warnings

    out = {}
    for name, config in configs.items():
        collector = _attach(model, sink, config)
        passed = config is None or config["pass"]
        step += 1
        train_step(model, optimizer, batch, mask, collector, step, passed)  # warm
        torch.cuda.synchronize()
        step += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(model, optimizer, batch, mask, collector, step, passed)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[name] = sum("synchroniz" in str(w.message) for w in caught)
        if collector is not None:
            collector.detach()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads) if args.threads else None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = build_model(args.model, args.device, dtype, args.hidden)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    batch = make_batch(args, vocab, args.device)
    mask = completion_mask(batch)
    configs = {
        "baseline": None,
        "logprobs": {"regions": None, "pass": True},
        "logprobs+fingerprints": {"regions": "auto", "pass": True},
        "collector-logprobs": {"regions": None, "pass": False},
    }
    if args.background:
        configs["fingerprints+background"] = {"regions": "auto", "pass": True, "background": True}
    times: dict[str, list[float]] = {name: [] for name in configs}
    host: dict[str, list[float]] = {name: [] for name in configs}  # until the step is queued
    tmp = tempfile.TemporaryDirectory()
    if args.sink == "direct":
        from isoaudit.collectors.sinks.direct import DirectSink  # SQLAlchemy only when asked for

        sink: Any = DirectSink(f"sqlite:///{tmp.name}/bench.db", queue_size=1024)
    else:
        sink = MemorySink(keep=False, validate=False, queue_size=1024)  # the collector alone, as before
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else _no_sync
    step = 0
    for _ in range(args.warmup):
        train_step(model, optimizer, batch, mask, None, step, True)
    # Short blocks in a rotating order over many rounds: load from other processes then falls on
    # every configuration alike, and the median per configuration is robust to the rest.
    names = list(configs)
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            config = configs[name]
            collector = _attach(model, sink, config)
            for _ in range(args.steps):
                step += 1
                sync()
                started = time.perf_counter()
                train_step(model, optimizer, batch, mask, collector, step, config is None or config["pass"])
                queued = time.perf_counter()
                sync()
                times[name].append(time.perf_counter() - started)
                host[name].append(queued - started)
            if collector is not None:
                if collector.counters.errors or collector.stats()["hook_errors"]:
                    raise RuntimeError(f"collector errors in {name}: {collector.stats()}")
                collector.detach()
    syncs = count_syncs(model, optimizer, batch, mask, sink, configs, step) if sync is not _no_sync else None
    checks = check_logprobs(model, batch)
    delivered = sink.flush(120)
    stats = sink.stats()
    sink.close()
    tmp.cleanup()
    base = statistics.median(times["baseline"])
    result = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": args.model,
        "hidden": model.config.hidden_size,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "batch": args.batch,
        "tokens_per_step": int(batch.input_ids.numel()),
        "sink": args.sink,
        "sink_delivered_all": delivered,
        "sink_stats": stats,
        "steps_per_config": len(times["baseline"]),
        "checks": checks,
        "median_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        # host time until the step was queued (the rest is the device finishing): a collector that
        # only adds host time hides behind a device-bound step, one that syncs cannot
        "host_median_ms": {name: 1e3 * statistics.median(t) for name, t in host.items()},
        "syncs_per_step": syncs,
        "overhead_pct": {
            name: 100 * (statistics.median(t) / base - 1) for name, t in times.items() if name != "baseline"
        },
    }
    return result


def _decode_seconds(engine: Any, prompts: list[list[int]], new: int, sync: Any) -> float:
    """Decode time of one ``generate``: ``new`` tokens minus 1 token (the prefill cancels)."""
    times = []
    for count in (new, 1):
        sync()
        t0 = time.perf_counter()
        engine.generate(prompts, [count] * len(prompts), seed=1)
        sync()
        times.append(time.perf_counter() - t0)
    return times[0] - times[1]


def _records_equal(a: list[Any], b: list[Any]) -> tuple[int, int]:
    """(records compared, records whose positions and every field agree bit for bit)."""
    import numpy as np
    from isoaudit.audit.fingerprints import ROW_FIELDS

    ka = {(r.sample_key, r.region, r.case): r for r in a}
    kb = {(r.sample_key, r.region, r.case): r for r in b}
    same = 0
    for key, ra in ka.items():
        rb = kb.get(key)
        if rb is None or not np.array_equal(ra.positions, rb.positions):
            continue
        fields = (np.asarray(getattr(ra, n)).view(np.uint8) for n in ROW_FIELDS)
        others = (np.asarray(getattr(rb, n)).view(np.uint8) for n in ROW_FIELDS)
        same += all(np.array_equal(x, y) for x, y in zip(fields, others, strict=True))
    return max(len(ka), len(kb)), same


def run_engine_graphs(args: argparse.Namespace) -> dict[str, Any]:
    """The reference engine's graphed decode with every region fingerprinted against without."""
    from isoaudit.collectors.engine_capture import EngineFingerprints
    from isoaudit.kernels.adapters import HFCausalLM
    from isoaudit.kernels.engine import RolloutEngine

    from isoaudit import kernels

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = build_model(args.model, args.device, dtype, args.hidden).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    max_len = args.prompt + args.new + 1
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else _no_sync
    kw = {} if cuda else {"bucketed_decode": True}
    plain = RolloutEngine(HFCausalLM(model), max_len=max_len, **kw)
    watched_model = HFCausalLM(model)
    watched = RolloutEngine(watched_model, max_len=max_len, **kw)
    prints = EngineFingerprints(watched_model, "auto", watched)
    kernels.disable()
    fusion: dict[int, dict[str, int]] = {}
    for eng in (plain, watched):  # capture and warm both
        eng.generate(prompts, [4] * len(prompts))
    prints.records("bench", 0, prompts, [[0]] * len(prompts))  # drop the warm-up's rows
    times: dict[str, list[float]] = {"graphs": [], "graphs+fingerprints": []}
    for round_ in range(args.rounds):
        order = [("graphs", plain), ("graphs+fingerprints", watched)]
        for name, eng in order if round_ % 2 == 0 else order[::-1]:
            times[name].append(_decode_seconds(eng, prompts, args.new, sync))
            if eng is watched:
                prints._decoded.clear()  # the timing's rows are not records (kept on the device)
                prints._rows.clear()
    base, with_prints = statistics.median(times["graphs"]), statistics.median(times["graphs+fingerprints"])
    replays_before = watched.replays
    fusion = prints.fusion  # per bucket: regions in the multi-region launches, and those alone
    # Kernels on: the graphed fingerprints against the eager packed steps', bit for bit.
    with kernels.enable():
        switch_from = len(watched.captures)
        watched.drop_graphs()  # what a mode switch does
        done = watched.generate(prompts, [args.check_new] * len(prompts), seed=3)
        recapture = [c[2] for c in watched.captures[switch_from:]]
        graphed_records = prints.records("bench", 1, [c.prompt for c in done], [c.tokens for c in done])
        replayed = watched.replays - replays_before
        eager_model = HFCausalLM(model)
        prints.detach()
        eager = RolloutEngine(eager_model, max_len=max_len, cuda_graphs=False)
        eager_prints = EngineFingerprints(eager_model, "auto", None)
        done_eager = eager.generate(prompts, [args.check_new] * len(prompts), seed=3)
        eager_records = eager_prints.records(
            "bench", 1, [c.prompt for c in done_eager], [c.tokens for c in done_eager]
        )
        eager_prints.detach()
    compared, equal = _records_equal(graphed_records, eager_records)
    same_tokens = [c.tokens for c in done] == [c.tokens for c in done_eager]
    same_logprobs = [c.logprobs for c in done] == [c.logprobs for c in done_eager]
    if plain.graphed():  # the acceptance: decode replayed from the graph, fingerprints inside it
        if replayed < args.check_new - 1:
            raise AssertionError(f"decode not replayed from a graph: {replayed} replays")
        if not compared or equal != compared:
            raise AssertionError(f"graphed fingerprints differ from eager: {equal}/{compared} equal")
    return {
        "graphed": plain.graphed(),
        "decode_ms": {"graphs": 1e3 * base, "graphs+fingerprints": 1e3 * with_prints},
        "ratio": with_prints / base,
        "regions": len(prints.specs),
        "fusion": fusion,
        "kernels_on_check": {
            "records_compared": compared,
            "records_bitwise_equal": equal,
            "tokens_equal": same_tokens,
            "logprobs_equal": same_logprobs,
            "decode_steps_replayed_from_graph": replayed,
        },
        "recapture_s_after_switch": recapture,
    }


def _kernel_table(fn: Any, rows: int) -> str:
    """``fn()``'s time by kernel or op name, the ``rows`` largest by device time and then the ``rows``
    largest by host time (torch.profiler's tables)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    averages = prof.key_averages()
    return "\n".join(
        averages.table(sort_by=key, row_limit=rows, max_name_column_width=70)
        for key in ("self_cuda_time_total", "self_cpu_time_total")
    )


#: The device sleep :func:`_waits_during` queues ahead of a step (cycles: about 60 ms at 1.7 GHz).
WAIT_PROBE_CYCLES = 100_000_000


def _waits_during(fn: Callable[[dict[str, list[float]]], None]) -> str:
    """Where the host waits for the device in ``fn``: a long device sleep is queued first, so the
    first call that waits for the device (a synchronising copy, an event's or a stream's
    synchronize, a pinned allocation) absorbs it; the Python functions of most own time under
    cProfile, and each phase's host time, name it."""
    import io
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(WAIT_PROBE_CYCLES)
    profile = cProfile.Profile()
    phases: dict[str, list[float]] = {}
    profile.enable()
    started = time.perf_counter()
    fn(phases)
    host = time.perf_counter() - started
    profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(8)
    lines = [line for line in out.getvalue().splitlines() if line.strip()][-9:]
    laps = "  ".join(f"{k} {1e3 * v[0]:.1f}" for k, v in phases.items() if not k.endswith(" cpu"))
    return f"  host {1e3 * host:.1f} ms until queued; phases (ms): {laps}\n" + "\n".join(lines)


def _device_calls() -> dict[str, int]:
    """cudaMalloc and cudaFree calls the caching allocator made so far (a cudaFree waits for the
    device)."""
    stats = torch.cuda.memory_stats()
    return {"cudaMalloc": stats.get("num_device_alloc", 0), "cudaFree": stats.get("num_device_free", 0)}


def _syncs_during(fn: Any) -> int:
    """Device synchronisations ``fn()`` makes (what ``torch.cuda.set_sync_debug_mode("warn")``
    reports)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


#: The compiled trainer's acceptance: the step with every region fingerprinted against without.
TARGET_RATIO = 1.10


def run_compiled_trainer(args: argparse.Namespace) -> dict[str, Any]:
    """A compiled training step with every region fingerprinted through the op against without.

    Every configuration trains its own copy of one model (the same weights), compiled once, in
    interleaved rounds; the compile and ``--warmup`` steps of each are left out of every figure.
    ``compiled+fingerprints`` runs the collector's defaults (records built on the training
    thread); with ``--background`` one more copy builds them on the collector's helper thread."""
    import copy

    from isoaudit.collectors.control import FixedControl

    from isoaudit import kernels

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    base_model = build_model(args.model, args.device, dtype, args.hidden)
    batch = make_batch(args, base_model.config.vocab_size, args.device)
    mask = completion_mask(batch)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else _no_sync
    sink = MemorySink(keep=False, validate=False, queue_size=1024)
    control = FixedControl("bench", "native")
    kernels.disable()
    torch._dynamo.reset()

    def config(collect: bool, **options: Any) -> tuple[Any, Any, Any, Any]:
        model = copy.deepcopy(base_model)
        collector = None
        if collect:
            collector = attach(model, run="bench", sink=sink, regions="auto", sample_every=1, **options)
        compiled = torch.compile(model)
        return model, compiled, torch.optim.AdamW(model.parameters(), lr=1e-6), collector

    # the baseline compiles before any collector attaches, as a job without isoaudit does: a
    # collector attached later must still get its regions into the graph (the watched classes)
    baseline = config(False)
    train_step(baseline[1], baseline[2], batch, mask, None, 0, True)
    sync()
    watched = config(True, control=control)
    configs = [("compiled", baseline), ("compiled+fingerprints", watched)]
    if args.background:  # the collector's default builds records on the training thread
        configs.append(("compiled+fingerprints+background", config(True, background_records=True)))
    if args.without_distribution:  # what the distribution's top-k and sketch cost of the above
        configs.append(("compiled+fingerprints-distribution", config(True, distribution_k=0)))
    record_s: dict[str, list[float]] = {name: [] for name, which in configs if which[3] is not None}
    host_s: dict[str, list[float]] = {name: [] for name, _ in configs}
    times: dict[str, list[float]] = {name: [] for name, _ in configs}
    # --profile: the host's Python time of each configuration's timed steps (compiles excluded)
    profiles = {name: cProfile.Profile() for name, _ in configs} if args.profile else {}
    # --phases: host seconds of each phase in each timed step, and of the collector's parts summed
    phases: dict[str, dict[str, list[float]]] = {name: {} for name, _ in configs} if args.phases else {}
    # the caching allocator's cudaMalloc and cudaFree calls during each configuration's timed steps
    device_calls: dict[str, dict[str, int]] = {name: {"cudaMalloc": 0, "cudaFree": 0} for name, _ in configs}
    inside: dict[str, dict[str, float]] = {name: {} for name, _ in configs} if args.phases else {}
    collections = _GcClock()  # --phases: how much of each phase was Python's cyclic collector

    def step(which: tuple[Any, Any, Any, Any], n: int, name: str | None = None) -> float:
        """One step, timed from an idle device to an idle device; ``name``: kept under it."""
        model, compiled, optimizer, col = which
        spent: list[float] | None = [] if name is not None else None
        sync()
        profile = profiles.get(name) if name is not None else None
        if profile is not None:
            profile.enable()
        collections.into = inside.get(name) if name is not None else None
        before = _device_calls() if cuda and args.phases and name is not None else None
        t0 = time.perf_counter()
        train_step(compiled, optimizer, batch, mask, col, n, True, spent, phases.get(name) if name else None)
        queued = time.perf_counter()
        collections.into = None
        if profile is not None:
            profile.disable()
        sync()
        elapsed = time.perf_counter() - t0
        if before is not None and name is not None:
            for call, count in _device_calls().items():
                device_calls[name][call] += count - before[call]
        if name is not None:
            times[name].append(elapsed)
            host_s[name].append(queued - t0)
            if spent:
                record_s[name] += spent
        return elapsed

    for n in range(args.warmup + 1):  # compile each (the collector's graph: the second call)
        for _, which in configs:
            step(which, n)
    for name, which in configs:
        if args.phases and which[3] is not None:
            time_collector_phases(which[3], inside[name])
    n = args.warmup + 1
    for round_ in range(args.rounds):
        shift = round_ % len(configs)
        for name, which in configs[shift:] + configs[:shift]:
            for _ in range(args.steps):
                n += 1
                step(which, n, name)
    inside = {name: dict(spent) for name, spent in inside.items()}  # the timed steps' only
    if args.phases:  # printed now too: what follows (syncs, a switch's recompile) takes a while
        steps = {name: len(t) for name, t in times.items()}
        early = {
            name: {k: round(1e3 * statistics.median(v), 3) for k, v in spent.items()}
            for name, spent in phases.items()
        }
        print(f"timed phases (host ms per step, median): {json.dumps(early)}", flush=True)
        print(f"threads alive: {sorted(t.name for t in threading.enumerate())}", flush=True)
        print(
            f"timed collector parts (host ms per step, mean): {json.dumps({n: {k: round(1e3 * v / steps[n], 3) for k, v in d.items()} for n, d in inside.items()})}",
            flush=True,
        )
        print(
            f"timed step ms (median): {json.dumps({n: round(1e3 * statistics.median(t), 3) for n, t in times.items()})}",
            flush=True,
        )
    if args.find_waits and cuda:  # one more step each behind a queued device sleep: who waits for it
        for name, (_, compiled, optimizer, col) in configs:
            n += 1
            print(
                f"host waits for the device, {name}:\n{_waits_during(lambda ph, c=compiled, o=optimizer, col=col, n=n: train_step(c, o, batch, mask, col, n, True, None, ph))}"
            )
            sync()
    if args.kernels and cuda:  # one more step each under the profiler: where the device time goes
        for name, which in configs:
            n += 1
            print(
                f"device time by kernel, {name}:\n{_kernel_table(lambda w=which, n=n: step(w, n), args.kernels)}"
            )
        stats = torch.cuda.memory_stats()  # a retry frees the allocator's cache: a device sync
        print(
            f"allocator: peak {stats['allocated_bytes.all.peak'] / 2**30:.1f} GiB, "
            f"retries {stats['num_alloc_retries']}, cudaMalloc calls {stats.get('num_device_alloc', 'n/a')}"
        )
    syncs: dict[str, int] | None = None
    if cuda:  # one more step each: what it makes the host wait for
        syncs = {}
        for name, (_, compiled, optimizer, col) in configs:
            n += 1
            sync()
            syncs[name] = _syncs_during(
                lambda compiled=compiled, optimizer=optimizer, col=col, n=n: train_step(
                    compiled, optimizer, batch, mask, col, n, True
                )
            )
            sync()
    own = watched[3].counters.own_forwards
    recompile = float("nan")
    # a switch to the invariant kernels: the next step recompiles (Dynamo guards on it)
    if not args.no_switch:
        control.set("invariant")
        n += 1
        first = step(watched, n)
        steady = [step(watched, n + 1 + i) for i in range(args.steps)]
        recompile = first - statistics.median(steady)
        control.set("native")
        step(watched, n + 10)
    mutated = sorted(watched[3]._capture.mutated)  # regions left on the per-region op
    errors = 0
    background = {}
    for name, which in configs:
        col = which[3]
        if col is not None:
            background[name] = col._pipeline.background
            errors += col.counters.errors + col.stats()["hook_errors"]
            col.detach()
    sink.close()
    collections.close()
    kernels.disable()
    for name, profile in profiles.items():
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(Path(args.profile) / f"{name.replace('+', '_')}.prof")
    step_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    ratio = step_ms["compiled+fingerprints"] / step_ms["compiled"]
    return {
        "step_ms": step_ms,
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "within_target": ratio <= TARGET_RATIO,
        "ratios": {name: ms / step_ms["compiled"] for name, ms in step_ms.items() if name != "compiled"},
        "timed_steps_per_config": len(times["compiled"]),
        # host time until the step was queued (the rest is the device finishing)
        "host_ms": {name: 1e3 * statistics.median(t) for name, t in host_s.items()},
        # host time inside record_step (between forward and backward), median over the timed steps
        "record_step_host_ms": {name: 1e3 * statistics.median(t) for name, t in record_s.items()},
        "records_on_helper_thread": background,
        "syncs_per_step": syncs,
        "regions_on_the_per_region_op": mutated,
        "own_forwards": own,
        "collector_errors": errors,
        "recompile_s_after_switch": recompile,
        # --phases: host ms per timed step of each phase, and of the collector's parts inside them
        "phase_host_ms": {
            name: {phase: 1e3 * statistics.median(t) for phase, t in spent.items()}
            for name, spent in phases.items()
        },
        # the slowest step's phases: a one-off (a pinned allocation, a collection) shows here
        "phase_host_ms_max": {
            name: {phase: 1e3 * max(t) for phase, t in spent.items() if not phase.endswith(" cpu")}
            for name, spent in phases.items()
        },
        "device_allocator_calls": device_calls if cuda and args.phases else None,
        "collector_host_ms": {
            name: {part: 1e3 * t / len(times[name]) for part, t in spent.items()}
            for name, spent in inside.items()
            if spent
        },
    }


def run_graphs(args: argparse.Namespace) -> dict[str, Any]:
    """Both graph-citizen scenarios in one run, on one device."""
    engine = run_engine_graphs(args) if args.part in ("both", "engine") else None
    print(f"engine: {json.dumps(engine)}", flush=True)  # kept should the trainer's scenario fail
    trainer = run_compiled_trainer(args) if args.part in ("both", "trainer") else None
    print(f"compiled_trainer: {json.dumps(trainer)}", flush=True)
    return {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": args.model,
        "dtype": args.dtype,
        "engine": engine,
        "compiled_trainer": trainer,
    }


def print_engine(engine: dict[str, Any]) -> None:
    """The reference engine's graphed-decode figures."""
    check = engine["kernels_on_check"]
    print(
        f"engine decode ({'CUDA graphs' if engine['graphed'] else 'bucketed, eager: no CUDA'}), "
        f"{engine['regions']} regions: {engine['decode_ms']['graphs']:.2f} ms -> "
        f"{engine['decode_ms']['graphs+fingerprints']:.2f} ms  ratio {engine['ratio']:.3f} (target <= 1.10)"
    )
    print(
        f"  kernels on: {check['records_bitwise_equal']}/{check['records_compared']} records bitwise equal "
        f"to eager, tokens {check['tokens_equal']}, logprobs {check['logprobs_equal']}, "
        f"{check['decode_steps_replayed_from_graph']} decode steps replayed from a graph; "
        f"recapture after a switch {engine['recapture_s_after_switch']} s"
    )
    print(f"  multi-region launches per bucket: {engine['fusion']}")


def print_trainer(trainer: dict[str, Any]) -> None:
    """The compiled trainer's figures."""
    verdict = "within" if trainer["within_target"] else "OVER"
    print(
        f"compiled trainer step: {trainer['step_ms']['compiled']:.2f} ms -> "
        f"{trainer['step_ms']['compiled+fingerprints']:.2f} ms  ratio {trainer['ratio']:.3f} "
        f"({verdict} the target <= {trainer['target_ratio']:.2f}; medians of "
        f"{trainer['timed_steps_per_config']} interleaved steps each); own forwards "
        f"{trainer['own_forwards']}, errors {trainer['collector_errors']}, recompile after a switch "
        f"{trainer['recompile_s_after_switch']:.2f} s"
    )
    syncs = trainer["syncs_per_step"]
    for name, ms in trainer["step_ms"].items():
        line = f"  {name:34s} {ms:8.2f} ms  host until queued {trainer['host_ms'][name]:7.2f} ms"
        if name in trainer["ratios"]:
            line += f"  ratio {trainer['ratios'][name]:.3f}"
        if name in trainer["record_step_host_ms"]:
            helper = "helper thread" if trainer["records_on_helper_thread"][name] else "training thread"
            line += (
                f"  record_step {trainer['record_step_host_ms'][name]:.2f} ms (records built on the {helper})"
            )
        if syncs is not None:
            line += f"  syncs {syncs[name]}"
        print(line)
    print(
        f"  regions on the per-region op (written in place after their tap): {trainer['regions_on_the_per_region_op']}"
    )
    for name, spent in trainer.get("phase_host_ms", {}).items():
        print(f"  host ms per step (median), {name}: " + "  ".join(f"{k} {v:.2f}" for k, v in spent.items()))
        slowest = trainer["phase_host_ms_max"][name]
        print("    the slowest step's: " + "  ".join(f"{k} {v:.2f}" for k, v in slowest.items()))
        calls = (trainer.get("device_allocator_calls") or {}).get(name)
        if calls is not None:
            print(
                f"    allocator in the timed steps: {calls['cudaMalloc']} cudaMalloc, {calls['cudaFree']} cudaFree"
            )
        inside = trainer["collector_host_ms"].get(name)
        if inside:
            print("    inside the collector (mean): " + "  ".join(f"{k} {v:.2f}" for k, v in inside.items()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=["tiny", "deep-tiny", "0.5b"])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny models")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--sink", default="memory", choices=["memory", "direct"])
    parser.add_argument(
        "--background",
        action="store_true",
        help="also time fingerprints with the records built on the collector's helper thread "
        "(background_records=True)",
    )
    parser.add_argument(
        "--without-distribution",
        action="store_true",
        help="graphs/trainer: also time every region fingerprinted without the distribution's top-k "
        "and sketch (distribution_k=0)",
    )
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--scenario", default="trainer", choices=["trainer", "graphs"])
    parser.add_argument(
        "--part",
        default="both",
        choices=["both", "engine", "trainer"],
        help="graphs: which of the two to time",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="graphs/trainer: write cProfile stats of each configuration's timed steps here",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="graphs/trainer: host time per step of each phase (forward, record_step, backward, ...) "
        "and of the collector's parts (a perf_counter around each; no profiler)",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="graphs/trainer on CUDA: print the N kernels of most device time in one step of each "
        "configuration (torch.profiler)",
    )
    parser.add_argument(
        "--find-waits",
        action="store_true",
        help="graphs/trainer on CUDA: one more step of each configuration behind a queued device "
        "sleep, under cProfile: the call that waits for the device shows the sleep as its own time",
    )
    parser.add_argument(
        "--no-switch", action="store_true", help="graphs/trainer: leave out timing a mode switch's recompile"
    )
    parser.add_argument("--new", type=int, default=128, help="graphs: decode steps timed per generate")
    parser.add_argument("--check-new", type=int, default=16, help="graphs: tokens of the bitwise check")
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.scenario == "graphs":
        if args.threads:
            torch.set_num_threads(args.threads)
        result = run_graphs(args)
        engine, trainer = result["engine"], result["compiled_trainer"]
        print(f"device {result['device_name']}  model {result['model']}  {result['dtype']}")
        if engine is not None:
            print_engine(engine)
        if trainer is not None:
            print_trainer(trainer)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return
    result = run(args)
    for name, ms in result["median_ms"].items():
        extra = f"  {result['overhead_pct'][name]:+6.1f} %" if name in result["overhead_pct"] else "         "
        queued = result["host_median_ms"][name]
        syncs = result["syncs_per_step"]
        extra += f"   host {queued:8.2f} ms" + (f"   syncs {syncs[name]}" if syncs else "")
        print(f"{name:24s} {ms:9.2f} ms/step{extra}")
    shown = ("median_ms", "overhead_pct", "host_median_ms", "syncs_per_step")
    print(json.dumps({k: v for k, v in result.items() if k not in shown}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
