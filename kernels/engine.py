"""A minimal rollout engine: batched requests of different lengths, (chunked) prefill, then
incremental decode with a KV cache, sampled tokens and their logprobs.

It exists to prove the kernels end to end without vLLM: the same model run as a trainer (whole
sequences, autograd) and through this engine must give bitwise-equal sampled-token logprobs when
:func:`isoaudit.kernels.enable` is on. Any model with ``new_cache``/``step``/``lm_head_weight`` works
(:class:`isoaudit.kernels.adapters.HFCausalLM`, :class:`isoaudit.kernels.models.gdn_lm.GDNLM`).

It runs as an engine does, on both sides alike (kernels on or off), so a generation time measured
against it means something:

* while some prompt is still being prefilled, each step packs every live request's pending tokens
  (prompt chunks and single decode tokens) into one flat batch;
* on CUDA with a model that has ``decode`` (:class:`~isoaudit.kernels.adapters.HFCausalLM`,
  :class:`~isoaudit.kernels.adapters_moe.HFMoECausalLM`) and says it is capturable in the current
  mode (``decode_capturable()``: an MoE model's is when the kernels are on and its experts take the
  host-sync-free path), once every prompt is in the cache, all requests decode together, one row
  per cache slot, the batch padded to a size bucket, the step (the whole model, fp32 logits,
  log-softmax and the logits at the temperature) replayed from a CUDA graph captured once per
  bucket and mode (elsewhere, or with ``cuda_graphs=False``, the packed steps go on with the live
  requests; ``bucketed_decode=True`` runs the bucketed step eagerly instead);
* after each bucketed step the model's ``decoded(positions, live)`` hears which rows were real
  and at which positions (an MoE model files the step's routing, which the step wrote into a
  device buffer, in the active routing traces);
* sampled tokens and logprobs stay on the device; the host reads them once, at the end.

With the kernels on, the graph computes the same bits as the eager step (the kernels are
batch-invariant, so neither the padding rows nor the launch path change a row).

A :class:`DecodeObserver` (the collector's fingerprints) keeps the graphs: each bucket's graph is
captured inside :meth:`DecodeObserver.capturing`, where the observer's code writes into device
buffers of its own through ops the capture records (no host sync), and after each replay the engine
tells it which slot rows were real and at which positions (:meth:`DecodeObserver.replayed`), from
the layout the host already knows. Attaching or detaching an observer drops the captured graphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from . import dispatch


class EngineModel(Protocol):
    """What the engine runs. Optional, for the bucketed decode: ``decode(ids, positions, cache)``
    (one token per cache slot, :meth:`step`'s bits per token), ``decode_capturable()`` (whether
    that step may be captured in a CUDA graph in the current mode; absent: yes) and
    ``decoded(positions, live)`` (told after each bucketed step which rows were real, where)."""

    @property
    def lm_head_weight(self) -> torch.Tensor: ...  # read only (HFCausalLM's is a property)

    def new_cache(self, slots: int, max_len: int) -> Any: ...

    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, slots: list[int], cache: Any
    ) -> torch.Tensor: ...


class DecodeObserver(Protocol):
    """What watches the graphed decode (the reference-engine collector's fingerprints)."""

    def capturing(self, slots: int) -> AbstractContextManager[None]:
        """Around the warm-up and capture of the ``slots``-row decode graph: work the observer does
        on the device inside it (writes into its own preallocated buffers) is recorded into the
        graph and so repeated by every replay."""
        ...

    def replayed(self, slots: int, positions: np.ndarray, live: np.ndarray) -> None:
        """After a replay of the ``slots``-row graph: ``positions[i]`` is the absolute position
        row ``i`` (cache slot ``i``) computed, ``live[i]`` whether that row was a request's real
        token (padding and finished requests are not). Must not sync with the device."""
        ...


@dataclass
class Completion:
    """One request's result: sampled tokens and the engine's logprob of each."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


#: Decode batch sizes a CUDA graph is captured for (a batch runs in the smallest that holds it).
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The smallest bucket that holds ``n`` rows (``n`` itself beyond the largest)."""
    for b in buckets:
        if b >= n:
            return b
    return n


class _DecodeGraph:
    """One decode step of ``slots`` rows (row i is cache slot i) captured in a CUDA graph: inputs
    are the static ``ids``/``pos`` buffers, outputs the static ``logp`` and ``scaled`` logits.
    ``capture=False`` (no CUDA): the same bucketed step run eagerly on every call, inside
    ``around`` each time (what the capture recorded once)."""

    def __init__(
        self,
        run: Callable[..., Any],
        slots: int,
        park: int,
        dev: torch.device,
        *,
        capture: bool = True,
        around: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.ids = torch.zeros(slots, dtype=torch.long, device=dev)
        # Warm-up and capture write K/V at ``park`` (the last cache position, which no real token
        # reaches: prompt + max_new <= max_len), so capturing never disturbs a cached sequence.
        self.pos = torch.full((slots,), park, dtype=torch.long, device=dev)
        self.inv_t = torch.ones((), dtype=torch.float32, device=dev)
        self._run = run
        self._around = around
        self.graph: Any = None
        if not capture:
            return
        with around():
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile, autotune and allocate outside the capture
                    self._call()
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.logp, self.scaled = self._call()

    def _call(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(self.ids, self.pos, self.inv_t)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is None:
            with self._around():
                self.logp, self.scaled = self._call()
        else:
            self.graph.replay()
        return self.logp, self.scaled


class RolloutEngine:
    """Continuous-batching-lite: packed prefill steps, then all requests decode together.

    ``cuda_graphs``: capture the decode step per batch-size bucket (CUDA, models with ``decode``);
    ``False`` runs the same step eagerly. ``buckets``: the decode batch sizes graphs are made for.
    ``bucketed_decode``: where no graph is captured (CPU, ``cuda_graphs=False``), still decode every
    request together in a bucket's static buffers, eagerly (the graphed loop without the graph).
    """

    def __init__(
        self,
        model: EngineModel,
        max_len: int = 512,
        prefill_chunk: int | None = None,
        *,
        cuda_graphs: bool = True,
        buckets: tuple[int, ...] = BUCKETS,
        bucketed_decode: bool = False,
    ) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: at least 1 token, got {prefill_chunk}")
        self.model = model
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.cuda_graphs = cuda_graphs
        self.bucketed_decode = bucketed_decode
        self.buckets = tuple(sorted(buckets))
        self._caches: dict[int, Any] = {}
        self._graphs: dict[tuple[int, str], _DecodeGraph] = {}
        self._observer: DecodeObserver | None = None
        #: (bucket, mode, seconds) of every graph captured: what a mode switch or an observer cost
        self.captures: list[tuple[int, str, float]] = []
        #: decode steps replayed from a captured graph, over the engine's life
        self.replays = 0

    def graphed(self) -> bool:
        """Whether decode steps replay CUDA graphs (else they run eagerly): CUDA, a model with
        ``decode`` that, where it has ``decode_capturable()``, says the step is capturable in the
        current mode (else it decodes eagerly, in packed steps or, with ``bucketed_decode``, in a
        bucket)."""
        m = self.model
        if not (self.cuda_graphs and m.lm_head_weight.is_cuda and callable(getattr(m, "decode", None))):
            return False
        capturable = getattr(m, "decode_capturable", None)
        return not callable(capturable) or bool(capturable())

    def bucketed(self) -> bool:
        """Whether decode runs every request together in a bucket (graphed or not)."""
        m = self.model
        return self.graphed() or (self.bucketed_decode and callable(getattr(m, "decode", None)))

    @property
    def observer(self) -> DecodeObserver | None:
        """The observer of the graphed decode, or None."""
        return self._observer

    def set_observer(self, observer: DecodeObserver | None) -> None:
        """Watch (or stop watching) the graphed decode; the graphs are re-captured with (or
        without) the observer's work inside them at their next use."""
        if observer is not self._observer:
            self._observer = observer
            self._graphs.clear()

    def clear_graphs(self) -> None:
        """Drop the captured graphs and their caches (they hold device memory)."""
        self._graphs.clear()
        self._caches.clear()

    def drop_graphs(self) -> None:
        """Drop the captured graphs but keep their caches: each bucket is captured again, in the
        process's current mode, at its next decode (what a remediation switch calls)."""
        self._graphs.clear()

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new: list[int], seed: int = 0, temperature: float = 1.0
    ) -> list[Completion]:
        """Sample ``max_new[i]`` tokens after ``prompts[i]`` for all requests at once."""
        n = len(prompts)
        if len(max_new) != n:
            raise ValueError(f"max_new: {len(max_new)} counts for {n} prompts")
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        for i, (p, m) in enumerate(zip(prompts, max_new, strict=True)):
            if not p or m < 0 or len(p) + m > self.max_len:
                raise ValueError(
                    f"prompts[{i}]: {len(p)} prompt tokens + max_new {m} must be >= 1 and fit max_len {self.max_len}"
                )
        if n == 0:
            return []
        w = self.model.lm_head_weight
        dev = w.device
        if dispatch.is_enabled() and dispatch.is_fp8():
            # E4M3 copies of weights changed since the last call (a weight sync), re-made in place
            # before any decode graph replays over them
            from .fp8 import refresh_fp8_weights
            from .fp8_grouped import refresh_fp8_experts

            refresh_fp8_weights()
            refresh_fp8_experts()
        gen = torch.Generator(device=dev).manual_seed(seed)
        graphed = self.bucketed()
        slots = bucket(n, self.buckets) if graphed else n
        cache = self._cache(slots) if graphed else self.model.new_cache(n, self.max_len)
        inv_t = torch.full((), 1.0 / temperature, dtype=torch.float32, device=dev)
        state = _State(n, max(max_new), dev)

        # Packed steps: every live request's pending tokens (prompt chunks, single decode tokens)
        # in one flat batch; with graphs, only while some prompt is still being prefilled.
        filled = [0] * n
        while True:
            live = [i for i in range(n) if state.count[i] < max_new[i]]
            if not live or (graphed and all(filled[i] == len(prompts[i]) for i in live)):
                break
            host_ids: list[int] = []
            from_last: list[int] = []
            pos: list[int] = []
            cu = [0]
            sampled: list[int] = []  # requests whose last packed row is sampled this step
            for i in live:
                p = prompts[i]
                if filled[i] < len(p):
                    m = len(p) - filled[i]
                    if self.prefill_chunk is not None:
                        m = min(m, self.prefill_chunk)
                    host_ids += p[filled[i] : filled[i] + m]
                    from_last += [-1] * m
                    pos += range(filled[i], filled[i] + m)
                    filled[i] += m
                    if filled[i] == len(p):
                        sampled.append(len(cu) - 1)
                else:
                    m = 1
                    host_ids.append(0)
                    from_last.append(i)
                    pos.append(len(p) + state.count[i] - 1)
                    sampled.append(len(cu) - 1)
                cu.append(cu[-1] + m)
            src = torch.tensor(from_last, device=dev)
            ids = torch.where(src >= 0, state.last[src.clamp(min=0)], torch.tensor(host_ids, device=dev))
            cu_t = torch.tensor(cu, device=dev, dtype=torch.int32)
            hidden = self.model.step(ids, torch.tensor(pos, device=dev), cu_t, live, cache)
            if not sampled:
                continue
            rows = torch.tensor([cu[j + 1] - 1 for j in sampled], device=dev)
            logp, scaled = _head(hidden[rows], w, inv_t)
            reqs = [live[j] for j in sampled]
            state.take(reqs, [state.count[i] for i in reqs], logp, scaled, gen)

        # Graphed decode: every request together, one row per slot, padded to the bucket.
        left = [max(max_new[i] - state.count[i], 0) for i in range(n)]
        steps = max(left)
        if steps:
            base = torch.tensor([len(prompts[i]) + state.count[i] - 1 for i in range(n)], device=dev)
            last_step = torch.tensor([max(x - 1, 0) for x in left], device=dev)
            cols = torch.tensor(state.count, device=dev)
            state.widen(max(state.count) + steps)
            rows_all = torch.arange(n, device=dev)
            g = self._graph(slots, cache)
            g.inv_t.copy_(inv_t)
            g.pos.fill_(self.max_len - 1)
            g.ids[:n] = state.last
            observer = self._observer
            decoded = getattr(self.model, "decoded", None)
            # the same positions, known on the host
            base_h = np.array([len(prompts[i]) + state.count[i] - 1 for i in range(n)], dtype=np.int64)
            left_h = np.array(left, dtype=np.int64)
            pos_h = np.full(slots, self.max_len - 1, dtype=np.int64)
            live_h = np.zeros(slots, dtype=bool)
            for s in range(steps):
                # A request that is done repeats its last position (harmless: its slot is its own).
                g.pos[:n] = base + last_step.clamp(max=s)
                logp, scaled = g()
                self.replays += g.graph is not None
                pos_h[:n] = base_h + np.minimum(np.maximum(left_h - 1, 0), s)
                live_h[:n] = left_h > s
                if callable(decoded):
                    decoded(pos_h.copy(), live_h.copy())
                if observer is not None:
                    observer.replayed(slots, pos_h.copy(), live_h.copy())
                tok = _sample(scaled[:n], None, n, gen)
                state.tokens[rows_all, cols + s] = tok
                state.logprobs[rows_all, cols + s] = logp[:n].gather(1, tok[:, None])[:, 0]
                g.ids[:n] = tok

        tokens, logprobs = state.tokens.tolist(), state.logprobs.tolist()  # the one host read
        return [
            Completion(list(prompts[i]), tokens[i][: max_new[i]], logprobs[i][: max_new[i]]) for i in range(n)
        ]

    # ------------------------------------------------------------------ internals

    def _cache(self, slots: int) -> Any:
        """A persistent cache per slot count (the graphs are captured over its buffers)."""
        if slots not in self._caches:
            self._caches[slots] = self.model.new_cache(slots, self.max_len)
        return self._caches[slots]

    def _graph(self, slots: int, cache: Any) -> _DecodeGraph:
        mode = dispatch.mode()
        key = (slots, mode)
        if key not in self._graphs:
            dev = self.model.lm_head_weight.device
            observer = self._observer
            around = (lambda: observer.capturing(slots)) if observer is not None else nullcontext
            t0 = time.perf_counter()
            graph = _DecodeGraph(
                self._decode_fn(cache), slots, self.max_len - 1, dev, capture=self.graphed(), around=around
            )
            if graph.graph is not None:
                torch.cuda.synchronize(dev)
                self.captures.append((slots, mode, time.perf_counter() - t0))
            self._graphs[key] = graph
        return self._graphs[key]

    def _decode_fn(self, cache: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """One decode step over every slot (row i = slot i) to (log-softmax, logits / T)."""
        decode, w = self.model.decode, self.model.lm_head_weight  # type: ignore[attr-defined]  # models with decode()

        def run(
            ids: torch.Tensor, pos: torch.Tensor, inv_t: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return _head(decode(ids, pos, cache), w, inv_t)

        return run


def _head(h: torch.Tensor, w: torch.Tensor, inv_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits once: their log-softmax (the recorded logprobs: the same bits as
    ``dispatch.token_logprobs``, which is ``z[token] - logsumexp(z)`` too) and the logits at the
    temperature (what :func:`_sample` draws from)."""
    z = dispatch.logits_fp32(h, w)
    return dispatch.log_softmax(z), z * inv_t


def _sample(scaled: torch.Tensor, rows: torch.Tensor | None, n: int, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``scaled`` (logits over the temperature), drawn from their softmax by
    the exponential race (``argmax(z/T - log E)``, E ~ Exp(1), is a draw from softmax(z/T)). The
    noise is drawn for all ``n`` requests every time and row r takes request ``rows[r]``'s, so a
    request's draw does not depend on which others share its step: the graphed decode (every
    request, every step) and the packed eager steps (live requests only) sample the same tokens."""
    noise = torch.empty(n, scaled.shape[-1], dtype=torch.float32, device=scaled.device).exponential_(
        generator=gen
    )
    if rows is not None:
        noise = noise[rows]
    return (scaled - noise.log_()).argmax(-1)


class _State:
    """Sampled tokens and logprobs on the device, plus each request's count on the host."""

    def __init__(self, n: int, width: int, dev: torch.device) -> None:
        self.count = [0] * n
        self.last = torch.zeros(n, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(n, max(width, 1), dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(n, max(width, 1), dtype=torch.float32, device=dev)

    def widen(self, width: int) -> None:
        if width > self.tokens.shape[1]:
            extra = width - self.tokens.shape[1]
            self.tokens = torch.nn.functional.pad(self.tokens, (0, extra))
            self.logprobs = torch.nn.functional.pad(self.logprobs, (0, extra))

    def take(
        self, reqs: list[int], cols: list[int], logp: torch.Tensor, scaled: torch.Tensor, gen: torch.Generator
    ) -> None:
        """Sample one token for each of ``reqs`` from its row of ``scaled``."""
        dev = logp.device
        r, c = torch.tensor(reqs, device=dev), torch.tensor(cols, device=dev)
        tok = _sample(scaled, r, len(self.count), gen)
        lp = logp.gather(1, tok[:, None])[:, 0]
        self.tokens[r, c] = tok
        self.logprobs[r, c] = lp
        self.last[r] = tok
        for i in reqs:
            self.count[i] += 1
