"""The environment that decides a side's bits, carried on its manifest (``Manifest.environment``).

Four groups, each a flat map of names to plain values, so that two manifests compare key by key
(:mod:`audit.environment` names what changed):

* ``versions``: libraries and drivers (torch, triton, vllm, transformers, flash-attn, flashinfer,
  deep_gemm, ... when installed; cuda, cudnn, nccl, the driver when a GPU is used);
* ``backends``: the kernels chosen (attention, torch's SDPA switches, the BLAS library, isoaudit's
  kernel configuration);
* ``flags``: determinism and batch-invariance switches, torch's reduced-precision switches;
* ``env``: the allow-listed environment variables that change numerics (``CUBLAS_WORKSPACE_CONFIG``,
  ``NCCL_ALGO``, ``VLLM_*`` pins, ...), never anything else of the environment.
"""

from __future__ import annotations

from typing import Final

from isoaudit.audit.records.checks import RecordError, check_json
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The groups, in the order a diff lists them.
GROUPS: Final = ("versions", "backends", "flags", "env")

#: Entries one group may hold, and the longest name or text value: an environment is a few dozen
#: facts; a bound keeps a buggy collector from sending a whole ``os.environ``.
MAX_ENTRIES: Final = 256
MAX_TEXT: Final = 1024

#: A value of the environment: text, a number, a switch, or None ("not known").
EnvValue = str | int | float | bool | None


class Environment(BaseModel):
    """What one side's process ran with, beyond the model: see the module's docstring."""

    model_config = ConfigDict(extra="forbid")

    versions: dict[str, str] = Field(
        default_factory=dict, description="library or driver -> version (only those present)"
    )
    backends: dict[str, EnvValue] = Field(
        default_factory=dict, description="kernel choices: attention, SDPA, BLAS, isoaudit kernels"
    )
    flags: dict[str, EnvValue] = Field(
        default_factory=dict, description="determinism, batch-invariance and precision switches"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="allow-listed environment variables that change numerics"
    )

    @model_validator(mode="after")
    def _check(self) -> Environment:
        for group in GROUPS:
            values = getattr(self, group)
            if len(values) > MAX_ENTRIES:
                raise RecordError(f"environment.{group}", f"{len(values)} entries, more than {MAX_ENTRIES}")
            for key, value in values.items():
                if len(key) > MAX_TEXT or (isinstance(value, str) and len(value) > MAX_TEXT):
                    raise RecordError(f"environment.{group}.{key[:64]}", f"longer than {MAX_TEXT} characters")
            check_json(values, f"environment.{group}")
        return self

    def groups(self) -> dict[str, dict[str, EnvValue]]:
        """The four groups by name, in :data:`GROUPS` order."""
        return {group: dict(getattr(self, group)) for group in GROUPS}
