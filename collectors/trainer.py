"""The trainer collector: ``Session.watch_trainer(model)`` (or :func:`attach`) and one
``record_step`` per forward.

Usage in a training loop::

    handle = audit.watch_trainer(model, sample_every=10)   # audit: an isoaudit.session(...)
    for step, batch in enumerate(loader):
        handle.begin_step(step)                       # optional: gates fingerprinting precisely
        out = model(**batch.model_inputs())           # hooks fingerprint regions on the device
        logprobs = compute_logprobs(out.logits, ...)  # the trainer's own
        handle.record_step(step, batch, logprobs=logprobs)   # or no logprobs: computed from logits
        ...
    audit.close()                                     # or leave the session's ``with`` block

``record_step`` uses the forward the hooks just saw when it ran over the same ``input_ids``; when
there was none (or fingerprints are due and the forward was not fingerprinted) it runs its own
``no_grad`` forward. Everything that leaves the device per step goes in one transfer; records are
handed to the sink's queue, never written in the training thread. Errors are counted and logged
once, never raised (unless ``strict=True``, for tests).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from isoaudit.audit.records import Case, Record, Run, RuntimeFacts, expand_blocks
from isoaudit.collectors.assemble import fingerprint_blocks, keys_for, sample_records, sequence_tokens
from isoaudit.collectors.base import Collector, CollectorCounters, ModeReport
from isoaudit.collectors.batch_probe import (
    PROBE_COUNTERS,
    ProbeArg,
    ProbePolicy,
    attach_trainer_probe,
    guarded_probe,
    trainer_probe,
)
from isoaudit.collectors.canary import canary_tokens, model_canary, vocab_of
from isoaudit.collectors.control import ControlChannel
from isoaudit.collectors.distribution import distribution_rows
from isoaudit.collectors.fingerprints import PackedHostPrints, PrintsLayout, SpanPrints, pack_prints
from isoaudit.collectors.held_weights import module_digests
from isoaudit.collectors.hooks import Capture, ForwardCapture
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.logprobs import (
    SamplingArg,
    applied_transforms,
    processed_logprob_rows,
    sampling_values,
)
from isoaudit.collectors.manifest import ContractArg, runtime_signature, trainer_runtime
from isoaudit.collectors.quantization import effective_digests, quantizes_activations
from isoaudit.collectors.regions import RegionsArg, resolve_regions
from isoaudit.collectors.remediation import RemediationHook, apply_kernels_mode, switch_with
from isoaudit.collectors.sinks.base import Sink
from isoaudit.collectors.step_pipeline import BuiltStep, Outcome, StepPipeline
from isoaudit.collectors.transfer import HostCopy, to_device
from torch import nn

log = logging.getLogger(__name__)

LogprobsLayout = Literal["auto", "tokens", "shifted", "completion"]
LogprobsArg = torch.Tensor | np.ndarray | Sequence[Any] | None


class TrainerCounters(CollectorCounters):
    NAMES = (*CollectorCounters.NAMES, "own_forwards", *PROBE_COUNTERS)


@dataclass(frozen=True)
class StepReport:
    """What one ``record_step`` produced (``records`` only with ``keep_records=True``)."""

    step: int
    sample_keys: list[str]
    n_fingerprint_records: int
    own_forward: bool
    records: list[Record] = field(default_factory=list)
    deferred: bool = False  # the device copy is still under way: keys and records follow later


@dataclass
class _StepInFlight:
    """A recorded step whose arrays are still travelling to the host."""

    step: int
    batch: StepBatch
    copy: HostCopy
    version: str | None
    layout: PrintsLayout
    keys: list[tuple[str, int]]
    compacted: bool
    head: list[Record]
    sampling: dict[str, np.ndarray | None] = field(default_factory=dict)
    distribution: bool = False  # the copy holds each position's top-k and sketch ("dk_*")


class TrainerCollector(Collector):
    """The handle :func:`attach` (or ``Session.watch_trainer``) returns.

    ``regions``: ``"auto"`` (HF Llama/Qwen2/Qwen3/Mistral), canonical names (a subset), a mapping
    canonical name → module name (any model), or ``None`` (logprobs only). ``sample_every``:
    fingerprint every N-th step (logprobs are recorded every step). ``case``: ``trainer_fwd`` or
    ``trainer_recompute``. ``contract``: the execution contract (or its identities) for the
    manifest. ``control``: where the desired remediation mode comes from (``None``: never
    switches by itself). ``remediation_hook(model, mode)``: how this process switches modes
    (default: :mod:`isoaudit.kernels` on/off). ``mode``: the mode the model runs in now.
    ``validate``: build records through pydantic (tests; the store validates anyway);
    ``strict``: raise instead of counting errors (tests); ``keep_records``: return each step's
    records in its report. ``weight_digests``: digest every parameter on its device at attach and
    at each weight version change (``Manifest.weight_tensor_digests``), so weights that differ under
    one claimed version are named.

    Each step's records travel through one :class:`~isoaudit.collectors.step_pipeline.StepPipeline`.
    ``async_transfer``: on CUDA, let each step's arrays travel to the host while the training step
    goes on; their records are built at a later ``record_step`` (at most ``max_inflight`` steps
    behind), or at ``flush``/``detach``. Off, ``record_step`` waits for the copy.
    ``background_records``: a helper thread waits for each step's copy and builds its records; the
    training thread only sends them, at its next ``record_step`` or ``flush``. Reports are then
    always deferred. Off (the default), the records of a step whose copy landed are built on the
    training thread at a later ``record_step``: the helper's Python holds the interpreter lock
    while it works, so in a host-bound step (a compiled trainer queues its kernels faster than the
    GPU runs them only when nothing else takes the lock) it costs the step as much or more than
    building inline (``bench/collector_overhead.py --scenario graphs --background``).
    ``distribution_k``: on fingerprinted steps (every ``sample_every``-th), record per completion
    position the top-k of the distribution its logprob comes from and its full-vocabulary sketch
    (:mod:`isoaudit.audit.distribution`); 0: never. ``batch_probe``: on fingerprinted steps, recompute
    a few samples alone and record how far their logprobs moved with the batch composition
    (:mod:`isoaudit.collectors.batch_probe`; ``"auto"``: while this side quantizes activations).
    """

    side = "trainer"
    COUNTERS = TrainerCounters

    def __init__(
        self,
        model: nn.Module,
        *,
        run: str | Run,
        sink: Sink,
        regions: RegionsArg = "auto",
        sample_every: int = 1,
        case: Case = "trainer_fwd",
        contract: ContractArg = None,
        control: ControlChannel | None = None,
        remediation_hook: RemediationHook | None = apply_kernels_mode,
        mode: str = "native",
        validate: bool = False,
        strict: bool = False,
        keep_records: bool = False,
        async_transfer: bool = True,
        max_inflight: int = 2,
        weight_digests: bool = True,
        background_records: bool = False,
        distribution_k: int = 8,
        batch_probe: ProbeArg = "auto",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(sample_every, int) or sample_every < 1:
            raise ValueError(f"sample_every: must be an integer >= 1, got {sample_every!r}")
        if case not in ("trainer_fwd", "trainer_recompute"):
            raise ValueError(f"case: a trainer records 'trainer_fwd' or 'trainer_recompute', got {case!r}")
        if not isinstance(distribution_k, int) or distribution_k < 0:
            raise ValueError(f"distribution_k: must be an integer >= 0, got {distribution_k!r}")
        if max_inflight < 0:
            raise ValueError(f"max_inflight: must be >= 0, got {max_inflight}")
        super().__init__(
            run=run, sink=sink, cases=(case,), contract=contract, control=control, strict=strict, mode=mode
        )
        self.model = model
        self.sample_every = sample_every
        self.distribution_k = distribution_k
        self.batch_probe = ProbePolicy.parse(batch_probe)
        self.case: Case = case
        self.validate = validate
        self.keep_records = keep_records
        self.async_transfer = async_transfer
        self.max_inflight = max_inflight
        self.background_records = background_records
        self._pipeline: StepPipeline[_StepInFlight] = StepPipeline(
            self._build, _copy_landed, background=bool(background_records)
        )
        self.remediation_hook = remediation_hook
        self.resolved = resolve_regions(model, regions)
        self._next_step: int | None = None
        self._capture = ForwardCapture(model, self.resolved.specs, should_fingerprint=self._fingerprint_due)
        self.weight_digests = weight_digests
        self._applied: tuple[str, ...] = ("temperature",)
        self._held_now()
        self._canary_now(self.weight_version)
        self._begin(self.resolved.names, self.resolved.unobserved)

    # ------------------------------------------------------------------ public

    @property
    def regions(self) -> list[str]:
        """Canonical regions hooked, in forward order."""
        return self.resolved.names

    @property
    def attached(self) -> bool:
        return self._capture.attached

    def begin_step(self, step: int, batch: StepBatch | Mapping[str, Any] | None = None) -> None:
        """Say which step the next forwards belong to, so hooks fingerprint only on sampled steps
        (without it the collector assumes the step after the last recorded one). With ``batch``,
        padding rows are skipped on any device (otherwise only when the mask is on the CPU). It is
        also a step boundary: a new desired remediation mode is applied here (else at the end of
        the previous ``record_step``)."""
        self._next_step = step
        coerced = StepBatch.coerce(batch) if batch is not None else None
        self._capture.row_hint = _row_hint(coerced) if coerced is not None else None
        # a new remediation mode takes effect before this step's forward; the manifests go out
        # with the step's records (record_step checks them first), or now if the mode changed
        self._step_boundary(publish=False)
        # a compiled forward fingerprints through the op into buffers of this batch's shape
        due = coerced is not None and bool(self.resolved.specs) and self._fingerprint_due()
        param = next(self.model.parameters(), None) if due else None
        shape = tuple(coerced.input_ids.shape) if coerced is not None else ()
        self._capture.prepare_compiled(shape, param.device if param is not None else None)

    def record_step(
        self,
        step: int,
        batch: StepBatch | Mapping[str, Any],
        *,
        logprobs: LogprobsArg = None,
        logprobs_layout: LogprobsLayout = "auto",
        weight_version: str | int | None = None,
        top_k: SamplingArg = None,
        top_p: SamplingArg = None,
        min_p: SamplingArg = None,
    ) -> StepReport | None:
        """Record one forward's samples: their logprobs (given, or computed from the logits with the
        sampler's transforms) and, on sampled steps, every hooked region's fingerprints.

        ``top_k``/``top_p``/``min_p`` (one value, or one per sample; ``None``: not applied): computed
        logprobs apply them exactly as vLLM's processed mode does (temperature, min-p, top-k, top-p,
        then a log-softmax renormalised over the kept set); with given ``logprobs`` they state what
        the caller applied. Either way each record and the manifest (``logprobs_applied``) say so.

        ``logprobs``: one 1-D array per sample (its completion tokens), or a tensor laid out like
        ``input_ids`` (``tokens``: value at each token's own position), shifted by one
        (``shifted``: ``[rows, cols-1]``, position t holds token t+1's), or ``[samples, max
        completion]`` (``completion``); ``auto`` tells them apart by shape.
        """
        try:
            return self.guarded(
                "record_step",
                self._record,
                step,
                batch,
                logprobs,
                logprobs_layout,
                weight_version,
                {"top_k": top_k, "top_p": top_p, "min_p": min_p},
            )
        finally:
            self._capture.row_hint = None
            if isinstance(step, int | np.integer):
                self._next_step = int(step) + 1

    def stats(self) -> dict[str, Any]:
        """Collector counters, hook errors, the applied mode and the sink's counters."""
        return {**super().stats(), "hook_errors": self._capture.errors}

    # ------------------------------------------------------------------ internals

    def _fingerprint_due(self) -> bool:
        return self._next_step is None or self._next_step % self.sample_every == 0

    def _runtime(self) -> RuntimeFacts:
        return trainer_runtime(self.model).model_copy(update={"logprobs_applied": ",".join(self._applied)})

    def _signature(self) -> tuple[Any, ...]:
        return (*runtime_signature(self.model), self._applied)

    def _held_now(self) -> None:
        """Digest the parameters this process holds now (at attach and at each version change)."""
        if self.weight_digests:
            digests = self.guarded("weight digests", module_digests, self.model)
            self.weight_tensor_digests = digests if digests is not None else {}
            effective = self.guarded("effective weight digests", effective_digests, self.model)
            self.effective_weight_tensor_digests = effective if effective is not None else {}

    def _weights_moved(self, version: str, digest: str | None) -> None:
        self._held_now()
        self._canary_now(version)

    def _canary_now(self, version: str | None) -> None:
        """The canary through this model's own forward (the capture hooks stand aside: it is no step)."""
        if not self.canary_enabled:
            return
        capture, last = self._capture, self._capture.last
        force, capture.force = capture.force, False
        try:
            vocab = vocab_of(self.model)
            if vocab is not None:  # a model with no vocabulary is no language model: no canary
                tokens = canary_tokens(vocab)
                self._take_canary(version, tokens, lambda: (model_canary(self.model, tokens), None))
        except Exception as exc:  # sizing the canary failed: counted, never raised into the job
            self.guarded("canary", _reraise, exc)
        finally:
            capture.force, capture.last = force, last

    def _apply_mode(self, mode: str, version: int | None) -> ModeReport:
        return switch_with(self.remediation_hook, self.model, mode, "trainer")

    def _finish_pending(self) -> None:
        finished, complete = self._pipeline.take_all(FINISH_TIMEOUT)
        self._send_finished(finished)
        if not complete:
            self._log_once("building", "isoaudit trainer collector: records still being built at flush")

    def _remove_hooks(self) -> None:
        self._capture.remove()
        self._pipeline.stop(FINISH_TIMEOUT)

    def _send_finished(self, finished: list[tuple[_StepInFlight, Outcome]]) -> dict[int, BuiltStep]:
        """Send finished steps, in step order, from this (the training) thread: the sink's send
        hooks (routing) run where they always do; a failed build is counted here. Returns what was
        sent, by id of the step."""
        sent: dict[int, BuiltStep] = {}
        for step, outcome in finished:
            if isinstance(outcome, BaseException):
                self.guarded("building records", _reraise, outcome)
            elif self.guarded("sending records", self._send, step, outcome) is not None:
                sent[id(step)] = outcome
        return sent

    def _record(
        self,
        step: int,
        batch_arg: StepBatch | Mapping[str, Any],
        logprobs: LogprobsArg,
        layout: LogprobsLayout,
        weight_version: str | int | None,
        sampling: dict[str, SamplingArg],
    ) -> StepReport:
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step: must be an integer >= 0, got {step!r}")
        step = int(step)
        batch = StepBatch.coerce(batch_arg)
        if weight_version is not None and str(weight_version) != self.weight_version:
            # a version given here has no known digest (weights_changed(version, digest) gives one)
            self.weight_version, self.weight_digest = str(weight_version), None
            self._held_now()
            self._canary_now(self.weight_version)
        version = self.weight_version
        transforms = {
            name: sampling_values(value, batch.num_samples, name) for name, value in sampling.items()
        }
        given = logprobs is not None
        self._applied = applied_transforms(batch.temperature, transforms, given=given)
        records: list[Record] = []
        self._manifests(records)

        fingerprint_now = bool(self.resolved.specs) and step % self.sample_every == 0
        distribution_now = fingerprint_now and self.distribution_k > 0
        probe_now = self.batch_probe.due(step, fingerprint_now, quantizes_activations())
        need_logits = logprobs is None or distribution_now or probe_now
        capture = self._capture.take()
        if capture is None:  # a compiled forward: its regions went through the op
            capture = self._capture.take_compiled(batch.input_ids)
        if capture is not None and not capture.matches(batch.input_ids):
            capture = None
        own = (fingerprint_now and (capture is None or not capture.fingerprinting)) or (
            need_logits and (capture is None or not _logits_cover(capture.logits, batch.input_ids))
        )
        if own:
            capture = self._own_forward(batch, fingerprint_now)

        tensors: dict[str, torch.Tensor] = {"ids": batch.input_ids}
        predict, target = batch.completion_rows()
        if need_logits:
            assert capture is not None and capture.logits is not None
            assert batch.temperature is not None  # StepBatch fills it in
            sample_of = np.repeat(np.arange(batch.num_samples), [s.completion_len for s in batch.spans])
            rows, targets = processed_logprob_rows(
                capture.logits.detach(),
                batch.input_ids,
                predict,
                target,
                batch.temperature,
                sample_of,
                **transforms,
            )
            if logprobs is None:
                tensors["lp"] = rows.gather(1, targets[:, None]).squeeze(1)
            if distribution_now and rows.shape[0]:
                k = min(self.distribution_k, int(rows.shape[1]))
                found = distribution_rows(rows, k)
                tensors.update({f"dk_{name}": value for name, value in found.items()})
            del rows
        if logprobs is not None:
            tensors.update(_given_logprobs(logprobs, batch, target, layout))
        if probe_now and capture is not None and capture.logits is not None:
            args = (self.model, self._capture, batch, capture.logits, self.batch_probe, self.counters)
            tensors.update(guarded_probe(self, lambda: trainer_probe(*args), {}))
        prints = self._prints_of(capture, batch) if fingerprint_now and capture is not None else {}
        if prints and capture is not None and capture.rows is not None:
            tensors["rows"] = capture.rows
        # the prints travel as a few groups, not region by region
        packed, prints_layout = pack_prints(prints, prefix="p")
        tensors.update(packed)
        self.counters.steps += 1
        if own:
            self.counters.own_forwards += 1
        pending = _StepInFlight(
            step=step,
            batch=batch,
            # the step's one transfer; the fingerprints ("p...") are this step's own, never written again
            copy=HostCopy(tensors, asynchronous=self.async_transfer, fresh=_is_print),
            version=version,
            layout=prints_layout,
            keys=list(prints),
            compacted=bool(prints) and capture is not None and capture.rows is not None,
            head=records,
            sampling=transforms,
            distribution="dk_sketch" in tensors,
        )
        if self._pipeline.background:
            self._send_finished(self._pipeline.take(None))  # earlier steps, built meanwhile
            # a helper stuck on max_inflight + 1 steps: this one is built and sent here
            if not self._pipeline.push(pending, room=self.max_inflight + 1, timeout=PUT_TIMEOUT):
                self._send_finished([(pending, self._pipeline.build_now(pending))])
            self._step_boundary(publish=False)
            return StepReport(step, [], -1, own, [], deferred=True)
        self._pipeline.push(pending, room=self.max_inflight + 1, timeout=PUT_TIMEOUT)
        sent = self._send_finished(self._pipeline.take(self.max_inflight))
        self._step_boundary(publish=False)
        mine = sent.get(id(pending))
        if mine is not None:
            # as the store keeps them: each block of fingerprints as its per-sample records
            records = expand_blocks(mine.records) if self.keep_records else []
            return StepReport(step, mine.keys, mine.n_fingerprint_records, own, records)
        return StepReport(step, [], -1, own, [], deferred=True)

    def _send(self, pending: _StepInFlight, built: BuiltStep) -> bool:
        self.sink.send(built.records)
        self.counters.samples += pending.batch.num_samples
        self.counters.fingerprint_records += built.n_fingerprint_records
        return True

    def _build(self, pending: _StepInFlight) -> BuiltStep:
        """The step's records, once its copy landed (waits for it): no counter, no send, so that
        the pipeline's helper thread can run it."""
        host = pending.copy.result()
        batch, step, version = pending.batch, pending.step, pending.version
        records = pending.head
        tokens = sequence_tokens(batch, host["ids"])
        keys = keys_for(batch, tokens)
        lengths = [s.completion_len for s in batch.spans]
        if "lp" in host:
            flat = host["lp"].astype(np.float32, copy=False)
            per_sample = np.split(flat, np.cumsum(lengths)[:-1])
        else:
            per_sample = [
                host[f"lp{i}"].astype(np.float32, copy=False).reshape(-1) for i in range(batch.num_samples)
            ]
        samples = sample_records(
            run_id=self.run.run_id,
            step=step,
            side="trainer",
            batch=batch,
            tokens=tokens,
            keys=keys,
            logprobs=per_sample,
            weight_version=version,
            validate=self.validate,
        )
        for name, values in pending.sampling.items():  # what this side applied, per sample
            if values is not None:
                for i, sample in enumerate(samples):
                    value = float(values[i])
                    if value == value:  # NaN: not applied to this sample
                        setattr(sample, name, int(value) if name == "top_k" else value)
        if pending.distribution:
            _attach_distribution(samples, host, lengths)
        attach_trainer_probe(samples, host)
        records += samples
        row_index = host["rows"].astype(np.int64) if pending.compacted else None
        prints = PackedHostPrints(host, pending.layout, pending.keys, row_index)
        # one record per region call with every sample's rows: a step with every region
        # fingerprinted is a hundred-odd objects, not a thousand (host time the training step pays)
        blocks = fingerprint_blocks(
            run_id=self.run.run_id,
            step=step,
            side="trainer",
            case=self.case,
            batch=batch,
            keys=keys,
            prints=prints,
            validate=self.validate,
        )
        records += blocks
        return BuiltStep(keys, len(blocks) * len(keys), records)

    def _prints_of(self, capture: Capture, batch: StepBatch) -> Mapping[tuple[str, int], Any]:
        rows, cols = batch.shape
        expected = rows * cols if capture.rows is None else int(capture.rows.numel())
        prints = capture.prints
        if isinstance(prints, SpanPrints) and prints.plan is not None and prints.plan.rows == expected:
            return prints  # every region as many rows as the forward's
        out = {}
        for key, fp in capture.prints.items():
            if len(fp) != expected:
                self._log_once(
                    f"rows:{key[0]}",
                    f"isoaudit collector: region {key[0]} has {len(fp)} rows for "
                    f"{rows}x{cols} tokens; not recorded",
                )
                continue
            out[key] = fp
        return out

    def _own_forward(self, batch: StepBatch, fingerprint: bool) -> Capture:
        param = next(self.model.parameters(), None)
        device = param.device if param is not None else batch.input_ids.device
        inputs = {k: v.to(device) for k, v in batch.model_inputs().items()}
        if getattr(getattr(self.model, "config", None), "use_cache", False):
            inputs["use_cache"] = False  # type: ignore[assignment]  # the inputs are tensors but for this one flag HF accepts
        self._capture.force = fingerprint
        self._capture.row_hint = _row_hint(batch)
        try:
            with torch.no_grad():
                self.model(**inputs)
        finally:
            self._capture.force = None
        capture = self._capture.take()
        if capture is None:
            raise RuntimeError("model: the collector's own forward left no capture (hooks removed?)")
        return capture


#: How long flush/detach wait for steps being built, and a step for room in the pipeline (s).
FINISH_TIMEOUT = 60.0
PUT_TIMEOUT = 1.0


def _reraise(exc: BaseException) -> None:
    raise exc


def _copy_landed(step: _StepInFlight) -> bool:
    return step.copy.ready()


def _is_print(name: str) -> bool:
    return name.startswith("p")


def _row_hint(batch: StepBatch) -> tuple[tuple[int, ...], torch.Tensor]:
    """(input shape, flat rows of real tokens): what the hooks fingerprint for this batch."""
    rows = np.concatenate([batch.flat_start(i) + np.arange(s.length) for i, s in enumerate(batch.spans)])
    return tuple(batch.input_ids.shape), torch.from_numpy(np.sort(rows))


def _logits_cover(logits: torch.Tensor | None, input_ids: torch.Tensor) -> bool:
    """Whether captured ``logits`` hold one vocabulary row per token of ``input_ids`` (a forward
    called with ``logits_to_keep``, or one whose output is not logits, does not)."""
    if logits is None or logits.dim() < 2:
        return False
    return logits.numel() // logits.shape[-1] == input_ids.numel()


def _given_logprobs(
    logprobs: Any, batch: StepBatch, target: np.ndarray, layout: LogprobsLayout
) -> dict[str, torch.Tensor]:
    """The caller's logprobs as tensors to transfer: ``lp`` (flat, sample order) or ``lp{i}``."""
    rows, cols = batch.shape
    lengths = [s.completion_len for s in batch.spans]
    if isinstance(logprobs, np.ndarray):
        logprobs = torch.from_numpy(logprobs)
    if isinstance(logprobs, torch.Tensor):
        lp = logprobs.detach()
        shape = tuple(lp.shape)
        if layout == "auto":
            if shape == (rows, cols):
                layout = "tokens"
            elif shape == (rows, cols - 1):
                layout = "shifted"
            elif len(shape) == 2 and shape[0] == batch.num_samples and shape[1] >= max(lengths):
                layout = "completion"
            else:
                raise ValueError(
                    f"logprobs: shape {list(shape)} fits no layout of input_ids [{rows}, {cols}] "
                    "(tokens [rows, cols], shifted [rows, cols-1], completion [samples, max completion])"
                )
        if layout == "tokens":
            index = target
            lp = lp.reshape(-1)
        elif layout == "shifted":
            row, col = np.divmod(target, cols)
            index = row * (cols - 1) + col - 1
            lp = lp.reshape(-1)
        elif layout == "completion":
            width = shape[1]
            index = (
                np.concatenate([i * width + np.arange(n) for i, n in enumerate(lengths)])
                if lengths
                else target
            )
            lp = lp.reshape(-1)
        else:
            raise ValueError(f"logprobs_layout: expected auto, tokens, shifted or completion, got {layout!r}")
        index_t = to_device(torch.from_numpy(index.astype(np.int64)), lp.device)  # never a sync
        return {"lp": lp.index_select(0, index_t).float()}
    if isinstance(logprobs, Sequence):
        if len(logprobs) != batch.num_samples:
            raise ValueError(f"logprobs: {len(logprobs)} arrays for {batch.num_samples} samples")
        out = {}
        for i, values in enumerate(logprobs):
            tensor = (
                values.detach() if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
            )
            if tensor.numel() != lengths[i]:
                raise ValueError(f"logprobs[{i}]: {tensor.numel()} values for {lengths[i]} completion tokens")
            out[f"lp{i}"] = tensor.reshape(-1).float()
        return out
    raise TypeError(
        f"logprobs: expected a tensor, an array or one array per sample, got {type(logprobs).__name__}"
    )


#: ``attach(model, run=..., sink=..., ...)``: hook ``model`` and send the run and the trainer's
#: manifest to ``sink`` (the session does this for you: ``Session.watch_trainer``).
attach = TrainerCollector


def _attach_distribution(
    samples: Sequence[Any], host: Mapping[str, np.ndarray], lengths: Sequence[int]
) -> None:
    """Each sample's share of the step's per-position top-k and sketch (the "dk_*" arrays)."""
    bounds = np.cumsum(lengths)[:-1]
    ids = np.split(host["dk_topk_ids"].astype(np.int32, copy=False), bounds)
    values = np.split(host["dk_topk_logprobs"].astype(np.float32, copy=False), bounds)
    sketch = np.split(host["dk_sketch"].astype(np.float32, copy=False), bounds)
    for sample, i, v, sk in zip(samples, ids, values, sketch, strict=True):
        sample.topk_ids, sample.topk_logprobs, sample.dist_sketch = i, v, sk
