"""StepBatch: where each sample sits, from the tensors a trainer already has."""

from __future__ import annotations

import pytest
import torch
from isoaudit.collectors.layout import Span, StepBatch


def test_padded_both_sides_and_position_ids() -> None:
    right = StepBatch.padded([[1, 2], [3]], [[4], [5, 6, 7]], pad_token_id=0)
    assert right.spans == [Span(0, 0, 3, 2), Span(1, 0, 4, 1)]
    assert right.input_ids.tolist() == [[1, 2, 4, 0], [3, 5, 6, 7]]
    left = StepBatch.padded([[1, 2], [3]], [[4], [5, 6, 7]], padding_side="left")
    assert left.spans[0] == Span(0, 1, 3, 2)
    assert left.position_ids.tolist()[0] == [0, 0, 1, 2]  # the sample starts at position 0 either side


def test_from_tensors_reads_every_layout() -> None:
    ids = torch.arange(1, 9).reshape(1, 8)
    by_lens = StepBatch.from_tensors(ids, [1, 2], seq_lens=[3, 5])
    by_pos = StepBatch.from_tensors(ids, [1, 2], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    assert by_lens.spans == by_pos.spans == [Span(0, 0, 3, 1), Span(0, 3, 5, 2)]
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    padded = StepBatch.from_tensors(ids.reshape(2, 4), [2, 1], attention_mask=mask)
    assert padded.spans == [Span(0, 1, 3, 2), Span(1, 0, 2, 1)]
    assert StepBatch.coerce({"input_ids": ids, "prompt_lens": [3]}).spans == [Span(0, 0, 8, 3)]
    assert [t.tolist() for t in padded.completion_rows()] == [
        [2, 4],
        [3, 5],
    ]  # (predicting row, token row) per completion token


def test_layout_errors_name_the_argument() -> None:
    ids = torch.arange(8).reshape(2, 4)
    with pytest.raises(ValueError, match="attention_mask"):
        StepBatch.from_tensors(ids, [1, 1], attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="prompt_lens"):
        StepBatch.from_tensors(ids, [1])
    with pytest.raises(ValueError, match="seq_lens"):
        StepBatch.from_tensors(ids[:1], [1], seq_lens=[5])
    with pytest.raises(ValueError, match="temperature"):
        StepBatch.padded([[1]], [[2]], temperature=[0.5, 0.5])
    with pytest.raises(ValueError, match="padding_side"):
        StepBatch.padded([[1]], [[2]], padding_side="middle")
    with pytest.raises(TypeError, match="batch"):
        StepBatch.coerce([1, 2, 3])
