"""GRPO's arithmetic, written out so a reader can check each line against the paper.

Each prompt is sampled ``group`` times; a completion's advantage is its reward minus its group's
mean, over the group's standard deviation. The policy loss is PPO's clipped surrogate on the
per-token ratio between the policy being updated and the one that produced the old logprobs: here
the trainer's own recompute before the update (as verl and TRL do), not the rollout engine's
logprobs, whose difference from that recompute is exactly what isoaudit audits.

Logprobs come from the model's final hidden states through :func:`isoaudit.kernels.dispatch.token_logprobs`,
the same call the rollout engine makes: natively the stock lm_head (in the model's dtype) and a
log-softmax, with the invariant kernels on an fp32 lm_head and a batch-invariant log-softmax, so
then both sides agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from isoaudit.collectors.layout import StepBatch
from isoaudit.kernels import dispatch
from torch import nn


@dataclass(frozen=True)
class PolicyOutput:
    """The completion tokens' logprobs (differentiable), their entropies, and the raw HF output."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    logits: torch.Tensor


def policy_logprobs(model: nn.Module, batch: StepBatch) -> PolicyOutput:
    """One full forward of an HF causal LM over ``batch``; the completion tokens' logprobs (in
    sample order, as :meth:`StepBatch.completion_rows` lists them) through the routed head.

    The whole model runs (``lm_head`` included) so a collector hooked on it sees every region, and
    the forward's inputs are the batch's own, so the trainer collector reuses this forward.
    """
    out = model(**batch.model_inputs(), output_hidden_states=True)
    final = out.hidden_states[-1]  # after the final norm: what lm_head reads
    predict, target = batch.completion_rows()
    device = final.device
    hidden = final.reshape(-1, final.shape[-1])[torch.as_tensor(predict, device=device)]
    tokens = batch.input_ids.reshape(-1).to(device)[torch.as_tensor(target, device=device)]
    weight = cast(nn.Linear, model.lm_head).weight  # an HF causal LM's head is an nn.Linear
    logprobs = dispatch.token_logprobs(hidden, weight, tokens)
    with torch.no_grad():
        log_p = torch.log_softmax(dispatch.logits_fp32(hidden.detach(), weight.detach()), dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
    return PolicyOutput(logprobs=logprobs, entropy=entropy, logits=out.logits)


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """(reward − group mean) / (group std + eps), for rewards laid out group after group."""
    if group < 1 or rewards.numel() % group:
        raise ValueError(f"group: {rewards.numel()} rewards do not split into groups of {group}")
    r = rewards.float().view(-1, group)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).reshape(-1)


@dataclass(frozen=True)
class LossOutput:
    """The scalar to backpropagate and the fraction of tokens where the clip was active."""

    loss: torch.Tensor
    clip_fraction: float


def clipped_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    token_advantages: torch.Tensor,
    clip_eps: float = 0.2,
) -> LossOutput:
    """PPO's clipped surrogate, averaged over tokens: −mean(min(ρA, clip(ρ, 1−ε, 1+ε)A))."""
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps: expected 0 < eps < 1, got {clip_eps}")
    ratio = torch.exp(new_logprobs - old_logprobs.detach())
    unclipped = ratio * token_advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * token_advantages
    per_token = -torch.minimum(unclipped, clipped)
    active = (clipped < unclipped).float().mean() if per_token.numel() else torch.tensor(0.0)
    return LossOutput(loss=per_token.mean(), clip_fraction=float(active))
