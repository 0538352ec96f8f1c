"""Step time of a training loop with the trainer collector against without, in the same run.

Configurations, interleaved in rounds so drift and noise hit all of them alike:

* ``baseline``: no collector.
* ``logprobs``: collector with no regions; the trainer hands it the logprobs it computed.
* ``logprobs+fingerprints``: every canonical region fingerprinted at ``sample_every=1``.
* ``collector-logprobs`` (extra): no regions, and the collector computes the logprobs itself.
* ``fingerprints+background`` (with ``--background``): as ``logprobs+fingerprints``, the records
  built on the collector's helper thread (``background_records=True``).

A step is a real training step: forward, the trainer's processed logprobs, a policy-gradient-like
loss, backward, AdamW. Reported: median step time per configuration and the overhead against the
baseline. Targets on the CPU with a tiny model: logprobs <= 3 %, with fingerprints <= 25 %.

    python bench/collector_overhead.py                         # CPU, tiny Qwen3
    python bench/collector_overhead.py --device cuda --model 0.5b
    python bench/collector_overhead.py --model deep-tiny --hidden 16   # CPU, the 0.5b's 123 regions
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import qwen3_05b_config  # noqa: E402
from isoaudit.collectors.layout import StepBatch  # noqa: E402
from isoaudit.collectors.sinks.memory import MemorySink  # noqa: E402
from isoaudit.collectors.trainer import attach  # noqa: E402

TEMPERATURE = 0.8


def build_model(size: str, device: str, dtype: torch.dtype, hidden: int = 256) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    if size in ("tiny", "deep-tiny"):
        # tiny: a few million parameters, 4 layers, MLP 3x hidden, 1k vocab; deep-tiny: the 0.5b
        # model's 24 layers (and so its 123 regions) at tiny widths
        config = Qwen3Config(
            vocab_size=1024,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=4 if size == "tiny" else 24,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
    elif size == "0.5b":  # the shape of Qwen2.5-0.5B in the Qwen3 architecture: ~0.49B parameters
        config = qwen3_05b_config(max_positions=4096)
    else:
        raise ValueError(f"--model: expected tiny, deep-tiny or 0.5b, got {size!r}")
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a 0.5B init on the CPU takes long
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def make_batch(args: argparse.Namespace, vocab: int, device: str) -> StepBatch:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    completions = []
    for i in range(args.batch):  # varied completion lengths: padding matters
        n = max(1, args.completion - (i * args.completion) // (2 * args.batch))
        completions.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    return StepBatch.padded(prompts, completions, temperature=TEMPERATURE, device=device)


def train_step(
    model, optimizer, batch: StepBatch, mask: torch.Tensor, collector, step: int, pass_logprobs: bool
):
    if collector is not None:
        collector.begin_step(step, batch)  # with the batch: padding rows are skipped on any device
    logits = model(**batch.model_inputs()).logits
    logprobs = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
    logprobs = logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # [rows, cols-1]
    if collector is not None:
        collector.record_step(step, batch, logprobs=logprobs.detach() if pass_logprobs else None)
    loss = -(logprobs * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def completion_mask(batch: StepBatch) -> torch.Tensor:
    rows, cols = batch.shape
    mask = torch.zeros(rows, cols - 1)
    for span in batch.spans:
        mask[span.row, span.start + span.prompt_len - 1 : span.start + span.length - 1] = 1
    return mask.to(batch.input_ids.device)


def check_logprobs(model: torch.nn.Module, batch: StepBatch) -> dict[str, Any]:
    """The collector's own logprobs against the trainer's ``log_softmax(logits / T)`` on this device,
    and every region fingerprinted for every sample."""
    sink = MemorySink()
    collector = attach(
        model, run="bench-check", sink=sink, keep_records=True, strict=True, async_transfer=False
    )
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits
        report = collector.record_step(0, batch)
    collector.detach()
    sink.close()
    reference = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    equal, worst = 0, 0.0
    samples = [r for r in report.records if r.kind == "sample"]
    for span, record in zip(batch.spans, samples, strict=True):
        rows = reference[span.row, span.start + span.prompt_len - 1 : span.start + span.length - 1]
        tokens = batch.input_ids[span.row, span.start + span.prompt_len : span.start + span.length]
        want = rows.gather(-1, tokens[:, None]).squeeze(-1).clamp(max=0).cpu().numpy()
        equal += int((want == record.logprobs).all())
        worst = max(worst, float(abs(want - record.logprobs).max()))
    return {
        "samples_bitwise_equal": f"{equal}/{len(samples)}",
        "max_abs_diff": worst,
        "regions": len(collector.regions),
        "fingerprint_records": report.n_fingerprint_records,
    }


def _no_sync() -> None:
    return None


def _attach(model, sink, config: dict[str, Any] | None):
    """The collector of one configuration (None: the baseline, no collector)."""
    if config is None:
        return None
    return attach(
        model,
        run="bench",
        sink=sink,
        regions=config["regions"],
        sample_every=1,
        background_records=config.get("background", False),
    )


def count_syncs(model, optimizer, batch, mask, sink, configs, step: int) -> dict[str, int]:
    """Device synchronisations in one training step per configuration (CUDA): what
    ``torch.cuda.set_sync_debug_mode("warn")`` reports, after a warm step. The collector's
    configurations should report what the baseline does."""
    import warnings

    out = {}
    for name, config in configs.items():
        collector = _attach(model, sink, config)
        passed = config is None or config["pass"]
        step += 1
        train_step(model, optimizer, batch, mask, collector, step, passed)  # warm
        torch.cuda.synchronize()
        step += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(model, optimizer, batch, mask, collector, step, passed)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[name] = sum("synchroniz" in str(w.message) for w in caught)
        if collector is not None:
            collector.detach()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads) if args.threads else None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = build_model(args.model, args.device, dtype, args.hidden)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    batch = make_batch(args, vocab, args.device)
    mask = completion_mask(batch)
    configs = {
        "baseline": None,
        "logprobs": {"regions": None, "pass": True},
        "logprobs+fingerprints": {"regions": "auto", "pass": True},
        "collector-logprobs": {"regions": None, "pass": False},
    }
    if args.background:
        configs["fingerprints+background"] = {"regions": "auto", "pass": True, "background": True}
    times: dict[str, list[float]] = {name: [] for name in configs}
    host: dict[str, list[float]] = {name: [] for name in configs}  # until the step is queued
    tmp = tempfile.TemporaryDirectory()
    if args.sink == "direct":
        from isoaudit.collectors.sinks.direct import DirectSink  # SQLAlchemy only when asked for

        sink: Any = DirectSink(f"sqlite:///{tmp.name}/bench.db", queue_size=1024)
    else:
        sink = MemorySink(keep=False, validate=False, queue_size=1024)  # the collector alone, as before
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else _no_sync
    step = 0
    for _ in range(args.warmup):
        train_step(model, optimizer, batch, mask, None, step, True)
    # Short blocks in a rotating order over many rounds: load from other processes then falls on
    # every configuration alike, and the median per configuration is robust to the rest.
    names = list(configs)
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            config = configs[name]
            collector = _attach(model, sink, config)
            for _ in range(args.steps):
                step += 1
                sync()
                started = time.perf_counter()
                train_step(model, optimizer, batch, mask, collector, step, config is None or config["pass"])
                queued = time.perf_counter()
                sync()
                times[name].append(time.perf_counter() - started)
                host[name].append(queued - started)
            if collector is not None:
                if collector.counters.errors or collector.stats()["hook_errors"]:
                    raise RuntimeError(f"collector errors in {name}: {collector.stats()}")
                collector.detach()
    syncs = count_syncs(model, optimizer, batch, mask, sink, configs, step) if sync is not _no_sync else None
    checks = check_logprobs(model, batch)
    delivered = sink.flush(120)
    stats = sink.stats()
    sink.close()
    tmp.cleanup()
    base = statistics.median(times["baseline"])
    result = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": args.model,
        "hidden": model.config.hidden_size,
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "batch": args.batch,
        "tokens_per_step": int(batch.input_ids.numel()),
        "sink": args.sink,
        "sink_delivered_all": delivered,
        "sink_stats": stats,
        "steps_per_config": len(times["baseline"]),
        "checks": checks,
        "median_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        # host time until the step was queued (the rest is the device finishing): a collector that
        # only adds host time hides behind a device-bound step, one that syncs cannot
        "host_median_ms": {name: 1e3 * statistics.median(t) for name, t in host.items()},
        "syncs_per_step": syncs,
        "overhead_pct": {
            name: 100 * (statistics.median(t) / base - 1) for name, t in times.items() if name != "baseline"
        },
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=["tiny", "deep-tiny", "0.5b"])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny models")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--sink", default="memory", choices=["memory", "direct"])
    parser.add_argument(
        "--background",
        action="store_true",
        help="also time fingerprints with the records built on a helper thread (background_records)",
    )
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    result = run(args)
    for name, ms in result["median_ms"].items():
        extra = f"  {result['overhead_pct'][name]:+6.1f} %" if name in result["overhead_pct"] else "         "
        queued = result["host_median_ms"][name]
        syncs = result["syncs_per_step"]
        extra += f"   host {queued:8.2f} ms" + (f"   syncs {syncs[name]}" if syncs else "")
        print(f"{name:24s} {ms:9.2f} ms/step{extra}")
    shown = ("median_ms", "overhead_pct", "host_median_ms", "syncs_per_step")
    print(json.dumps({k: v for k, v in result.items() if k not in shown}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
