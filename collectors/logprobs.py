"""Per-token logprobs with the *processed* semantics: fp32 log-softmax of logits / temperature.

Only the rows that predict a completion token are gathered before the softmax, so a long prompt
costs nothing here. When every sample shares one temperature the division is by that Python float,
exactly the ``log_softmax(logits / T)`` a trainer writes (on CUDA, dividing by a scalar and by a
tensor of the same value can round differently).

While the invariant kernels are on (remediation mode ``invariant``), the log-softmax is theirs, so the
trainer's logprobs are the same arithmetic as an engine running :func:`kernels.routing.token_logprobs`.
"""

from __future__ import annotations

import numpy as np
import torch


def processed_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    predict_rows: np.ndarray,
    target_rows: np.ndarray,
    temperature: np.ndarray,
    sample_of_token: np.ndarray,
) -> torch.Tensor:
    """Logprob of each target token under the logits of its predicting row, fp32, on logits' device.

    ``predict_rows``/``target_rows`` index the flattened ``[rows * cols]`` positions; ``temperature``
    has one value per sample and ``sample_of_token`` maps each target to its sample. A temperature of
    0 (greedy) is applied as 1.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if flat.shape[0] != input_ids.numel():
        raise ValueError(f"logits: {flat.shape[0]} rows for {input_ids.numel()} tokens (logits_to_keep set?)")
    device = logits.device
    predict = torch.from_numpy(predict_rows).to(device)
    targets = input_ids.reshape(-1).to(device).index_select(0, torch.from_numpy(target_rows).to(device))
    rows = flat.index_select(0, predict).float()
    temps = np.where(temperature > 0, temperature, 1.0)
    if temps.size == 0 or bool(np.all(temps == temps[0])):
        scale = float(temps[0]) if temps.size else 1.0
        scaled = rows / scale if scale != 1.0 else rows
    else:
        per_token = torch.from_numpy(temps[sample_of_token].astype(np.float32)).to(device)
        scaled = rows / per_token[:, None]
    return _log_softmax(scaled).gather(1, targets[:, None]).squeeze(1)


def _log_softmax(rows: torch.Tensor) -> torch.Tensor:
    from kernels import routing

    return routing.log_softmax(rows)  # the invariant one while kernels are on (CPU or Triton), else torch's
