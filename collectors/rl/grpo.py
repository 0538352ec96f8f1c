"""GRPO's arithmetic, written out so a reader can check each line against the paper.

Each prompt is sampled ``group`` times; a completion's advantage is its reward minus its group's
mean, over the group's standard deviation. The policy loss is PPO's clipped surrogate on the
per-token ratio between the policy being updated and the one that produced the old logprobs: here
the trainer's own recompute before the update (as verl and TRL do), not the rollout engine's
logprobs, whose difference from that recompute is exactly what isoaudit audits.

Logprobs come from the model's final hidden states through :func:`isoaudit.kernels.dispatch.token_logprobs`,
the same call the rollout engine makes: natively the stock lm_head (in the model's dtype) and a
log-softmax, with the invariant kernels on an fp32 lm_head and a batch-invariant log-softmax, so
then both sides agree bit for bit. Neither side holds a [tokens x vocabulary] tensor at length: the
invariant head is fused over row blocks and vocabulary slabs, the native one takes the same blocks
and slabs once its logits outgrow one slab, and the entropies are built a block of rows at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from isoaudit.collectors.hooks import fingerprints_next_forward
from isoaudit.collectors.layout import StepBatch
from isoaudit.kernels import dispatch
from torch import nn

#: Rows of the entropy's head built at once: its fp32 logits, log-probabilities and their product
#: are three [rows x vocab] fp32 blocks (about 0.9 GB at a 152k vocabulary), whatever the batch.
ENTROPY_ROWS = 512


@dataclass(frozen=True)
class PolicyOutput:
    """The completion tokens' logprobs (differentiable) and their entropies (no autograd)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


def policy_logprobs(model: nn.Module, batch: StepBatch) -> PolicyOutput:
    """One full forward of an HF causal LM over ``batch``; the completion tokens' logprobs (in
    sample order, as :meth:`StepBatch.completion_rows` lists them) through the routed head.

    The whole model runs (``lm_head`` included) so a collector hooked on it sees every region, and
    the forward's inputs are the batch's own, so the trainer collector reuses this forward. The
    logprobs and entropies come from the final hidden states alone, so HF's own logits (a
    model-dtype [rows x cols x vocab] tensor, tens of GB at long context) are kept for one position (``logits_to_keep=1``), except when a collector hooked on
    the model fingerprints this forward: its lm_head hook then reads the logits of every real token,
    as it does on every fingerprinted step (the engine's are compared row for row). A collector
    that computes logprobs from the logits itself runs its own forward when these do not cover the
    batch. A model whose forward takes no ``logits_to_keep`` computes them all.
    """
    extra: dict[str, Any] = {}
    if _takes_logits_to_keep(model) and not any(fingerprints_next_forward(m) for m in _wrapped(model)):
        extra["logits_to_keep"] = 1
    out = model(**batch.model_inputs(), output_hidden_states=True, **extra)
    final = out.hidden_states[-1]  # after the final norm: what lm_head reads
    del out
    predict, target = batch.completion_rows()
    device = final.device
    hidden = final.reshape(-1, final.shape[-1])[torch.as_tensor(predict, device=device)]
    tokens = batch.input_ids.reshape(-1).to(device)[torch.as_tensor(target, device=device)]
    weight = cast(nn.Linear, model.lm_head).weight  # an HF causal LM's head is an nn.Linear
    logprobs = dispatch.token_logprobs(hidden, weight, tokens)
    return PolicyOutput(logprobs=logprobs, entropy=token_entropy(hidden, weight))


def token_entropy(hidden: torch.Tensor, weight: torch.Tensor, rows: int = ENTROPY_ROWS) -> torch.Tensor:
    """``-sum p log p`` per row of ``hidden`` (T, H) under the routed fp32 head ``weight`` (V, H),
    ``rows`` rows at a time, so no [T x V] tensor is built; no autograd (a figure of the loop).
    Each row's value is its own: under the invariant kernels the same bits for any ``rows``."""
    if rows < 1:
        raise ValueError(f"rows: must be at least 1, got {rows}")
    h, w = hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach()
    out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    with torch.no_grad():
        for r0 in range(0, h.shape[0], rows):
            log_p = torch.log_softmax(dispatch.logits_fp32(h[r0 : r0 + rows], w), dim=-1)
            out[r0 : r0 + rows] = -log_p.exp().mul_(log_p).sum(-1)
    return out


def _wrapped(model: Any) -> Iterator[nn.Module]:
    """``model`` and the modules it wraps (DDP's ``module``, ``torch.compile``'s ``_orig_mod``):
    wherever a collector may have hooked."""
    seen: set[int] = set()
    while isinstance(model, nn.Module) or hasattr(model, "module"):
        if id(model) in seen:
            return
        seen.add(id(model))
        if isinstance(model, nn.Module):
            yield model
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return
        model = inner


def _takes_logits_to_keep(model: Any) -> bool:
    """Whether the innermost model's forward names ``logits_to_keep`` (HF causal LMs do)."""
    modules = list(_wrapped(model))
    inner = modules[-1] if modules else model
    try:
        return "logits_to_keep" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


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
