"""The grid's region keys (``layers.2.mlp#1``): built and parsed by one grammar in audit.regions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from isoaudit.audit.regions import parse_region_key, region_key

#: Region names as records carry them: any text without the key's separator.
region_names = st.text(min_size=1, max_size=40).filter(lambda name: "#" not in name)


@given(region_names, st.integers(min_value=0, max_value=2**31 - 1))
def test_a_region_key_parses_back_to_its_region_and_call(region: str, forward_index: int) -> None:
    assert parse_region_key(region_key(region, forward_index)) == (region, forward_index)


def test_the_first_call_is_the_bare_region_name() -> None:
    assert region_key("layers.2.mlp", 0) == "layers.2.mlp"
    assert region_key("layers.2.mlp", 1) == "layers.2.mlp#1"
    assert parse_region_key("logits") == ("logits", 0)
