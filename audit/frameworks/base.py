"""What a framework's mismatch figures are made of: the step's tokens as a framework sees them
(:class:`StepTokens`), one framework release's figures and their arithmetic (:class:`Era`), and a
framework's eras by release (:class:`Framework`).

A framework module (``audit.frameworks.verl`` …) writes each era's arithmetic as one function of
the step's tokens and the framework's settings, in float64, following the framework's own code:
its reductions (token mean, per sample then mean, per process then mean), its ddof, its clamps and
where they apply, its masks and its defaults. Golden tests check every figure against values the
framework's own functions returned on the same inputs (``tests/fixtures/parity``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from isoaudit.audit.metrics.blocks import Key, Request, TokenBlocks
from packaging.version import InvalidVersion, Version


@dataclass(frozen=True, eq=False)
class StepTokens:
    """One step's compared tokens, as a framework's metric function sees them after its masks.

    ``recorded_trainer``/``recorded_rollout``: the sampled tokens' logprobs as recorded (float32, or
    float64), concatenated over samples; :attr:`trainer`/:attr:`rollout` are them in float64.
    ``offsets``: sample ``i`` is ``[offsets[i], offsets[i+1])``; tokens a framework masks out of its
    loss (tool outputs, padding) are not here, so every token counts. ``advantages``: per sample,
    NaN where unknown (``None``: none recorded); ``ranks``: the process that recorded each sample
    (-1: unknown).

    A figure that reduces a per-token function reads it by name from :attr:`blocks`
    (:mod:`audit.metrics.blocks`): each sample's sum, extreme or centred squares, measured for every
    name :data:`STANDARD` lists in one pass over blocks of whole samples (:meth:`prepare`)."""

    recorded_trainer: np.ndarray
    recorded_rollout: np.ndarray
    offsets: np.ndarray
    advantages: np.ndarray | None = None
    ranks: np.ndarray | None = None

    @classmethod
    def of(
        cls,
        trainer: list[np.ndarray] | np.ndarray,
        rollout: list[np.ndarray] | np.ndarray,
        offsets: np.ndarray | None = None,
        *,
        advantages: list[float | None] | np.ndarray | None = None,
        ranks: list[int | None] | np.ndarray | None = None,
    ) -> StepTokens:
        """From per-sample arrays (``offsets`` derived) or concatenated ones with their ``offsets``."""
        if isinstance(trainer, list):
            if offsets is not None:
                raise ValueError(
                    "offsets: give per-sample arrays or concatenated ones with offsets, not both"
                )
            lengths = [np.asarray(t).size for t in trainer]
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            trainer = np.concatenate(trainer) if trainer else np.zeros(0)
            rollout = np.concatenate(rollout) if rollout else np.zeros(0)
        if offsets is None:
            raise ValueError("offsets: required with concatenated arrays")
        t, r = _recorded(trainer), _recorded(rollout)
        o = np.asarray(offsets, dtype=np.int64)
        if t.shape != r.shape or t.ndim != 1:
            raise ValueError(f"rollout: {r.shape} tokens for the trainer's {t.shape}")
        if o.ndim != 1 or o.size < 1 or o[0] != 0 or o[-1] != t.size or np.any(np.diff(o) < 0):
            raise ValueError("offsets: must rise from 0 to the number of tokens")
        n = o.size - 1
        adv = None
        if advantages is not None:
            adv = np.array([np.nan if a is None else a for a in advantages], dtype=np.float64)
            if adv.size != n:
                raise ValueError(f"advantages: {adv.size} for {n} samples")
        rk = None
        if ranks is not None:
            rk = np.array([-1 if x is None else x for x in ranks], dtype=np.int64)
            if rk.size != n:
                raise ValueError(f"ranks: {rk.size} for {n} samples")
        return cls(t, r, o, adv, rk)

    @classmethod
    def over(
        cls,
        blocks: TokenBlocks,
        *,
        advantages: list[float | None] | np.ndarray | None = None,
        ranks: list[int | None] | np.ndarray | None = None,
    ) -> StepTokens:
        """The step whose per-token reductions ``blocks`` holds (over all its tokens), sharing them:
        what was measured there is not measured again."""
        tokens = cls.of(blocks.trainer, blocks.rollout, blocks.offsets, advantages=advantages, ranks=ranks)
        if blocks.finite_only:
            raise ValueError("blocks: a step's frameworks see every token, not the finite ones only")
        tokens.__dict__["blocks"] = blocks  # the cached_property's slot: measured reductions are shared
        return tokens

    @cached_property
    def trainer(self) -> np.ndarray:
        """The trainer's logprobs in float64."""
        return _shared(self.recorded_trainer.astype(np.float64))

    @cached_property
    def rollout(self) -> np.ndarray:
        """The rollout's logprobs in float64."""
        return _shared(self.recorded_rollout.astype(np.float64))

    # -- reductions of named per-token quantities ---------------------------------------------------
    @cached_property
    def blocks(self) -> TokenBlocks:
        """Per-sample reductions of the step's named per-token quantities (audit.metrics.blocks)."""
        return TokenBlocks(self.recorded_trainer, self.recorded_rollout, self.offsets)

    def prepare(self, threads: int = 1) -> None:
        """Measure every reduction of :data:`STANDARD` in one pass over the step's blocks."""
        self.blocks.measure(STANDARD, threads)

    def total(self, key: Key) -> float:
        """The step's sum of the per-token quantity ``key`` (its samples' sums in sample order)."""
        return self.blocks.total(key)

    def mean_of(self, key: Key) -> float:
        """The step's token mean of ``key`` (NaN over no tokens), as ``np.mean``: sum over count."""
        return self.blocks.total(key) / self.n_tokens if self.n_tokens else float("nan")

    # -- shapes ------------------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def n_tokens(self) -> int:
        return int(self.recorded_trainer.size)

    @cached_property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @cached_property
    def sample_of_token(self) -> np.ndarray:
        """The sample index of each token."""
        return np.repeat(np.arange(self.n_samples), self.lengths)

    @cached_property
    def delta(self) -> np.ndarray:
        """Δ = trainer − rollout per token (log p_trainer / p_rollout)."""
        return _shared(self.trainer - self.rollout)

    # -- per-token quantities several frameworks compute the same way: once per step, read-only ------
    @cached_property
    def p_trainer(self) -> np.ndarray:
        """exp(trainer): the trainer's token probabilities."""
        return _shared(np.exp(self.trainer))

    @cached_property
    def p_rollout(self) -> np.ndarray:
        """exp(rollout): the rollout's token probabilities."""
        return _shared(np.exp(self.rollout))

    @cached_property
    def exp_delta(self) -> np.ndarray:
        """exp(Δ), unclamped (inf where Δ overflows)."""
        with np.errstate(over="ignore"):
            return _shared(np.exp(self.delta))

    @cached_property
    def abs_delta(self) -> np.ndarray:
        """|Δ|."""
        return _shared(np.abs(self.delta))

    @cached_property
    def exp_abs_delta(self) -> np.ndarray:
        """exp(|Δ|): the multiplicative probability error per token."""
        with np.errstate(over="ignore"):
            return _shared(np.exp(self.abs_delta))

    def clamped_delta(self, bound: float) -> np.ndarray:
        """Δ clamped to [−bound, bound] (``np.clip``), once per bound."""
        return self._memo(("clamped_delta", bound), lambda: np.clip(self.delta, -bound, bound))

    def exp_clamped_delta(self, bound: float) -> np.ndarray:
        """exp(Δ clamped to ±bound): the importance weight with a safety bound."""
        return self._memo(("exp_clamped_delta", bound), lambda: np.exp(self.clamped_delta(bound)))

    @cached_property
    def k3(self) -> np.ndarray:
        """exp(Δ) − Δ − 1, in that order (the k3 estimator as verl and PRIME-RL write it)."""
        return _shared(self.exp_delta - self.delta - 1.0)

    @cached_property
    def delta_sums(self) -> np.ndarray:
        """Per-sample ΣΔ (the blocks' sums of ``d``: :meth:`sample_sums` of :attr:`delta`)."""
        return self.blocks.sums("d")

    @cached_property
    def _cache(self) -> dict[tuple[object, ...], np.ndarray]:
        return {}

    def _memo(self, key: tuple[object, ...], make: Callable[[], np.ndarray]) -> np.ndarray:
        """``make()`` once per key; two threads asking at once may both make it (the same values),
        and both get the one stored first."""
        if key not in self._cache:
            return self._cache.setdefault(key, _shared(make()))
        return self._cache[key]

    # -- reductions --------------------------------------------------------------------------------
    def sample_sums(self, values: np.ndarray) -> np.ndarray:
        """Per-sample sums of a per-token array (0 for an empty sample), each added up over its
        sample's span by ``np.add.reduceat`` (numpy's pairwise summation), as :attr:`blocks` sums."""
        values = np.asarray(values, dtype=np.float64)
        out = np.zeros(self.n_samples)
        has = self.lengths > 0
        if has.any():
            out[has] = np.add.reduceat(values, self.offsets[:-1][has])
        return out

    def sample_means(self, values: np.ndarray) -> np.ndarray:
        """Per-sample means of a per-token array (NaN for an empty sample)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.sample_sums(values) / self.lengths

    def per_rank(self) -> list[StepTokens]:
        """The step split by the process that recorded each sample, in rank order (one part when
        ranks are unknown): for frameworks whose logged value is a mean of per-process values."""
        if self.ranks is None or np.all(self.ranks == self.ranks[0]):
            return [self]
        parts = []
        for rank in np.unique(self.ranks):
            keep = np.flatnonzero(self.ranks == rank)
            parts.append(self.select(keep))
        return parts

    def select(self, samples: np.ndarray) -> StepTokens:
        """The step restricted to ``samples`` (indices, in the order given)."""
        t = [self.trainer[self.offsets[i] : self.offsets[i + 1]] for i in samples]
        r = [self.rollout[self.offsets[i] : self.offsets[i + 1]] for i in samples]
        return StepTokens.of(
            t,
            r,
            advantages=None if self.advantages is None else self.advantages[samples],
            ranks=None if self.ranks is None else self.ranks[samples],
        )


def _recorded(values: Any) -> np.ndarray:
    """Recorded logprobs as they are (float32 or float64), anything else as float64."""
    array = np.asarray(values)
    return array if array.dtype in (np.float32, np.float64) else array.astype(np.float64)


#: The reductions the frameworks' figures read at their defaults, measured together by
#: :meth:`StepTokens.prepare`: sums, extremes and centred squares of the named quantities.
STANDARD: tuple[Request, ...] = (
    *(
        ("sum", key)
        for key in (
            "t",
            "r",
            "d",
            "abs_d",
            "d_sq",
            "exp_t",
            "exp_r",
            "abs_p_diff",
            "exp_abs_d",
            "k3",
            "nemo_k3",
            "nemo_k3_reverse",
            "nemo_js",
            ("sq", "rho"),
            ("finite_or_zero", "exp_d"),
        )
    ),
    *(("max", key) for key in ("abs_p_diff", "abs_d", "k3")),
    ("min", "abs_d"),
    *(("m2", key) for key in ("abs_p_diff", "abs_d", "k3", "exp_t", "exp_r")),
    (("cm", "exp_r"), "exp_t"),
)


def _shared(values: np.ndarray) -> np.ndarray:
    """``values`` made read-only: an array cached on a step is shared by every framework's figures,
    so a framework that wrote into it would change the others' (numpy raises instead)."""
    values.setflags(write=False)
    return values


def token_mean(values: np.ndarray) -> float:
    """The mean over tokens (NaN over none)."""
    return float(np.mean(values)) if values.size else float("nan")


def sample_std(values: np.ndarray) -> float:
    """The sample standard deviation (ddof=1, ``torch.std``'s default): NaN for fewer than 2 values."""
    return float(np.std(values, ddof=1)) if values.size > 1 else float("nan")


Settings = Mapping[str, Any]
#: One era's arithmetic: the step's tokens and the resolved settings to {logged name: value}.
Compute = Callable[[StepTokens, Settings], dict[str, float]]

#: A setting with no default upstream (the framework refuses to start without it).
REQUIRED: Any = object()


@dataclass(frozen=True)
class Figure:
    """One figure a framework logs: its name, what it is, and the settings it reads."""

    name: str  #: as the framework logs it (its W&B key)
    definition: str  #: one line, in the framework's own terms
    also: tuple[str, ...] = ()  #: other spellings it is logged under (prefixes)
    settings: tuple[str, ...] = ()  #: the settings its value depends on
    #: the canonical stored key (audit.metrics) that equals it exactly, when one does
    same_as: str | None = None
    #: the framework function that computes it upstream ("verl/trainer/ppo/rollout_corr_helper.py:
    #: compute_rollout_corr_metrics_from_logprobs"), as the golden fixtures record it
    source: str = ""
    #: what the figure needs beyond logprobs ("advantages"), absent from the output without it
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Era:
    """A framework's figures from one release on: their names, definitions, settings and arithmetic."""

    since: str  #: the first release with these definitions ("0.7.0"); "0" for the earliest covered
    commit: str  #: the upstream commit that introduced them (full sha)
    date: str  #: that commit's date, ISO
    change: str  #: what changed from the era before, in a line
    figures: tuple[Figure, ...]
    compute: Compute = field(repr=False)
    #: the framework's defaults for the settings its figures read (REQUIRED: no default upstream)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    #: release the era's code first shipped in, None while it is only on the framework's main branch
    released: bool = True

    def figure(self, name: str) -> Figure | None:
        return next((f for f in self.figures if name in (f.name, *f.also)), None)


def parse_version(text: str, where: str = "framework") -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise ValueError(f"{where}: {text!r} is not a version (like 0.7.1)") from None


@dataclass(frozen=True)
class Framework:
    """One framework: its eras, oldest first, and where its code lives."""

    name: str
    repository: str  #: owner/name on GitHub
    eras: tuple[Era, ...]

    @property
    def head(self) -> Era:
        return self.eras[-1]

    def era(self, version: str | None = None) -> Era:
        """The era a release runs (its newest era released at or before it); the head era for
        ``None``. A partial version means its newest release (``0.6``: the newest 0.6.x); a full one
        is ordered as a version, dev and pre-releases included (``0.5.1.dev38`` comes after
        ``0.5.1.dev28``: some frameworks tag every commit of their main branch)."""
        if version is None:
            return self.head
        wanted = parse_version(version, f"{self.name} version")
        partial = len(wanted.release) < 3 and not (wanted.is_devrelease or wanted.is_prerelease)
        precision = len(wanted.release)
        chosen: Era | None = None
        for era in self.eras:
            if not era.released:
                continue
            since = parse_version(era.since, f"{self.name} era")
            if (since.release[:precision] <= wanted.release) if partial else (since <= wanted):
                chosen = era
        if chosen is None:
            raise ValueError(
                f"framework: {self.name} {version} is older than the oldest release isoaudit covers "
                f"({self.eras[0].since})"
            )
        return chosen

    def settings_of(self, era: Era, declared: Settings | None) -> tuple[dict[str, Any], dict[str, str]]:
        """The settings ``era``'s figures read: declared ones over the framework's defaults; and for
        each, where it came from ("declared", "default", or "unset" for a required one not given)."""
        declared = dict(declared or {})
        known = set(era.defaults)
        unknown = sorted(set(declared) - known)
        if unknown:
            raise ValueError(
                f"framework_config.{unknown[0]}: not a setting of {self.name} {era.since}'s figures "
                f"(known: {', '.join(sorted(known)) or 'none'})"
            )
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for key, default in era.defaults.items():
            if key in declared:
                values[key], origin[key] = declared[key], "declared"
            elif default is REQUIRED:
                origin[key] = "unset"
            else:
                values[key], origin[key] = default, "default"
        return values, origin
