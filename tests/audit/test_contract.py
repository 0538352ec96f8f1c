"""isoaudit.audit.contract: identities, validation, file round trip and the handshake."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from isoaudit.audit.contract import (
    CompositionEntry,
    Constant,
    Contract,
    ContractError,
    Deployment,
    Implementation,
    ModelSpec,
    StateInvalidationClaim,
    ToleranceClaim,
    TopologyClaim,
    canonical_json,
    constant,
    contract_bytes,
    dump_contract,
    handshake,
    identities,
    load_contract,
    manifest_fields,
    numerical_policy_fields,
    parse_contract,
    policy_identity,
    validate,
)
from isoaudit.audit.records import Manifest
from isoaudit.audit.regions import canonical_regions

FIXTURE = Path(__file__).parent / "contracts" / "tiny_qwen3.json"
CASES = ["trainer_fwd", "trainer_recompute", "engine_prefill", "engine_decode"]


def build_tiny_qwen3() -> Contract:
    """The fixture, built in code: a 2-layer Qwen3 routed through the invariant kernels."""
    eps = {"eps": constant(1e-6, "float32")}
    entries = []
    for region in canonical_regions(2):
        for case in CASES:
            engine = case.startswith("engine")
            route, fused_into, consts = "invariant", None, {}
            if region == "embed":
                impl, route = Implementation(id="kernels.embedding.gather", version="0.1.0"), "reference"
            elif region.endswith("norm"):
                impl, consts = Implementation(id="kernels.rmsnorm.invariant", version="0.1.0"), eps
            elif region.endswith("attn"):
                impl = Implementation(id="kernels.attention.invariant", version="0.1.0")
                consts = {"softmax_scale": constant(0.25, "float32"), "rope_theta": constant(1e6, "float32")}
            elif region.endswith("mlp"):
                impl = Implementation(id="kernels.gemm.batch_invariant", version="0.1.0")
            elif region.endswith("out") and engine:
                # vLLM adds the residual inside the next norm
                layer = int(region.split(".")[1])
                fused_into = "layers.1.input_norm" if layer == 0 else "final_norm"
                impl, route = Implementation(id="kernels.rmsnorm.invariant", version="0.1.0"), "fused"
            elif region.endswith("out"):
                impl, route = Implementation(id="kernels.residual.add", version="0.1.0"), "reference"
            else:  # logits
                impl = Implementation(id="kernels.logprobs.fp32_lm_head", version="0.1.0")
            entries.append(
                CompositionEntry(
                    region=region,
                    case=case,
                    implementation=impl,
                    arch="any" if route != "native" else "sm_90",
                    route=route,
                    fused_into=fused_into,
                    constants=consts,
                )
            )
    return Contract(
        model=ModelSpec(
            family="qwen3", name="tiny-qwen3", num_layers=2, hidden_size=64, vocab_size=256, dtype="bfloat16"
        ),
        cases=CASES,
        composition=entries,
        claims=[
            TopologyClaim(
                regions=["*"],
                mode="invariant",
                domain={"batch_size": {"min": 1, "max": 4096}, "num_tokens": {"min": 1, "max": 32768}},
            ),
            StateInvalidationClaim(state="prefix_cache", on="weight_sync"),
            ToleranceClaim(
                regions=["logits"],
                cases=["engine_decode"],
                min_agreeing_bits=23,
                reason="fp32 log_softmax: exact by construction; admitted at full fp32 mantissa",
            ),
        ],
        deployment=Deployment(
            name="tiny-qwen3 CI",
            description="the contract of the unit tests",
            hosts=["ci-runner"],
            labels={"team": "isoaudit"},
        ),
    )


def with_changes(contract: Contract, **changes) -> Contract:
    return Contract.model_validate({**contract.model_dump(mode="json"), **changes})


def test_fixture_is_valid_and_round_trips_byte_for_byte(tmp_path: Path) -> None:
    built = build_tiny_qwen3()
    assert validate(built) == []
    assert FIXTURE.read_bytes() == contract_bytes(built), "fixture is stale: rewrite it with dump_contract"
    loaded = load_contract(FIXTURE)
    assert loaded == built
    out = tmp_path / "again.json"
    dump_contract(loaded, out)
    assert out.read_bytes() == FIXTURE.read_bytes()
    # a user-ordered file keeps its order through load and dump
    shuffled = with_changes(
        built,
        composition=random.Random(0).sample(
            built.model_dump(mode="json")["composition"], k=len(built.composition)
        ),
    )
    dump_contract(shuffled, out)
    first = out.read_bytes()
    dump_contract(load_contract(out), out)
    assert out.read_bytes() == first


def test_identities_ignore_order_and_deployment() -> None:
    base = build_tiny_qwen3()
    ids = identities(base)
    assert all(len(v) == 64 for v in (ids.semantic, ids.numerical_policy, ids.deployment))
    data = base.model_dump(mode="json")
    rng = random.Random(1)
    reordered = with_changes(
        base,
        composition=rng.sample(data["composition"], k=len(data["composition"])),
        claims=list(reversed(data["claims"])),
        cases=list(reversed(data["cases"])),
    )
    assert identities(reordered) == ids
    moved = with_changes(
        base,
        deployment={
            "name": "prod",
            "description": "other cluster",
            "hosts": ["a", "b"],
            "labels": {},
            "notes": "moved",
        },
    )
    moved_ids = identities(moved)
    assert moved_ids.numerical_policy == ids.numerical_policy and moved_ids.semantic == ids.semantic
    assert moved_ids.deployment != ids.deployment


def flip_constant_bit(contract: Contract, entry_index: int, name: str, bit: int) -> Contract:
    data = contract.model_dump(mode="json")
    c = data["composition"][entry_index]["constants"][name]
    c["bits"] = f"0x{int(c['bits'], 16) ^ (1 << bit):0{len(c['bits']) - 2}x}"
    return Contract.model_validate(data)


def test_one_bit_of_one_constant_rotates_the_policy() -> None:
    base = build_tiny_qwen3()
    ids = identities(base)
    index = next(i for i, e in enumerate(base.composition) if "eps" in e.constants)
    for bit in (0, 22, 31):
        flipped = flip_constant_bit(base, index, "eps", bit)
        assert validate(flipped) == []
        new = identities(flipped)
        assert new.numerical_policy != ids.numerical_policy
        assert new.semantic != ids.semantic and new.deployment != ids.deployment
    # an implementation change is numerical, not semantic
    data = base.model_dump(mode="json")
    data["composition"][5]["implementation"]["version"] = "0.1.1"
    bumped = identities(Contract.model_validate(data))
    assert bumped.semantic == ids.semantic and bumped.numerical_policy != ids.numerical_policy


def test_policy_identity_is_the_hash_of_the_fields() -> None:
    base = build_tiny_qwen3()
    fields = numerical_policy_fields(base)
    assert policy_identity(fields) == identities(base).numerical_policy
    assert fields["composition.layers.0.input_norm.engine_decode.constants.eps"] == "float32:0x358637bd"
    assert fields["composition.layers.0.out.engine_decode.fused_into"] == "layers.1.input_norm"
    assert fields["claims.state_invalidation.prefix_cache"] == ["weight_sync"]
    assert fields["claims.topology.logits.trainer_fwd"] == [
        "invariant:batch_size=1..4096,num_tokens=1..32768"
    ]
    assert (
        "claims.tolerance.logits.engine_decode" in fields
        and "claims.tolerance.logits.trainer_fwd" not in fields
    )
    json.dumps(fields)  # JSON-ready for Manifest.numerical_policy


def test_constants_are_bits() -> None:
    assert constant(1.0, "float32") == Constant(dtype="float32", bits="0x3f800000")
    assert constant(1.0, "bfloat16").bits == "0x3f80"
    assert constant(1e-6, "float32").value() == np.float32(1e-6)
    assert constant(-2.5, "float16").value() == np.float16(-2.5)
    assert constant(7, "int32").bits == "0x00000007" and constant(-1, "int64").bits == "0xffffffffffffffff"
    assert constant(True, "bool").value()
    assert float(constant(1.00390625, "bfloat16").value()) == 1.0  # ties to even
    with pytest.raises(ValueError, match="decimal float"):
        canonical_json({"a": [1, {"b": 0.5}]})
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()


def test_validate_names_every_problem() -> None:
    base = build_tiny_qwen3()
    data = base.model_dump(mode="json")
    dropped = data["composition"].pop(0)  # (embed, trainer_fwd) no longer covered
    data["composition"].append(dict(data["composition"][3]))  # a duplicate
    data["composition"][1]["constants"]["eps"] = 1e-6  # decimal float
    data["composition"][2]["constants"]["k"] = 3  # bare int
    data["composition"][4]["constants"]["eps"] = {"dtype": "float32", "bits": "0x3f80"}  # wrong width
    data["composition"][6]["region"] = "layers.7.attn"  # not in a 2-layer model
    problems = validate(Contract.model_validate(data))
    text = "\n".join(problems)
    assert f"composition: (embed, {dropped['case']}) is not covered" in text
    assert "covered 2 times" in text
    assert "composition[1].constants.eps: decimal float 1e-06" in text and "0x358637bd" in text
    assert "composition[2].constants.k: bare number 3" in text
    assert "composition[4].constants.eps.bits" in text
    assert "composition[6].region: 'layers.7.attn' is not a canonical region" in text
    assert all(": " in p for p in problems)


def test_route_requirements() -> None:
    base = build_tiny_qwen3()
    data = base.model_dump(mode="json")
    data["claims"] = [c for c in data["claims"] if c["kind"] != "topology"]
    data["composition"][0].update(
        route="native", arch="any", implementation={"id": "torch.embedding", "version": "2.6"}
    )
    data["composition"][1].update(
        route="reference", implementation={"id": "torch.embedding", "version": "2.6"}
    )
    fused = next(i for i, e in enumerate(data["composition"]) if e["route"] == "fused")
    data["composition"][fused]["fused_into"] = "layers.0.mlp"  # host has another implementation
    problems = "\n".join(validate(Contract.model_validate(data)))
    assert "composition[0].arch: a 'native' kernel" in problems
    assert "composition[0].route: 'native' needs a pinned topology claim or an admitted tolerance" in problems
    assert "composition[1].implementation.id: route 'reference' needs a kernel of the registry" in problems
    assert "route: 'invariant' needs a topology claim" in problems
    assert (
        f"composition[{fused}].implementation: a fused region carries its host's implementation" in problems
    )
    # a native kernel on a named arch under a pinned topology is fine
    ok = base.model_dump(mode="json")
    ok["composition"][0].update(
        route="native", arch="sm_90", implementation={"id": "torch.embedding", "version": "2.6"}
    )
    ok["claims"].append(
        {
            "kind": "topology",
            "regions": ["embed"],
            "mode": "pinned",
            "domain": {"tp_size": {"min": 1, "max": 1}},
        }
    )
    assert validate(Contract.model_validate(ok)) == []
    bad_claim = base.model_dump(mode="json")
    bad_claim["claims"].append(
        {
            "kind": "topology",
            "regions": ["layers.*.moe"],
            "mode": "pinned",
            "domain": {"tp_size": {"min": 1, "max": 2}},
        }
    )
    problems = "\n".join(validate(Contract.model_validate(bad_claim)))
    assert "claims[3].regions[0]: 'layers.*.moe' matches no canonical region" in problems
    assert "claims[3].domain.tp_size: a pinned axis holds one value" in problems


def test_load_contract_raises_naming_the_field(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text())
    data["composition"][3]["constants"] = {"eps": 1e-5}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ContractError) as err:
        load_contract(path)
    assert err.value.field == "composition[3].constants.eps"
    data = json.loads(FIXTURE.read_text())
    data["model"]["num_layers"] = "two"
    path.write_text(json.dumps(data))
    with pytest.raises(ContractError) as err:
        load_contract(path)
    assert err.value.field == "model.num_layers"
    data = json.loads(FIXTURE.read_text())
    data["composition"][0]["route"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(ContractError, match=r"composition\[0\]\.route"):
        load_contract(path)
    with pytest.raises(ContractError, match="<json>: line 1"):
        parse_contract(b"{")
    with pytest.raises(ContractError, match="model: key repeated"):
        parse_contract(b'{"model": {}, "model": {}}')


def manifest(side: str, case: str, contract: Contract, **extra) -> Manifest:
    return Manifest(run_id="run-1", side=side, case=case, **manifest_fields(contract), **extra)


def test_handshake_accepts_one_policy_and_refuses_with_reasons() -> None:
    base = build_tiny_qwen3()
    result = handshake(manifest("trainer", "trainer_fwd", base), manifest("rollout", "engine_decode", base))
    assert result.ok and result.reasons == []
    # deployment may differ
    moved = with_changes(
        base, deployment={"name": "elsewhere", "description": "", "hosts": [], "labels": {}, "notes": ""}
    )
    assert handshake(manifest("trainer", "trainer_fwd", base), manifest("rollout", "engine_decode", moved)).ok
    # one bit of eps on the engine side
    index = next(
        i for i, e in enumerate(base.composition) if "eps" in e.constants and e.case == "engine_decode"
    )
    flipped = flip_constant_bit(base, index, "eps", 0)
    result = handshake(
        manifest("trainer", "trainer_fwd", base), manifest("rollout", "engine_decode", flipped)
    )
    assert not result.ok
    field = f"composition.{base.composition[index].region}.engine_decode.constants.eps"
    assert result.differing_fields == [field]
    assert any(
        r.startswith(f"numerical_policy.{field}: trainer 'float32:0x358637bd' != engine 'float32:0x358637bc'")
        for r in result.reasons
    )
    assert any(r.startswith("contract.semantic") for r in result.reasons)


def test_handshake_refuses_missing_tampered_and_misplaced_manifests() -> None:
    base = build_tiny_qwen3()
    good = manifest("rollout", "engine_decode", base)
    bare = Manifest(run_id="run-1", side="trainer", case="trainer_fwd")
    result = handshake(bare, good)
    assert (
        not result.ok
        and "trainer.contract.numerical_policy: missing (no contract declared)" in result.reasons
    )
    fields = dict(numerical_policy_fields(base))
    fields["model.dtype"] = "float16"
    tampered = Manifest(
        run_id="run-1", side="trainer", case="trainer_fwd", contract=identities(base), numerical_policy=fields
    )
    result = handshake(tampered, good)
    assert not result.ok and any(
        r.startswith("trainer.numerical_policy: fields do not hash") for r in result.reasons
    )
    no_fields = Manifest(
        run_id="run-1",
        side="trainer",
        case="trainer_fwd",
        contract=identities(build_tiny_qwen3().model_copy(update={"cases": ["trainer_fwd"]})),
    )
    result = handshake(no_fields, good)
    assert not result.ok and any("trainer carries no numerical_policy fields" in r for r in result.reasons)
    assert result.differing_fields == []
    result = handshake(good, manifest("trainer", "trainer_fwd", base))
    assert any(r.startswith("trainer.side") for r in result.reasons)
    assert any(r.startswith("engine.side") for r in result.reasons)
    only_engine = with_changes(
        base,
        cases=["engine_prefill", "engine_decode"],
        composition=[
            e for e in base.model_dump(mode="json")["composition"] if e["case"].startswith("engine")
        ],
    )
    result = handshake(
        manifest("trainer", "trainer_fwd", only_engine), manifest("rollout", "engine_decode", only_engine)
    )
    assert (
        "trainer.case: 'trainer_fwd' is not among the contract's cases ['engine_decode', 'engine_prefill']"
        in result.reasons
    )
    # survives the wire
    wired = Manifest.model_validate_json(good.model_dump_json())
    assert handshake(
        Manifest.model_validate_json(manifest("trainer", "trainer_fwd", base).model_dump_json()), wired
    ).ok


def test_canonical_regions_in_forward_order() -> None:
    from isoaudit.audit.regions import is_canonical, region_order

    regions = canonical_regions(2)
    assert regions[:3] == ["embed", "layers.0.input_norm", "layers.0.attn"]
    assert regions[-3:] == ["layers.1.out", "final_norm", "logits"] and len(regions) == 13
    shuffled = random.Random(2).sample(regions, k=len(regions))
    assert sorted(shuffled, key=region_order) == regions
    assert region_order("layers.10.attn") > region_order("layers.9.out")
    assert region_order("layers.1.moe") > region_order("layers.1.out")  # unknown names still sort
    assert region_order("something") > region_order("logits")
    assert is_canonical("layers.1.mlp", 2) and not is_canonical("layers.2.mlp", 2)
    assert not is_canonical("layers.1.moe") and not is_canonical("layers.01.mlp")
