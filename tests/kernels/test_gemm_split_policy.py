"""The GEMM's fixed split-K as part of the kernel configuration: a stated policy over the weight
shape (N, K), never M; its bits stated per choice; each side's manifest and contract state it, and
the contract handshake refuses two sides that run different policies."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from isoaudit.audit.contract import handshake, manifest_fields
from isoaudit.audit.records import Manifest, RuntimeFacts
from isoaudit.kernels import gemm_policy as policy
from isoaudit.kernels.gemm import gemm
from isoaudit.kernels.gemm_policy import (
    DEFAULT_SPLIT,
    NO_SPLIT,
    GemmConfig,
    SplitPolicy,
    gemm_config,
    plan_tiles,
    set_split_policy,
    split_policy_from_env,
)

from .conftest import bits_equal, needs_triton

H200 = (9, 0)
SMS = 132
#: The 0.5B model's projections (hidden 896, MLP 4864) and an 8B-class pair.
WEIGHTS = [(896, 896), (4864, 896), (896, 4864), (1024, 4096), (4096, 4096), (4096, 14336)]


@pytest.fixture
def restore_policy() -> Iterator[None]:
    previous = policy.split_policy()
    yield
    set_split_policy(previous)


def test_the_default_policy_is_stated() -> None:
    """Which weights split, and how: the narrow 0.5B weights with a long K (the 896 x 4864 down
    projection, a 1024 x 4096 one) in four spans of a multiple of 128; nothing else, and nothing
    off the H200's capability."""
    assert DEFAULT_SPLIT.label == "N<=1024,K>=2048,spans=4,align=128,sm_90"
    assert NO_SPLIT.label == "off" and not NO_SPLIT.enabled
    spans = {nk: DEFAULT_SPLIT.span(*nk) for nk in WEIGHTS}
    assert spans == {
        (896, 896): 0,
        (4864, 896): 0,
        (896, 4864): 1280,  # 1216 rounded up to 128: spans of 1280, 1280, 1280, 1024
        (1024, 4096): 1024,
        (4096, 4096): 0,
        (4096, 14336): 0,
    }
    assert DEFAULT_SPLIT.span_on(896, 4864, (9, 0)) == 1280
    assert DEFAULT_SPLIT.span_on(896, 4864, (10, 0)) == 0 and DEFAULT_SPLIT.span_on(896, 4864, None) == 0
    assert all(NO_SPLIT.span(*nk) == 0 for nk in WEIGHTS)


def test_the_split_is_the_weights_alone() -> None:
    """Every M from 1 to 16,384 runs the weight's one span (whether the spans run as programs or
    in turn is the launch's choice, never the sum's)."""
    for n, k in WEIGHTS:
        base = policy._config(n, k, torch.bfloat16, H200, DEFAULT_SPLIT)
        want = DEFAULT_SPLIT.span(n, k)
        assert base.k_split == want
        for m in range(1, 16_385):
            plan = plan_tiles(base, m, n, k, SMS, 2, False)
            assert plan.k_split == want, (n, k, m)
            assert plan.config.k_split == want, (n, k, m)


def test_the_environment_override_is_read_once_and_named() -> None:
    assert split_policy_from_env(None) is DEFAULT_SPLIT and split_policy_from_env("1") is DEFAULT_SPLIT
    assert split_policy_from_env("0") is NO_SPLIT
    with pytest.raises(ValueError, match="ISOAUDIT_GEMM_SPLIT_K='yes'"):
        split_policy_from_env("yes")


def test_setting_the_policy_replans(restore_policy: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The active policy decides every plan made after it is set (the plans of the old one are
    dropped); the environment, read when the kernels were imported, no longer does."""
    import importlib

    gemm_module = importlib.import_module(
        "isoaudit.kernels.gemm"
    )  # the module (the package's ``gemm`` is the function)
    set_split_policy(DEFAULT_SPLIT)
    assert gemm_config(896, 4864, torch.bfloat16, H200).k_split == 1280
    gemm_module._plan(4, 896, 4864, torch.bfloat16, torch.bfloat16, False, torch.device("cpu"), None)
    assert gemm_module._plan.cache_info().currsize > 0
    monkeypatch.setenv("ISOAUDIT_GEMM_SPLIT_K", "0")  # not read again: the manifest states what runs
    assert gemm_config(896, 4864, torch.bfloat16, H200).k_split == 1280
    assert set_split_policy(NO_SPLIT) is DEFAULT_SPLIT
    assert gemm_module._plan.cache_info().currsize == 0
    assert gemm_config(896, 4864, torch.bfloat16, H200).k_split == 0
    narrow = SplitPolicy(max_n=2048, min_k=896, spans=2)
    set_split_policy(narrow)
    assert gemm_config(896, 896, torch.bfloat16, H200).k_split == 512


def _staircase(k: int, n: int, slab: int, sums: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A row of ones and a weight whose every column's BLOCK_K slab ``i`` holds ``sums[i]`` in one
    element: every slab's dot is exact, so only the order of the adds across slabs sets the bits."""
    x = torch.ones(1, k)
    w = torch.zeros(n, k)
    for i, value in enumerate(sums):
        w[:, i * slab] = value
    return x, w


@needs_triton
@pytest.mark.parametrize("rows", [1, 40])
def test_the_bits_of_each_split_choice(rows: int) -> None:
    """The arithmetic each choice defines, to the bit (fp32 under the interpreter; the bf16 kernel
    on the GPU sums in the same order): slab sums 2^24, 1, 1, 1 in BLOCK_K = 16 slabs.

    * no split: ((((0 + 2^24) + 1) + 1) + 1) = 2^24, each +1 a tie rounded to even;
    * spans of two slabs: (0 + ((0 + 2^24) + 1)) + ((0 + 1) + 1) = 2^24 + 2.

    One row runs the spans as programs (the split grid), 40 rows sum them in turn: the same bits."""
    slab, k, n = 16, 64, 32
    x, w = _staircase(k, n, slab, [2.0**24, 1.0, 1.0, 1.0])
    x = x.expand(rows, k).contiguous()
    plain = GemmConfig(32, 32, slab, 4, 2)
    split = GemmConfig(32, 32, slab, 4, 2, k_split=2 * slab)
    got_plain = gemm(x, w, impl="triton", config=plain)
    got_split = gemm(x, w, impl="triton", config=split)
    assert (got_plain == 2.0**24).all() and (got_split == 2.0**24 + 2).all()
    # the same orders in numpy float32, as the docstrings state them
    f = np.float32
    assert f(f(f(f(f(0) + f(2**24)) + f(1)) + f(1)) + f(1)) == f(2**24)
    assert f(f(0) + f(f(f(0) + f(2**24)) + f(1))) + f(f(f(0) + f(1)) + f(1)) == f(2**24 + 2)
    plan = plan_tiles(split, rows, n, k, 2, 4, True)
    assert plan.split_grid == (rows == 1)


@needs_triton
def test_batch_invariant_under_the_policy(restore_policy: None) -> None:
    """A policy's split, run by the kernel (fp32, interpreter) at every M around the switch between
    spans as programs and spans in turn: each row's bits are its own."""
    torch.manual_seed(0)
    small = SplitPolicy(max_n=64, min_k=128, spans=3, align=16)
    n, k = 32, 200
    span = small.span(n, k)
    assert span == 80  # ceil(200 / 3) = 67, rounded up to 16
    cfg = GemmConfig(32, 32, 16, 4, 2, k_split=span)
    a, w, b = torch.randn(70, k), torch.randn(n, k), torch.randn(n)
    full = gemm(a, w, b, impl="triton", config=cfg)
    for m in (1, 2, 3, 8, 9, 33, 69):
        assert bits_equal(gemm(a[:m], w, b, impl="triton", config=cfg), full[:m]), m
    # up to 200 / (8 x 3) rows the spans run as programs, from 9 in turn
    assert (
        plan_tiles(cfg, 8, n, k, 2, 4, True).split_grid
        and not plan_tiles(cfg, 9, n, k, 2, 4, True).split_grid
    )


# ----------------------------------------------------------------------------- manifests and contract


def _manifest(side: str, split: str | None, contract=None) -> Manifest:
    from isoaudit.audit.contract import ModelSpec
    from isoaudit.collectors.policy import build_contract, exact_ops, kernel_ops

    if contract is None:
        spec = ModelSpec(
            family="llama", name="tiny", num_layers=1, hidden_size=8, vocab_size=16, dtype="bfloat16"
        )
        ops = {**exact_ops(), **kernel_ops("cpu"), "rotary": "torch.rope_hf@1"}
        contract = build_contract(spec, ops, qk_norm=False)
    extra = {} if split is None else {"gemm_split": split, "gemm_split_k": split != "off"}
    return Manifest(
        run_id="r",
        side=side,
        case="trainer_fwd" if side == "trainer" else "engine_decode",
        runtime=RuntimeFacts(remediation="invariant", **extra),
        **manifest_fields(contract),
    )


def test_the_handshake_refuses_two_split_policies() -> None:
    on, off = DEFAULT_SPLIT.label, NO_SPLIT.label
    assert handshake(_manifest("trainer", on), _manifest("rollout", on)).ok
    result = handshake(_manifest("trainer", on), _manifest("rollout", off))
    assert not result.ok and result.differing_fields == ["runtime.gemm_split"]
    assert result.reasons[0].startswith(
        "runtime.gemm_split: trainer 'N<=1024,K>=2048,spans=4,align=128,sm_90' != engine 'off': "
        "the invariant GEMM's fixed split-K policy"
    )
    # a side that does not state it (its kernels are off) is not judged on it here
    assert handshake(_manifest("trainer", on), _manifest("rollout", None)).ok


def test_the_contract_names_the_split(restore_policy: None) -> None:
    """The GPU GEMM's implementation version names the policy, so two sides under different
    policies have different numerical-policy identities, and the handshake names the fields."""
    from isoaudit.audit.contract import ModelSpec
    from isoaudit.collectors.policy import build_contract, exact_ops, kernel_ops

    spec = ModelSpec(
        family="llama", name="tiny", num_layers=1, hidden_size=8, vocab_size=16, dtype="bfloat16"
    )

    def contract():
        ops = {**exact_ops(), **kernel_ops("cuda"), "rotary": "torch.rope_hf@1"}
        assert ops["linear"].version.endswith(f".split[{policy.split_policy().label}]")
        return build_contract(spec, ops, qk_norm=False, arch="sm_90")

    set_split_policy(DEFAULT_SPLIT)
    split = contract()
    set_split_policy(NO_SPLIT)
    plain = contract()
    result = handshake(
        _manifest("trainer", DEFAULT_SPLIT.label, split), _manifest("rollout", NO_SPLIT.label, plain)
    )
    assert not result.ok and result.differing_fields[0] == "runtime.gemm_split"
    assert "composition.layers.0.mlp.trainer_fwd.implementation" in result.differing_fields
    assert "composition.logits.engine_decode.implementation" in result.differing_fields
