"""The diagnosis cases on the real vLLM engine (CPU build, in this process) against the HF
trainer, both attached through ``isoaudit.session``: each failure users hit is named correctly,
and the clean control is never a false alarm.

One engine for the module (bf16, eager, processed logprobs, prefix caching on). Every case draws
prompts of its own (no accidental prefix-cache hit between cases) and sets the weights it needs on
both sides first, so the cases do not depend on their order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import isoaudit.collectors.vllm as cv  # noqa: E402
from isoaudit.audit.compare import compare_samples  # noqa: E402
from isoaudit.audit.records import Run, off_policy_of  # noqa: E402
from isoaudit.collectors.layout import StepBatch  # noqa: E402
from isoaudit.collectors.sessions import MemoryDestination  # noqa: E402

import isoaudit  # noqa: E402
from tests.vllm.conftest import by_key, engine, generate, perturbed_weights, prompts_of  # noqa: E402

pytestmark = pytest.mark.vllm

#: Prompts longer than one KV block (the CPU backend's block size is read from the engine).
PROMPT_LEN = 70
SAMPLES = 3
TEMPERATURE = 0.7


@dataclass
class Engine:
    llm: Any
    path: Path
    base: dict[str, torch.Tensor]  # the checkpoint: "version 0"
    next: dict[str, torch.Tensor]  # the trainer's next weights: "version 1"
    trainer: Any  # the HF model the trainer side scores with


@pytest.fixture(scope="module")
def eng(tiny_qwen3: Path) -> Iterator[Engine]:
    from isoaudit.collectors.tiny_models import load_tiny_model
    from safetensors.torch import load_file

    with engine(tiny_qwen3, enable_prefix_caching=True, block_size=32) as llm:
        model, _ = load_tiny_model(tiny_qwen3, dtype=torch.bfloat16)
        base = load_file(str(tiny_qwen3 / "model.safetensors"))
        yield Engine(llm, tiny_qwen3, base, perturbed_weights(tiny_qwen3), model)


@dataclass
class Case:
    destination: MemoryDestination
    run: Run

    def records(self, side: str, kind: str, step: int) -> dict[str, list[Any]]:
        return by_key(self.destination.sinks[side], kind, step)

    def diagnoses(self, step: int = 0, rollout_step: int | None = None) -> list[Any]:
        """The diagnosis of every sample of ``step`` on both sides (the worker's comparison); the
        rollout's records of ``rollout_step`` when the trainer scored the same samples twice."""
        rs = step if rollout_step is None else rollout_step
        t, r = self.records("trainer", "sample", step), self.records("rollout", "sample", rs)
        tp, rp = self.records("trainer", "fingerprints", step), self.records("rollout", "fingerprints", rs)
        keys = sorted(t.keys() & r.keys())
        assert len(keys) == SAMPLES, f"{len(keys)} samples paired of {SAMPLES}"
        found = compare_samples(
            [(t[k][0], r[k][0]) for k in keys],
            {k: (tp.get(k, []), rp.get(k, [])) for k in keys},
            (
                self.destination.sinks["trainer"].of_kind("manifest"),
                self.destination.sinks["rollout"].of_kind("manifest"),
            ),
            policy=off_policy_of(self.run.config),
        )
        return [c.diagnosis for c in found]

    def rollout_samples(self, step: int) -> list[Any]:
        return [v[0] for v in self.records("rollout", "sample", step).values()]


@contextmanager
def sides(
    eng: Engine, name: str, *, config: Mapping[str, Any] | None = None
) -> Iterator[tuple[Any, Any, Case]]:
    """A session with both sides attached: (vLLM handle, trainer handle, the case's records)."""
    run = Run(run_id=f"diag-{name}", name=name, config=dict(config or {}))
    destination = MemoryDestination()
    audit = isoaudit.session(run, destination=destination, strict=True, report=False)
    with audit:
        rollout = audit.watch_vllm(eng.llm, fingerprint="all")
        trainer = audit.watch_trainer(eng.trainer, async_transfer=False)
        yield rollout, trainer, Case(destination, run)


def set_weights(
    eng: Engine, rollout: Any, trainer: Any, *, engine_w: dict, engine_v: str, trainer_w: dict, trainer_v: str
) -> None:
    """Load ``engine_w`` into the engine as ``engine_v`` and ``trainer_w`` into the trainer as ``trainer_v``."""
    cv.load_weights(eng.llm, engine_w, engine_v)
    eng.trainer.load_state_dict(trainer_w)
    trainer.weights_changed(trainer_v)


def rollout_step(eng: Engine, rollout: Any, step: int, prompts: list[list[int]], **params: Any) -> list[Any]:
    outputs = generate(eng.llm, prompts, temperature=params.pop("temperature", TEMPERATURE), **params)
    rollout.record_step(step, outputs)
    return outputs


def trainer_step(
    trainer: Any, step: int, outputs: list[Any], *, temperature: float = TEMPERATURE, **applied: Any
) -> None:
    prompts = [list(o.prompt_token_ids) for o in outputs]
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    trainer.record_step(step, StepBatch.padded(prompts, completions, temperature=temperature), **applied)


def kinds(diagnoses: list[Any]) -> list[str]:
    return [d.kind for d in diagnoses]


def fresh(seed: int) -> list[list[int]]:
    return prompts_of([PROMPT_LEN] * SAMPLES, seed=1000 + seed)


# ---------------------------------------------------------------- the control


def test_clean_control_is_numerical_or_clean(eng: Engine) -> None:
    with sides(eng, "control") as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.base, trainer_v="0")
        outputs = rollout_step(eng, rollout, 0, fresh(0))
        trainer_step(trainer, 0, outputs)
    found = case.diagnoses()
    assert set(kinds(found)) <= {"numerical", "clean"}, [d.sentence for d in found]
    # both sides digested the same weights under the trainer's names (fused qkv/gate_up split)
    [tm] = case.destination.sinks["trainer"].of_kind("manifest")[-1:]
    [rm] = case.destination.sinks["rollout"].of_kind("manifest")[-1:]
    names = set(tm.weight_tensor_digests) & set(rm.weight_tensor_digests)
    assert "model.layers.1.self_attn.k_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert names == set(tm.weight_tensor_digests)
    assert all(tm.weight_tensor_digests[n] == rm.weight_tensor_digests[n] for n in names)


# ---------------------------------------------------------------- sampling semantics


def test_topk_engine_against_a_temperature_only_trainer_names_top_k(eng: Engine) -> None:
    with sides(eng, "topk") as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.base, trainer_v="0")
        outputs = rollout_step(eng, rollout, 0, fresh(1), top_k=20)
        trainer_step(trainer, 0, outputs)  # temperature only
        trainer_step(trainer, 1, outputs, top_k=20)  # what the engine applied
    found = case.diagnoses(0)
    assert kinds(found) == ["semantics"] * SAMPLES, [d.sentence for d in found]
    assert all(d.evidence["cause"] == "truncation_mismatch" for d in found)
    assert all(list(d.evidence["parameters"]) == ["top_k"] for d in found)
    # a trainer applying exactly what the engine applied measures the same distribution
    matched = case.diagnoses(1, rollout_step=0)
    assert set(kinds(matched)) <= {"numerical", "clean"}, [d.sentence for d in matched]
    manifests = case.destination.sinks["trainer"].of_kind("manifest")
    assert {m.runtime.model_extra.get("logprobs_applied") for m in manifests} >= {
        "temperature",
        "temperature,top_k",
    }


def test_trainer_applies_what_the_engine_applies(eng: Engine) -> None:
    """min-p, top-k and top-p together, renormalised over the kept set: the two sides' processed
    logprobs then agree to kernel noise (a temperature-only trainer is off by far more)."""
    params = {"top_k": 40, "top_p": 0.8, "min_p": 0.02}
    with sides(eng, "truncation") as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.base, trainer_v="0")
        outputs = rollout_step(eng, rollout, 0, fresh(2), **params)
        trainer_step(trainer, 0, outputs, **params)
    samples = case.rollout_samples(0)
    assert all(
        s.min_p == pytest.approx(0.02) and s.top_k == 40 and s.top_p == pytest.approx(0.8) for s in samples
    )
    t = case.records("trainer", "sample", 0)
    assert all(v[0].top_k == 40 and v[0].min_p == pytest.approx(0.02) for v in t.values())
    found = case.diagnoses(0)
    assert set(kinds(found)) <= {"numerical", "clean"}, [d.sentence for d in found]


# ---------------------------------------------------------------- weights


def test_stale_weights_with_versions_that_differ(eng: Engine) -> None:
    with sides(eng, "stale-versions") as (rollout, trainer, case):
        set_weights(
            eng,
            rollout,
            trainer,
            engine_w=eng.base,
            engine_v="sync-a",
            trainer_w=eng.next,
            trainer_v="sync-b",
        )
        outputs = rollout_step(eng, rollout, 0, fresh(3))
        trainer_step(trainer, 0, outputs)
    found = case.diagnoses()
    assert kinds(found) == ["weights"] * SAMPLES, [d.sentence for d in found]
    assert all(d.evidence["cause"] == "version_mismatch" for d in found)


def test_stale_weights_with_versions_that_agree_name_the_tensor(eng: Engine) -> None:
    """The sync sent one stale tensor (layer 1's k_proj, which vLLM holds inside the fused qkv_proj):
    both sides claim version 1, their held digests differ in exactly that tensor."""
    stale = "model.layers.1.self_attn.k_proj.weight"
    sent = {**eng.next, stale: eng.base[stale]}
    with sides(eng, "stale-agree") as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=sent, engine_v="1", trainer_w=eng.next, trainer_v="1")
        outputs = rollout_step(eng, rollout, 0, fresh(4))
        trainer_step(trainer, 0, outputs)
    found = case.diagnoses()
    assert kinds(found) == ["weights"] * SAMPLES, [d.sentence for d in found]
    assert all(d.evidence["cause"] == "held_weights_differ" for d in found)
    assert all(d.evidence["differing_tensors"] == [stale] for d in found)
    assert stale in found[0].sentence


def test_a_version_bump_without_a_sync_names_every_tensor(eng: Engine) -> None:
    """The job says "version 1" to the engine (its own broadcast failed): nothing was loaded."""
    with sides(eng, "no-sync") as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.next, trainer_v="1")
        rollout.weights_changed("1")  # claimed, never loaded
        outputs = rollout_step(eng, rollout, 0, fresh(5))
        trainer_step(trainer, 0, outputs)
    found = case.diagnoses()
    assert kinds(found) == ["weights"] * SAMPLES
    differing = set(found[0].evidence["differing_tensors"])
    assert {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    } <= differing


# ---------------------------------------------------------------- off-policy


@pytest.mark.parametrize(
    ("config", "expected", "cause"),
    [
        ({"off_policy": {"max_staleness": 1}}, "off_policy", "declared_lag"),
        ({}, "weights", "undeclared_lag"),
    ],
    ids=["declared", "undeclared"],
)
def test_one_step_off_policy(eng: Engine, config: dict, expected: str, cause: str) -> None:
    """The rollout samples with version 0 while the trainer already scores with version 1."""
    with sides(eng, f"off-policy-{expected}", config=config) as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.next, trainer_v="1")
        outputs = rollout_step(eng, rollout, 0, fresh(6 if config else 7))
        trainer_step(trainer, 0, outputs)
    found = case.diagnoses()
    assert kinds(found) == [expected] * SAMPLES, [d.sentence for d in found]
    assert all(d.evidence["cause"] == cause and d.evidence["policy_lag_max"] == 1 for d in found)


# ---------------------------------------------------------------- engine state after a sync


def test_prefix_cache_across_a_weight_update(eng: Engine) -> None:
    prompts = fresh(8)
    with sides(eng, "prefix") as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.next, trainer_v="1")
        rollout_step(eng, rollout, 0, prompts)  # fills the prefix cache under version 0
        cv.load_weights(eng.llm, eng.next, "1")  # in place: the prefix cache is kept
        outputs = rollout_step(eng, rollout, 1, prompts, seed=100)
        trainer_step(trainer, 1, outputs)
        eng.llm.reset_prefix_cache()  # the fix
        rollout_step(eng, rollout, 2, prompts, seed=200)  # computes the prompts again under version 1
        outputs = rollout_step(eng, rollout, 3, prompts, seed=300)  # hits blocks of version 1
        trainer_step(trainer, 3, outputs)
    stale = [s.path["prefix_cache_stale_tokens"] for s in case.rollout_samples(1)]
    assert all(n >= 32 and n % 32 == 0 for n in stale), stale
    assert {s.path["prefix_cache_weight_version"] for s in case.rollout_samples(1)} == {"0"}
    found = case.diagnoses(1)
    assert kinds(found) == ["inference_path"] * SAMPLES, [d.sentence for d in found]
    assert all(d.evidence["cause"] == "prefix_cache_crossed_weight_update" for d in found)
    assert "crossed a weight update" in found[0].sentence
    # hits on blocks of the current version are prefix caching in general, not a stale cache
    assert all(
        s.path["prefix_cache_stale_tokens"] == 0 and s.path["prefix_cached_tokens"] > 0
        for s in case.rollout_samples(3)
    )
    assert all(d.evidence.get("cause") != "prefix_cache_crossed_weight_update" for d in case.diagnoses(3))


# ---------------------------------------------------------------- precision of the head


def test_fp32_lm_head_against_bf16_names_the_field_and_the_side(eng: Engine) -> None:
    eng.trainer.load_state_dict(eng.base)
    head = eng.trainer.lm_head
    bf16 = head.weight
    head.weight = torch.nn.Parameter(bf16.detach().float().clone(), requires_grad=False)
    cast = head.register_forward_pre_hook(lambda _m, args: (args[0].float(),))
    try:
        with sides(eng, "fp32-head") as (rollout, trainer, case):
            cv.load_weights(eng.llm, eng.base, "0")
            trainer.weights_changed("0")
            outputs = rollout_step(eng, rollout, 0, fresh(9))
            trainer_step(trainer, 0, outputs)
    finally:
        cast.remove()
        head.weight = bf16
    found = case.diagnoses()
    assert kinds(found) == ["numerical"] * SAMPLES, [d.sentence for d in found]
    for d in found:
        assert d.evidence["cause"] == "precision"
        precision = d.evidence["precision"]
        assert precision["field"] == "runtime.lm_head_dtype" and precision["side"] == "rollout"
        assert precision["trainer"] == "float32" and precision["rollout"] == "bfloat16"
    assert "lm_head" in found[0].sentence


# ---------------------------------------------------------------- in-flight weight updates


@pytest.mark.parametrize(
    ("in_flight", "expected"), [(True, "off_policy"), (False, "weights")], ids=["declared", "undeclared"]
)
def test_an_in_flight_update_splits_a_sample_into_weight_spans(
    eng: Engine, in_flight: bool, expected: str
) -> None:
    """PipelineRL-style: the weights change while the sequences are generated (between engine steps);
    each sample then carries the version of each span of its tokens."""
    from vllm import SamplingParams

    config = {"off_policy": {"max_staleness": 1, "in_flight_updates": in_flight}}
    core = eng.llm.llm_engine
    with sides(eng, f"in-flight-{in_flight}", config=config) as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.next, trainer_v="1")
        for i, prompt in enumerate(fresh(30 + in_flight)):
            params = SamplingParams(temperature=TEMPERATURE, max_tokens=12, min_tokens=12, logprobs=0, seed=i)
            core.add_request(f"in-flight-{in_flight}-{i}", {"prompt_token_ids": prompt}, params)
        finished, steps = [], 0
        while core.has_unfinished_requests():
            finished += [out for out in core.step() if out.finished]
            steps += 1
            if steps == 4:  # four tokens sampled under version 0
                cv.load_weights(eng.llm, eng.next, "1")
        rollout.record_step(0, finished)
        trainer_step(trainer, 0, finished)
    for sample in case.rollout_samples(0):
        assert [(s.start, s.version) for s in sample.weight_spans] == [(0, "0"), (4, "1")]
        assert sample.weight_version == "1"
    found = case.diagnoses()
    assert kinds(found) == [expected] * SAMPLES, [d.sentence for d in found]
    assert all(d.evidence["policy_lag_max"] == 1 and d.evidence["policy_lag_min"] == 0 for d in found)
