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

from collectors.vllm.messages import PackedTensor

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
    from collectors.vllm.collector import attached
    from collectors.vllm.link import EngineLink
    from collectors.vllm.messages import LoadWeights, to_wire

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
        collector._weights_now(str(version), value)  # the workers know already
    return value
