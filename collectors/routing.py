"""MoE routing on both sides: the experts every MoE layer chose per token, attached to
the side's sample records (``SampleLogprobs.routes``: a few bytes a token and layer).

Routing is observed through :mod:`isoaudit.kernels.moe`'s routing traces, which see both modes: natively
the HF router's own selection (``isoaudit.kernels.adapters_moe.instrument`` hooks ``mlp.gate``), with the
invariant kernels on the selection of :func:`isoaudit.kernels.moe.moe_layer`. One recorder plugs into any
collector's record stream, so the trainer, the reference engine and a job's own sender share it:

* :class:`TrainerRoutes` opens a trace around every top-level forward of the trainer's model and
  keeps the last few forwards' rows (a row's real tokens by its attention mask);
* :class:`EngineRoutes` opens one around every ``generate`` of the reference engine, whose model
  tags each row with its request slot and absolute position.

Records are matched to routes by their tokens (the sample key is derived from them), in the
collector's sink: a record's routes are attached just before it is queued, so nothing in the
training or generation step waits. A sample no forward routed is sent without routes (counted).

Routing replay (R3, verl's ``router_replay``, vLLM's routed-experts output): :meth:`TrainerRoutes.replay`
makes the trainer's HF routers take given routes, recomputing the weights from the trainer's own
router logits, and marks the tokens replayed; the manifest then says ``router_replay``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from isoaudit.audit.records import Record, Routes, SampleLogprobs, sample_key
from isoaudit.collectors.counting import Counters, LogOnce
from torch import nn
from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)


class RoutingCounters(Counters):
    NAMES = ("forwards", "attached", "unmatched", "errors")


def _moe() -> Any:
    from isoaudit.kernels import moe

    return moe


def instrument(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """Number ``model``'s MoE blocks and hook their routers into :mod:`isoaudit.kernels.moe` traces; returns
    (decoder layer, block) for each (empty for a dense model)."""
    from isoaudit.kernels import adapters_moe

    adapters_moe.instrument(model)
    return adapters_moe.moe_blocks(model)


def _expert_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


@dataclass
class _Forward:
    """One traced forward: per MoE layer the experts of every flat row, and what each row is."""

    experts: dict[int, np.ndarray]  # layer -> [rows, k]
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict
    )  # key -> (flat rows, positions)
    replayed: np.ndarray | None = None  # per flat row: 1 where the route was replayed (R3)


class _Recorder:
    """What both sides share: the MoE layout of the model, the recent forwards, the sink wrapper."""

    side = "trainer"

    def __init__(self, model: nn.Module, *, keep: int = 4) -> None:
        blocks = instrument(model)
        if not blocks:
            raise ValueError("model: no MoE block (Qwen3-MoE / Mixtral sparse block) to record routing of")
        self.model = model
        self.layers = [i for i, _ in blocks]
        gate: Any = blocks[0][1].gate  # HF's MoE router (top_k, num_experts): no typed attributes
        self.top_k = int(gate.top_k)
        self.num_experts = int(gate.num_experts)
        self.dtype = _expert_dtype(self.num_experts)
        self.recent: deque[_Forward] = deque(maxlen=keep)
        self.counters = RoutingCounters()
        self._warn = LogOnce(log)
        self._undo: list[Callable[[], None]] = []

    # ------------------------------------------------------------ records

    def routes_for(self, tokens: np.ndarray) -> Routes | None:
        """The routes of the sample whose whole sequence is ``tokens``, from the latest forward
        that ran it (None when none did)."""
        key = sample_key(tokens)
        for forward in reversed(self.recent):
            found = forward.rows.get(key)
            if found is None:
                continue
            rows, positions = found
            width = len(self.layers) * self.top_k
            experts = np.empty((rows.size, width), dtype=self.dtype)
            for j, layer in enumerate(self.layers):
                chosen = forward.experts.get(layer)
                if chosen is None:
                    return None
                experts[:, j * self.top_k : (j + 1) * self.top_k] = chosen[rows]
            return Routes.model_construct(
                layers=list(self.layers),
                top_k=self.top_k,
                num_experts=self.num_experts,
                positions=positions.astype(np.int32),
                experts=experts,
                replayed=self._replayed(forward, rows),
            )
        return None

    def _replayed(self, forward: _Forward, rows: np.ndarray) -> np.ndarray | None:
        return forward.replayed[rows].astype(np.uint8) if forward.replayed is not None else None

    def attach(self, records: Sequence[Record]) -> None:
        """Give this side's sample records their routes (in place)."""
        for record in records:
            if (
                not isinstance(record, SampleLogprobs)
                or record.side != self.side
                or record.routes is not None
            ):
                continue
            try:
                routes = self.routes_for(record.token_ids)
            except Exception as exc:  # never break the sender
                self._fail("routes", exc)
                continue
            if routes is None:
                self.counters.unmatched += 1
                self._warn.warn(
                    "unmatched",
                    f"isoaudit {self.side} routing: a sample no traced forward ran is sent without routes (counted)",
                )
                continue
            record.routes = routes
            self.counters.attached += 1

    #: Runtime facts this side adds to its collector's manifest (``router_replay``).
    _facts: dict[str, Any] = {}

    def join(self, collector: Any) -> None:
        """Ride along ``collector`` through its public hooks: routes go on its records just before
        they are queued, this side's facts into its manifests, and the recorder detaches with it."""
        self._undo.append(collector.before_send(self.attach))
        self._undo.append(collector.add_runtime_facts(lambda: dict(self._facts)))
        collector.on_detach(self.detach)

    def detach(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _fail(self, where: str, exc: BaseException) -> None:
        self.counters.errors += 1
        self._warn.warn(
            f"fail:{where}", f"isoaudit routing: {where} failed ({type(exc).__name__}: {exc}); counted"
        )

    def stats(self) -> dict[str, Any]:
        return self.counters.as_dict()


def _layer_rows(calls: Sequence[Any], layers: Sequence[int]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {layer: [] for layer in layers}
    for call in calls:
        if call.layer in out:
            out[call.layer].append(call)
    return out


class TrainerRoutes(_Recorder):
    """Routing of the trainer's model: every top-level forward is traced and its rows kept (the
    last ``keep`` forwards), so a ``record_step`` up to a few steps behind still finds them."""

    side = "trainer"

    def __init__(self, model: nn.Module, *, keep: int = 4) -> None:
        super().__init__(model, keep=keep)
        self._open: contextlib.ExitStack | None = None
        self._trace: Any = None
        self._inputs: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self._replay: dict[str, Any] | None = None
        self._replay_mask: np.ndarray | None = None
        self._facts: dict[str, Any] = {"router_replay": "off"}
        handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._begin, with_kwargs=True),
            model.register_forward_hook(self._end, always_call=True),
        ]

        def remove() -> None:
            for handle in handles:
                handle.remove()

        self._undo.append(remove)

    def _begin(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._open is not None:
            return  # a nested call of the root belongs to the outer forward
        try:
            ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
            mask = kwargs.get("attention_mask")
            self._inputs = (ids, mask if isinstance(mask, torch.Tensor) else None)
            stack = contextlib.ExitStack()
            self._trace = stack.enter_context(_moe().trace_routing())
            self._open = stack
        except Exception as exc:
            self._fail("forward", exc)

    def _end(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        stack, self._open = self._open, None
        if stack is None:
            return
        try:
            stack.close()
            ids, mask = self._inputs
            self._inputs = (None, None)
            if ids is not None and ids.dim() == 2:
                self.recent.append(self._forward(self._trace.calls, ids, mask))
                self.counters.forwards += 1
        except Exception as exc:
            self._fail("forward", exc)
        finally:
            self._trace = None

    def _forward(self, calls: Sequence[Any], ids: torch.Tensor, mask: torch.Tensor | None) -> _Forward:
        """Rows of a [batch, length] forward: each row's real tokens (its mask, else all) as one
        sample, at positions 0.. in order."""
        rows_total = ids.numel()
        experts = {}
        for layer, mine in _layer_rows(calls, self.layers).items():
            if len(mine) == 1 and mine[0].experts.shape[0] == rows_total:
                experts[layer] = mine[0].experts.numpy().astype(self.dtype, copy=False)
        host_ids = ids.detach().cpu().numpy()
        host_mask = mask.detach().cpu().numpy().astype(bool) if mask is not None else None
        forward = _Forward(experts)
        width = host_ids.shape[1]
        for b in range(host_ids.shape[0]):
            cols = np.flatnonzero(host_mask[b]) if host_mask is not None else np.arange(width)
            forward.rows[sample_key(host_ids[b, cols])] = (b * width + cols, np.arange(cols.size))
        if self._replay_mask is not None and self._replay_mask.size == rows_total:
            forward.replayed = self._replay_mask
        return forward

    # ------------------------------------------------------------ routing replay (R3)

    @contextlib.contextmanager
    def replay(
        self,
        routes: Mapping[int, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
        *,
        source: str = "isoaudit",
    ) -> Iterator[None]:
        """Inside the block, the trainer's HF routers take ``routes[layer]`` (flat rows × k, the
        rollout's experts) where ``mask`` (flat rows, bool; default all) is set, their weights
        recomputed from the trainer's own router logits; other rows route themselves (a missing
        route). ``routes=None``: the job's framework replays by itself (verl's ``router_replay``);
        only ``mask`` (then required) says which rows it replayed. Either way the forwards'
        records mark each token replayed or not, and the manifest says ``router_replay=source``
        from the next step on."""
        if routes is None and mask is None:
            raise ValueError("mask: say which rows the framework replayed (routes=None replays nothing here)")
        handles = []
        if routes is not None:
            for i, block in instrument(self.model):
                if i in routes:
                    # Before isoaudit.kernels.adapters_moe's recording hook, so traces see the replayed routes.
                    gate = cast(nn.Module, block.gate)  # the block's router module
                    handles.append(gate.register_forward_hook(_replaying(routes[i], mask), prepend=True))
        if mask is not None:
            host_mask = mask.detach().reshape(-1).cpu().numpy().astype(np.uint8)
        else:
            host_mask = np.ones(next(iter(routes.values())).shape[0], np.uint8)  # type: ignore[union-attr]  # routes is not None on this branch (checked by the caller's loop)
        self._replay_mask, self._facts = host_mask, {"router_replay": source}
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._replay_mask = None


def _replaying(chosen: torch.Tensor, mask: torch.Tensor | None) -> Callable[..., Any]:
    """A router forward hook that swaps in the replayed experts on the masked rows, their weights
    recomputed from the router's own logits (as verl's router replay does)."""

    def hook(module: nn.Module, _args: Any, output: Any) -> Any:
        logits, weights, experts = output
        replayed = chosen.to(experts.device, experts.dtype).reshape(experts.shape)
        if mask is not None:
            m = mask.to(experts.device).reshape(-1, 1).bool()
            replayed = torch.where(m, replayed, experts)
        probs = torch.softmax(logits.float(), dim=-1)
        new = probs.gather(1, replayed.long())
        if getattr(module, "norm_topk_prob", True):
            new = new / new.sum(dim=-1, keepdim=True)
        return logits, new.to(weights.dtype), replayed

    return hook


class EngineRoutes(_Recorder):
    """Routing inside the reference engine (:class:`isoaudit.kernels.engine.RolloutEngine` over
    :class:`isoaudit.kernels.adapters_moe.HFMoECausalLM`): each ``generate`` is traced; its rows are tagged
    (request slot, absolute position), so the routes of request ``i`` are the rows of slot ``i``,
    each position once (its first computation)."""

    side = "rollout"

    def __init__(self, engine: Any, *, keep: int = 4) -> None:
        adapter = getattr(engine, "model", None)
        model = getattr(adapter, "model", None)
        if not isinstance(model, nn.Module):
            raise TypeError(
                "engine: expected an isoaudit.kernels.engine.RolloutEngine over an HF MoE adapter"
            )
        super().__init__(model, keep=keep)
        self.engine = engine
        inner = engine.generate

        def generate(prompts: Any, *args: Any, **kwargs: Any) -> Any:
            with _moe().trace_routing() as trace:
                result = inner(prompts, *args, **kwargs)
            try:
                self.recent.append(self._forward(trace.calls, result))
                self.counters.forwards += 1
            except Exception as exc:
                self._fail("generate", exc)
            return result

        engine.generate = generate
        self._undo.append(
            lambda: setattr(engine, "generate", inner) if vars(engine).get("generate") is generate else None
        )

    def _forward(self, calls: Sequence[Any], completions: Sequence[Any]) -> _Forward:
        per_layer = _layer_rows(calls, self.layers)
        tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for layer, mine in per_layer.items():
            tagged = [c for c in mine if c.seq is not None and c.pos is not None]
            if not tagged:
                continue
            seq = np.concatenate([c.seq.numpy() for c in tagged])
            pos = np.concatenate([c.pos.numpy() for c in tagged])
            experts = np.concatenate([c.experts.numpy().astype(self.dtype, copy=False) for c in tagged])
            # First computation of each (slot, position) wins (a finished request's filler re-runs).
            _, first = np.unique(np.stack([seq, pos], axis=1), axis=0, return_index=True)
            first.sort()
            tables[layer] = (seq[first], pos[first], experts[first])
        # Flat rows of the forward: layer tables aligned on (slot, position).
        forward = _Forward({})
        if not tables or len(tables) != len(self.layers):
            return forward
        base_seq, base_pos, _ = tables[self.layers[0]]
        order = np.lexsort((base_pos, base_seq))
        keys = np.stack([base_seq[order], base_pos[order]], axis=1)
        for layer, (seq, pos, experts) in tables.items():
            mine = np.lexsort((pos, seq))
            if not np.array_equal(np.stack([seq[mine], pos[mine]], axis=1), keys):
                return _Forward({})  # the layers did not route the same tokens
            forward.experts[layer] = experts[mine]
        for slot, completion in enumerate(completions):
            rows = np.flatnonzero(keys[:, 0] == slot)
            tokens = np.asarray(list(completion.prompt) + list(completion.tokens), dtype=np.int32)
            forward.rows[sample_key(tokens)] = (rows, keys[rows, 1])
        return forward


def watch_routing(collector: Any) -> Any:
    """Record MoE routing beside ``collector`` (a trainer collector, the reference-engine collector
    or a vLLM collector, in-process or in worker processes:
    :class:`isoaudit.collectors.routing_vllm.VllmRoutes`): routes go on its sample records and the trainer's
    manifest says ``router_replay``. Returns the recorder, or ``None`` for a dense model (nothing to record).
    Detached with the collector."""
    if hasattr(collector, "link"):  # the vLLM collector
        from isoaudit.collectors.routing_vllm import VllmRoutes

        try:
            return VllmRoutes(collector)
        except LookupError:  # a dense model: no router to capture
            return None
    engine = getattr(collector, "engine", None)
    try:
        recorder: _Recorder = EngineRoutes(engine) if engine is not None else TrainerRoutes(collector.model)
    except ValueError:
        return None
    recorder.join(collector)
    return recorder


# ---------------------------------------------------------------------- routing replay inputs (R3)


def replay_tensors(
    batch: Any, routes: Sequence[Routes | None]
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """What :meth:`TrainerRoutes.replay` takes for a :class:`~isoaudit.collectors.layout.StepBatch` whose
    sample ``i`` the rollout routed as ``routes[i]`` (e.g. the rollout's sample records, or
    :func:`routes_from_vllm`): per MoE layer the experts of every flat row of the batch, and the
    mask of rows that have a route (the rest, such as the last sampled token or a sample the
    rollout sent no routes for, route themselves and are reported as missing where needed)."""
    rows, cols = batch.shape
    layers = sorted({layer for r in routes if r is not None for layer in r.layers})
    if not layers:
        raise ValueError("routes: no sample has routes to replay")
    k = next(r.top_k for r in routes if r is not None)
    out = {layer: torch.zeros(rows * cols, k, dtype=torch.long) for layer in layers}
    mask = torch.zeros(rows * cols, dtype=torch.bool)
    for i, found in enumerate(routes):
        if found is None:
            continue
        if found.top_k != k:
            raise ValueError(f"routes[{i}]: top_k {found.top_k} differs from the others' {k}")
        flat = torch.from_numpy(batch.flat_start(i) + found.positions.astype(np.int64))
        experts = torch.from_numpy(found.layer_experts().astype(np.int64))
        for j, layer in enumerate(found.layers):
            out[layer][flat] = experts[:, j]
        mask[flat] = True
    return out, mask


def routes_from_vllm(
    routed_experts: np.ndarray, layers: Sequence[int] | None = None, *, num_experts: int
) -> Routes:
    """A rollout sample's routes from vLLM's routed-experts output (``CompletionOutput.routed_experts``,
    ``[positions, layers, top_k]`` from position 0, with ``enable_return_routed_experts``; vLLM
    returns it with its model runner V2 only, which the CPU build lacks). ``layers``: the decoder
    index of each of its layers (default 0..L-1)."""
    array = np.asarray(routed_experts)
    if array.ndim != 3:
        raise ValueError(
            f"routed_experts: expected [positions, layers, top_k], got shape {list(array.shape)}"
        )
    n, n_layers, k = array.shape
    chosen = list(range(n_layers)) if layers is None else [int(i) for i in layers]
    if len(chosen) != n_layers:
        raise ValueError(f"layers: {len(chosen)} indices for {n_layers} layers of routed_experts")
    return Routes(
        layers=chosen,
        top_k=k,
        num_experts=num_experts,
        positions=np.arange(n, dtype=np.int32),
        experts=array.reshape(n, n_layers * k).astype(_expert_dtype(num_experts)),
    )
