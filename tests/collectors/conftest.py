"""Tiny models made once per session (random weights, local tokenizer) and loaded fresh per test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model

NUM_LAYERS = 2


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        family: make_tiny_model(family, root / family, num_layers=NUM_LAYERS, hidden=64, vocab=512, seed=7)
        for family in ("qwen3", "llama")
    }


@pytest.fixture
def load(tiny_dirs: dict[str, Path]) -> Callable[[str], torch.nn.Module]:
    def loader(family: str) -> torch.nn.Module:
        model, _ = load_tiny_model(tiny_dirs[family])
        return model

    return loader


def random_samples(n: int, seed: int = 0, vocab: int = 512) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` prompts and completions of varied lengths (so padding and packing both matter)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(2, 9))).tolist() for _ in range(n)]
    completions = [rng.integers(0, vocab, int(rng.integers(1, 11))).tolist() for _ in range(n)]
    return prompts, completions
