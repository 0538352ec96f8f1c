"""CPR Gated DeltaNet decode under every launch its table may pick: the value columns split over
programs (each repeating the key-side chain), other warps and stages, and the trainer's bits
throughout (prefill/decode splits, packed and one sequence a call)."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels import gdn_decode
from isoaudit.kernels.gdn import gdn_chunk
from isoaudit.kernels.gdn_decode import DECODE_CANDIDATES, DECODE_TABLE, DecodeLaunch, decode_launch

from .conftest import bits_equal, gpu, needs_triton
from .test_gdn import _check_splits, _decode, _inputs

pytestmark = needs_triton


def _only(monkeypatch: pytest.MonkeyPatch, launch: DecodeLaunch) -> None:
    """Every batch size takes ``launch``."""
    monkeypatch.setattr(gdn_decode, "DECODE_TABLE", ((1, launch),))


def test_table_covers_every_batch() -> None:
    """Rows in increasing batch order; a batch past the last row takes the last row's launch."""
    bounds = [most for most, _ in DECODE_TABLE]
    assert bounds == sorted(set(bounds))
    for lo, (most, launch) in zip([0, *bounds], DECODE_TABLE, strict=False):
        assert decode_launch(lo + 1) == decode_launch(most) == launch
    assert decode_launch(bounds[-1] + 1) == DECODE_TABLE[-1][1]
    assert {launch for _, launch in DECODE_TABLE} <= set(DECODE_CANDIDATES)


@pytest.mark.parametrize("bv", [16, 32])
def test_value_blocks_cpu(dev: str, bv: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """dv = 48 in blocks of 16 (three programs per head) and of 32 (the second one partial),
    chunks of two slabs, decode from an empty cache across a boundary and after a prefill that
    left the first slab cached: the trainer's bits, whichever program of a slot arrives last."""
    _only(monkeypatch, DecodeLaunch(bv, 2))
    _check_splits(dev, torch.float32, h=2, dk=16, dv=48, chunk=32, splits=[0, 17], lens=[40, 21])


@gpu
@pytest.mark.parametrize("launch", sorted(set(DECODE_CANDIDATES), key=lambda c: (c.bv, c.warps, c.stages)))
def test_every_launch_same_bits_gpu(launch: DecodeLaunch, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate launch (the table's among them) at the engine's head sizes: decode after
    prefills of 0 and 65 tokens, packed and not, equals the chunk form bit for bit."""
    lens = [140, 67]
    x = _inputs(sum(lens), 4, 128, 128, "cuda", torch.bfloat16)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
    trainer, _ = gdn_chunk(*x, cu, impl="triton")
    _only(monkeypatch, launch)
    for split in (0, 65):
        for packed in (True, False):
            assert bits_equal(_decode(x, lens, split, "cuda", packed, 64), trainer), (split, packed)
