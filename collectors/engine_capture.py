"""Fingerprints inside isoaudit's reference rollout engine (:class:`kernels.engine.RolloutEngine` driving
:class:`kernels.adapters.HFCausalLM`): the rollout side of the demo and of the kernels' end-to-end story.

The engine packs the new tokens of every live request into one flat batch per step and calls the HF
model's own submodules. Forward hooks on those modules (the trainer's region map) see packed rows;
a wrapper on the adapter's ``step`` records, per step, which (request slot, absolute position) each
row is, so rows can be filed under their request. Regions the engine never calls (the decoder layer
as a whole, ``lm_head``) are reported as unobserved, never as equal.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from audit.fingerprints import ROW_FIELDS, fingerprint_rows
from audit.records import RegionFingerprints, sample_key
from collectors.regions import RegionsArg, read_tap, resolve_regions


class EngineFingerprints:
    """Hooks an :class:`~kernels.adapters.HFCausalLM`; call :meth:`records` after each ``generate``."""

    def __init__(self, adapter: Any, regions: RegionsArg = "auto") -> None:
        self.adapter = adapter
        resolved = resolve_regions(adapter.model, regions)
        self.specs = resolved.specs
        self._layout: tuple[np.ndarray, np.ndarray] | None = None  # (slot per row, position per row)
        self._rows: dict[str, list[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]] = defaultdict(list)
        self._ladder_bits: dict[str, list[int]] = {}
        self._handles: list[RemovableHandle] = []
        self._original_step = adapter.step
        adapter.step = self._step
        for spec in self.specs:
            module = adapter.model.get_submodule(spec.module)
            self._handles.append(module.register_forward_hook(self._hook(spec.name, spec.tap)))

    def _step(
        self, ids: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, slots: list[int], cache: Any
    ):
        lengths = (cu[1:] - cu[:-1]).tolist()
        self._layout = (
            np.repeat(np.asarray(slots), lengths),
            positions.detach().cpu().numpy().astype(np.int32),
        )
        try:
            return self._original_step(ids, positions, cu, slots, cache)
        finally:
            self._layout = None

    def _hook(self, region: str, tap: Any):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if self._layout is None:  # a forward outside the engine (e.g. the trainer's): not ours
                return
            tensor = read_tap(output, tap)
            if tensor is None:
                return
            prints = fingerprint_rows(tensor.detach().reshape(-1, tensor.shape[-1])).to_numpy()
            self._ladder_bits[region] = prints.pop("ladder_bits")
            slots, positions = self._layout
            self._rows[region].append((slots, positions, prints))

        return hook

    @property
    def unobserved(self) -> dict[str, str]:
        """Regions the engine never ran through a hooked module (so far)."""
        return {
            spec.name: "the engine does not call this module"
            for spec in self.specs
            if spec.name not in self._rows
        }

    def records(
        self, run_id: str, step: int, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[RegionFingerprints]:
        """The fingerprints gathered since the last call, one record per (request, region, case):
        ``engine_prefill`` for prompt positions, ``engine_decode`` for generated ones."""
        out = []
        for region, chunks in self._rows.items():
            slots = np.concatenate([c[0] for c in chunks])
            positions = np.concatenate([c[1] for c in chunks])
            fields = {name: np.concatenate([c[2][name] for c in chunks]) for name in ROW_FIELDS}
            for slot, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
                mine = slots == slot
                key = sample_key(prompt, completion)
                for case, rows in (
                    ("engine_prefill", mine & (positions < len(prompt))),
                    ("engine_decode", mine & (positions >= len(prompt))),
                ):
                    if not rows.any():
                        continue
                    order = np.argsort(positions[rows], kind="stable")
                    out.append(
                        RegionFingerprints(
                            run_id=run_id,
                            step=step,
                            side="rollout",
                            case=case,
                            sample_key=key,
                            region=region,
                            positions=positions[rows][order],
                            ladder_bits=self._ladder_bits[region],
                            **{name: values[rows][order] for name, values in fields.items()},
                        )
                    )
        self._rows.clear()
        return out

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.adapter.step = self._original_step
