"""A small synchronous GRPO job with isoaudit attached: the recipe ``isoaudit demo`` runs.

Read it as a template for your own loop: :mod:`.task` is the verifiable task and its reward,
:mod:`.grpo` the policy-gradient arithmetic (group-normalised advantages, the clipped ratio, the
trainer's recompute of logprobs), and the loop wires a rollout engine, a trainer and the audit
session together with a weight sync after every update.
"""
