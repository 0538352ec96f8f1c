"""The invariant kernels as registered torch custom ops, so a ``torch.compile``'d model runs them.

Dynamo would otherwise trace into each kernel's Python (host reads, autograd Functions, caches)
and break the graph, or hand its arithmetic to inductor, which fuses and reorders it into other
bits. :mod:`isoaudit.kernels.dispatch` calls these ops instead of the kernels while it is being
traced (``torch.compiler.is_compiling()``); eagerly it calls the kernels directly, as before. Each
op's forward is the eager path's function (``dispatch.*_on``), so a compiled forward gives the
eager bits. Its backward is a second op that runs the eager path's own backward (the kernel's
autograd Function, on the saved inputs): gradients through a compiled model are the eager
ones, bit for bit, at the cost of recomputing the op's forward in the backward.

The mode is not an argument: a traced forward reads ``dispatch``'s flag while tracing, so Dynamo
guards on it and a switch recompiles (native forwards contain no op at all); FP8 is read when the
op runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from torch.library import custom_op

from . import dispatch


@contextmanager
def _autograd_on() -> Iterator[None]:
    """Autograd recording inside an op's implementation: the custom-op machinery runs it below
    autograd (its dispatch keys excluded), where the eager backward's own autograd (a kernel's
    reference backward differentiates a recomputation) would record nothing."""
    keys = [torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView]
    was = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    try:
        for k in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        with torch.enable_grad():
            yield
    finally:
        for k, w in zip(keys, was, strict=True):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, w)


def _vjp(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor | None],
    needs: Sequence[bool],
    grad: torch.Tensor,
    extra: Sequence[Any] = (),
) -> list[torch.Tensor]:
    """The eager backward of ``fn(*inputs, *extra)`` for the inputs in ``needs`` (an empty tensor
    for the others: custom ops return no None)."""
    with _autograd_on():
        leaves = [
            t.detach().requires_grad_(bool(n)) if t is not None else None
            for t, n in zip(inputs, needs, strict=True)
        ]
        out = fn(*leaves, *extra)
        wrt = [t for t, n in zip(leaves, needs, strict=True) if n and t is not None]
        got = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True) if wrt else ())
    result = []
    for t, n in zip(leaves, needs, strict=True):
        g = next(got) if n and t is not None else None
        result.append(g.contiguous() if g is not None else grad.new_empty(0))
    return result


def _grads(ctx: Any, got: Sequence[torch.Tensor], count: int) -> tuple[torch.Tensor | None, ...]:
    return tuple(
        got[i] if i < len(got) and ctx.needs_input_grad[i] and got[i].numel() else None for i in range(count)
    )


# ------------------------------------------------------------------------------------- linear


@custom_op("isoaudit::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``dispatch.linear`` with the kernels on."""
    return dispatch.linear_on(x, weight, bias).contiguous()


@linear.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@custom_op("isoaudit::linear_backward", mutates_args=())
def linear_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, needs: list[bool]
) -> list[torch.Tensor]:
    """The eager backward of :func:`linear`."""
    return _vjp(dispatch.linear_on, (x, weight, bias), needs, grad)


@linear_backward.register_fake
def _linear_backward_fake(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, needs: list[bool]
) -> list[torch.Tensor]:
    like = (x, weight, bias)
    return [
        t.new_empty(t.shape) if n and t is not None else grad.new_empty(0)
        for t, n in zip(like, needs, strict=True)
    ]


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias)


def _linear_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, bias = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    return _grads(ctx, torch.ops.isoaudit.linear_backward(grad, x, weight, bias, needs), 3)


linear.register_autograd(_linear_grad, setup_context=_linear_setup)


# ------------------------------------------------------------------------------------ rms_norm


@custom_op("isoaudit::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``dispatch.rms_norm`` with the kernels on."""
    return dispatch.rms_norm_on(x, weight, eps).contiguous()


@rms_norm.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


@custom_op("isoaudit::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, needs: list[bool]
) -> list[torch.Tensor]:
    """The eager backward of :func:`rms_norm`."""
    return _vjp(dispatch.rms_norm_on, (x, weight), needs, grad, (eps,))


@rms_norm_backward.register_fake
def _rms_norm_backward_fake(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, needs: list[bool]
) -> list[torch.Tensor]:
    return [
        t.new_empty(t.shape) if n and t is not None else grad.new_empty(0)
        for t, n in zip((x, weight), needs, strict=True)
    ]


def _rms_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:2]]
    got = torch.ops.isoaudit.rms_norm_backward(grad, x, weight, ctx.eps, needs)
    return (*_grads(ctx, got, 2), None)


rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup)


# ---------------------------------------------------------------------------------------- silu


@custom_op("isoaudit::silu", mutates_args=())
def silu(x: torch.Tensor) -> torch.Tensor:
    """``dispatch.silu`` with the kernels on."""
    return dispatch.silu_on(x).contiguous()


@silu.register_fake
def _silu_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


@custom_op("isoaudit::silu_backward", mutates_args=())
def silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The eager backward of :func:`silu`."""
    return _vjp(dispatch.silu_on, (x,), (True,), grad)[0]


@silu_backward.register_fake
def _silu_backward_fake(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _silu_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _silu_grad(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return torch.ops.isoaudit.silu_backward(grad, x)


silu.register_autograd(_silu_grad, setup_context=_silu_setup)


# ----------------------------------------------------------------------------------- attention


@custom_op("isoaudit::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """``dispatch.attention`` with the kernels on (packed queries against a KV cache)."""
    return dispatch.attention_on(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale).contiguous()


@attention.register_fake
def _attention_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    return q.new_empty(q.shape)


@custom_op("isoaudit::attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None,
    needs: list[bool],
) -> list[torch.Tensor]:
    """The eager backward of :func:`attention` (for q, k_cache, v_cache)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dispatch.attention_on(q, k, v, cu_q, q_pos0, kv_len, slots, scale)

    return _vjp(run, (q, k_cache, v_cache), needs, grad)


@attention_backward.register_fake
def _attention_backward_fake(
    grad: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None,
    needs: list[bool],
) -> list[torch.Tensor]:
    return [
        t.new_empty(t.shape) if n else grad.new_empty(0)
        for t, n in zip((q, k_cache, v_cache), needs, strict=True)
    ]


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, k, v, cu, p0, kv, slots, scale = inputs
    ctx.save_for_backward(q, k, v, cu, p0, kv, slots)
    ctx.scale = scale


def _attention_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, cu, p0, kv, slots = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    got = torch.ops.isoaudit.attention_backward(grad, q, k, v, cu, p0, kv, slots, ctx.scale, needs)
    return (*_grads(ctx, got, 3), None, None, None, None, None)


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


# ------------------------------------------------------------------------------- head (no grad)


@custom_op("isoaudit::logits_fp32", mutates_args=())
def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dispatch.logits_fp32`` with the kernels on (the fp32 head; forward only)."""
    return dispatch.logits_fp32_on(hidden, weight).contiguous()


@logits_fp32.register_fake
def _logits_fp32_fake(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty(*hidden.shape[:-1], weight.shape[0], dtype=torch.float32)


@custom_op("isoaudit::log_softmax", mutates_args=())
def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``dispatch.log_softmax`` with the kernels on (forward only)."""
    return dispatch.log_softmax_on(logits).contiguous()


@log_softmax.register_fake
def _log_softmax_fake(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape, dtype=torch.float32)


# ------------------------------------------------------------------------------------- rotary

#: The original ``forward`` of each HF rotary-embedding class the adapters patch, by class name.
ROTARY_FORWARDS: dict[str, Callable[..., Any]] = {}


@custom_op("isoaudit::rotary", mutates_args=())
def rotary(
    x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, cls: str
) -> list[torch.Tensor]:
    """An HF rotary embedding's own forward (class ``cls``, default RoPE), ``(cos, sin)``, run
    eagerly: inductor's fused sin/cos give other bits than torch's kernels, and the trainer's
    rotary must stay the engine's."""
    module = SimpleNamespace(inv_freq=inv_freq, attention_scaling=scaling, rope_type="default")
    with torch.no_grad():
        cos, sin = ROTARY_FORWARDS[cls](module, x, position_ids)
    return [cos.contiguous(), sin.contiguous()]


@rotary.register_fake
def _rotary_fake(
    x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, cls: str
) -> list[torch.Tensor]:
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return [x.new_empty(shape), x.new_empty(shape)]
