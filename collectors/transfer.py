"""One device-to-host copy per step for everything a collector keeps, without stalling the step.

Each ``.cpu()`` of a CUDA tensor is a synchronisation and a small transfer; a step with every region
fingerprinted has hundreds of small tensors. Packing them as bytes into one buffer makes that one
copy, then numpy views split it back on the host without further copies. On CUDA the copy goes to
pinned memory asynchronously, on a stream of its own (:class:`HostCopy`): the training loop keeps
queueing its backward, and the device keeps running it, while the bytes travel; the collector reads
them a step later (or when asked to flush).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int16: np.int16,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


_fallback_logged = False


def _warn_sync_fallback(exc: BaseException) -> None:
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        logging.getLogger(__name__).warning(
            "isoaudit collector: asynchronous host copy unavailable (%s); copying synchronously", exc
        )


class PinnedPool:
    """Pinned host buffers kept for reuse: at most ``keep`` per size (rounded up to a power of two)
    and ``max_bytes`` in all, so batch shapes that vary step to step keep no more than that pinned.

    Each step's copy lands in a pinned buffer, and a fresh one costs a ``cudaHostAlloc``, which
    waits for the device, whenever the caching host allocator has none free; the step's records
    hold numpy views of the buffer
    until the sink delivers them. A buffer taken here comes back when the last view of its host
    array is gone (:meth:`lend`), or is simply freed when the pool is full."""

    def __init__(self, keep: int = 4, max_bytes: int = 256 << 20) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self.kept_bytes = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made (the rest were reused)

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of at least ``nbytes`` bytes (its first ``nbytes`` are the ones to use)."""
        size = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            free = self._free.get(size)
            if free:
                self.kept_bytes -= size
                return free.pop()
        self.allocated += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def lend(self, buffer: torch.Tensor, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``buffer`` as a numpy array (whose copy has landed): the buffer
        returns to the pool once that array and every view of it are gone."""
        array = buffer[:nbytes].numpy()
        weakref.finalize(array, self._give_back, buffer)
        return array

    def _give_back(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self._lock:
            free = self._free.setdefault(size, [])
            if len(free) < self.keep and self.kept_bytes + size <= self.max_bytes:
                free.append(buffer)
                self.kept_bytes += size


#: The pool every :class:`HostCopy` takes its pinned buffer from.
PINNED = PinnedPool()


class HostCopy:
    """``tensors`` on their way to the host: CPU ones copied at once, CUDA ones packed into one
    buffer and copied asynchronously into pinned memory, on the device's copy stream
    (:func:`copy_stream`, after the work queued so far), behind an event. ``fresh``: names of CPU
    tensors that nothing writes again (the collector's own fingerprints), viewed instead of copied."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        asynchronous: bool = True,
        fresh: Callable[[str], bool] | None = None,
    ) -> None:
        self._done: dict[str, np.ndarray] = {}
        self._items: list[tuple[str, torch.Tensor]] = []
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None  # kept alive until the copy is done
        self._event: Any = None
        on_device = {k: t for k, t in tensors.items() if t.device.type == "cuda"}
        rest = {k: t for k, t in tensors.items() if k not in on_device}
        self._done.update(to_host(rest, fresh=fresh))
        if not on_device:
            return
        if not asynchronous:
            self._done.update(to_host(on_device))
            return
        for name, tensor in on_device.items():
            if tensor.dtype not in _NUMPY:
                raise TypeError(f"tensors[{name!r}]: dtype {tensor.dtype} cannot travel")
            self._items.append((name, tensor.detach()))
        try:
            parts = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in self._items]
            self._device = torch.cat(parts)
            self._host = PINNED.take(self._device.numel())
            # the copy runs on a stream of its own, after what the step queued so far: the step's
            # next kernels need not wait for the bytes to cross the bus
            stream = copy_stream(self._device.device)
            stream.wait_stream(torch.cuda.current_stream(self._device.device))
            with torch.cuda.stream(stream):
                self._host[: self._device.numel()].copy_(self._device, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(stream)
            self._device.record_stream(stream)
        except RuntimeError as exc:  # no pinned memory, say: the plain synchronous copy still works
            _warn_sync_fallback(exc)
            self._items, self._event, self._device = [], None, None
            self._done.update(to_host(on_device))

    @property
    def travelling(self) -> bool:
        """Is an asynchronous copy under way (or landed and not yet read)?"""
        return self._event is not None

    def ready(self) -> bool:
        """Has the copy landed (never blocks)?"""
        return self._event is None or bool(self._event.query())

    def result(self) -> dict[str, np.ndarray]:
        """The numpy arrays, waiting for the copy if it is still under way."""
        if self._event is not None:
            self._event.synchronize()
            assert self._host is not None and self._device is not None
            host = PINNED.lend(self._host, self._device.numel())
            self._host = None  # back to the pool once the views are gone
            offset = 0
            for name, tensor in self._items:
                size = tensor.numel() * tensor.element_size()
                self._done[name] = (
                    host[offset : offset + size].view(_NUMPY[tensor.dtype]).reshape(tuple(tensor.shape))
                )
                offset += size
            self._event = self._device = None
            self._items = []
        return self._done


_STREAMS: dict[torch.device, Any] = {}
_STREAMS_LOCK = threading.Lock()


def copy_stream(device: torch.device) -> Any:
    """The stream host copies of ``device`` travel on (one per device, made once)."""
    with _STREAMS_LOCK:
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (a small CPU one: an index, say) on ``device`` without making the host wait for
    the device: a CUDA copy leaves from pinned memory, asynchronously. ``.to(device)`` from ordinary
    memory synchronises the stream, which mid-step drains all the work queued so far."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    try:
        source = tensor if tensor.is_pinned() else tensor.pin_memory()
    except RuntimeError as exc:  # no pinned memory: the plain copy still works
        _warn_sync_fallback(exc)
        return tensor.to(device)
    return source.to(device, non_blocking=True)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements in row-major order as a 1-D uint8 view (a copy only if not contiguous).
    A tensor of at most one element counts as contiguous whatever its stride, and keeps that stride
    through ``reshape``: a column of a one-row buffer has stride 5, which a byte view refuses."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def to_host(
    tensors: Mapping[str, torch.Tensor], *, fresh: Callable[[str], bool] | None = None
) -> dict[str, np.ndarray]:
    """Numpy copies of ``tensors`` (same shapes and dtypes), with one transfer per source device.
    ``fresh(name)``: that CPU tensor is never written again, so a view of it will do."""
    out: dict[str, np.ndarray] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if tensor.dtype not in _NUMPY:
            raise TypeError(
                f"tensors[{name!r}]: dtype {tensor.dtype} cannot travel (expected one of {list(_NUMPY)})"
            )
        by_device.setdefault(tensor.device, []).append((name, tensor.detach()))
    for device, items in by_device.items():
        if device.type == "cpu":
            for name, tensor in items:
                array = tensor.contiguous().numpy()
                out[name] = array if fresh is not None and fresh(name) else array.copy()
            continue
        parts = [flat_bytes(t) for _, t in items]
        host = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, np.uint8)
        offset = 0
        for (name, tensor), part in zip(items, parts, strict=True):
            size = part.numel()
            out[name] = host[offset : offset + size].view(_NUMPY[tensor.dtype]).reshape(tuple(tensor.shape))
            offset += size
    return out
