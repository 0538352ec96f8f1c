"""The tiny-model maker: standard configs, seeded random weights, a local tokenizer, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from isoaudit.collectors.tiny_models import make_tiny_model, tiny_config
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer


def test_made_dirs_load_with_transformers(tiny_dirs: dict[str, Path], load) -> None:
    for family, path in tiny_dirs.items():
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == family and config["tie_word_embeddings"] is False
        assert config["max_position_embeddings"] >= 512 and config["vocab_size"] == 512
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = tokenizer("The trainer and the engine disagree at position 7.")["input_ids"]
        assert max(ids) < config["vocab_size"]
        assert tokenizer.decode(ids) == "The trainer and the engine disagree at position 7."
        assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
        model = load(family)
        assert type(model).__name__.lower().startswith(family)


def test_seeded_bfloat16_weights(tmp_path: Path) -> None:
    a = make_tiny_model("llama", tmp_path / "a", seed=3, dtype="bfloat16")
    b = make_tiny_model("llama", tmp_path / "b", seed=3, dtype="bfloat16")
    c = make_tiny_model("llama", tmp_path / "c", seed=4, dtype="bfloat16")
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(t.dtype == torch.bfloat16 for t in wa.values())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    assert AutoConfig.from_pretrained(a).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"family": "gpt2"}, "family"),
        ({"num_layers": 0}, "num_layers"),
        ({"hidden": 66}, "hidden"),
        ({"max_positions": 256}, "max_positions"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        tiny_config(**kwargs)
