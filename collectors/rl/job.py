"""The loop itself: sample, reward, recompute, update, sync — with both sides audited.

One step of synchronous GRPO, in the order a real job runs it:

1. the rollout engine samples ``group`` completions for each prompt (its collector records the
   tokens, logprobs and fingerprints);
2. each completion is rewarded exactly (:mod:`.task`);
3. the trainer recomputes the completions' logprobs (its collector records them: the audited
   mismatch is this recompute against the engine's logprobs);
4. ``updates`` passes of the clipped GRPO loss update the policy;
5. the new weights go to the engine as weight version ``step + 1``, and the session is told.

The remediation mode the dashboard asks for is applied by each collector at its next step
boundary (the engine's ``generate``, the trainer's ``begin_step``); the loop does nothing for it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.rl import grpo
from isoaudit.collectors.rl.rollout import Rollout
from isoaudit.collectors.rl.task import Problem, copy_problems, rewards
from isoaudit.collectors.sessions import Session
from torch import nn


@dataclass(frozen=True)
class JobConfig:
    """The loop's knobs; the defaults run in a few seconds a step on two CPU cores."""

    steps: int = 20
    prompts: int = 8
    group: int = 4
    max_new: int = 6
    temperature: float = 1.0
    learning_rate: float = 3e-3
    clip_eps: float = 0.2
    updates: int = 2
    sample_every: int = 1
    seed: int = 0
    #: The trainer collector's fingerprinted regions ("auto": every region; None: logprobs only).
    trainer_regions: str | None = "auto"
    #: Long-context jobs (retrieval, multi-turn history): every prompt is brought to this many
    #: tokens by a fixed filler document placed before the task (None: the task's prompt alone).
    prompt_len: int | None = None
    #: Samples per forward and backward of an update, their gradients accumulated before the
    #: optimizer's step (None: the whole batch at once). A long-context batch's activations for the
    #: backward outgrow a GPU; the loss stays the mean over all the batch's tokens.
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "group", "max_new", "updates", "sample_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("prompt_len", "micro_batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1 (or None), got {getattr(self, name)}")
        if self.group < 2:
            raise ValueError(f"group: GRPO compares completions within a group; need >= 2, got {self.group}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")


@dataclass(frozen=True)
class StepFigures:
    """The loop's own figures for one step, as the dashboard sets them beside the mismatch."""

    step: int
    reward_mean: float
    reward_std: float
    entropy: float
    clip_fraction: float
    generation_s: float
    training_s: float
    weight_version: int
    mode: str
    #: The step's train-rollout mismatch as the loop sees it (the trainer's recompute against the
    #: engine's logprobs, before the update): mean |delta| and the fraction of tokens exactly equal.
    mismatch_mean_abs: float = float("nan")
    exact_fraction: float = float("nan")


def run_job(
    audit: Session,
    policy: nn.Module,
    tokenizer: object,
    rollout: Rollout,
    config: JobConfig = JobConfig(),
    *,
    on_step: Callable[[StepFigures], None] | None = None,
) -> list[StepFigures]:
    """Train ``policy`` for ``config.steps`` GRPO steps against ``rollout``, audited by ``audit``."""
    torch.manual_seed(config.seed)
    trainer = audit.watch_trainer(
        policy, regions=config.trainer_regions, sample_every=config.sample_every, case="trainer_recompute"
    )
    rollout.watch(audit)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.learning_rate)
    problems = copy_problems(1024, seed=config.seed)
    rng = random.Random(config.seed)
    pad = int(getattr(tokenizer, "pad_token_id", 0) or 0)
    device = next(policy.parameters()).device
    figures: list[StepFigures] = []
    for step in range(config.steps):
        chosen = [p for p in rng.sample(problems, config.prompts) for _ in range(config.group)]
        prompts = [list(tokenizer(p.prompt)["input_ids"]) for p in chosen]  # type: ignore[operator]  # HF tokenizers are callable; the stubs type the base class
        if config.prompt_len is not None:
            prompts = with_context(prompts, tokenizer, config.prompt_len)

        started = time.perf_counter()
        sampled = rollout.generate(step, prompts, config.max_new, config.temperature, seed=config.seed + step)
        _settle(device)
        generation_s = time.perf_counter() - started

        started = time.perf_counter()
        completions = [s.tokens for s in sampled]
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)  # type: ignore[attr-defined]  # HF tokenizers have batch_decode; the stubs type the base class
        reward = torch.tensor(rewards(texts, chosen))
        batch = StepBatch.padded(
            prompts, completions, pad_token_id=pad, temperature=config.temperature, device=device
        )
        trainer.begin_step(step, batch)  # a step boundary: a new remediation mode applies here
        policy.train()
        with torch.no_grad():
            old = grpo.policy_logprobs(policy, batch)
        lengths = [len(c) for c in completions]
        trainer.record_step(step, batch, logprobs=list(torch.split(old.logprobs.float(), lengths)))
        delta = (
            old.logprobs.detach().float().cpu() - torch.tensor([x for s in sampled for x in s.logprobs])
        ).abs()
        token_advantages = (
            grpo.group_advantages(reward, config.group).repeat_interleave(torch.tensor(lengths)).to(device)
        )
        parts = _micro_batches(batch, prompts, completions, config.micro_batch, pad, config.temperature)
        clip = []
        for _ in range(config.updates):
            optimizer.zero_grad(set_to_none=True)
            clip.append(_accumulate(policy, parts, old.logprobs.float(), token_advantages, config.clip_eps))
            optimizer.step()
        version = step + 1
        rollout.sync(policy, version)
        audit.weights_changed(version)
        _settle(device)
        training_s = time.perf_counter() - started

        row = StepFigures(
            step=step,
            reward_mean=float(reward.mean()),
            reward_std=float(reward.std(unbiased=False)),
            entropy=float(old.entropy.mean()),
            clip_fraction=float(np.mean(clip)),
            generation_s=generation_s,
            training_s=training_s,
            weight_version=version,
            mode=trainer.mode,
            mismatch_mean_abs=float(delta.mean()) if delta.numel() else 0.0,
            exact_fraction=float((delta == 0).float().mean()) if delta.numel() else 1.0,
        )
        audit.record_stats(
            step,
            reward_mean=row.reward_mean,
            reward_std=row.reward_std,
            entropy=row.entropy,
            clip_fraction=row.clip_fraction,
            generation_s=row.generation_s,
            training_s=row.training_s,
        )
        figures.append(row)
        if on_step is not None:
            on_step(row)
    return figures


def _micro_batches(
    batch: StepBatch,
    prompts: list[list[int]],
    completions: list[list[int]],
    size: int | None,
    pad: int,
    temperature: float,
) -> list[tuple[StepBatch, int, int]]:
    """(batch, first token, end token) per micro-batch of ``size`` samples, the tokens counted in
    sample order (the old logprobs' and advantages' layout); the whole batch when ``size`` covers it."""
    n = len(prompts)
    if size is None or size >= n:
        return [(batch, 0, sum(len(c) for c in completions))]
    parts, first = [], 0
    for lo in range(0, n, size):
        hi = min(lo + size, n)
        part = StepBatch.padded(
            prompts[lo:hi],
            completions[lo:hi],
            pad_token_id=pad,
            temperature=temperature,
            device=batch.input_ids.device,
        )
        end = first + sum(len(c) for c in completions[lo:hi])
        parts.append((part, first, end))
        first = end
    return parts


def _accumulate(
    policy: nn.Module,
    parts: list[tuple[StepBatch, int, int]],
    old_logprobs: torch.Tensor,
    token_advantages: torch.Tensor,
    clip_eps: float,
) -> float:
    """One update's gradients, micro-batch by micro-batch: each part's clipped loss weighted by its
    share of the tokens, so the sum is the whole batch's token mean. Returns the clip fraction."""
    total = parts[-1][2]
    clipped = 0.0
    for part, first, end in parts:
        if end == first and len(parts) > 1:
            continue  # no completion tokens: nothing to learn from
        new = grpo.policy_logprobs(policy, part)
        loss = grpo.clipped_loss(
            new.logprobs.float(), old_logprobs[first:end], token_advantages[first:end], clip_eps
        )
        share = (end - first) / total if total else 1.0
        (loss.loss * share).backward()
        clipped += loss.clip_fraction * share
    return clipped


#: The filler document of long-context prompts: plain prose, so any tokenizer encodes it.
FILLER = (
    "The archive holds the letters of a harbour town, sorted by the year they were sent and the "
    "ship that carried them; each one names its writer, its reader and the weather of the day. "
)


def with_context(prompts: list[list[int]], tokenizer: object, prompt_len: int) -> list[list[int]]:
    """Each prompt brought to ``prompt_len`` tokens by the start of the filler document (repeated as
    needed) placed before it; a prompt already that long is left as it is."""
    unit = list(tokenizer(FILLER)["input_ids"])  # type: ignore[operator]  # HF tokenizers are callable
    longest = max((prompt_len - len(p) for p in prompts), default=0)
    filler = unit * (longest // max(len(unit), 1) + 1)
    return [filler[: max(prompt_len - len(p), 0)] + p for p in prompts]


def _settle(device: torch.device) -> None:
    """Wait for the device's queued work, so a phase's time is the phase's (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["JobConfig", "Problem", "StepFigures", "run_job"]
