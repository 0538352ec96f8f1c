"""A data-parallel GRPO job under ``torchrun``: every rank is a trainer (``torch.distributed``,
DistributedDataParallel) and an engine worker, each with one :func:`isoaudit.session` for the
same run; the session stamps the process's rank on what it sends.

This is the shape of a multi-node RL job with isoaudit in it: nothing coordinates sample ids across
ranks (both sides derive a sample's key from its tokens), so the trainer rank that recomputes a
sample need not be the engine rank that sampled it. Here, on purpose, it never is: engine rank
``r`` samples its own prompt groups, the groups are all-gathered, and trainer rank ``r`` trains on
engine rank ``r + 1``'s. Run it with::

    ISOAUDIT_URL=http://isoaudit:8000 ISOAUDIT_TOKEN=... \\
        torchrun --nproc-per-node 4 -m isoaudit.collectors.integrations.torchrun --model path/to/model --run-id dp-7

``--stop-sending-rank R --stop-sending-after S`` closes rank R's session after step S while the rank
keeps training (what a rank whose collector died looks like to the service).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.rl import grpo
from isoaudit.collectors.rl.rollout import ReferenceRollout
from isoaudit.collectors.rl.task import copy_problems, rewards
from isoaudit.collectors.sessions import session as audit_session


class _Replicated:
    """The policy under DistributedDataParallel, as ``grpo.policy_logprobs`` reads a model: DDP's
    forward (its backward all-reduces the gradients) and the policy's own ``lm_head``."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.ddp = torch.nn.parallel.DistributedDataParallel(policy)
        self.module = policy  # what DDP wraps: where the trainer collector hooks
        self.lm_head = policy.lm_head

    def __call__(self, **inputs: torch.Tensor) -> Any:
        return self.ddp(**inputs)


def data_parallel_job(
    model_path: str,
    *,
    run: str,
    steps: int = 3,
    groups_per_rank: int = 1,
    group: int = 2,
    max_new: int = 4,
    temperature: float = 1.0,
    learning_rate: float = 3e-3,
    stop_sending_rank: int | None = None,
    stop_sending_after: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``steps`` GRPO steps on this rank (the process group must be up); returns this rank's
    session summary and, per step, which engine rank sampled what this rank trained on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = int(tokenizer.pad_token_id or 0)
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    model = _Replicated(policy)  # gloo all-reduces the gradients
    optimizer = torch.optim.AdamW(policy.parameters(), lr=learning_rate)
    audit = audit_session(run)  # the rank comes from the process group
    rollout = ReferenceRollout(policy)
    rollout.watch(audit)
    trainer = audit.watch_trainer(policy, case="trainer_recompute")
    audit.weights_changed(0)
    problems = copy_problems(256, seed=seed)
    rng = random.Random(seed)  # the same on every rank: every rank knows every rank's prompts
    sending, trained_from, summary = True, [], None
    for step in range(steps):
        chosen = rng.sample(problems, groups_per_rank * world)
        mine = [
            p for p in chosen[rank * groups_per_rank : (rank + 1) * groups_per_rank] for _ in range(group)
        ]
        ids = [list(tokenizer(p.prompt)["input_ids"]) for p in mine]
        sampled = rollout.generate(step, ids, max_new, temperature, seed + 1000 * step + rank)
        shards: list[Any] = [None] * world
        dist.all_gather_object(shards, (ids, [s.tokens for s in sampled]))
        source = (rank + 1) % world  # train on another engine rank's samples
        prompts, completions = shards[source]
        problems_of = [
            p for p in chosen[source * groups_per_rank : (source + 1) * groups_per_rank] for _ in range(group)
        ]
        reward = rewards(tokenizer.batch_decode(completions, skip_special_tokens=True), problems_of)
        batch = StepBatch.padded(prompts, completions, pad_token_id=pad, temperature=temperature)
        lengths = [len(c) for c in completions]
        if sending:
            trainer.begin_step(step, batch)
        with torch.no_grad():
            old = grpo.policy_logprobs(policy, batch)
        if sending:
            trainer.record_step(step, batch, logprobs=list(torch.split(old.logprobs.float(), lengths)))
        advantages = grpo.group_advantages(torch.tensor(reward), group)
        new = grpo.policy_logprobs(model, batch)  # type: ignore[arg-type]  # DDP wraps the model; grpo reads it as the nn.Module it is
        loss = grpo.clipped_loss(
            new.logprobs.float(),
            old.logprobs.float(),
            advantages.repeat_interleave(torch.tensor(lengths)),
            0.2,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.loss.backward()
        optimizer.step()
        rollout.sync(policy, step + 1)
        if sending:
            audit.weights_changed(step + 1)
        trained_from.append(source)
        if sending and rank == stop_sending_rank and step == stop_sending_after:
            summary = audit.close()  # this rank goes on training, but sends nothing more
            sending = False
    if summary is None:
        summary = audit.close()
    return {
        "rank": rank,
        "trained_from": trained_from,
        "summary": {s: asdict(v) for s, v in summary.sides.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups-per-rank", type=int, default=1)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--stop-sending-rank", type=int, default=None)
    parser.add_argument("--stop-sending-after", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        result = data_parallel_job(
            args.model,
            run=args.run_id,
            steps=args.steps,
            groups_per_rank=args.groups_per_rank,
            group=args.group,
            stop_sending_rank=args.stop_sending_rank,
            stop_sending_after=args.stop_sending_after,
        )
        # One write of the whole line: ranks share stdout, and print's separate write of the
        # newline (unbuffered under PYTHONUNBUFFERED) let another rank's line land in between.
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
