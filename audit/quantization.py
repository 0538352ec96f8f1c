"""Quantization as a cause of mismatch: what each side quantizes (read from its manifest), whether
the two sides quantize differently, and the signature the logprob differences show.

A side states its quantization in its manifest's runtime facts: ``quant`` (a mapping of
``weights``, ``activations``, ``kv_cache``, ``source``; see :data:`QUANT_FIELDS`), and, for a vLLM
engine, its own ``kv_cache_dtype`` and ``quantization`` (the engine's cache and quant configs). A
field that is absent or names an unquantized format (``auto``, bf16, fp16, fp32) means "not
quantized".

Signatures (each read from what the records hold):

* ``position_onset``: the logprobs agree (|Δ| at the level of bf16 noise) up to a position and part
  from there: a quantized KV cache read by decode but not by prefill.
* ``batch_mates``: the same sample computed in two batch compositions gave different logprobs on
  a side that quantizes activations (``SampleLogprobs.path[BATCH_PROBE]``, recorded by the
  collectors' batch probe): a per-tensor dynamic scale spans the batch. A probe that moved on a side
  that quantizes no activations is reported (``batch_probe``) but is no quantization evidence: its
  batch dependence comes from elsewhere (a batch-variant kernel).
* ``step_sized``: the nonzero differences take a few discrete values (FP8's coarse grid).

A configuration is *symmetric* when both sides quantize the same way with scales that do not
depend on batch-mates; then the two can be made exact. One side quantized (or per-tensor dynamic
scales) cannot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from isoaudit.audit.records import Manifest, RuntimeFacts, SampleLogprobs

#: The quantization facts of a side, in the order they are reported.
QUANT_FIELDS = ("weights", "activations", "kv_cache", "source")

#: Runtime fact (a mapping of :data:`QUANT_FIELDS`) a collector sets where its side quantizes.
QUANT_FACT = "quant"

#: Path fact of a sample: the largest |logprob difference| this side saw between this sample
#: computed in its batch and the same sample computed in another batch composition (a probe).
BATCH_PROBE = "batch_probe_max_abs_diff"

#: Formats that are not quantization (a KV cache or weights kept in the model's float format).
_UNQUANTIZED = {
    "",
    "auto",
    "none",
    "bfloat16",
    "bf16",
    "float16",
    "fp16",
    "half",
    "float32",
    "fp32",
    "float",
}

#: |Δ| below this is bf16-level noise when locating where the sides part.
ONSET_NOISE = 2e-2


def _format(value: Any) -> str | None:
    """A quantized format's name, or None for an unquantized/unknown one."""
    if value is None:
        return None
    name = str(value).replace("torch.", "").strip().lower()
    return None if name in _UNQUANTIZED else name


def quantization_of(manifest: Manifest | None) -> dict[str, str | None]:
    """This side's quantization: format and scale granularity per field (None: not quantized)."""
    if manifest is None:
        return dict.fromkeys(QUANT_FIELDS)
    return runtime_quantization(manifest.runtime)


def runtime_quantization(runtime: RuntimeFacts) -> dict[str, str | None]:
    """The quantization a side's runtime facts state (:func:`quantization_of` of its manifest)."""
    out: dict[str, str | None] = dict.fromkeys(QUANT_FIELDS)
    extra = runtime.model_extra or {}
    declared = extra.get(QUANT_FACT)
    if isinstance(declared, dict):
        for name in QUANT_FIELDS:
            out[name] = _format(declared.get(name)) if name != "source" else declared.get(name)
    kv = _format(extra.get("kv_cache_dtype"))
    if kv is not None and out["kv_cache"] is None:
        out["kv_cache"] = kv
    weights = _format(extra.get("quantization"))
    if weights is not None and out["weights"] is None:
        out["weights"] = weights
    if out["weights"] is None and out["activations"] is None and out["source"] is not None:
        out["source"] = None  # nothing is quantized, so there is no quantization source
    return out


def _per_tensor_dynamic(activations: str | None) -> bool:
    """Activations scaled per tensor at run time (one scale over the whole batch); a static
    per-tensor scale is a constant, the same whatever the batch holds."""
    words = str(activations or "")
    return "per-tensor" in words and "static" not in words


def quantization_difference(tm: Manifest | None, rm: Manifest | None) -> dict[str, Any] | None:
    """The quantization facts the two sides state differently, each with both values, and whether
    the configuration is symmetric; None when neither side quantizes or either is unknown."""
    if tm is None or rm is None:
        return None
    t, r = quantization_of(tm), quantization_of(rm)
    if not any(v for k, v in t.items() if k != "source") and not any(
        v for k, v in r.items() if k != "source"
    ):
        return None
    differing = {
        name: {"trainer": t[name], "rollout": r[name]} for name in QUANT_FIELDS if t[name] != r[name]
    }
    if not (t["weights"] and r["weights"]):
        differing.pop("source", None)  # a source differs only where both sides quantize weights
    per_tensor = [
        side for side, q in (("trainer", t), ("rollout", r)) if _per_tensor_dynamic(q.get("activations"))
    ]
    return {
        "trainer": t,
        "rollout": r,
        "differing": differing,
        "per_tensor_dynamic": per_tensor,
        "symmetric": not differing,
    }


def position_onset(delta: np.ndarray, noise: float = ONSET_NOISE) -> int | None:
    """The completion index from which the sides part: the split that best separates an agreeing
    head (|Δ| at noise level) from a tail whose mean |Δ| is at least three times the head's largest
    (and above ``noise`` / 2); None where no split does (they part at once, or never)."""
    size = np.abs(np.asarray(delta, dtype=np.float64))
    best, best_gap = None, 0.0
    for k in range(1, size.size):
        head, tail = float(size[:k].max()), float(size[k:].mean())
        if head < noise and tail > max(3.0 * head, noise / 2) and tail - head > best_gap:
            best, best_gap = k, tail - head
    return best


def step_sized(delta: np.ndarray) -> bool:
    """The nonzero differences take a few discrete values (at most a quarter as many as there are)."""
    nonzero = delta[delta != 0]
    return nonzero.size >= 8 and np.unique(nonzero).size <= max(2, nonzero.size // 4)


def batch_probes(*samples: SampleLogprobs) -> dict[str, float]:
    """Per side, the batch probe's largest |Δ| where that side recorded one (0 included)."""
    out: dict[str, float] = {}
    for sample in samples:
        value = sample.path.get(BATCH_PROBE)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[sample.side] = float(value)
    return out


def batch_dependence(
    *samples: SampleLogprobs, quantizing: Mapping[str, dict[str, str | None]] | None = None
) -> dict[str, float]:
    """Per side, the batch probe's largest |Δ| where it is nonzero and, given ``quantizing`` (each
    side's :func:`quantization_of`), that side quantizes activations."""
    return {
        side: value
        for side, value in batch_probes(*samples).items()
        if value > 0 and (quantizing is None or (quantizing.get(side) or {}).get("activations"))
    }


def _describe(name: str, value: str | None) -> str:
    if name == "kv_cache":
        return f"a {value} KV cache" if value else "an unquantized KV cache"
    if name == "source":
        return f"quantizes from {value} masters" if value else "no quantization source"
    return f"{value} {name}" if value else f"unquantized {name}"


def signature(trainer: SampleLogprobs, rollout: SampleLogprobs, found: dict[str, Any]) -> dict[str, Any]:
    """What the logprob differences of one sample show, given the sides' quantization ``found``."""
    delta = np.asarray(trainer.logprobs, dtype=np.float64) - np.asarray(rollout.logprobs, dtype=np.float64)
    out: dict[str, Any] = {"step_sized": bool(step_sized(delta))}
    size = np.abs(delta)
    onset = position_onset(delta)
    if "kv_cache" in found["differing"] and size.size > 1:
        # the first completion token comes from the prefill (fresh K/V); every later one from decode,
        # which reads the cache: a quantized cache parts the sides from the first decode position
        out["prefill_token_abs_diff"] = float(size[0])
        out["decode_mean_abs_diff"] = float(size[1:].mean())
        if 3.0 * size[0] < size[1:].mean() and onset is None:
            onset = 1
    if onset is not None:
        out["position_onset"] = trainer.prompt_len + onset
        out["onset_index"] = onset
        out["before_onset_max_abs_diff"] = float(size[:onset].max())
        out["after_onset_mean_abs_diff"] = float(size[onset:].mean())
    probes = batch_probes(trainer, rollout)
    if probes:
        out["batch_probe"] = probes
    batch = batch_dependence(trainer, rollout, quantizing=found)
    if batch:
        out["batch_mates"] = batch
    return out


def effective_weights(tm: Manifest | None, rm: Manifest | None) -> dict[str, Any] | None:
    """Compare the weights each side's GEMMs effectively multiply by: a quantizing side's
    dequantized-weight digests (``Manifest.effective_weight_tensor_digests``), an unquantized side's
    held ones. None unless at least one side reports effective digests."""
    if tm is None or rm is None:
        return None
    if not (tm.effective_weight_tensor_digests or rm.effective_weight_tensor_digests):
        return None
    a = tm.effective_weight_tensor_digests or tm.weight_tensor_digests
    b = rm.effective_weight_tensor_digests or rm.weight_tensor_digests
    common = sorted(set(a) & set(b))
    differing = [name for name in common if a[name] != b[name]]
    return {"tensors_compared": len(common), "differing": len(differing), "differing_tensors": differing[:16]}


def _cause(differing: dict[str, Any], batch: dict[str, float]) -> str:
    """The signature word of the verdict: what the two sides differ in first."""
    if batch:
        return "batch_mates"
    for name in ("kv_cache", "source"):
        if name in differing:
            return name
    return "asymmetric" if differing else "per_tensor_dynamic"


def explain(
    trainer: SampleLogprobs, rollout: SampleLogprobs, tm: Manifest | None, rm: Manifest | None
) -> tuple[str, dict[str, Any]] | None:
    """The sentence and evidence of a ``quantization`` verdict for this sample, or None when the
    sides quantize alike with batch-independent scales and no probe shows batch-mate dependence."""
    found = quantization_difference(tm, rm)
    if found is None:
        return None
    batch = batch_dependence(trainer, rollout, quantizing=found)
    if not found["differing"] and not batch and not found["per_tensor_dynamic"]:
        return None
    seen = signature(trainer, rollout, found)
    parts = []
    for name, v in found["differing"].items():
        sides = [s for s in ("rollout", "trainer") if v[s]]
        if name == "source":
            parts.append(
                f"the rollout quantizes from {v['rollout']} weights and the trainer from {v['trainer']} "
                "(the quantization source)"
            )
        elif len(sides) == 1:
            other = "trainer" if sides[0] == "rollout" else "rollout"
            parts.append(f"the {sides[0]} uses {_describe(name, v[sides[0]])} and the {other} does not")
        else:
            parts.append(
                f"the rollout uses {_describe(name, v['rollout'])} and the trainer {_describe(name, v['trainer'])}"
            )
    if batch:
        parts.append(
            "the same sample in another batch composition gave different logprobs on the "
            + " and ".join(sorted(batch))
            + " (a dynamic scale shared by batch-mates)"
        )
    elif found["per_tensor_dynamic"]:
        parts.append(
            f"the {' and '.join(found['per_tensor_dynamic'])} scales activations per tensor (batch-mate dependent)"
        )
    sentence = "Quantization: " + "; ".join(parts) + "."
    if "position_onset" in seen:
        sentence += f" The logprobs agree up to position {seen['position_onset']} and part from there" + (
            " (decode reads the quantized KV cache, prefill does not)."
            if "kv_cache" in found["differing"]
            else "."
        )
    if seen["step_sized"]:
        sentence += " The differences fall on a few discrete steps."
    exact = found["symmetric"] and not batch and not found["per_tensor_dynamic"]
    sentence += (
        " Both sides quantize the same way: this can be made exact."
        if exact
        else " As configured this cannot be made exact: quantize both sides the same way (per-token-group "
        "or block scales, the same source) or neither."
    )
    effective = effective_weights(tm, rm)
    if effective is not None and effective["tensors_compared"]:
        sentence += (
            f" The effective (dequantized) weights differ in {effective['differing']} of "
            f"{effective['tensors_compared']} tensors."
            if effective["differing"]
            else f" The effective (dequantized) weights agree in all {effective['tensors_compared']} tensors."
        )
    evidence = {
        "cause": _cause(found["differing"], batch),
        "quantization": {"trainer": found["trainer"], "rollout": found["rollout"]},
        "differing": found["differing"],
        "symmetric": found["symmetric"],
        "can_be_exact": exact,
        "signature": seen,
        "effective_weights": effective,
    }
    return sentence, evidence
