"""A GRPO job whose trainer and rollout engine are Ray actors, each with a collector inside, all
sending to one isoaudit service.

This is the shape of verl, OpenRLHF and SkyRL jobs: the driver owns no model; a rollout actor
samples, a trainer actor recomputes and updates, and weights travel from one to the other with a
version. Each actor opens its own :func:`isoaudit.session` for the same run; where records go
comes from the actor's environment (``ISOAUDIT_URL`` + ``ISOAUDIT_TOKEN``, set for every actor
through Ray's ``runtime_env``), so the actors need no isoaudit arguments and may sit on any node.
Both sides derive each sample's key from its tokens, so nothing coordinates ids across actors::

    ray.init()
    figures = run_ray_job("path/to/model", run="grpo-ray", steps=10,
                          env={"ISOAUDIT_URL": "http://isoaudit:8000", "ISOAUDIT_TOKEN": token})

The arithmetic is the recipe's (:mod:`isoaudit.collectors.rl.grpo`, :mod:`isoaudit.collectors.rl.task`); the
engine is isoaudit's reference engine (:class:`isoaudit.collectors.rl.rollout.ReferenceRollout`) over the
actor's own copy of the weights.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.rl import grpo
from isoaudit.collectors.rl.rollout import ReferenceRollout
from isoaudit.collectors.rl.task import copy_problems, rewards
from isoaudit.collectors.sessions import session as audit_session


def _load(path: str | Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


class RolloutWorker:
    """The rollout side (``ray.remote(RolloutWorker)`` makes it an actor): the reference engine
    over its own copy of the weights, watched by its session's rollout collector."""

    def __init__(
        self, model_path: str | Path, *, run: str, session_args: Mapping[str, Any] | None = None
    ) -> None:
        self.audit = audit_session(run, **dict(session_args or {}))
        self.rollout = ReferenceRollout(_load(model_path).eval())
        self.rollout.watch(self.audit)

    def generate(
        self, step: int, prompts: list[list[int]], max_new: int, temperature: float, seed: int
    ) -> list[list[int]]:
        """Sample one completion per prompt (recorded as step ``step``); returns the tokens."""
        return [s.tokens for s in self.rollout.generate(step, prompts, max_new, temperature, seed)]

    @torch.no_grad()
    def load_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Copy the trainer's tensors into the engine's model; they are weight version ``version``."""
        for name, param in self.rollout.model.named_parameters():
            param.copy_(state[name])
        self.audit.weights_changed(version)

    def close(self) -> dict[str, Any]:
        """Detach, flush, close; what each side sent, spooled, dropped and had rejected."""
        return {side: asdict(s) for side, s in self.audit.close().sides.items()}


class TrainerWorker:
    """The trainer side: the policy, its optimizer and the trainer collector."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        run: str,
        learning_rate: float = 3e-3,
        clip_eps: float = 0.2,
        session_args: Mapping[str, Any] | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.policy = _load(model_path)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=learning_rate)
        self.clip_eps = clip_eps
        self.audit = audit_session(run, **dict(session_args or {}))
        self.trainer = self.audit.watch_trainer(self.policy, case="trainer_recompute")
        self.audit.weights_changed(0)

    def train_step(
        self,
        step: int,
        prompts: list[list[int]],
        completions: list[list[int]],
        reward: Sequence[float],
        group: int,
        temperature: float,
        pad_token_id: int = 0,
    ) -> dict[str, float]:
        """Recompute the completions' logprobs (recorded as step ``step``), then one clipped GRPO
        update; returns the step's figures."""
        batch = StepBatch.padded(prompts, completions, pad_token_id=pad_token_id, temperature=temperature)
        self.trainer.begin_step(step, batch)
        self.policy.train()
        with torch.no_grad():
            old = grpo.policy_logprobs(self.policy, batch)
        lengths = [len(c) for c in completions]
        self.trainer.record_step(step, batch, logprobs=list(torch.split(old.logprobs.float(), lengths)))
        advantages = grpo.group_advantages(torch.tensor(list(reward)), group)
        new = grpo.policy_logprobs(self.policy, batch)
        loss = grpo.clipped_loss(
            new.logprobs.float(),
            old.logprobs.float(),
            advantages.repeat_interleave(torch.tensor(lengths)),
            self.clip_eps,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.loss.backward()
        self.optimizer.step()
        return {
            "loss": float(loss.loss),
            "clip_fraction": loss.clip_fraction,
            "entropy": float(old.entropy.mean()),
        }

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """The policy's tensors for the engine; from now on this side computes with ``version``."""
        self.audit.weights_changed(version)
        return {name: p.detach().clone() for name, p in self.policy.named_parameters()}

    def close(self) -> dict[str, Any]:
        return {side: asdict(s) for side, s in self.audit.close().sides.items()}


def run_ray_job(
    model_path: str | Path,
    *,
    run: str,
    steps: int = 2,
    prompts: int = 4,
    group: int = 2,
    max_new: int = 4,
    temperature: float = 1.0,
    env: Mapping[str, str] | None = None,
    session_args: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Drive ``steps`` GRPO steps through a rollout actor and a trainer actor (``ray.init`` first).

    ``env``: environment variables for both actors (``ISOAUDIT_URL``/``ISOAUDIT_TOKEN``);
    ``session_args``: :func:`isoaudit.session` arguments for both. Returns the per-step figures
    and each actor's session summary (``{"steps": [...], "rollout": {...}, "trainer": {...}}``).
    """
    import ray
    from transformers import AutoTokenizer

    options = {"num_cpus": 1, "runtime_env": {"env_vars": dict(env or {})}}
    # Ray's actor handles: Any, as Ray's types do not give the actor methods their .remote()
    rollout: Any = (
        ray.remote(RolloutWorker).options(**options).remote(model_path, run=run, session_args=session_args)
    )
    trainer: Any = (
        ray.remote(TrainerWorker).options(**options).remote(model_path, run=run, session_args=session_args)
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    pad = int(tokenizer.pad_token_id or 0)
    problems = copy_problems(256, seed=seed)
    rng = random.Random(seed)
    figures = []
    try:
        for step in range(steps):
            chosen = [p for p in rng.sample(problems, prompts) for _ in range(group)]
            ids = [list(tokenizer(p.prompt)["input_ids"]) for p in chosen]
            completions = ray.get(rollout.generate.remote(step, ids, max_new, temperature, seed + step))
            reward = rewards(tokenizer.batch_decode(completions, skip_special_tokens=True), chosen)
            figures.append(
                ray.get(trainer.train_step.remote(step, ids, completions, reward, group, temperature, pad))
            )
            ray.get(rollout.load_weights.remote(step + 1, trainer.weights.remote(step + 1)))
        return {
            "steps": figures,
            "rollout": ray.get(rollout.close.remote()),
            "trainer": ray.get(trainer.close.remote()),
        }
    finally:
        for actor in (rollout, trainer):
            ray.kill(actor)
