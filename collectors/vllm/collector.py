"""The rollout collector: ``attach(llm, run=..., sink=...)`` and one ``record_step`` per generate.

Usage in an RL loop::

    llm = LLM(model, enforce_eager=True, logprobs_mode="processed_logprobs")   # or worker_extension_cls=EXTENSION
    handle = collectors.vllm.attach(llm, run="rl-run-7", sink=HttpSink(url, token), fingerprint=8)
    for step in range(steps):
        outputs = llm.generate(prompts, SamplingParams(temperature=0.7, logprobs=0))
        handle.record_step(step, outputs)          # logprobs + fingerprints of 1 request in 8
        ...
        collectors.vllm.load_weights(llm, trainer_state.items(), version=step + 1)

What is recorded per sampled sequence: the tokens (prompt ‖ completion) and the logprobs vLLM
returned for them, with their semantics (the engine's ``logprobs_mode``), the request's temperature,
top-k and top-p as the engine applied them, the weight version, and the ``sample_key`` derived from
the tokens exactly as the trainer derives it. For the requests chosen for fingerprinting, the
engine's per-region fingerprints at every position it computed, as ``engine_prefill`` or
``engine_decode``. ``record_step`` never raises (unless ``strict=True``); records go to the sink's
queue.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from audit.records import (
    Case,
    Manifest,
    Record,
    RegionFingerprints,
    Run,
    RuntimeFacts,
    SampleLogprobs,
    sample_key,
)
from collectors.manifest import ManifestTracker
from collectors.sinks.base import Sink
from collectors.vllm.link import EngineLink
from collectors.vllm.outputs import Completion, read_completions
from collectors.vllm.selection import SelectionArg, parse_selection

log = logging.getLogger(__name__)

#: vLLM's ``logprobs_mode`` → the wire's ``semantics``. The ``*_logits`` modes return logits, not logprobs.
SEMANTICS = {"raw_logprobs": "raw", "processed_logprobs": "processed"}

CASES: tuple[Case, ...] = ("engine_prefill", "engine_decode")

_ATTACHED: weakref.WeakKeyDictionary[Any, VllmCollector] = weakref.WeakKeyDictionary()


@dataclass
class RolloutCounters:
    steps: int = 0
    samples: int = 0
    fingerprint_records: int = 0
    manifests: int = 0
    missing_logprobs: int = 0
    missing_engine_info: int = 0
    truncated_samples: int = 0
    mixed_weight_versions: int = 0
    errors: int = 0


@dataclass(frozen=True)
class StepReport:
    """What one ``record_step`` produced (``records`` only with ``keep_records=True``)."""

    step: int
    sample_keys: list[str]
    n_fingerprint_records: int
    records: list[Record] = field(default_factory=list)


def _merge_ranks(
    results: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """One entry per request across workers: metadata from the first that has it, prints from all
    (each pipeline stage sees its own layers; only TP rank 0 of a stage records)."""
    merged: dict[str, dict[str, Any]] = {}
    for result in results:
        for ext, body in result.get("requests", {}).items():
            if ext not in merged:
                merged[ext] = {**body, "prints": list(body["prints"])}
            else:
                merged[ext]["prints"].extend(body["prints"])
                merged[ext]["truncated"] = merged[ext]["truncated"] or body["truncated"]
    return merged, [dict(r.get("counters", {})) for r in results]


def _prints_records(
    *, run_id: str, step: int, key: str, n_tokens: int, prints: Sequence[Mapping[str, Any]], validate: bool
) -> list[RegionFingerprints]:
    records = []
    for body in prints:
        positions = np.frombuffer(body["positions"], dtype="<i4")
        keep = positions < n_tokens
        rungs = len(body["ladder_bits"])
        n = positions.size
        fields = {
            "run_id": run_id,
            "step": step,
            "side": "rollout",
            "case": body["case"],
            "sample_key": key,
            "region": body["region"],
            "forward_index": 0,
            "positions": positions[keep].astype(np.int32),
            "digest": np.frombuffer(body["digest"], dtype=np.uint64)[keep],
            "ladder_bits": list(body["ladder_bits"]),
            "ladder": np.frombuffer(body["ladder"], dtype=np.uint64).reshape(n, rungs)[keep],
            "sketch": np.frombuffer(body["sketch"], dtype=np.float32).reshape(n, -1)[keep],
            "l2": np.frombuffer(body["l2"], dtype=np.float32)[keep],
            "maxabs": np.frombuffer(body["maxabs"], dtype=np.float32)[keep],
        }
        if not keep.any():
            continue
        records.append(
            RegionFingerprints(**fields) if validate else RegionFingerprints.model_construct(**fields)
        )
    return records


class VllmCollector:
    """The handle :func:`attach` returns.

    ``contract``: the execution contract (or its identities) the engine runs under, for the
    manifest. ``weight_version``: the version of the weights the engine starts with (later ones come
    from :func:`collectors.vllm.load_weights`). ``max_requests``/``max_rows``: the engine-side
    buffers' bounds (requests tracked, fingerprint rows kept until drained). ``flush_bytes``: how
    many bytes of selected activations wait on the device before a batched fingerprint pass.
    ``validate``: build records through pydantic validation (tests); ``strict``: raise instead of
    counting errors (tests); ``keep_records``: return each step's records in its report.
    """

    def __init__(
        self,
        llm: Any,
        *,
        run: str | Run,
        sink: Sink,
        regions: str | Sequence[str] | Mapping[str, str] | None = "auto",
        fingerprint: SelectionArg = "all",
        contract: Any = None,
        weight_version: str | int | None = None,
        max_requests: int = 65536,
        max_rows: int = 1 << 20,
        flush_bytes: int = 64 << 20,
        validate: bool = False,
        strict: bool = False,
        keep_records: bool = False,
    ) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink: expected a collectors.sinks.Sink, got {type(sink).__name__}")
        if not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests: must be an integer >= 1, got {max_requests!r}")
        if not isinstance(max_rows, int) or max_rows < 0:
            raise ValueError(f"max_rows: must be an integer >= 0, got {max_rows!r}")
        if not isinstance(flush_bytes, int) or flush_bytes < 0:
            raise ValueError(f"flush_bytes: must be an integer >= 0, got {flush_bytes!r}")
        selection = parse_selection(fingerprint)
        if attached(llm) is not None:
            raise ValueError("llm: a collector is already attached to this engine; detach() it first")
        self.link = EngineLink(llm)
        mode = str(llm.llm_engine.vllm_config.model_config.logprobs_mode)
        if mode not in SEMANTICS:
            raise ValueError(
                f"llm: logprobs_mode {mode!r} returns logits, not logprobs; start the engine with "
                "logprobs_mode='processed_logprobs' (or 'raw_logprobs')"
            )
        self.semantics = SEMANTICS[mode]
        self.run = run if isinstance(run, Run) else Run(run_id=run, name=run)
        self.sink = sink
        self.validate = validate
        self.strict = strict
        self.keep_records = keep_records
        self.counters = RolloutCounters()
        self.engine_counters: list[dict[str, Any]] = []
        self._logged: set[str] = set()
        infos = self.link.call(
            "start",
            {
                "regions": regions
                if regions is None or isinstance(regions, str | Mapping)
                else list(regions),
                "selection": selection.to_wire(),
                "max_requests": max_requests,
                "max_rows": max_rows,
                "flush_bytes": flush_bytes,
                "version": str(weight_version) if weight_version is not None else None,
            },
        )
        self.infos = infos
        lead = infos[0]
        self.facts = RuntimeFacts(**lead["facts"])
        self.refusal: str | None = lead["refusal"]
        self.regions = sorted({name for info in infos for name in info["regions"]}, key=_order)
        hooked = set(self.regions)
        self._unobserved = {k: v for info in infos for k, v in info["unobserved"].items() if k not in hooked}
        self.weight_version: str | None = lead["weight_version"]
        self.weight_digest: str | None = lead["weight_digest"]
        self._trackers = {
            case: ManifestTracker(
                run_id=self.run.run_id,
                side="rollout",
                case=case,
                regions=self.regions,
                unobserved=self._unobserved_for(selection.mode),
                contract=contract,
            )
            for case in CASES
        }
        initial: list[Record] = [self.run]
        self._refresh_manifests(initial)
        self.sink.send(initial)
        _ATTACHED[llm] = self
        if self.refusal:
            log.warning("isoaudit vllm collector: %s", self.refusal)

    # ------------------------------------------------------------------ public

    @property
    def manifest(self) -> Manifest | None:
        """The latest manifest sent (the ``engine_prefill`` one; ``engine_decode`` differs only in case)."""
        return self._trackers["engine_prefill"].current

    @property
    def mode(self) -> str:
        """How the collector reaches the workers: ``in_process`` or ``worker_extension``."""
        return self.link.mode

    def record_step(self, step: int, outputs: Iterable[Any]) -> StepReport | None:
        """Record the sampled sequences of ``outputs`` (what ``LLM.generate`` returned) as step ``step``:
        their logprobs and, for the requests chosen for fingerprinting, the engine's region fingerprints."""
        try:
            return self._record(step, outputs)
        except Exception as exc:
            self.counters.errors += 1
            if self.strict:
                raise
            self._log_once(
                "record",
                f"isoaudit vllm collector: record_step failed ({type(exc).__name__}: {exc}); counted",
            )
            return None

    def select(self, fingerprint: SelectionArg) -> None:
        """Change which requests are fingerprinted from the next request the engine sees (the
        manifest follows: with ``None`` it says no region is observed, and why)."""
        selection = parse_selection(fingerprint)
        self.link.call("select", selection.to_wire())
        for tracker in self._trackers.values():
            tracker.unobserved = self._unobserved_for(selection.mode)
        records: list[Record] = []
        self._refresh_manifests(records)
        self.sink.send(records)

    def _unobserved_for(self, mode: str) -> dict[str, str]:
        if mode == "none" and self.refusal is None:
            return {"*": "fingerprints not requested (fingerprint=None)"}
        return dict(self._unobserved)

    def stats(self) -> dict[str, Any]:
        """Collector counters, the engine-side counters of the last drain, and the sink's counters."""
        return {**asdict(self.counters), "engine": self.engine_counters, "sink": self.sink.stats()}

    def flush(self, timeout: float | None = 30.0) -> bool:
        return self.sink.flush(timeout)

    def detach(self) -> None:
        """Remove every hook inside the engine; it then runs exactly as before :func:`attach`.
        Never raises (an engine already shut down has no hooks left to remove)."""
        _ATTACHED.pop(self.link.llm, None)
        try:
            self.engine_counters = self.link.call("stop")
        except Exception as exc:
            self.counters.errors += 1
            self._log_once(
                "detach", f"isoaudit vllm collector: detach could not reach the engine ({exc}); counted"
            )

    # ------------------------------------------------------------------ internals

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("%s", message)

    def _refresh_manifests(self, out: list[Record]) -> None:
        for tracker in self._trackers.values():
            built = tracker.build(self.facts, self.weight_version).model_copy(
                update={"weight_digest": self.weight_digest}
            )
            manifest = tracker.changed(built)
            if manifest is not None:
                out.append(manifest)
                self.counters.manifests += 1

    def weights_changed(self, version: str, digest: str | None) -> None:
        """Called by :func:`collectors.vllm.load_weights`: later manifests carry the new weights."""
        self.weight_version, self.weight_digest = version, digest
        records: list[Record] = []
        self._refresh_manifests(records)
        self.sink.send(records)

    def _record(self, step: int, outputs: Iterable[Any]) -> StepReport:
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step: must be an integer >= 0, got {step!r}")
        step = int(step)
        completions = read_completions(outputs)
        merged, engine_counters = _merge_ranks(self.link.call("drain", [c.engine_id for c in completions]))
        self.engine_counters = engine_counters
        records: list[Record] = []
        self._refresh_manifests(records)
        keys, n_prints = [], 0
        for completion in completions:
            engine = merged.get(completion.engine_id)
            built = self._sample(step, completion, engine)
            if built is None:
                continue
            sample, prints = built
            records.append(sample)
            records += prints
            keys.append(str(sample.sample_key))
            n_prints += len(prints)
        self.sink.send(records)
        self.counters.steps += 1
        self.counters.samples += len(keys)
        self.counters.fingerprint_records += n_prints
        return StepReport(step, keys, n_prints, records if self.keep_records else [])

    def _sample(
        self, step: int, completion: Completion, engine: Mapping[str, Any] | None
    ) -> tuple[SampleLogprobs, list[RegionFingerprints]] | None:
        if completion.logprobs is None:
            self.counters.missing_logprobs += 1
            self._log_once(
                "logprobs",
                "isoaudit vllm collector: a request returned no logprobs; ask for them "
                "with SamplingParams(logprobs=0) (its samples are not recorded; counted)",
            )
            return None
        if engine is None:
            self.counters.missing_engine_info += 1
            self._log_once(
                "engine",
                "isoaudit vllm collector: the engine has no record of a request (run before "
                "attach, drained already, or evicted); its sample is not recorded (counted)",
            )
            return None
        tokens = np.concatenate([completion.prompt_ids, completion.completion_ids]).astype(np.int32)
        key = sample_key(tokens)
        prompt_len = int(completion.prompt_ids.size)
        if engine["first_version"] != engine["last_version"]:
            self.counters.mixed_weight_versions += 1
        version = engine["last_version"] if engine["last_version"] is not None else self.weight_version
        fields = {
            "run_id": self.run.run_id,
            "step": step,
            "side": "rollout",
            "sample_key": key,
            "weight_version": version,
            "prompt_len": prompt_len,
            "token_ids": tokens,
            # A log-softmax can round to a hair above 0 for a near-certain token; the wire refuses > 0.
            "logprobs": np.minimum(completion.logprobs, np.float32(0.0)),
            "temperature": float(engine["temperature"]),
            "top_k": engine["top_k"],
            "top_p": engine["top_p"],
            "semantics": self.semantics,
            "path": _path_facts(completion.cached_tokens, engine.get("prefill_forwards")),
        }
        sample = SampleLogprobs(**fields) if self.validate else SampleLogprobs.model_construct(**fields)
        if engine["truncated"]:
            self.counters.truncated_samples += 1
        prints = _prints_records(
            run_id=self.run.run_id,
            step=step,
            key=key,
            n_tokens=tokens.size,
            prints=engine["prints"],
            validate=self.validate,
        )
        return sample, prints


def _path_facts(cached_tokens: int | None, prefill_forwards: int | None) -> dict[str, int]:
    """The inference path this sample actually took (``SampleLogprobs.path``), as far as it is known:
    the diagnosis blames prefix caching or chunked prefill only when they were taken, not merely on."""
    facts = {"prefix_cached_tokens": cached_tokens, "prefill_chunks": prefill_forwards}
    return {name: int(value) for name, value in facts.items() if value is not None}


def _order(name: str) -> tuple[int, int, int, str]:
    from audit.regions import region_order

    return region_order(name)


def attach(
    llm: Any,
    run: str | Run,
    sink: Sink,
    regions: str | Sequence[str] | Mapping[str, str] | None = "auto",
    fingerprint: SelectionArg = "all",
    **options: Any,
) -> VllmCollector:
    """Hook the engine of ``llm`` (a ``vllm.LLM``) and send the run and the engine's manifests to ``sink``.

    ``regions``: ``"auto"`` (vLLM Llama/Mistral/Qwen2/Qwen3), canonical names (a subset), a mapping
    canonical name → module name, or ``None`` (logprobs only). ``fingerprint``: which requests to
    fingerprint: ``"all"``, an integer N (one in N), a list of request ids, or ``None``. Further
    options: :class:`VllmCollector` (``contract``, ``weight_version``, ``max_rows``, ``strict``, ...).

    The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or have been created
    with ``worker_extension_cls=collectors.vllm.EXTENSION``.
    """
    return VllmCollector(llm, run=run, sink=sink, regions=regions, fingerprint=fingerprint, **options)


def attached(llm: Any) -> VllmCollector | None:
    """The collector attached to ``llm``, if any."""
    return _ATTACHED.get(llm)
