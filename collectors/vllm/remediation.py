"""Remediation inside a vLLM worker: its layers switched onto isoaudit's invariant kernels and back.

vLLM lets a worker replace, per layer instance and between two steps:

* the **linear method**: each unquantized linear layer's ``quant_method.apply`` runs the kernels'
  invariant GEMM (:func:`kernels.routing.linear`) on the layer's *raw* weight. vLLM-CPU packs each
  weight for oneDNN/SGL at load and removes the original, so :func:`keep_raw_weights` hooks
  ``UnquantizedLinearMethod.process_weights_after_loading`` to keep it; it must be installed before
  the worker loads the model (importing :mod:`collectors.vllm.worker`, the worker extension, does
  it; so does :class:`collectors.rl.rollout.VllmRollout`), and an in-place weight reload re-runs it;
* the **RMSNorm and SiluAndMul ops**: ``CustomOp`` binds its forward at construction, so each
  instance's ``_forward_method`` is swapped (the residual-fused norm: ``x + residual`` in the model
  dtype, then the norm, as HF computes it);
* the **head**: ``LogitsProcessor._get_logits`` computes fp32 logits
  (:func:`kernels.routing.logits_fp32`), and the sampler's log-softmax (``compute_logprobs`` and the
  top-k/top-p sampler's processed logprobs) is :func:`kernels.routing.log_softmax`.

What a worker cannot replace stays vLLM's own and is named: the attention (its paged-KV kernel:
``CPU_ATTN`` on the CPU, FlashAttention/FlashInfer/Triton on GPUs) and the rotary embedding that
feeds it, and any layer whose weights were not kept or that is quantized. The replacements call
the kernels with routing forced on for that call only, so an in-process trainer that shares this
process keeps its own mode. They need an eager engine (``enforce_eager=True``): a compiled decoder
or a replayed CUDA graph never calls the Python forwards replaced here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

#: Where a linear layer's weight and bias, as loaded, are kept (a plain attribute, not a parameter,
#: so vLLM's reload machinery neither sees nor moves it).
RAW = "_isoaudit_raw"

_installed: dict[str, Any] = {}
_lock = threading.Lock()


def keep_raw_weights() -> bool:
    """Make every unquantized linear layer keep its weight (and bias) as loaded, before vLLM's
    post-load processing packs and removes it. Idempotent; ``False`` when vLLM is missing. Costs
    one extra copy of the linear weights in host memory on vLLM-CPU (where packing removes them)."""
    with _lock:
        if "linear" in _installed:
            return True
        try:
            from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        except Exception:  # pragma: no cover - vLLM absent or broken
            return False
        original = UnquantizedLinearMethod.process_weights_after_loading

        def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
            weight = getattr(layer, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.ndim == 2 and not weight.is_meta:
                bias = getattr(layer, "bias", None)
                with torch.inference_mode(False):  # a normal tensor: the kernels cache its integer form
                    kept = weight.detach().clone()
                    kept_bias = bias.detach().clone() if isinstance(bias, torch.Tensor) else None
                object.__setattr__(layer, RAW, (kept, kept_bias))
            original(self, layer)

        process_weights_after_loading.__wrapped__ = original  # type: ignore[attr-defined]
        UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]
        _installed["linear"] = original
        return True


@contextmanager
def _routed() -> Iterator[None]:
    """:mod:`kernels.routing` enabled for the duration of one replaced op."""
    from kernels import routing

    previous = routing.set_enabled(True)
    try:
        yield
    finally:
        routing.set_enabled(previous)


# ----------------------------------------------------------------------------- replacements


def _linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from kernels import routing

    raw = vars(layer).get(RAW)
    weight, raw_bias = raw if raw is not None else (layer.weight, bias)
    with _routed():
        return routing.linear(x, weight, raw_bias if bias is not None else None)


def _norm_forward(module: nn.Module) -> Callable[..., Any]:
    from kernels import routing

    eps = float(module.variance_epsilon)

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        weight = module.weight.data if module.has_weight else None
        with _routed():
            if residual is None:
                return routing.rms_norm(x, weight, eps)
            summed = x + residual  # the residual stream in the model dtype, as HF adds it
            return routing.rms_norm(summed, weight, eps), summed

    return forward


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from kernels import routing

    d = x.shape[-1] // 2
    with _routed():
        return routing.silu(x[..., :d]) * x[..., d:]


def _logits_forward(processor: nn.Module) -> Callable[..., Any]:
    from kernels import routing

    def get_logits(
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        embedding_bias: torch.Tensor | None,
        skip_gather: bool = False,
    ) -> torch.Tensor | None:
        with _routed():
            logits = routing.logits_fp32(hidden_states, lm_head.weight)
        if embedding_bias is not None:
            logits = logits + embedding_bias.float()
        if skip_gather:
            return logits
        if getattr(lm_head, "tp_size", 1) > 1:
            logits = processor._gather_logits(logits)
        return logits[..., : processor.org_vocab_size] if logits is not None else None

    return get_logits


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    from kernels import routing

    with _routed():
        return routing.log_softmax(logits)


def _processed_logprobs(sampler: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    """The top-k/top-p sampler with its processed logprobs from the invariant log-softmax: it is run
    asking for the processed *logits*, which are then normalised here."""

    def forward(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> tuple[torch.Tensor, Any]:
        if sampler.logprobs_mode != "processed_logprobs":
            return original(logits, generators, k, p)
        sampler.logprobs_mode = "processed_logits"
        try:
            sampled, processed = original(logits, generators, k, p)
        finally:
            sampler.logprobs_mode = "processed_logprobs"
        return sampled, _log_softmax(processed) if processed is not None else None

    return forward


# ----------------------------------------------------------------------------- the worker's switch


def _version() -> str:
    import vllm

    return str(vllm.__version__)


def _attention_backends(runner: Any) -> list[str]:
    names = []
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups:
            try:
                names.append(str(group.backend.get_name()))
            except Exception:
                continue
    return sorted(set(names)) or ["unknown"]


class WorkerRemediation:
    """The remediation state of one worker's model: :meth:`apply` switches every layer it can
    (instance by instance, so :meth:`restore` puts back exactly what was there) and reports what
    stays native and why; :meth:`ops` names the implementation of each op as it runs now."""

    def __init__(self, runner: Any, model: nn.Module) -> None:
        self.runner = runner
        self.model = model
        self.mode = "native"
        self.native: dict[str, str] = {}  # op -> why it stays vLLM's own in the invariant mode
        self._undo: list[Callable[[], None]] = []

    # ------------------------------------------------------------ switching

    def apply(self, mode: str) -> tuple[str, str | None]:
        """Switch to ``mode``; returns (applied mode, what stays native and why)."""
        if mode not in ("native", "invariant"):
            raise ValueError(f"mode: expected native or invariant, got {mode!r}")
        self.restore()
        if mode == "native":
            return "native", None
        self.native = self._install()
        self.mode = "invariant"
        return "invariant", self.reason()

    def restore(self) -> None:
        """vLLM's own ops again, everywhere (idempotent)."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.native = {}
        self.mode = "native"

    def reason(self) -> str | None:
        if not self.native:
            return None
        return "stays vLLM's own: " + "; ".join(f"{op} ({why})" for op, why in self.native.items())

    def _set(self, obj: Any, name: str, value: Any) -> None:
        """Set an instance attribute, remembering how to put back what was there."""
        own = vars(obj)
        had, before = name in own, own.get(name)
        object.__setattr__(obj, name, value)

        def undo() -> None:
            if had:
                object.__setattr__(obj, name, before)
            else:
                vars(obj).pop(name, None)

        self._undo.append(undo)

    def _install(self) -> dict[str, str]:
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        native: dict[str, str] = {}
        unkept, quantized, odd_norms = [], [], []
        for name, module in self.model.named_modules():
            if isinstance(module, LinearBase):
                if type(module.quant_method) is not UnquantizedLinearMethod:
                    quantized.append(name)
                elif RAW in vars(module) or (module.weight.ndim == 2 and module.weight.numel() > 0):
                    self._set(module.quant_method, "apply", _linear)
                else:
                    unkept.append(name)
            elif type(module) is RMSNorm:
                if module.variance_size_override is None:
                    self._set(module, "_forward_method", _norm_forward(module))
                else:
                    odd_norms.append(name)
            elif type(module) is SiluAndMul:
                self._set(module, "_forward_method", _silu_and_mul)
            elif isinstance(module, LogitsProcessor):
                if module.logits_as_input or module.soft_cap is not None or module.scale != 1.0:
                    native["lm_head"] = f"{name} scales or caps its logits"
                else:
                    self._set(module, "_get_logits", _logits_forward(module))
        sampler = getattr(self.runner, "sampler", None)
        if sampler is not None:
            self._set(sampler, "compute_logprobs", _log_softmax)
            top = getattr(sampler, "topk_topp_sampler", None)
            if top is not None and callable(getattr(top, "forward", None)):
                self._set(top, "forward", _processed_logprobs(top, top.forward))
        else:
            native["log_softmax"] = "the model runner has no sampler to replace"
        if unkept:
            native["linear"] = (
                f"{len(unkept)} layers' raw weights were not kept at load (e.g. {unkept[0]}): start the "
                "engine with worker_extension_cls=collectors.vllm.EXTENSION, or call "
                "collectors.vllm.remediation.keep_raw_weights() before creating it"
            )
        if quantized:
            native["linear"] = f"{len(quantized)} quantized layers (e.g. {quantized[0]})"
        if odd_norms:
            native["norm"] = f"RMSNorm over part of the hidden size ({odd_norms[0]})"
        native["attention"] = (
            f"vLLM's paged-KV attention kernel ({', '.join(_attention_backends(self.runner))}): no "
            "extension point reaches inside it"
        )
        native["rotary"] = "vLLM's rotary embedding over its cos/sin cache, feeding only the attention"
        return native

    # ------------------------------------------------------------ reporting

    def ops(self) -> dict[str, str]:
        """Each contract op (:data:`collectors.policy.REGION_OPS`) → ``id@version`` as run now."""
        from vllm.platforms import current_platform

        from collectors.policy import exact_ops, kernel_ops, torch_op

        version = _version()
        cpu = bool(current_platform.is_cpu())
        vllm_op = lambda name: f"vllm.{name}@{version}"  # noqa: E731
        ops = {op: impl.text for op, impl in exact_ops().items()}
        ops.update(
            {
                "residual_add": vllm_op("fused_add_rms_norm"),
                "norm": vllm_op("rms_norm"),
                "qk_norm": vllm_op("rms_norm"),
                "linear": vllm_op("cpu_gemm" if cpu else "unquantized_gemm"),
                "rotary": vllm_op("rotary_embedding"),
                "attention": vllm_op("attention." + "+".join(_attention_backends(self.runner))),
                "silu": torch_op("silu").text if cpu else vllm_op("silu_and_mul"),
                "gate_mul": torch_op("mul").text if cpu else vllm_op("silu_and_mul"),
                "lm_head": vllm_op("cpu_gemm" if cpu else "unquantized_gemm"),
                "log_softmax": torch_op("log_softmax").text,
            }
        )
        if self.mode == "invariant":
            device = next(self.model.parameters()).device.type
            for op, impl in kernel_ops(device).items():
                if op not in self.native and not (op == "qk_norm" and "norm" in self.native):
                    ops[op] = impl.text
            if "norm" not in self.native:
                ops["residual_add"] = torch_op("add").text
            if "silu" not in self.native:
                ops["gate_mul"] = torch_op("mul").text
        return ops


def remediation_of(worker: Any) -> WorkerRemediation:
    """The worker's :class:`WorkerRemediation` (made on first use, kept on the worker)."""
    state = getattr(worker, "_isoaudit_remediation", None)
    runner = worker.model_runner
    model = runner.get_model()
    if state is None or state.model is not model:
        state = WorkerRemediation(runner, model)
        worker._isoaudit_remediation = state
    return state
