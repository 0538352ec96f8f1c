"""The rollout collector: ``attach(llm, run=..., sink=...)`` and one ``record_step`` per generate.

Usage in an RL loop::

    llm = LLM(model, enforce_eager=True, logprobs_mode="processed_logprobs")   # or worker_extension_cls=EXTENSION
    handle = audit.watch_vllm(llm, fingerprint=8)      # audit: an isoaudit.session(...)
    for step in range(steps):
        outputs = llm.generate(prompts, SamplingParams(temperature=0.7, logprobs=0))
        handle.record_step(step, outputs)          # logprobs + fingerprints of 1 request in 8
        ...
        isoaudit.collectors.vllm.load_weights(llm, trainer_state.items(), version=step + 1)

What is recorded per sampled sequence: the tokens (prompt ‖ completion) and the logprobs vLLM
returned for them, with their semantics (the engine's ``logprobs_mode``), the request's temperature,
top-k and top-p as the engine applied them, the weight version, and the ``sample_key`` derived from
the tokens exactly as the trainer derives it. For the requests chosen for fingerprinting, the
engine's per-region fingerprints at every position it computed, as ``engine_prefill`` or
``engine_decode``. ``record_step`` never raises (unless ``strict=True``); records go to the sink's
queue. At the end of each ``record_step`` (or at ``begin_step``, called before ``generate``) the collector
asks its control channel for the desired remediation mode; a new one goes to every worker, which
switches its layers at its next step (:mod:`isoaudit.collectors.vllm.worker.remediation`) and reports the mode
it runs, and each op's implementation, with the next drain; the manifest then says what was applied
and which regions stay native.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from isoaudit.audit.records import (
    Case,
    Environment,
    Record,
    RegionFingerprints,
    Run,
    RuntimeFacts,
    SampleLogprobs,
    sample_key,
)
from isoaudit.collectors.base import Collector, CollectorCounters, ModeReport, RolloutStep
from isoaudit.collectors.batch_probe import PROBE_COUNTERS, ProbeArg, ProbePolicy
from isoaudit.collectors.control import ControlChannel
from isoaudit.collectors.manifest import ContractArg
from isoaudit.collectors.sinks.base import Sink
from isoaudit.collectors.vllm.batch_probe import probe_step
from isoaudit.collectors.vllm.canary import take_canary, take_pending_canary
from isoaudit.collectors.vllm.engine_state import drain_facts, sample_fields
from isoaudit.collectors.vllm.link import EngineLink
from isoaudit.collectors.vllm.messages import (
    ENVIRONMENT_KEY,
    Drain,
    Drained,
    LoadWeights,
    ModeState,
    RegionPrints,
    RequestRecord,
    SetMode,
    Start,
    Started,
    Stopped,
    from_wire,
    to_wire,
)
from isoaudit.collectors.vllm.outputs import Completion, read_completions
from isoaudit.collectors.vllm.selection import SelectionArg, parse_selection
from isoaudit.collectors.vllm.weights import refresh_held

log = logging.getLogger(__name__)

#: vLLM's ``logprobs_mode`` → the wire's ``semantics``. The ``*_logits`` modes return logits, not logprobs.
#: The vLLM probe's default cadence: every recorded step is one the engine fingerprints, and a probe
#: prefills its samples twice more (alone, beside their batch-mates), so it runs every 8th step.
PROBE_EVERY = 8

SEMANTICS = {"raw_logprobs": "raw", "processed_logprobs": "processed"}

CASES: tuple[Case, ...] = ("engine_prefill", "engine_decode")

RegionsArg = str | Sequence[str] | Mapping[str, str] | None

_ATTACHED: weakref.WeakKeyDictionary[Any, VllmCollector] = weakref.WeakKeyDictionary()


class RolloutCounters(CollectorCounters):
    NAMES = (
        *CollectorCounters.NAMES,
        "missing_logprobs",
        "missing_engine_info",
        "truncated_samples",
        "mixed_weight_versions",
        *PROBE_COUNTERS,
    )


#: What one ``record_step`` produced.
StepReport = RolloutStep


def _merge_ranks(results: Sequence[Drained]) -> tuple[dict[str, RequestRecord], list[dict[str, int]]]:
    """One entry per request across workers: metadata from the first that has it, prints from all
    (each pipeline stage sees its own layers; only TP rank 0 of a stage records)."""
    merged: dict[str, RequestRecord] = {}
    for result in results:
        for ext, body in result.requests.items():
            if ext not in merged:
                merged[ext] = body
            else:
                first = merged[ext]
                first.prints = [*first.prints, *body.prints]
                first.truncated = first.truncated or body.truncated
    return merged, [dict(r.counters) for r in results]


def _prints_records(
    *, run_id: str, step: int, key: str, n_tokens: int, prints: Sequence[RegionPrints], validate: bool
) -> list[RegionFingerprints]:
    records = []
    for body in prints:
        arrays = body.arrays()
        positions = arrays["positions"]
        # positions are sorted: those of the sample's tokens come first (usually all of them)
        kept = int(np.searchsorted(positions, n_tokens))
        if kept == 0:
            continue
        fields: dict[str, Any] = {
            "run_id": run_id,
            "step": step,
            "side": "rollout",
            "case": body.case,
            "sample_key": key,
            "region": body.region,
            "forward_index": 0,
            "ladder_bits": list(body.ladder_bits),
            **{name: values[:kept] if kept < positions.size else values for name, values in arrays.items()},
        }
        fields["positions"] = fields["positions"].astype(np.int32)
        records.append(
            RegionFingerprints(**fields) if validate else RegionFingerprints.model_construct(**fields)
        )
    return records


class VllmCollector(Collector):
    """The handle :func:`attach` (or ``Session.watch_vllm``) returns.

    ``regions``: ``"auto"`` (vLLM Llama/Mistral/Qwen2/Qwen3), canonical names (a subset), a mapping
    canonical name → module name, or ``None`` (logprobs only). ``fingerprint``: which requests to
    fingerprint: ``"all"``, an integer N (one in N), a list of request ids, or ``None``.
    ``contract``: the execution contract (or its identities) the engine runs under, for the
    manifest; ``"auto"``: built from what the workers report running in each mode
    (:mod:`isoaudit.collectors.policy`), so the handshake names the regions remediation cannot replace.
    ``control``: where the desired remediation mode comes from. ``weight_version``: the version of the weights
    the engine starts with (later ones come from :func:`isoaudit.collectors.vllm.load_weights` or
    :meth:`weights_changed`). ``max_requests``/``max_rows``: the engine-side buffers' bounds (requests
    tracked, fingerprint rows kept until drained). ``flush_bytes``: how many bytes of selected activations
    wait on the device before a batched fingerprint pass. ``validate``: build records through pydantic
    validation (tests; the store validates anyway); ``strict``: raise instead of counting errors (tests);
    ``keep_records``: return each step's records in its report. ``distribution_k``: the most top-k
    entries per position kept from requests made with ``SamplingParams(logprobs=k)`` (0: none);
    with ``logprobs=-1`` the full-vocabulary sketch as well (:mod:`isoaudit.collectors.vllm.outputs`).
    ``batch_probe``: score a few of a step's samples again alone and beside their batch-mates
    (:mod:`isoaudit.collectors.vllm.batch_probe`; ``"auto"``: while the engine quantizes activations,
    on every :data:`PROBE_EVERY`-th step: each probe costs a few extra prefills; a ``ProbePolicy``
    sets its own cadence).

    The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or have been created
    with ``worker_extension_cls=isoaudit.collectors.vllm.EXTENSION``.
    """

    side = "rollout"
    COUNTERS = RolloutCounters

    def __init__(
        self,
        llm: Any,
        *,
        run: str | Run,
        sink: Sink,
        regions: RegionsArg = "auto",
        fingerprint: SelectionArg = "all",
        contract: ContractArg | Literal["auto"] = None,
        control: ControlChannel | None = None,
        weight_version: str | int | None = None,
        max_requests: int = 65536,
        max_rows: int = 1 << 20,
        flush_bytes: int = 64 << 20,
        validate: bool = False,
        strict: bool = False,
        keep_records: bool = False,
        distribution_k: int = 8,
        batch_probe: ProbeArg = "auto",
    ) -> None:
        self.batch_probe = ProbePolicy.parse(batch_probe, every=PROBE_EVERY)
        if not isinstance(distribution_k, int) or distribution_k < 0:
            raise ValueError(f"distribution_k: must be an integer >= 0, got {distribution_k!r}")
        if not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests: must be an integer >= 1, got {max_requests!r}")
        if not isinstance(max_rows, int) or max_rows < 0:
            raise ValueError(f"max_rows: must be an integer >= 0, got {max_rows!r}")
        if not isinstance(flush_bytes, int) or flush_bytes < 0:
            raise ValueError(f"flush_bytes: must be an integer >= 0, got {flush_bytes!r}")
        selection = parse_selection(fingerprint)
        if attached(llm) is not None:
            raise ValueError("llm: a collector is already attached to this engine; detach() it first")
        self.canary_pending: tuple[str | None] | None = None  # a canary an in-flight update deferred
        self._contract_auto = contract == "auto"  # built in _contract_now from what the workers run
        super().__init__(
            run=run,
            sink=sink,
            cases=CASES,
            contract=None if contract == "auto" else contract,
            control=control,
            strict=strict,
            weight_version=weight_version,
        )
        self.link = EngineLink(llm)
        logprobs_mode = str(llm.llm_engine.vllm_config.model_config.logprobs_mode)
        if logprobs_mode not in SEMANTICS:
            raise ValueError(
                f"llm: logprobs_mode {logprobs_mode!r} returns logits, not logprobs; start the engine with "
                "logprobs_mode='processed_logprobs' (or 'raw_logprobs')"
            )
        self.semantics = SEMANTICS[logprobs_mode]
        self.validate = validate
        self.keep_records = keep_records
        self.distribution_k = distribution_k
        self.engine_counters: list[dict[str, int]] = []
        start = Start(
            regions=(
                regions
                if regions is None or isinstance(regions, str)
                else dict(regions)
                if isinstance(regions, Mapping)
                else list(regions)
            ),
            selection=selection,
            max_requests=max_requests,
            max_rows=max_rows,
            flush_bytes=flush_bytes,
            version=self.weight_version,
        )
        if isinstance(start.regions, Mapping):
            start.regions = dict(start.regions)
        self._model_config = llm.llm_engine.vllm_config.model_config
        self._contracts: dict[tuple[Any, ...], Any] = {}
        self.infos = [from_wire(r, Started) for r in self.link.call("start", to_wire(start))]
        lead = self.infos[0]
        self.ops: dict[str, str] = dict(lead.mode.ops)
        #: the kernels' launch settings in the mode the workers run (the manifest's ``gemm_split``, ...)
        self.kernel_state: dict[str, Any] = dict(lead.mode.kernels)
        facts = dict(lead.facts)
        environment = facts.pop(ENVIRONMENT_KEY, None)
        #: the workers' environment, read where the forward runs (None: a worker that sent none)
        self.worker_environment = Environment.model_validate(environment) if environment else None
        self.facts = RuntimeFacts(**facts)
        self.refusal: str | None = lead.refusal
        self.regions = sorted({name for info in self.infos for name in info.regions}, key=_order)
        hooked = set(self.regions)
        self._unobserved = {
            k: v for info in self.infos for k, v in info.unobserved.items() if k not in hooked
        }
        self.weight_version = lead.weight_version
        self.weight_digest = lead.weight_digest
        self.guarded("request facts", self.link.call, "track_requests")  # stale prefix, spans, min-p
        refresh_held(self)  # what the workers hold, per tensor, for the first manifest
        take_canary(self, self.weight_version)
        self._begin(self.regions, self._unobserved_for(selection.mode))
        _ATTACHED[llm] = self
        if self.refusal:
            log.warning("isoaudit vllm collector: %s", self.refusal)

    # ------------------------------------------------------------------ public

    @property
    def link_mode(self) -> str:
        """How the collector reaches the workers: ``in_process`` or ``worker_extension``."""
        return self.link.mode

    def record_step(self, step: int, outputs: Iterable[Any]) -> StepReport | None:
        """Record the sampled sequences of ``outputs`` (what ``LLM.generate`` returned) as step ``step``:
        their logprobs and, for the requests chosen for fingerprinting, the engine's region fingerprints;
        then apply a new desired remediation mode (the workers switch at their next step)."""
        report = self.guarded("record_step", self._record, step, outputs)
        take_pending_canary(self)
        self._step_boundary()
        return report

    def begin_step(self, step: int | None = None) -> None:
        """A step boundary before ``generate``: a new desired remediation mode goes to the workers
        now, so they run this step's first forward in it (``record_step`` is the boundary
        otherwise, and the mode then applies from the next step)."""
        take_pending_canary(self)
        self._step_boundary()

    def select(self, fingerprint: SelectionArg) -> None:
        """Change which requests are fingerprinted from the next request the engine sees (the
        manifest follows: with ``None`` it says no region is observed, and why)."""
        selection = parse_selection(fingerprint)
        self.link.call("select", to_wire(selection))
        self._set_observed(unobserved=self._unobserved_for(selection.mode))
        self.publish()

    def stats(self) -> dict[str, Any]:
        """Collector counters, the engine-side counters of the last drain, and the sink's counters."""
        return {**super().stats(), "engine": self.engine_counters}

    # ------------------------------------------------------------------ internals

    def _unobserved_for(self, mode: str) -> dict[str, str]:
        if mode == "none" and self.refusal is None:
            return {"*": "fingerprints not requested (fingerprint=None)"}
        return dict(self._unobserved)

    def _environment(self) -> Environment:
        return getattr(self, "worker_environment", None) or super()._environment()

    def _runtime(self) -> RuntimeFacts:
        graph = getattr(self, "graph_state", None)
        kernels = getattr(self, "kernel_state", None) or {}
        if self.mode_report.applied != "invariant" or not self.ops:
            extra = {**kernels, "compiled_graph": graph} if graph else kernels
            return self.facts.model_copy(update=extra) if extra else self.facts
        from isoaudit.collectors.policy import QK_NORM_FAMILIES, regions_running

        hf = self._model_config.hf_config
        head = "float32" if self.ops.get("lm_head", "").startswith("kernels.") else self.facts.lm_head_dtype
        still = regions_running(
            self.ops,
            int(hf.num_hidden_layers),
            qk_norm=getattr(hf, "model_type", None) in QK_NORM_FAMILIES,
            prefix="vllm.",
        )
        update = {"lm_head_dtype": head, "remediation_native_regions": still, **kernels}
        return self.facts.model_copy(update={**update, "compiled_graph": graph} if graph else update)

    def _signature(self) -> tuple[Any, ...]:
        # the facts are read once, at attach: only the mode, the ops the workers run, the state compiled
        # into the decoder, the kernels' settings in that mode and the weights change them
        graph = getattr(self, "graph_state", None) or {}
        kernels = getattr(self, "kernel_state", None) or {}
        return (*sorted(self.ops.items()), str(graph.get("compiled_state")), str(sorted(kernels.items())))

    def _contract_now(self) -> Any:
        """``contract="auto"``: the contract of what the workers report they run (rebuilt when that
        changes); anything else as given."""
        if self._contract_auto:
            return self._auto_contract()
        return super()._contract_now()

    def _auto_contract(self) -> Any:
        if not self.ops:
            return None
        key = tuple(sorted(self.ops.items()))
        if key not in self._contracts:
            from isoaudit.collectors.policy import QK_NORM_FAMILIES, build_contract, model_spec

            dtype = str(self.facts.dtype or "bfloat16")
            head = "float32" if self.ops.get("lm_head", "").startswith("kernels.") else dtype
            hf = self._model_config.hf_config
            spec = model_spec(hf, dtype=dtype, lm_head_dtype=head)
            family = getattr(hf, "model_type", None)
            self._contracts[key] = build_contract(spec, self.ops, qk_norm=family in QK_NORM_FAMILIES)
        return self._contracts[key]

    def _apply_mode(self, mode: str, version: int | None) -> ModeReport | None:
        self.link.call("set_mode", to_wire(SetMode(mode=mode, version=version)))
        return None  # the workers switch at their next step; the next drain reports it

    def _workers_mode(self, states: Sequence[ModeState | None]) -> None:
        """The mode the workers report (the first rank's; a rank that differs is named)."""
        known = [s for s in states if s is not None]
        if known and known[0].graph:
            self.graph_state = dict(known[0].graph)
        if known:
            self.kernel_state = dict(known[0].kernels)
        if not known or known[0].step == 0 and known[0].version is None:
            return
        lead = known[0]
        if lead.ops:
            self.ops = dict(lead.ops)
        reason = lead.reason
        if any((s.applied, s.requested) != (lead.applied, lead.requested) for s in known[1:]):
            reason = f"{reason or ''}; workers disagree: {[s.applied for s in known]}".lstrip("; ")
        self._mode_reported(ModeReport(lead.requested, lead.applied, reason, lead.version))

    def _weights_moved(self, version: str, digest: str | None) -> None:
        """Tell the workers: what they compute from now on has this weight version."""
        self.link.call("load_weights", to_wire(LoadWeights(version=version, digest=digest)))
        refresh_held(self)
        take_canary(self, version)

    def _remove_hooks(self) -> None:
        """Remove every hook inside the engine; it then runs exactly as before. Never raises (an
        engine already shut down has no hooks left to remove)."""
        _ATTACHED.pop(self.link.llm, None)
        try:
            self.link.call("release_facts")
            self.engine_counters = [from_wire(r, Stopped).counters for r in self.link.call("stop")]
        except Exception as exc:
            self.counters.errors += 1
            self._log_once(
                "detach", f"isoaudit vllm collector: detach could not reach the engine ({exc}); counted"
            )

    def _record(self, step: int, outputs: Iterable[Any]) -> StepReport:
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step: must be an integer >= 0, got {step!r}")
        step = int(step)
        completions = read_completions(
            outputs, vocab=int(self._model_config.get_vocab_size()), k=self.distribution_k
        )
        drained = [
            from_wire(r, Drained)
            for r in self.link.call("drain", to_wire(Drain(request_ids=[c.engine_id for c in completions])))
        ]
        merged, self.engine_counters = _merge_ranks(drained)
        facts = (
            self.guarded("request facts", drain_facts, self.link, [c.engine_id for c in completions]) or {}
        )
        self._workers_mode([d.mode for d in drained])
        records: list[Record] = []
        self._manifests(records)
        keys, n_prints = [], 0
        for completion in completions:
            built = self._sample(
                step, completion, merged.get(completion.engine_id), facts.get(completion.engine_id)
            )
            if built is None:
                continue
            sample, prints = built
            records.append(sample)
            records += prints
            keys.append(str(sample.sample_key))
            n_prints += len(prints)
        probe_step(self, step, records)
        self.sink.send(records)
        self.counters.steps += 1
        self.counters.samples += len(keys)
        self.counters.fingerprint_records += n_prints
        return StepReport(step, keys, n_prints, records if self.keep_records else [])

    def _sample(
        self,
        step: int,
        completion: Completion,
        engine: RequestRecord | None,
        facts: dict[str, Any] | None = None,
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
        if engine.first_version != engine.last_version:
            self.counters.mixed_weight_versions += 1
        version = engine.last_version if engine.last_version is not None else self.weight_version
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
            "temperature": float(engine.temperature),
            "top_k": engine.top_k,
            "top_p": engine.top_p,
            "semantics": self.semantics,
            "path": _path_facts(completion.cached_tokens, engine.prefill_forwards),
            # the engine's top-k per position (logprobs=k), and the sketch when it returned the whole vocabulary
            "topk_ids": completion.topk_ids,
            "topk_logprobs": completion.topk_logprobs,
            "dist_sketch": completion.dist_sketch,
        }
        extra = sample_fields(
            facts,
            n_completion=int(completion.completion_ids.size),
            prefix_caching=bool(self.facts.prefix_caching),
        )
        fields.update({**extra, "path": {**fields["path"], **extra.get("path", {})}})
        sample = SampleLogprobs(**fields) if self.validate else SampleLogprobs.model_construct(**fields)
        if engine.truncated:
            self.counters.truncated_samples += 1
        prints = _prints_records(
            run_id=self.run.run_id,
            step=step,
            key=key,
            n_tokens=tokens.size,
            prints=engine.prints,
            validate=self.validate,
        )
        return sample, prints


def _path_facts(cached_tokens: int | None, prefill_forwards: int | None) -> dict[str, int]:
    """The inference path this sample actually took (``SampleLogprobs.path``), as far as it is known:
    the diagnosis blames prefix caching or chunked prefill only when they were taken, not merely on."""
    facts = {"prefix_cached_tokens": cached_tokens, "prefill_chunks": prefill_forwards}
    return {name: int(value) for name, value in facts.items() if value is not None}


def _order(name: str) -> tuple[int, int, int, str]:
    from isoaudit.audit.regions import region_order

    return region_order(name)


#: ``attach(llm, run=..., sink=..., ...)``: hook the engine of ``llm`` (a ``vllm.LLM``) and send the
#: run and the engine's manifests to ``sink`` (the session does this: ``Session.watch_vllm``).
attach = VllmCollector


def attached(llm: Any) -> VllmCollector | None:
    """The collector attached to ``llm``, if any."""
    return _ATTACHED.get(llm)
