"""The module vLLM imports when it resolves ``worker_extension_cls=collectors.vllm.EXTENSION``.

Nothing of isoaudit imports it, so its first import is the worker resolving the extension, after
vLLM is loaded and before the worker loads the model: the one moment the raw-weight hook
(:func:`collectors.vllm.remediation.keep_raw_weights`) must be in place, in-process engines included
(where :mod:`collectors.vllm.worker` may long have been imported, before vLLM was)."""

import os

from isoaudit.collectors.vllm.remediation import keep_raw_weights
from isoaudit.collectors.vllm.worker import IsoauditWorkerExtension

if os.environ.get("ISOAUDIT_VLLM_KEEP_WEIGHTS", "1") != "0":
    keep_raw_weights()

__all__ = ["IsoauditWorkerExtension"]
