"""The RL recipe's task, reward and GRPO arithmetic, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.rl import grpo
from isoaudit.collectors.rl.task import Problem, copy_problems, reward, rewards


def test_copy_problems_are_deterministic_and_well_formed() -> None:
    a, b = copy_problems(5, digits=3, seed=4), copy_problems(5, digits=3, seed=4)
    assert a == b
    for p in a:
        assert p.prompt == f"copy {p.target}:" and len(p.target) == 3 and p.target.isdigit()
    with pytest.raises(ValueError, match="digits"):
        copy_problems(2, digits=0)


def test_reward_by_hand() -> None:
    p = Problem(prompt="copy 1234:", target="1234")
    assert reward(" 1234", p) == 1.0
    assert reward("1299", p) == 0.5 * 1 + 0.5 * 0.5  # all digits, two in place
    assert reward("ab34", p) == 0.5 * 0.5 + 0.5 * 0.5
    assert reward("", p) == 0.0 and reward("   ", p) == 0.0
    assert reward("12", p) == 0.5 * 0.5 + 0.5 * 0.5  # a short answer earns only what it covers
    with pytest.raises(ValueError, match="completions"):
        rewards(["1"], [p, p])


def test_group_advantages_by_hand() -> None:
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group=2)
    # group 1: mean 0.5, std 0.5 -> +1, -1; group 2: all equal -> 0, 0
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5)
    with pytest.raises(ValueError, match="group"):
        grpo.group_advantages(torch.zeros(3), group=2)


def test_clipped_loss_by_hand() -> None:
    old = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.5, 0.75, 0.25]))  # ratios 1.0, 1.5, 0.5
    adv = torch.tensor([1.0, 1.0, -1.0])
    out = grpo.clipped_loss(new, old, adv, clip_eps=0.2)
    # per token: -min(1*1, 1*1) = -1; -min(1.5, 1.2) = -1.2; -min(-0.5, -0.8) = 0.8
    assert math.isclose(float(out.loss), (-1.0 - 1.2 + 0.8) / 3, rel_tol=1e-6)
    assert math.isclose(out.clip_fraction, 2 / 3, rel_tol=1e-6)


def test_policy_logprobs_match_the_models_own_logits(tmp_path) -> None:
    """Through the fp32 head the logprobs equal a log-softmax of fp32 logits, and they backprop."""
    from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model

    model, _ = load_tiny_model(make_tiny_model("qwen3", tmp_path / "m", num_layers=1, hidden=32))
    batch = StepBatch.padded([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]])
    out = grpo.policy_logprobs(model, batch)
    logits = model(**batch.model_inputs()).logits.float()
    # by hand: row 0 predicts 6, 7 from positions 2, 3; row 1 predicts 8, 9, 10 from positions 1, 2, 3
    rows, cols, tokens = [0, 0, 1, 1, 1], [2, 3, 1, 2, 3], [6, 7, 8, 9, 10]
    expected = torch.log_softmax(logits, -1)[rows, cols, tokens]
    assert torch.allclose(out.logprobs.detach(), expected, atol=1e-5)
    assert out.entropy.shape == out.logprobs.shape and bool((out.entropy > 0).all())
    out.logprobs.sum().backward()
    assert model.lm_head.weight.grad is not None


def test_long_context_prompts_end_with_the_task_and_have_the_asked_length() -> None:
    from isoaudit.collectors.rl.job import FILLER, JobConfig, with_context

    def chars(text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    prompts = [[1, 2, 3], list(range(40)), list(range(700))]
    out = with_context(prompts, chars, 600)
    assert [len(p) for p in out] == [600, 600, 700]
    assert [p[-len(q) :] for p, q in zip(out, prompts, strict=True)] == prompts
    assert out[0][: len(FILLER)] == [ord(c) for c in FILLER]  # the document, from its start, repeated
    assert out[0][len(FILLER) : 2 * len(FILLER)] == [ord(c) for c in FILLER]
    with pytest.raises(ValueError, match="prompt_len"):
        JobConfig(prompt_len=0)
