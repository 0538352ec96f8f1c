"""The execution contract a side runs under, built from what it actually runs (DESIGN.md, "Execution
contract").

A side names the implementation of each op of a Llama-style decoder forward as it runs it now: an
invariant kernel of :mod:`isoaudit.kernels` when remediation is on, otherwise the framework's own (torch,
transformers, vLLM). Each canonical region's contract entry follows from its ops
(:data:`REGION_OPS`), and the contract's ``numerical_policy`` identity from the entries. Two sides
that run the same kernels everywhere therefore share that identity; where one runs something else
(vLLM-CPU's attention), exactly those regions' fields differ, and :func:`isoaudit.audit.contract.handshake`
names them.

A kernel's version is a digest of the source that defines it, so editing a kernel changes the
identity while two processes of one checkout agree. Ops whose bits are fixed by construction (a
row gather, correctly rounded elementwise adds and multiplies) are listed per region but do not
make a region "native"; a region is ``invariant`` when every other op is a kernel of the registry.
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from isoaudit.audit.contract import (
    CompositionEntry,
    Contract,
    Implementation,
    IntRange,
    ModelSpec,
    ToleranceClaim,
    TopologyClaim,
)
from isoaudit.audit.records import Case
from isoaudit.audit.regions import LAYER_REGIONS

#: Every case a trainer/engine pair may record: both sides describe all of them, so their contracts
#: can be equal.
CASES: tuple[Case, ...] = ("trainer_fwd", "trainer_recompute", "engine_prefill", "engine_decode")

#: The ops of each region of a Llama-style decoder, in forward order (``qk_norm``: Qwen3 only).
REGION_OPS: dict[str, tuple[str, ...]] = {
    "embed": ("embedding",),
    "input_norm": ("residual_add", "norm"),
    "attn": ("linear", "qk_norm", "rotary", "attention", "linear"),
    "post_attn_norm": ("residual_add", "norm"),
    "mlp": ("linear", "silu", "gate_mul", "linear"),
    "out": ("residual_add",),
    "final_norm": ("residual_add", "norm"),
    "logits": ("lm_head", "log_softmax"),
}

#: Families whose attention normalises q and k per head (the ``qk_norm`` op).
QK_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe"})

#: Ops whose result is bit-exact whatever the implementation (a gather; IEEE-rounded + and *).
EXACT = frozenset({"torch.embedding", "torch.add", "torch.mul"})

#: The domain an invariant kernel's bits do not depend on.
INVARIANT_DOMAIN = {"batch_size": IntRange(min=1, max=1 << 20), "num_tokens": IntRange(min=1, max=1 << 20)}


@dataclass(frozen=True)
class Impl:
    """One op's implementation: ``id@version``."""

    id: str
    version: str

    @property
    def text(self) -> str:
        return f"{self.id}@{self.version}"

    @property
    def exact(self) -> bool:
        return self.id in EXACT

    @property
    def kernel(self) -> bool:
        return self.id.startswith("kernels.")

    @classmethod
    def parse(cls, text: str) -> Impl:
        name, _, version = text.rpartition("@")
        if not name or not version:
            raise ValueError(f"implementation: expected 'id@version', got {text!r}")
        return cls(name, version)


Ops = Mapping[str, Impl | str]


# ----------------------------------------------------------------------------- versions


@cache
def source_digest(*files: str) -> str:
    """The first 12 hex digits of SHA-256 over the files' bytes (a kernel's version)."""
    digest = hashlib.sha256()
    for name in files:
        digest.update(Path(name).read_bytes())
    return digest.hexdigest()[:12]


@cache
def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@cache
def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def torch_op(name: str) -> Impl:
    return Impl(f"torch.{name}", _torch_version())


def rope_op() -> Impl:
    """HF's default RoPE arithmetic in torch ops (fp32 cos/sin of inv_freq x position, cast to the
    model dtype, ``q * cos + rotate_half(q) * sin``): what HF models run, and what
    :mod:`isoaudit.collectors.vllm.worker.remediation` runs in vLLM."""
    return Impl("torch.rope_hf", _torch_version())


def transformers_op(name: str) -> Impl:
    return Impl(f"transformers.{name}", _transformers_version())


# ----------------------------------------------------------------------------- op tables


#: The routed op behind each contract op when :mod:`isoaudit.kernels` is enabled, per tensor device.
_KERNEL_FUNCTIONS = {
    "linear": ("linear", "gemm.linear"),
    "norm": ("rms_norm", "rmsnorm.rms_norm"),
    "qk_norm": ("rms_norm", "rmsnorm.rms_norm"),
    "attention": ("attention", "attention.attention"),
    "silu": ("silu", "elementwise.silu"),
    "lm_head": ("lm_head_logits", "logprobs.lm_head_logits"),
    "log_softmax": ("log_softmax", "logprobs.log_softmax"),
}


#: Triton modules whose ops run the batch-invariant GEMM, so their version names its split policy.
_SPLIT_GEMM_MODULES = frozenset({"gemm", "logprobs"})


def kernel_ops(device_type: str = "cpu", fp8: bool = False) -> dict[str, Impl]:
    """The ops :mod:`isoaudit.kernels.dispatch` runs when enabled, on tensors of ``device_type``:
    isoaudit.kernels.cpu on the CPU (unless routed to the Triton modules), the Triton kernels elsewhere.
    ``fp8`` (the ``invariant-fp8`` mode): ``linear`` is the W8A8 linear of :mod:`isoaudit.kernels.fp8`
    on every device (its version covers the quantizers), so the numerical policy names the FP8
    arithmetic and a bf16-invariant side does not share it."""
    from isoaudit.kernels import dispatch

    on_cpu = device_type == "cpu" and dispatch._CPU_IMPL == "cpu"
    out = {}
    for op, (cpu_name, triton_name) in _KERNEL_FUNCTIONS.items():
        if on_cpu:
            module, function = "cpu", cpu_name
        else:
            module, function = triton_name.split(".")
        import importlib

        source = importlib.import_module(f"isoaudit.kernels.{module}").__file__
        version = source_digest(str(source), str(dispatch.__file__))
        if module in _SPLIT_GEMM_MODULES:  # the GEMM's split policy is part of its bits
            from isoaudit.kernels.gemm_policy import split_policy

            version = f"{version}.split[{split_policy().label}]"
        out[op] = Impl(f"kernels.{module}.{function}", version)
    if fp8:
        from isoaudit.kernels import fp8 as fp8_module
        from isoaudit.kernels import fp8_quant

        files = (str(fp8_module.__file__), str(fp8_quant.__file__), str(dispatch.__file__))
        out["linear"] = Impl("kernels.fp8.fp8_linear", source_digest(*files))
    return out


def exact_ops() -> dict[str, Impl]:
    """The bit-exact ops every side of a Llama-style decoder runs through torch."""
    return {"embedding": torch_op("embedding"), "residual_add": torch_op("add"), "gate_mul": torch_op("mul")}


def hf_ops(model: Any, mode: str, *, attention: str | None = None) -> dict[str, Impl]:
    """What an HF transformers model runs in ``mode``: natively torch/transformers' own ops;
    invariant, :mod:`isoaudit.kernels` patched in (nn.Linear, the RMSNorm classes, SiLU, the attention entry,
    the fp32 head), with transformers' rotary embedding (not in the registry) kept.
    ``attention``: the native attention's name (default: the config's implementation)."""
    config = getattr(model, "config", None)
    backend = attention or getattr(config, "_attn_implementation", None) or "sdpa"
    ops = {
        **exact_ops(),
        "linear": torch_op("linear"),
        "norm": transformers_op("rms_norm"),
        "qk_norm": transformers_op("rms_norm"),
        "rotary": rope_op(),
        "attention": transformers_op(f"attention.{backend}"),
        "silu": torch_op("silu"),
        "lm_head": torch_op("linear"),
        "log_softmax": torch_op("log_softmax"),
    }
    if mode in ("invariant", "invariant-fp8"):
        param = next(model.parameters(), None)
        ops.update(kernel_ops(param.device.type if param is not None else "cpu", fp8=mode == "invariant-fp8"))
    return ops


# ----------------------------------------------------------------------------- the contract


def model_spec(config: Any, *, dtype: str, lm_head_dtype: str) -> ModelSpec:
    """The contract's model from an HF config (its name is the checkpoint directory's, not a path)."""
    name = str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "") or "model")
    return ModelSpec(
        family=str(getattr(config, "model_type", None) or "llama"),
        name=Path(name).name or name,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        dtype=dtype,  # type: ignore[arg-type]  # a torch dtype's name, which the Literal of RuntimeFacts lists
        lm_head_dtype=lm_head_dtype,  # type: ignore[arg-type]  # a torch dtype's name, which the Literal of RuntimeFacts lists
    )


def region_ops(num_layers: int, *, qk_norm: bool) -> dict[str, tuple[str, ...]]:
    """Each canonical region of a ``num_layers``-layer model and the ops it runs."""
    out = {"embed": REGION_OPS["embed"]}
    for i in range(num_layers):
        for part in LAYER_REGIONS:
            ops = REGION_OPS[part]
            out[f"layers.{i}.{part}"] = tuple(op for op in ops if qk_norm or op != "qk_norm")
    out["final_norm"] = REGION_OPS["final_norm"]
    out["logits"] = REGION_OPS["logits"]
    return out


def _unique(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _entry(region: str, case: Case, impls: list[Impl], arch: str) -> tuple[CompositionEntry, bool, bool]:
    """The region's entry, whether it is invariant, whether it is exact."""
    defining = [i for i in impls if not i.exact] or impls
    invariant = all(i.kernel or i.exact for i in impls) and any(i.kernel for i in impls)
    exact = all(i.exact for i in impls)
    portable = all(i.id.startswith("kernels.cpu.") or i.exact for i in impls)
    implementation = Implementation(
        id="+".join(_unique([i.id for i in defining])),
        version="+".join(_unique([i.version for i in defining])),
    )
    entry = CompositionEntry(
        region=region,
        case=case,
        implementation=implementation,
        arch="any" if invariant and portable else arch,
        route="invariant" if invariant else "native",
    )
    return entry, invariant, exact


def build_contract(
    spec: ModelSpec, ops: Ops, *, qk_norm: bool, arch: str | None = None, cases: Sequence[Case] = CASES
) -> Contract:
    """The contract of a side that runs ``ops`` (op → :class:`Impl` or ``"id@version"``): one entry per
    (canonical region, case); invariant regions claim batch/token invariance, exact ones 0 ulps,
    the rest admit no bitwise promise (``min_agreeing_bits=0``) and name why."""
    impl = {op: value if isinstance(value, Impl) else Impl.parse(value) for op, value in ops.items()}
    arch = arch or platform.machine() or "unknown"
    entries: list[CompositionEntry] = []
    invariant: list[str] = []
    exact: list[str] = []
    native: list[str] = []
    for region, names in region_ops(spec.num_layers, qk_norm=qk_norm).items():
        missing = [n for n in names if n not in impl]
        if missing:
            raise ValueError(f"ops: no implementation for {missing} (region {region})")
        for case in cases:
            entry, is_invariant, is_exact = _entry(region, case, [impl[n] for n in names], arch)
            entries.append(entry)
        (invariant if is_invariant else exact if is_exact else native).append(region)
    claims: list[Any] = []
    if invariant:
        claims.append(TopologyClaim(regions=invariant, mode="invariant", domain=INVARIANT_DOMAIN))
    if exact:
        claims.append(ToleranceClaim(regions=exact, max_ulps=0, reason="a row gather and IEEE adds: exact"))
    if native:
        outside = _unique([i.text for n in impl for i in [impl[n]] if not (i.kernel or i.exact)])
        claims.append(
            ToleranceClaim(
                regions=native,
                min_agreeing_bits=0,
                reason=("no bitwise promise: ops outside the kernels registry (" + ", ".join(outside))[:495]
                + ")",
            )
        )
    return Contract(model=spec, cases=list(cases), composition=entries, claims=claims)


def native_regions(contract: Contract) -> list[str]:
    """The regions of ``contract`` that run native (not invariant, not exact) ops, in forward order."""
    exact = {
        r for c in contract.claims if isinstance(c, ToleranceClaim) and c.max_ulps == 0 for r in c.regions
    }
    return _unique([e.region for e in contract.composition if e.route == "native" and e.region not in exact])


def regions_running(ops: Ops, num_layers: int, *, qk_norm: bool, prefix: str) -> list[str]:
    """The regions, in forward order, with an op whose implementation id starts with ``prefix``
    (e.g. ``"vllm."``: what a remediated engine still runs of its own)."""
    text = {op: value if isinstance(value, str) else value.text for op, value in ops.items()}
    return [
        region
        for region, names in region_ops(num_layers, qk_norm=qk_norm).items()
        if any(text.get(name, "").startswith(prefix) for name in names)
    ]


def hf_contracts(model: Any, *, native_attention: Impl | None = None) -> Callable[[str], Contract]:
    """``mode -> contract`` of an HF model: the trainer's (what ``Session.watch_trainer`` attaches
    when the session builds contracts), or, with ``native_attention``, the reference engine's over
    the same modules (natively its own attention; invariant, the same kernels as the trainer)."""
    config = model.config
    param = next(model.parameters(), None)
    dtype = str(param.dtype).removeprefix("torch.") if param is not None else "float32"
    qk = hasattr(getattr(model.model.layers[0], "self_attn", None), "q_norm")
    built: dict[str, Contract] = {}

    def contract(mode: str) -> Contract:
        if mode not in built:
            invariant = mode in ("invariant", "invariant-fp8")
            head = "float32" if invariant else dtype
            spec = model_spec(config, dtype=dtype, lm_head_dtype=head)
            ops = hf_ops(model, mode)
            if native_attention is not None and not invariant:
                ops["attention"] = native_attention
            built[mode] = build_contract(spec, ops, qk_norm=qk)
        return built[mode]

    return contract
