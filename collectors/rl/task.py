"""The job's verifiable task: copy a short digit string, rewarded exactly from the tokens.

A random tiny model must see non-zero rewards from its first step, or GRPO's group-normalised
advantages are all zero and the policy never moves. So the reward has two exact parts: the fraction
of completion characters that are digits (reachable by chance) and the fraction of the target copied
in place (the actual task). Both are computed from the decoded text, never estimated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One prompt and the completion that earns the full reward."""

    prompt: str
    target: str


def copy_problems(n: int, *, digits: int = 4, seed: int = 0) -> list[Problem]:
    """``n`` prompts of the form ``"copy 3141:"`` whose target is ``"3141"``."""
    if n < 1:
        raise ValueError(f"n: at least one problem, got {n}")
    if not 1 <= digits <= 16:
        raise ValueError(f"digits: expected 1..16, got {digits}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        target = "".join(rng.choice("0123456789") for _ in range(digits))
        problems.append(Problem(prompt=f"copy {target}:", target=target))
    return problems


def reward(completion: str, problem: Problem) -> float:
    """Half for digits among the first ``len(target)`` characters, half for each one in place.

    Whitespace before the answer is ignored, so ``" 3141"`` earns the full reward.
    """
    answer = completion.lstrip()[: len(problem.target)]
    if not answer:
        return 0.0
    width = len(problem.target)
    digit_share = sum(ch.isdigit() for ch in answer) / width
    copied_share = sum(a == b for a, b in zip(answer, problem.target, strict=False)) / width
    return 0.5 * digit_share + 0.5 * copied_share


def rewards(completions: Sequence[str], problems: Sequence[Problem]) -> list[float]:
    """:func:`reward` for each (completion, problem) pair; the two must be as long."""
    if len(completions) != len(problems):
        raise ValueError(f"completions: {len(completions)} given for {len(problems)} problems")
    return [reward(c, p) for c, p in zip(completions, problems, strict=True)]
