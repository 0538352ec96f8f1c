"""The module vLLM imports when it resolves ``worker_extension_cls=isoaudit.collectors.vllm.EXTENSION``.

Nothing of isoaudit imports it, so its first import is the worker resolving the extension, after
vLLM is loaded and before the worker loads the model: the one moment the raw-weight hook
(:func:`isoaudit.collectors.vllm.worker.remediation.keep_raw_weights`) must be in place, in-process engines
included (where :mod:`isoaudit.collectors.vllm.worker.calls` may long have been imported, before vLLM was)."""

import os

from isoaudit.collectors.vllm.worker.calls import IsoauditWorkerExtension
from isoaudit.collectors.vllm.worker.remediation import keep_raw_weights

if os.environ.get("ISOAUDIT_VLLM_KEEP_WEIGHTS", "1") != "0":
    keep_raw_weights()

__all__ = ["IsoauditWorkerExtension"]
