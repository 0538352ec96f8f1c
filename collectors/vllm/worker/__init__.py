"""The worker side of the vLLM collector: everything here runs inside vLLM's worker processes (or in
the driver's process when the engine runs in-process), beside the model.

- :mod:`~isoaudit.collectors.vllm.worker.calls`: the entry points the driver calls through
  ``LLM.collective_rpc`` and the worker extension class;
- :mod:`~isoaudit.collectors.vllm.worker.capture`: the hooks on the model and the step lifecycle;
- :mod:`~isoaudit.collectors.vllm.worker.requests`: the request book (what is kept per request
  until the driver drains it);
- :mod:`~isoaudit.collectors.vllm.worker.print_buffer`: selected rows waiting for a batched
  fingerprint pass;
- :mod:`~isoaudit.collectors.vllm.worker.mode`: the remediation mode, switched at step boundaries;
- :mod:`~isoaudit.collectors.vllm.worker.remediation`: the layers switched onto invariant kernels;
- :mod:`~isoaudit.collectors.vllm.worker.rows`, :mod:`~isoaudit.collectors.vllm.worker.regions`,
  :mod:`~isoaudit.collectors.vllm.worker.facts`: the forward's row layout, the canonical regions on
  vLLM's modules, and the engine's runtime facts.

The driver talks to it only through the messages of :mod:`isoaudit.collectors.vllm.messages`.
"""
