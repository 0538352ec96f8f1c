"""Weight updates: load new weights into a running engine in place, and name them.

An RL job pushes the trainer's weights into the engine every few steps. Samples drawn before the
push and scored after it differ for a reason no kernel explains; the ``weights`` diagnosis catches
that from the *weight version* each side stamps on its records, and from a *weight digest*.

The digest is taken over the tensors as the trainer names and holds them (checkpoint names, HF
layout), not over the engine's fused and repacked parameters, so a trainer can compute the same
value from its own ``state_dict()`` with :func:`weight_digest`.

In the engine the update goes through vLLM's in-place reload (``reload_weights``), which re-runs
each layer's post-load processing: on the CPU backend linear weights are repacked for oneDNN / SGL
kernels after loading, so writing ``param.data`` alone would leave the kernels on the old weights.
Nothing else is touched: the KV and prefix caches stay and running requests go on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from isoaudit.collectors.vllm.messages import PackedTensor

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass
class WeightState:
    """The version and digest of the weights a worker computes with now."""

    version: str | None = None
    digest: str | None = None


def named_list(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """``named_tensors`` as a list of (name, tensor), checked."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValueError(f"named_tensors[{i}]: expected a (name, tensor) pair, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"named_tensors[{i}]: expected (str, torch.Tensor), got ({type(name).__name__}, {type(tensor).__name__})"
            )
        out.append((name, tensor))
    if not out:
        raise ValueError("named_tensors: empty; nothing to load")
    return out


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


def weight_digest(named_tensors: NamedTensors) -> str:
    """SHA-256 over (name, dtype, shape, bytes) of each tensor, in name order: the same for the same
    weights on any device and in any order of arrival."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_list(named_tensors), key=lambda item: item[0]):
        header = f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}|".encode()
        digest.update(np.uint64(len(header)).tobytes() + header)
        digest.update(hashlib.sha256(_tensor_bytes(tensor)).digest())
    return digest.hexdigest()


def pack_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[PackedTensor]:
    """Tensors as :class:`PackedTensor` messages: what crosses process boundaries intact."""
    return [
        PackedTensor(
            name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), data=_tensor_bytes(t)
        )
        for name, t in named_tensors
    ]


def unpack_tensors(packed: Iterable[PackedTensor]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of :func:`pack_tensors`."""
    out = []
    for item in packed:
        flat = (
            torch.frombuffer(bytearray(item.data), dtype=torch.uint8)
            if len(item.data)
            else torch.empty(0, dtype=torch.uint8)
        )
        out.append((item.name, flat.view(getattr(torch, item.dtype)).reshape(item.shape)))
    return out


def apply_weights(runner: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load checkpoint-named tensors into the runner's model in place; returns how many were given."""
    items = list(named_tensors)
    reload = getattr(runner, "reload_weights", None)
    if callable(reload):
        reload(weights_iterator=iter(items), is_checkpoint_format=True)
    else:  # older vLLM: the model's own loader (it maps checkpoint names onto fused parameters)
        runner.get_model().load_weights(iter(items))
    return len(items)


def load_weights(
    llm: Any, named_tensors: NamedTensors, version: str | int, *, digest: bool = True
) -> str | None:
    """Load the trainer's weights into ``llm``'s running engine in place and make ``version`` the
    weight version of everything it computes from now on; returns the weight digest (``None`` with
    ``digest=False``, for very large models).

    The update is in flight: no cache is cleared and no request is stopped (a request running across
    the update has tokens from both versions; the collector counts those). A collector attached to
    ``llm`` sends a manifest with the new version and digest, so the ``weights`` diagnosis can tell
    a stale trainer or engine from a numerical mismatch.
    """
    from isoaudit.collectors.vllm.collector import attached
    from isoaudit.collectors.vllm.link import EngineLink
    from isoaudit.collectors.vllm.messages import LoadWeights, to_wire

    if version is None or (isinstance(version, str) and not version):
        raise ValueError("version: give the new weights a version (e.g. the trainer step they come from)")
    items = named_list(named_tensors)
    value = weight_digest(items) if digest else None
    link = EngineLink(llm)
    if link.by_name:  # worker processes: the tensors travel as bytes in the message
        link.call(
            "load_weights",
            to_wire(LoadWeights(version=str(version), digest=value, packed=pack_tensors(items))),
        )
    else:  # in-process: the tensors themselves, no copy
        link.call("load_weights", to_wire(LoadWeights(version=str(version), digest=value)), items)
    collector = attached(llm)
    if collector is not None:
        refresh_held(collector)  # what the workers hold now, per tensor
        from isoaudit.collectors.vllm.canary import take_canary

        take_canary(collector, str(version))  # what the engine's forward reads now
        collector._weights_now(str(version), value)  # the workers know already
    return value


# ---------------------------------------------------------------- the weights the workers hold

#: Why some engine tensors have no digest (vLLM-CPU packs linear weights for oneDNN / SGL kernels
#: and removes the originals at load; a weight loaded before the collector attached is gone).
REMOVED_BEFORE_ATTACH = "removed by the engine's post-load repacking before the collector attached; digested from the next sync on"
#: How the digests of repacked weights are taken.
AS_LOADED = "as loaded into the parameter, just before vLLM's post-load processing repacked it"


def trainer_parts(
    module_name: str, module: Any, param_name: str, tensor: torch.Tensor, packed: Mapping[str, list[str]]
) -> list[tuple[str, torch.Tensor]]:
    """One engine parameter as the trainer's tensors: a fused ``qkv_proj``/``gate_up_proj`` split
    along its rows into ``q_proj``/``k_proj``/``v_proj`` (the names of ``packed_modules_mapping``),
    a padded vocabulary cut to the real one; other parameters as they are."""
    prefix, _, leaf = module_name.rpartition(".")
    subs = packed.get(leaf)
    sizes = getattr(module, "output_sizes", None)
    tp = int(getattr(module, "tp_size", 1) or 1)
    if subs and sizes is not None and len(subs) == len(sizes) and tensor.dim() >= 1:
        rows = [int(s) // tp for s in sizes]
        if sum(rows) == tensor.shape[0]:
            base = f"{prefix}." if prefix else ""
            return [
                (f"{base}{sub}.{param_name}", part)
                for sub, part in zip(subs, torch.split(tensor, rows, dim=0), strict=True)
            ]
    vocab = getattr(module, "org_vocab_size", None)
    if isinstance(vocab, int) and tp == 1 and tensor.dim() >= 1 and vocab < tensor.shape[0]:
        tensor = tensor[:vocab]  # vLLM pads the vocabulary to a multiple of 64 rows
    return [(f"{module_name}.{param_name}" if module_name else param_name, tensor)]


class HeldWeights:
    """The weights one worker holds, digested per trainer-named tensor.

    Parameters are digested where they are, after a sync. A parameter the engine's post-load
    processing removes (vLLM-CPU keeps only packed copies of its linear weights) is digested as it
    was loaded, just before that processing ran: each layer's ``quant_method.process_weights_after_loading``
    is wrapped (per instance) while the collector is attached, so every reload path is seen."""

    def __init__(self, model: Any, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.model = model
        self.suffix = f"@tp{tp_rank}" if tp_size > 1 else ""
        self.packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
        self.loaded: dict[str, dict[str, list[Any]]] = {}  # module -> param -> digests at its last load
        self.errors = 0
        self._wrapped: list[Any] = []
        self._names = {id(module): name for name, module in model.named_modules()}
        for name, module in model.named_modules():
            # vLLM's quant method (untyped, so Any); the callable() check below rules out None
            method: Any = getattr(module, "quant_method", None)
            if callable(getattr(method, "process_weights_after_loading", None)) and (
                "process_weights_after_loading" not in vars(method)
            ):
                method.process_weights_after_loading = self._wrap(name, method)
                self._wrapped.append(method)

    def _wrap(self, name: str, method: Any) -> Any:
        def process_weights_after_loading(layer: Any, *args: Any, **kwargs: Any) -> Any:
            try:  # by the layer given: one quant method object may serve several layers
                at = self._names.get(id(layer), name)
                self.loaded[at] = self._pending(at, layer)
            except Exception:  # never break the engine's load
                self.errors += 1
            # the class's method as it is now: a wrapper installed there later still runs
            return type(method).process_weights_after_loading(method, layer, *args, **kwargs)

        return process_weights_after_loading

    def _pending(self, name: str, module: Any) -> dict[str, list[Any]]:
        return {
            param_name: self._parts(name, module, param_name, param)
            for param_name, param in module.named_parameters(recurse=False)
            if param.numel() and not param.is_meta
        }

    def _parts(self, name: str, module: Any, param_name: str, param: torch.Tensor) -> list[Any]:
        from isoaudit.collectors.held_weights import pending

        parts = trainer_parts(name, module, param_name, param.data, self.packed)
        return pending((n + self.suffix, t) for n, t in parts)

    def digests(self) -> tuple[dict[str, str], list[str]]:
        """(name -> digest of what is held now, names of parameters that cannot be digested). A
        parameter still in place is digested as it is now (whatever wrote it); a removed one as it
        was last loaded."""
        from isoaudit.collectors.held_weights import landed

        items: list[Any] = []
        unavailable: list[str] = []
        seen: set[int] = set()
        for name, module in self.model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue  # a tied parameter, digested under its first name
                seen.add(id(param))
                if param.numel() and not param.is_meta:
                    items += self._parts(name, module, param_name, param)
                elif param_name in self.loaded.get(name, {}):
                    items += self.loaded[name][param_name]
                elif (kept := _kept_raw(module, param_name)) is not None:
                    items += self._parts(name, module, param_name, kept)
                else:
                    unavailable.append(f"{name}.{param_name}{self.suffix}")
        return landed(items), unavailable

    def remove(self) -> None:
        """Unwrap every layer's post-load processing."""
        for method in self._wrapped:
            vars(method).pop("process_weights_after_loading", None)
        self._wrapped.clear()
        self.loaded.clear()


#: Where the remediation keeps a linear layer's raw (weight, bias) as loaded
#: (:mod:`isoaudit.collectors.vllm.worker.remediation`).
_RAW = "_isoaudit_raw"


def _kept_raw(module: Any, param_name: str) -> torch.Tensor | None:
    kept = getattr(module, _RAW, None)
    if not isinstance(kept, tuple) or len(kept) != 2 or param_name not in ("weight", "bias"):
        return None
    tensor = kept[0] if param_name == "weight" else kept[1]
    return tensor if isinstance(tensor, torch.Tensor) and tensor.numel() else None


def worker_held(worker: Any, tp_rank: int = 0) -> HeldWeights:
    """This worker's :class:`HeldWeights`, created (hooks installed) on first use."""
    held = getattr(worker, "_isoaudit_held", None)
    if held is None:
        size = int(getattr(worker.vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        held = HeldWeights(worker.model_runner.get_model(), tp_rank=tp_rank, tp_size=size)
        worker._isoaudit_held = held
    return held


def held_digests_reply(worker: Any, tp_rank: int = 0) -> dict[str, Any]:
    """What one worker answers the driver: digests, the tensors without one, and how they were taken."""
    held = worker_held(worker, tp_rank)
    digests, unavailable = held.digests()
    return {"digests": digests, "unavailable": unavailable, "errors": held.errors}


def release_held(worker: Any) -> None:
    held = getattr(worker, "_isoaudit_held", None)
    if held is not None:
        held.remove()
        worker._isoaudit_held = None


def engine_digests(link: Any) -> tuple[dict[str, str], str]:
    """Every worker's held-weight digests merged (TP shards carry ``@tpN``), and a note of how
    they were taken, for the manifest's runtime facts (``weight_digests_form``)."""
    digests: dict[str, str] = {}
    unavailable: list[str] = []
    for reply in link.call("weight_digests"):
        digests.update(reply["digests"])
        unavailable += reply["unavailable"]
    note = "parameters as held after the sync; repacked ones " + AS_LOADED
    if unavailable:
        note += f"; not digested ({len(unavailable)}: {', '.join(unavailable[:3])}{'…' if len(unavailable) > 3 else ''}): {REMOVED_BEFORE_ATTACH}"
    return digests, note


def refresh_held(collector: Any) -> None:
    """Ask the workers what they hold now and put it in the collector's next manifest. Never raises
    (counted by the collector)."""
    found = collector.guarded("weight digests", engine_digests, collector.link)
    if found is not None:
        collector.weight_tensor_digests, note = found
        collector.facts = collector.facts.model_copy(update={"weight_digests_form": note})
