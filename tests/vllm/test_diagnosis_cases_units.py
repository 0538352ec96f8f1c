"""The trainer's truncation (``collectors.logprobs.truncate``) is vLLM's own: the same logits kept,
the same values after a log-softmax, against vLLM's ``apply_top_k_top_p`` and its min-p processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from isoaudit.collectors.logprobs import processed_logprobs, sampling_values, truncate  # noqa: E402

pytestmark = pytest.mark.vllm


def _vllm(
    scaled: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = scaled.clone()
    if min_p is not None:
        processor = MinPLogitsProcessor.__new__(MinPLogitsProcessor)  # its apply() reads these two
        processor.min_p_count, processor.min_p = int((min_p > 0).sum()), min_p.unsqueeze(1)
        logits = processor.apply(logits)
    return apply_top_k_top_p(logits, k, p).log_softmax(dim=-1)


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [
        ([20, 5, 512, 1], None, None),
        (None, [0.9, 0.5, 1.0, 0.2], None),
        ([40, 8, 3, 100], [0.8, 0.95, 0.6, 0.99], None),
        ([40, 8, 3, 100], [0.8, 0.95, 0.6, 0.99], [0.05, 0.0, 0.2, 0.01]),
    ],
    ids=["top_k", "top_p", "both", "with_min_p"],
)
def test_truncation_is_vllms(top_k: list | None, top_p: list | None, min_p: list | None) -> None:
    scaled = torch.randn(4, 512, generator=torch.Generator().manual_seed(3)) * 3 / 0.7
    rows = np.arange(4)
    values = {
        name: sampling_values(v, 4, name)
        for name, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p))
    }
    ours = truncate(scaled.clone(), rows, **values).log_softmax(dim=-1)
    as_tensor = lambda v, dtype: None if v is None else torch.tensor(v, dtype=dtype)  # noqa: E731
    theirs = _vllm(
        scaled, as_tensor(top_k, torch.long), as_tensor(top_p, torch.float32), as_tensor(min_p, torch.float32)
    )
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours, theirs)


def test_the_sampled_token_stays_in_the_kept_set() -> None:
    """A token past the trainer's top-k boundary (the engine kept it) scores a finite logprob."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    ids = torch.tensor([[0, 3]])  # the target (token 3) is the 4th largest: outside top_k=2
    lp = processed_logprobs(
        logits.reshape(1, 1, 5).expand(1, 2, 5).contiguous(),
        ids,
        np.array([0]),
        np.array([1]),
        np.array([1.0]),
        np.array([0]),
        top_k=sampling_values(2, 1, "top_k"),
    )
    kept = torch.tensor([4.0, 3.0, 1.0])
    assert torch.allclose(lp, (1.0 - torch.logsumexp(kept, 0)).reshape(1))
