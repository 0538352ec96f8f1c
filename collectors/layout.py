"""Where each sample sits in a forward's token tensor: padded rows or packed sequences.

Fingerprints and logprobs are computed for every row of a forward; a :class:`StepBatch` says which
rows belong to which sample so each record carries absolute positions 0..len-1 of its own sequence
(prompt ‖ completion), whatever the padding side or packing. That is what lets the rollout side,
which never pads the same way, line up position by position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch


@dataclass(frozen=True)
class Span:
    """One sample's tokens: ``length`` columns of batch row ``row`` from column ``start``."""

    row: int
    start: int
    length: int
    prompt_len: int

    @property
    def completion_len(self) -> int:
        return self.length - self.prompt_len


def _as_lists(seqs: Sequence[Any], name: str) -> list[list[int]]:
    out = []
    for i, seq in enumerate(seqs):
        values = seq.tolist() if isinstance(seq, torch.Tensor | np.ndarray) else list(seq)
        if any(not isinstance(v, int | np.integer) for v in values):
            raise ValueError(f"{name}[{i}]: token ids must be integers")
        out.append([int(v) for v in values])
    return out


def _advantages(advantages: Sequence[float] | np.ndarray | torch.Tensor, n: int) -> np.ndarray:
    if isinstance(advantages, torch.Tensor):
        advantages = advantages.detach().float().cpu().numpy()
    values = np.asarray(advantages, dtype=np.float64).reshape(-1)
    if values.shape != (n,):
        raise ValueError(f"advantages: expected {n} values (one per sample), got shape {list(values.shape)}")
    if not np.isfinite(values).all():
        raise ValueError("advantages: values must be finite")
    return values


def _temperatures(temperature: float | Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    temps = (
        np.full(n, float(cast(float, temperature)))
        if np.isscalar(temperature)
        else np.asarray(temperature, dtype=np.float64)
    )
    if temps.shape != (n,):
        raise ValueError(f"temperature: expected a number or {n} values, got shape {list(temps.shape)}")
    if (temps < 0).any() or not np.isfinite(temps).all():
        raise ValueError("temperature: values must be finite and >= 0")
    return temps


@dataclass
class StepBatch:
    """The samples of one forward: token ids ``[rows, cols]`` and each sample's :class:`Span`.

    Build one with :meth:`padded`, :meth:`packed` or :meth:`from_tensors` (tensors the trainer already
    has); ``model_inputs()`` gives the kwargs of an HF forward over exactly this layout.
    """

    input_ids: torch.Tensor
    spans: list[Span]
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    temperature: np.ndarray | None = None
    sample_keys: list[str] | None = None
    #: each sample's advantage in the trainer's objective (the framework figures that depend on its
    #: sign, e.g. PRIME-RL's masks); None: not given
    advantages: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() == 1:
            self.input_ids = self.input_ids.unsqueeze(0)
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [rows, cols], got shape {list(self.input_ids.shape)}")
        rows, cols = self.input_ids.shape
        for i, span in enumerate(self.spans):
            if not (0 <= span.row < rows and span.start >= 0 and span.start + span.length <= cols):
                raise ValueError(f"spans[{i}]: {span} lies outside input_ids of shape [{rows}, {cols}]")
            if not 1 <= span.prompt_len <= span.length:
                raise ValueError(
                    f"prompt_lens[{i}]: {span.prompt_len} must be in 1..{span.length} (the sample's length); "
                    "the first token has no logprob, so a sample needs at least one prompt token"
                )
        self.temperature = _temperatures(
            1.0 if self.temperature is None else self.temperature, len(self.spans)
        )
        if self.sample_keys is not None and len(self.sample_keys) != len(self.spans):
            raise ValueError(f"sample_keys: {len(self.sample_keys)} keys for {len(self.spans)} samples")
        if self.advantages is not None:
            self.advantages = _advantages(self.advantages, len(self.spans))

    # ---------------------------------------------------------------- builders

    @classmethod
    def padded(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        *,
        pad_token_id: int = 0,
        padding_side: str = "right",
        temperature: float | Sequence[float] = 1.0,
        device: torch.device | str | None = None,
        advantages: Sequence[float] | None = None,
    ) -> StepBatch:
        """One row per sample, padded to the longest with ``pad_token_id`` on ``padding_side``."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side: expected 'left' or 'right', got {padding_side!r}")
        seqs = _join(prompts, completions)
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        spans = []
        for row, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
            start = 0 if padding_side == "right" else width - len(seq)
            ids[row, start : start + len(seq)] = torch.tensor(seq)
            mask[row, start : start + len(seq)] = 1
            spans.append(Span(row, start, len(seq), len(prompt)))
        position_ids = (mask.cumsum(-1) - 1).clamp_(min=0)
        return cls(
            ids.to(device),
            spans,
            mask.to(device),
            position_ids.to(device),
            temperature,  # type: ignore[arg-type]  # normalised to an array by the dataclass's __post_init__
            advantages=advantages,  # type: ignore[arg-type]  # likewise
        )

    @classmethod
    def packed(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        *,
        temperature: float | Sequence[float] = 1.0,
        device: torch.device | str | None = None,
        advantages: Sequence[float] | None = None,
    ) -> StepBatch:
        """All samples back to back in one row; ``position_ids`` restart at each sample (HF then masks
        attention per sample)."""
        seqs = _join(prompts, completions)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long).unsqueeze(0)
        position_ids = torch.tensor([p for s in seqs for p in range(len(s))], dtype=torch.long).unsqueeze(0)
        spans, start = [], 0
        for seq, prompt in zip(seqs, prompts, strict=True):
            spans.append(Span(0, start, len(seq), len(prompt)))
            start += len(seq)
        return cls(ids.to(device), spans, None, position_ids.to(device), temperature, advantages=advantages)  # type: ignore[arg-type]  # temperature and advantages are normalised to arrays by the dataclass's __post_init__

    @classmethod
    def from_tensors(
        cls,
        input_ids: torch.Tensor,
        prompt_lens: Sequence[int],
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seq_lens: Sequence[int] | Sequence[Sequence[int]] | None = None,
        temperature: float | Sequence[float] = 1.0,
        sample_keys: Sequence[str] | None = None,
        advantages: Sequence[float] | torch.Tensor | None = None,
    ) -> StepBatch:
        """The layout of tensors a trainer already has.

        Packed rows: give ``seq_lens`` (per row, or one list for a single row) or ``position_ids``
        restarting at 0 for each sample. Padded rows: ``attention_mask`` (each row's ones contiguous,
        either padding side). Neither: each row is one whole sample.
        """
        ids = input_ids if input_ids.dim() == 2 else input_ids.reshape(1, -1)
        rows, cols = ids.shape
        if seq_lens is not None:
            per_row: list[list[int]] = (
                [list(cast(Sequence[int], seq_lens))]
                if seq_lens and np.isscalar(seq_lens[0])
                else [list(cast(Sequence[int], r)) for r in seq_lens]
            )
            if len(per_row) != rows:
                raise ValueError(f"seq_lens: {len(per_row)} rows of lengths for {rows} rows of input_ids")
            bounds = []
            for row, lengths in enumerate(per_row):
                if sum(lengths) > cols:
                    raise ValueError(
                        f"seq_lens: row {row} sums to {sum(lengths)} tokens, more than its {cols} columns"
                    )
                start = 0
                for length in lengths:
                    bounds.append((row, start, int(length)))
                    start += int(length)
        elif position_ids is not None and attention_mask is None:
            pos = position_ids.detach().reshape(-1, cols).expand(rows, cols).cpu().numpy()
            bounds = []
            for row in range(rows):
                starts = np.flatnonzero(pos[row] == 0).tolist() or [0]
                if starts[0] != 0:
                    raise ValueError(f"position_ids: row {row} does not start a sample at column 0")
                for a, b in zip(starts, starts[1:] + [cols], strict=True):
                    bounds.append((row, a, b - a))
        elif attention_mask is not None:
            mask = attention_mask.detach().reshape(rows, cols).cpu().numpy().astype(bool)
            bounds = []
            for row in range(rows):
                on = np.flatnonzero(mask[row])
                if on.size == 0:
                    raise ValueError(f"attention_mask: row {row} has no tokens")
                if on[-1] - on[0] + 1 != on.size:
                    raise ValueError(
                        f"attention_mask: row {row} has a gap; a padded row must be contiguous (use seq_lens to pack)"
                    )
                bounds.append((row, int(on[0]), int(on.size)))
        else:
            bounds = [(row, 0, cols) for row in range(rows)]
        if len(prompt_lens) != len(bounds):
            raise ValueError(f"prompt_lens: {len(prompt_lens)} values for {len(bounds)} samples in the batch")
        spans = [Span(r, s, n, int(p)) for (r, s, n), p in zip(bounds, prompt_lens, strict=True)]
        return cls(
            ids,
            spans,
            attention_mask,
            position_ids,
            temperature,  # type: ignore[arg-type]  # temperature is normalised to an array by the dataclass's __post_init__
            list(sample_keys) if sample_keys is not None else None,
            advantages,  # type: ignore[arg-type]  # normalised to an array by the dataclass's __post_init__
        )

    @classmethod
    def coerce(cls, batch: StepBatch | Mapping[str, Any]) -> StepBatch:
        """A StepBatch, or a mapping of :meth:`from_tensors` / :meth:`padded` arguments."""
        if isinstance(batch, StepBatch):
            return batch
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch: expected a StepBatch or a mapping, got {type(batch).__name__}")
        if "prompts" in batch:
            kwargs = dict(batch)
            return cls.padded(kwargs.pop("prompts"), kwargs.pop("completions"), **kwargs)
        if "input_ids" not in batch or "prompt_lens" not in batch:
            raise ValueError("batch: a mapping needs input_ids and prompt_lens (or prompts and completions)")
        kwargs = dict(batch)
        return cls.from_tensors(kwargs.pop("input_ids"), kwargs.pop("prompt_lens"), **kwargs)

    # ---------------------------------------------------------------- views

    @property
    def num_samples(self) -> int:
        return len(self.spans)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.input_ids.shape[0]), int(self.input_ids.shape[1]))

    def flat_start(self, i: int) -> int:
        """Index of sample ``i``'s first token among the forward's flattened rows."""
        span = self.spans[i]
        return span.row * self.shape[1] + span.start

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of an HF causal-LM forward over this layout."""
        inputs = {"input_ids": self.input_ids}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs

    def completion_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """For every completion token of every sample, in sample order: the flat row whose logits
        predict it (the previous position) and the flat row of the token itself."""
        predict, target = [], []
        for i, span in enumerate(self.spans):
            first = self.flat_start(i) + span.prompt_len
            tokens = np.arange(first, first + span.completion_len, dtype=np.int64)
            target.append(tokens)
            predict.append(tokens - 1)
        empty = np.zeros(0, np.int64)
        return (np.concatenate(predict) if predict else empty, np.concatenate(target) if target else empty)


def _join(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[list[int]]:
    p, c = _as_lists(prompts, "prompts"), _as_lists(completions, "completions")
    if len(p) != len(c):
        raise ValueError(f"completions: {len(c)} completions for {len(p)} prompts")
    if not p:
        raise ValueError("prompts: no samples")
    return [a + b for a, b in zip(p, c, strict=True)]
