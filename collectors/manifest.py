"""The trainer's manifest (DESIGN.md, "Records"): runtime facts its numerics depend on, the regions
it hooks, and the execution contract's identities. Sent on attach and again whenever any of it
changes (a dtype cast, a remediation switch, a new contract), so every record can be read against
the conditions it was computed under.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Union

import torch
from isoaudit.audit.records import Case, ContractIdentities, Manifest, RuntimeFacts, Side
from isoaudit.collectors.quantization import quantization_facts
from torch import nn

if TYPE_CHECKING:
    from isoaudit.audit.contract import Contract

#: An execution contract for the manifest: an ``isoaudit.audit.contract.Contract``, its identities (or a
#: mapping of them), or ``None``.
ContractArg = Union["Contract", ContractIdentities, Mapping[str, str], None]  # noqa: UP007
#: What a collector is given: a contract as above, or ``mode -> contract`` (the applied mode's is used,
#: e.g. :func:`isoaudit.collectors.policy.hf_contracts`).
ContractSource = Union[ContractArg, Callable[[str], ContractArg]]  # noqa: UP007


def process_name() -> str:
    """``host:pid`` and, under torch.distributed, ``/rank``: tells a job's processes apart."""
    name = f"{socket.gethostname()}:{os.getpid()}"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        name += f"/{torch.distributed.get_rank()}"
    return name


@lru_cache(maxsize=1)
def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _arch(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor} {torch.cuda.get_device_name(device)}"
    return f"{platform.machine()} {platform.processor() or ''}".strip()


def _kernels_on() -> bool:
    """Whether :mod:`isoaudit.kernels` routes this process (read only if a job imported it: no import here)."""
    routing = sys.modules.get("isoaudit.kernels.dispatch")
    return routing is not None and bool(routing.is_enabled())


def kernel_facts() -> dict[str, Any]:
    """Launch settings of :mod:`isoaudit.kernels` that set bits, while it routes this process (both sides
    must agree on them, so both manifests carry them and the contract handshake compares them): the
    GEMM's fixed split-K policy (``gemm_split``: its rule, or ``off``; ``gemm_split_k``: whether it
    splits any weight); in the ``invariant-fp8`` mode also the FP8 linear's arithmetic (``fp8``: E4M3
    W8A8, weights in 128x128 blocks, activations per token per 128 of K, promotion every 128 K) and
    its fixed split-K (``ISOAUDIT_FP8_SPLIT_K``). Empty when the kernels are off or not imported."""
    policy = sys.modules.get("isoaudit.kernels.gemm_policy")  # loaded with the GEMM
    if not _kernels_on() or policy is None:
        return {}
    split = policy.split_policy()
    facts: dict[str, Any] = {"gemm_split": split.label, "gemm_split_k": split.enabled}
    routing = sys.modules.get("isoaudit.kernels.dispatch")
    fp8 = sys.modules.get("isoaudit.kernels.fp8")
    if routing is not None and fp8 is not None and routing.is_fp8():
        facts["fp8"] = "e4m3 w8a8 w128x128 a1x128 promote128"
        facts["fp8_split_k"] = bool(fp8.split_enabled())
    return facts


def _head_dtype(weight: Any) -> str | None:
    """The dtype the head computes in: fp32 while kernels route (the invariant head, as the contract
    says), otherwise the weight's own (a stock lm_head)."""
    if _kernels_on():
        return "float32"
    return _dtype_name(weight.dtype if isinstance(weight, torch.Tensor) else None)


def _lm_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            return getter()
        except (NotImplementedError, AttributeError):
            return None
    return None


def trainer_runtime(
    model: nn.Module,
    *,
    remediation: str = "native",
    logprobs_mode: str = "processed",
    quant_source: str | None = None,
) -> RuntimeFacts:
    """What this process's numerics depend on, read from the model and torch's global switches.
    ``quant_source``: the dtype quantized weights are made from where it is not the model's own."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    head = _lm_head(model)
    head_weight = getattr(head, "weight", None)
    config = getattr(model, "config", None)
    is_hf = config is not None and _transformers_version() is not None
    facts: dict[str, Any] = {
        "framework": "transformers" if is_hf else "torch",
        "framework_version": _transformers_version() if is_hf else torch.__version__,
        "torch_version": torch.__version__,
        "device": str(device),
        "arch": _arch(device),
        "dtype": _dtype_name(param.dtype if param is not None else None),
        "lm_head_dtype": _head_dtype(head_weight),
        "logprobs_mode": logprobs_mode,
        "attention_backend": getattr(config, "_attn_implementation", None) if config is not None else None,
        "remediation": remediation,
        # torch switches that change matmul/conv numerics (extra fields, allowed by RuntimeFacts)
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "matmul_allow_bf16_reduced_precision": bool(
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "matmul_allow_fp16_reduced_precision": bool(
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
    }
    facts.update(kernel_facts())
    facts.update(quantization_facts(facts["dtype"], source=quant_source))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        facts["world_size"] = torch.distributed.get_world_size()
    return RuntimeFacts(**facts)


def runtime_signature(model: nn.Module) -> tuple[Any, ...]:
    """A cheap key of what :func:`trainer_runtime` reads that can change during a run (dtype, device,
    attention backend, torch's numerics switches): checked every step, the manifest rebuilt only
    when it changes."""
    param = next(model.parameters(), None)
    head_weight = getattr(_lm_head(model), "weight", None)
    config = getattr(model, "config", None)
    return (
        param.dtype if param is not None else None,
        param.device if param is not None else None,
        _head_dtype(head_weight),
        getattr(config, "_attn_implementation", None),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
        torch.distributed.is_available() and torch.distributed.is_initialized(),
    )


def contract_fields(contract: ContractArg) -> tuple[ContractIdentities, dict[str, Any]]:
    """Identities and numerical-policy fields of ``contract``: an ``isoaudit.audit.contract.Contract``, its
    identities (``ContractIdentities`` or a mapping of them), or ``None``."""
    if contract is None:
        return ContractIdentities(), {}
    if isinstance(contract, ContractIdentities):
        return contract, {}
    if isinstance(contract, Mapping):
        try:
            return ContractIdentities(**contract), {}
        except Exception as exc:
            raise ValueError(
                f"contract: a mapping must hold semantic/numerical_policy/deployment identities ({exc})"
            ) from exc
    from isoaudit.audit.contract import Contract, identities, numerical_policy_fields

    if not isinstance(contract, Contract):
        raise TypeError(
            "contract: expected an isoaudit.audit.contract.Contract or its identities, "
            f"got {type(contract).__name__}"
        )
    return identities(contract), numerical_policy_fields(contract)


class ManifestTracker:
    """Builds the manifest and says when it changed since the last one sent."""

    def __init__(
        self,
        *,
        run_id: str,
        side: Side,
        case: Case,
        regions: list[str],
        unobserved: dict[str, str],
        contract: ContractArg = None,
    ) -> None:
        self.run_id, self.side, self.case = run_id, side, case
        self.regions, self.unobserved = regions, unobserved
        self.identities, self.policy = contract_fields(contract)
        self.process = process_name()
        self.current: Manifest | None = None
        self._sent_hash: str | None = None

    def set_contract(self, contract: ContractArg) -> None:
        self.identities, self.policy = contract_fields(contract)

    def build(self, runtime: RuntimeFacts, weight_version: str | None = None) -> Manifest:
        return Manifest(
            run_id=self.run_id,
            side=self.side,
            case=self.case,
            process=self.process,
            runtime=runtime,
            regions=self.regions,
            unobserved=self.unobserved,
            contract=self.identities,
            numerical_policy=self.policy,
            weight_version=weight_version,
        )

    def changed(self, manifest: Manifest) -> Manifest | None:
        """``manifest`` if it differs from the last one returned here (then it counts as sent)."""
        digest = manifest.content_hash()
        if digest == self._sent_hash:
            return None
        self._sent_hash = digest
        self.current = manifest
        return manifest
