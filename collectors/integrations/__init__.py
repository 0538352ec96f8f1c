"""isoaudit inside the RL frameworks people run (DESIGN.md, "Collectors as users call them").

* :mod:`isoaudit.collectors.integrations.trl`: ``IsoauditCallback`` for TRL's ``GRPOTrainer`` (both sides in
  one call: the policy model and, with ``use_vllm=True`` in colocate mode, the vLLM engine);
* :mod:`isoaudit.collectors.integrations.ray`: trainer and rollout engine as Ray actors, each with a
  collector inside, all sending to one isoaudit service;
* ``docs/integrations.md``: recipes for verl, OpenRLHF and SkyRL (their hook points, config keys,
  where ``weights_changed`` goes, where isoaudit's figures sit beside theirs).

Each module imports its framework only when used, so ``import isoaudit.collectors.integrations`` costs nothing.
"""
