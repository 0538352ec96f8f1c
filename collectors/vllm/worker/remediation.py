"""Remediation inside a vLLM worker: its layers switched onto isoaudit's invariant kernels and back.

vLLM lets a worker replace, per layer instance and between two steps:

* the **linear method**: each unquantized linear layer's ``quant_method.apply`` runs the kernels'
  invariant GEMM (:func:`isoaudit.kernels.dispatch.linear`) on the layer's *raw* weight. vLLM-CPU packs each
  weight for oneDNN/SGL at load and removes the original, so :func:`keep_raw_weights` hooks
  ``UnquantizedLinearMethod.process_weights_after_loading`` to keep it; it must be installed before
  the worker loads the model (importing :mod:`isoaudit.collectors.vllm.extension`, the worker extension, does
  it; so does :class:`isoaudit.collectors.rl.rollout.VllmRollout`), and an in-place weight reload re-runs it;
* the **RMSNorm and SiluAndMul ops**: ``CustomOp`` binds its forward at construction, so each
  instance's ``_forward_method`` is swapped (the residual-fused norm: ``x + residual`` in the model
  dtype, then the norm, as HF computes it);
* the **head**: ``LogitsProcessor._get_logits`` computes fp32 logits
  (:func:`isoaudit.kernels.dispatch.logits_fp32`), and the sampler's log-softmax (``compute_logprobs`` and the
  top-k/top-p sampler's processed logprobs) is :func:`isoaudit.kernels.dispatch.log_softmax`;
* the **rotary embedding**: ``RotaryEmbedding._forward_method`` runs HF's default RoPE arithmetic
  (what the trainer runs) instead of vLLM's cos/sin cache;
* the **attention** (vLLM-CPU's ``CPU_ATTN`` backend): each layer's ``impl.forward`` writes the
  step's keys and values into a shadow store per cache block (vLLM's own cache keeps its kernel's
  layout, which is not read here) and runs :func:`isoaudit.kernels.dispatch.attention` over each request's
  keys in position order. A step that needs keys written before the switch (a request in flight across
  it) runs vLLM's kernel instead, counted. The store holds a second copy of the KV rows written while
  invariant (dropped when switching back).

What a worker cannot replace stays vLLM's own and is named: attention backends other than
``CPU_ATTN`` (the GPU ones read their paged cache inside their kernels), attention with prefix
caching (cached blocks hold keys this path did not write), ALiBi, sliding windows, soft caps, sinks
or an fp8 cache, a RoPE other than the default full-width NeoX one, and any layer whose weights
were not kept or that is quantized. The replacements call the kernels with routing forced on for
that call only, so an in-process trainer that shares this process keeps its own mode.

In a compiled engine (:mod:`isoaudit.collectors.vllm.worker.graph`) the replaced forwards of the
decoder call the same replacements through opaque custom ops (``isoaudit_vllm::linear``,
``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary``: :class:`GraphOps`), which name their
layer by a registry id, so Dynamo records one node per op and the kernels run eagerly inside it,
reading the layer's current raw weight; the decoder is then recompiled at the step boundary. The
attention is already an opaque op of vLLM's, and the head and the sampler run outside the graph.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from isoaudit.audit.control import REMEDIATION_MODES
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

        process_weights_after_loading.__wrapped__ = original  # type: ignore[attr-defined]  # marks the wrapper so it is not installed twice
        UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]  # installs the wrapper on vLLM's class (keep_raw_weights)
        _installed["linear"] = original
        return True


@contextmanager
def _routed() -> Iterator[None]:
    """:mod:`isoaudit.kernels.dispatch` enabled for the duration of one replaced op."""
    from isoaudit.kernels import dispatch

    previous = dispatch.set_enabled(True)
    try:
        yield
    finally:
        dispatch.set_enabled(previous)


# ----------------------------------------------------------------------------- replacements


def _linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from isoaudit.kernels import dispatch

    raw = vars(layer).get(RAW)
    # an unquantized linear layer's weight is a tensor; nn.Module's stubs type it Tensor | Module
    weight, raw_bias = raw if raw is not None else (cast(torch.Tensor, layer.weight), bias)
    with _routed():
        return dispatch.linear(x, weight, raw_bias if bias is not None else None)


def _norm_forward(module: Any) -> Callable[..., Any]:
    # module: vLLM's RMSNorm (variance_epsilon, has_weight, weight); typed Any, vLLM's layers have no useful types
    from isoaudit.kernels import dispatch

    eps = float(module.variance_epsilon)

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        weight = module.weight.data if module.has_weight else None
        with _routed():
            if residual is None:
                return dispatch.rms_norm(x, weight, eps)
            summed = x + residual  # the residual stream in the model dtype, as HF adds it
            return dispatch.rms_norm(summed, weight, eps), summed

    return forward


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from isoaudit.kernels import dispatch

    d = x.shape[-1] // 2
    with _routed():
        return dispatch.silu(x[..., :d]) * x[..., d:]


def _logits_forward(processor: Any) -> Callable[..., Any]:
    # processor: vLLM's LogitsProcessor (_gather_logits, org_vocab_size); Any, as vLLM's layers are untyped
    from isoaudit.kernels import dispatch

    def get_logits(
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        embedding_bias: torch.Tensor | None,
        skip_gather: bool = False,
    ) -> torch.Tensor | None:
        with _routed():
            logits = dispatch.logits_fp32(hidden_states, cast(torch.Tensor, lm_head.weight))
        if embedding_bias is not None:
            logits = logits + embedding_bias.float()
        if skip_gather:
            return logits
        if getattr(lm_head, "tp_size", 1) > 1:
            logits = processor._gather_logits(logits)
        return logits[..., : processor.org_vocab_size] if logits is not None else None

    return get_logits


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    from isoaudit.kernels import dispatch

    with _routed():
        return dispatch.log_softmax(logits)


def _processed_logprobs(sampler: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """The top-k/top-p sampler with its processed logprobs from the invariant log-softmax: it is run
    asking for the processed *logits*, which are then normalised here."""
    # sampler: vLLM's TopKTopPSampler (its logprobs_mode is set here); Any, as vLLM's layers are untyped

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


def _rotary_forward(module: Any) -> Callable[..., Any]:
    """HF's default RoPE arithmetic (what the trainer and the reference engine run): fp32 tables of
    inv_freq x position from a K=1 batched matmul, cos/sin, cast to the model dtype, then
    ``q * cos + rotate_half(q) * sin`` in the model dtype."""
    # module: vLLM's RotaryEmbedding (rotary_dim, base); Any, as vLLM's layers are untyped
    dim = int(module.rotary_dim)
    inv_freq = 1.0 / (float(module.base) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(cos.shape[0], -1, dim)
        half = dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return ((x * cos) + (rotated * sin)).reshape(shape)

    def forward(
        positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        flat = positions.flatten()
        freqs = (inv_freq[None, :, None].to(flat.device) @ flat[None, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)[0]
        cos, sin = emb.cos().to(query.dtype)[:, None, :], emb.sin().to(query.dtype)[:, None, :]
        return rotate(query, cos, sin), rotate(key, cos, sin) if key is not None else None

    return forward


class _ShadowKV:
    """The K/V rows this layer wrote while invariant, per cache block (vLLM's own cache keeps its
    kernel's layout), so the invariant attention can read a request's keys 0..n in order."""

    def __init__(self) -> None:
        self.block_size = 0  # vLLM's kernel block size, read from the cache's shape at first use
        self.rows: dict[int, int] = {}
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def _row(self, block: int, like: torch.Tensor) -> int:
        row = self.rows.get(block)
        if row is None:
            row = self.rows[block] = len(self.rows)
            if self.k is None or row >= self.k.shape[0]:
                size = max(16, 2 * row)
                shape = (size, self.block_size, *like.shape[1:])
                k = torch.zeros(shape, dtype=like.dtype, device=like.device)
                v = torch.zeros_like(k)
                if self.k is not None and self.v is not None:
                    k[: self.k.shape[0]] = self.k
                    v[: self.v.shape[0]] = self.v
                self.k, self.v = k, v
        return row

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        slots = slots.long()
        blocks = (slots // self.block_size).tolist()
        rows = torch.tensor([self._row(b, key) for b in blocks], dtype=torch.long, device=key.device)
        offsets = slots % self.block_size
        assert self.k is not None and self.v is not None
        self.k[rows, offsets] = key
        self.v[rows, offsets] = value

    def gather(self, block_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        count = -(-n // self.block_size)
        rows = [self.rows.get(b) for b in block_row[:count].tolist()]
        if self.k is None or self.v is None or any(r is None for r in rows):
            return None  # written before the switch (native): not held here
        index = torch.tensor(rows, dtype=torch.long, device=self.k.device)
        k = self.k.index_select(0, index).reshape(-1, *self.k.shape[2:])[:n]
        v = self.v.index_select(0, index).reshape(-1, *self.v.shape[2:])[:n]
        return k, v


def _attention_forward(impl: Any, original: Callable[..., Any], counts: dict[str, int]) -> Any:
    """The layer's attention through :func:`isoaudit.kernels.dispatch.attention` over the keys it wrote since
    the switch; a step that needs keys written before it runs vLLM's kernel instead (counted)."""
    from isoaudit.kernels import dispatch

    shadow = _ShadowKV()

    def forward(
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attn_metadata is None:  # warm-up
            return output
        n = int(attn_metadata.num_actual_tokens)
        shadow.block_size = shadow.block_size or int(kv_cache.shape[2])  # [blocks, kv heads, block, 2 x head]
        shadow.write(key[:n], value[:n], attn_metadata.slot_mapping[:n])
        starts = attn_metadata.query_start_loc.long()
        lengths = attn_metadata.seq_lens.long()
        batch = int(lengths.numel())
        held = [shadow.gather(attn_metadata.block_table[b], int(lengths[b])) for b in range(batch)]
        if any(h is None for h in held) or not bool(attn_metadata.causal):
            counts["native_fallbacks"] = counts.get("native_fallbacks", 0) + 1
            if counts["native_fallbacks"] == 1:
                log.warning(
                    "isoaudit vllm remediation: a request started before the switch to the invariant "
                    "mode; its steps run vLLM's attention until it finishes (counted, said once)"
                )
            return original(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        longest = int(lengths.max())
        k_cache = key.new_zeros((batch, longest, *key.shape[1:]))
        v_cache = value.new_zeros((batch, longest, *value.shape[1:]))
        for b, (k, v) in enumerate(held):  # type: ignore[misc]  # no entry is None here: the check above returned
            k_cache[b, : k.shape[0]] = k
            v_cache[b, : v.shape[0]] = v
        q_lens = starts[1:] - starts[:-1]
        with _routed():
            out = dispatch.attention(
                query[:n],
                k_cache,
                v_cache,
                starts,
                lengths - q_lens,
                lengths,
                torch.arange(batch, device=query.device),
                impl.scale,
            )
        output[:n].copy_(out.reshape(output[:n].shape))
        return output

    return forward


# ----------------------------------------------------------------------------- graph ops

_lib = torch.library.Library("isoaudit_vllm", "FRAGMENT")
_lib.define("linear(Tensor x, int layer, bool bias) -> Tensor")
_lib.define("rms_norm(Tensor x, int module) -> Tensor")
_lib.define("add_rms_norm(Tensor x, Tensor residual, int module) -> (Tensor, Tensor)")
_lib.define("silu_and_mul(Tensor x) -> Tensor")
_lib.define("rotary(Tensor positions, Tensor query, Tensor key, int module) -> (Tensor, Tensor)")

#: Layers the graph ops run, by id (an op's arguments are tensors and numbers, not modules).
_REGISTRY: dict[int, Any] = {}


def _register(obj: Any) -> int:
    _REGISTRY[id(obj)] = obj
    return id(obj)


def _op_linear(x: torch.Tensor, layer: int, bias: bool) -> torch.Tensor:
    module = _REGISTRY[layer]
    return _linear(module, x, module.bias if bias else None)


def _op_rms_norm(x: torch.Tensor, module: int) -> torch.Tensor:
    return cast(torch.Tensor, _REGISTRY[module]._isoaudit_norm(x))


def _op_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, module: int
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = _REGISTRY[module]._isoaudit_norm(x, residual)
    return normed, summed


def _op_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, module: int
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _REGISTRY[module]._isoaudit_rotary(positions, query, key)
    return q, k


for _name, _impl in (
    ("linear", _op_linear),
    ("rms_norm", _op_rms_norm),
    ("add_rms_norm", _op_add_rms_norm),
    ("silu_and_mul", _silu_and_mul),
    ("rotary", _op_rotary),
):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")


@torch.library.register_fake("isoaudit_vllm::linear")
def _fake_linear(x: torch.Tensor, layer: int, bias: bool) -> torch.Tensor:
    weight = _raw_weight(_REGISTRY[layer])
    return x.new_empty((*x.shape[:-1], int(weight.shape[0])))


@torch.library.register_fake("isoaudit_vllm::rms_norm")
def _fake_rms_norm(x: torch.Tensor, module: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("isoaudit_vllm::add_rms_norm")
def _fake_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, module: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("isoaudit_vllm::silu_and_mul")
def _fake_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], int(x.shape[-1]) // 2))


@torch.library.register_fake("isoaudit_vllm::rotary")
def _fake_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, module: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key)


def _raw_weight(layer: Any) -> torch.Tensor:
    raw = vars(layer).get(RAW)
    return cast(torch.Tensor, raw[0] if raw is not None else layer.weight)


class GraphOps:
    """The replacements as the compiled decoder calls them: each one opaque op of ``isoaudit_vllm``."""

    @staticmethod
    def register_linear(layer: nn.Module) -> None:
        """Give ``layer`` its registry id (at install: what Dynamo traces only reads it)."""
        object.__setattr__(layer, "_isoaudit_id", _register(layer))

    @staticmethod
    def linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ident = vars(layer)["_isoaudit_id"]
        return cast(torch.Tensor, torch.ops.isoaudit_vllm.linear(x, ident, bias is not None))

    @staticmethod
    def norm(module: Any) -> Callable[..., Any]:
        object.__setattr__(module, "_isoaudit_norm", _norm_forward(module))
        ident = _register(module)

        def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
            if residual is None:
                return torch.ops.isoaudit_vllm.rms_norm(x, ident)
            return torch.ops.isoaudit_vllm.add_rms_norm(x, residual, ident)

        return forward

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, torch.ops.isoaudit_vllm.silu_and_mul(x))

    @staticmethod
    def rotary(module: Any) -> Callable[..., Any]:
        eager = _rotary_forward(module)
        object.__setattr__(module, "_isoaudit_rotary", eager)
        ident = _register(module)

        def forward(
            positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            if key is None:
                return eager(positions, query, None)
            return torch.ops.isoaudit_vllm.rotary(positions, query, key, ident)

        return forward


# ----------------------------------------------------------------------------- the worker's switch


def _version() -> str:
    import vllm

    return str(vllm.__version__)


def _attention_refusal(runner: Any, layer: Any) -> str | None:
    """Why this attention layer cannot run the invariant kernel here, or ``None``."""
    impl: Any = getattr(layer, "impl", None)  # vLLM's attention impl (untyped); None fails the check below
    if type(impl).__name__ != "CPUAttentionBackendImpl":
        return f"vLLM's {type(impl).__name__} reads a paged cache in its own kernel: not replaced"
    if getattr(runner, "cache_config", None) is not None and runner.cache_config.enable_prefix_caching:
        return "prefix caching: cached blocks hold keys the invariant path did not write"
    if (
        impl.alibi_slopes is not None
        or impl.sliding_window != -1
        or impl.logits_soft_cap
        or impl.sinks is not None
        or impl.is_fp8_kv_cache
        or impl.kv_sharing_target_layer_name is not None
        or str(impl.attn_type).split(".")[-1].lower() != "decoder"
    ):
        return "ALiBi, a sliding window, a soft cap, sinks, an fp8 cache, shared KV or non-decoder attention"
    return None


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

    def __init__(self, runner: Any, model: nn.Module, *, graph: bool = False) -> None:
        self.runner = runner
        self.model = model
        self.graph = graph  # the decoder is compiled: its replacements are graph ops (GraphOps)
        self.mode = "native"
        self.native: dict[str, str] = {}  # op -> why it stays vLLM's own in the invariant mode
        self.counts: dict[str, int] = {}  # attention steps that needed keys written before the switch
        self._undo: list[Callable[[], None]] = []

    # ------------------------------------------------------------ switching

    def apply(self, mode: str) -> tuple[str, str | None]:
        """Switch to ``mode``; returns (applied mode, what stays native and why)."""
        if mode not in REMEDIATION_MODES:
            raise ValueError(f"mode: expected native or invariant, got {mode!r}")
        self.restore()
        if mode == "native":
            return "native", None
        self.native = self._install()
        self.mode = "invariant"
        return "invariant", self.reason()

    def kernel_facts(self) -> dict[str, Any]:
        """The launch settings of isoaudit's kernels in the mode applied now
        (:func:`isoaudit.collectors.manifest.kernel_facts`): the replaced ops route through the
        kernels only while they run, so the facts are read as those ops see them."""
        from isoaudit.collectors.manifest import kernel_facts

        if self.mode != "invariant":
            return kernel_facts()
        import isoaudit.kernels.gemm_policy  # noqa: F401  # the split policy the GEMMs read

        with _routed():
            return kernel_facts()

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
                elif RAW in vars(module) or (
                    (weight := cast(torch.Tensor, module.weight)).ndim == 2 and weight.numel() > 0
                ):
                    if self.graph:
                        GraphOps.register_linear(module)
                    self._set(module.quant_method, "apply", GraphOps.linear if self.graph else _linear)
                else:
                    unkept.append(name)
            elif type(module) is RMSNorm:
                if module.variance_size_override is None:
                    forward = GraphOps.norm(module) if self.graph else _norm_forward(module)
                    self._set(module, "_forward_method", forward)
                else:
                    odd_norms.append(name)
            elif type(module) is SiluAndMul:
                self._set(module, "_forward_method", GraphOps.silu_and_mul if self.graph else _silu_and_mul)
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
                "engine with worker_extension_cls=isoaudit.collectors.vllm.EXTENSION, or call "
                "isoaudit.collectors.vllm.worker.remediation.keep_raw_weights() before creating it"
            )
        if quantized:
            native["linear"] = f"{len(quantized)} quantized layers (e.g. {quantized[0]})"
        if odd_norms:
            native["norm"] = f"RMSNorm over part of the hidden size ({odd_norms[0]})"
        native.update(self._install_attention())
        return native

    def _install_attention(self) -> dict[str, str]:
        """The rotary embedding and the attention, where their form allows (else named native)."""
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        native: dict[str, str] = {}
        rotaries = [m for m in self.model.modules() if isinstance(m, RotaryEmbedding)]
        plain = [
            m
            for m in rotaries
            if type(m) is RotaryEmbedding and m.is_neox_style and m.rotary_dim == m.head_size
        ]
        if len(plain) != len(rotaries):
            native["rotary"] = "a rotary embedding other than the default full-width NeoX RoPE"
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        reasons = {_attention_refusal(self.runner, layer) for layer in layers} - {None}
        if reasons:
            native["attention"] = "; ".join(sorted(r for r in reasons if r))
        elif "rotary" in native:
            native["attention"] = "its rotary embedding stays native, so its keys would not be the trainer's"
        if "attention" in native and "rotary" not in native:
            native["rotary"] = "it feeds only the attention, which stays native"
        if "rotary" not in native:
            for module in plain:
                forward = GraphOps.rotary(module) if self.graph else _rotary_forward(module)
                self._set(module, "_forward_method", forward)
        if "attention" not in native:
            for layer in layers:
                self._set(
                    layer.impl, "forward", _attention_forward(layer.impl, layer.impl.forward, self.counts)
                )
        return native

    # ------------------------------------------------------------ reporting

    def ops(self) -> dict[str, str]:
        """Each contract op (:data:`isoaudit.collectors.policy.REGION_OPS`) → ``id@version`` as run now."""
        from isoaudit.collectors.policy import exact_ops, kernel_ops, rope_op, torch_op
        from vllm.platforms import current_platform

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
            if "rotary" not in self.native:
                ops["rotary"] = rope_op().text
            if "norm" not in self.native:
                ops["residual_add"] = torch_op("add").text
            if "silu" not in self.native:
                ops["gate_mul"] = torch_op("mul").text
        return ops


def remediation_of(worker: Any, *, graph: bool = False) -> WorkerRemediation:
    """The worker's :class:`WorkerRemediation` (made on first use, kept on the worker); ``graph``: the
    decoder is compiled (its replacements are then graph ops)."""
    state = getattr(worker, "_isoaudit_remediation", None)
    runner = worker.model_runner
    model = runner.get_model()
    if state is None or state.model is not model or state.graph != graph:
        if state is not None:
            state.restore()
        state = WorkerRemediation(runner, model, graph=graph)
        worker._isoaudit_remediation = state
    return state
