"""The GRPO step's memory bounds at tiny sizes: the native head chunked like the fused one beyond one
slab, the entropy a block of rows at a time, HF's logits trimmed unless a collector fingerprints the
forward, micro-batched updates, and a long-context job end to end on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from isoaudit.collectors.hooks import ForwardCapture
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.regions import RegionSpec, Tap
from isoaudit.collectors.rl import grpo, job
from isoaudit.kernels import dispatch
from isoaudit.kernels import fused_logprobs as fl

from isoaudit import kernels


@pytest.fixture
def small_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slabs of one lane block (BLOCK_V columns) and row blocks of 5: a head of a few rows over a
    vocabulary of a few thousand is then cut as a long-context one is."""
    monkeypatch.setattr(fl, "ROWS", 5)
    monkeypatch.setattr(fl, "SLAB_BYTES", 4 * 5 * fl.BLOCK_V)


def _head(t: int = 13, hidden: int = 16, vocab: int = 2500, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / 2).requires_grad_()
    tokens = torch.randint(0, vocab, (t,), generator=g)
    return h, w, tokens


def _whole_head(h: torch.Tensor, w: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(F.linear(h, w).float(), -1).gather(1, tokens[:, None])[:, 0]


def test_a_small_native_head_stays_whole() -> None:
    h, w, tokens = _head()
    assert fl.one_slab(h.shape[0], w.shape[0])
    with kernels.disable():
        assert torch.equal(dispatch.token_logprobs(h, w, tokens), _whole_head(h, w, tokens))


def test_a_long_native_head_is_chunked_like_the_fused_one(small_slabs: None) -> None:
    h, w, tokens = _head()
    assert not fl.one_slab(h.shape[0], w.shape[0])
    with kernels.disable():
        ours = dispatch.token_logprobs(h, w, tokens)
    assert torch.equal(ours, fl.native_chunked_token_logprobs(h, w, tokens))  # the same blocks and slabs
    whole = _whole_head(h, w, tokens)
    torch.testing.assert_close(ours, whole, rtol=0, atol=1e-5)  # last bits apart at most
    g = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((ours * g).sum(), (h, w))
    expected = torch.autograd.grad((whole * g).sum(), (h, w))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_invariant_fused_head_keeps_its_bits_under_any_chunking(small_slabs: None) -> None:
    h, w, tokens = _head()
    whole = fl.fused_token_logprobs(
        h.detach(), w.detach(), tokens, impl="torch", rows=64, slab=3 * fl.BLOCK_V
    )
    chunked = fl.fused_token_logprobs(h.detach(), w.detach(), tokens, impl="torch")
    assert torch.equal(chunked, whole)


def _entropy_whole(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(dispatch.logits_fp32(h.detach(), w.detach()), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("invariant", [False, True])
def test_entropy_in_row_blocks(invariant: bool) -> None:
    h, w, _ = _head(t=11)
    with kernels.enable() if invariant else kernels.disable():
        whole = _entropy_whole(h, w)
        blocks = [grpo.token_entropy(h, w, rows=r) for r in (1, 4, 11, 64)]
    for got in blocks:
        assert not got.requires_grad
        if invariant:
            assert torch.equal(got, whole)  # each row's logits and sum are its own
        else:
            torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        grpo.token_entropy(h, w, rows=0)


def _tiny(vocab: int = 512) -> torch.nn.Module:
    """A random one-layer Qwen3 (fp32, seed 0)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config)


def test_hf_logits_are_kept_whole_only_for_a_fingerprinting_collector() -> None:
    model = _tiny()
    batch = StepBatch.padded([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]])
    shapes: list[tuple[int, ...]] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    with torch.no_grad():
        alone = grpo.policy_logprobs(model, batch)
    assert shapes[-1][:2] == (2, 1)  # no collector: HF's logits of one position
    due = [False]
    capture = ForwardCapture(
        model, [RegionSpec("logits", "lm_head", Tap.FP32)], should_fingerprint=lambda: due[0]
    )
    with torch.no_grad():
        quiet = grpo.policy_logprobs(model, batch)
        assert shapes[-1][:2] == (2, 1)  # a collector that does not fingerprint this forward
        due[0] = True
        watched = grpo.policy_logprobs(model, batch)
    assert shapes[-1][:2] == tuple(batch.input_ids.shape)  # every row, for the lm_head's fingerprints
    last = capture.take()
    assert last is not None and last.fingerprinting and ("logits", 0) in last.prints
    assert capture.errors == 0
    capture.remove()
    for out in (quiet, watched):
        assert torch.equal(out.logprobs, alone.logprobs) and torch.equal(out.entropy, alone.entropy)


def test_micro_batches_accumulate_the_whole_batch_gradient() -> None:
    model = _tiny()
    prompts, completions = [[1, 2, 3], [4, 5], [6], [7, 8]], [[6, 7], [8, 9, 10], [], [11]]
    batch = StepBatch.padded(prompts, completions)
    with torch.no_grad():
        old = grpo.policy_logprobs(model, batch).logprobs.float() + 0.05  # a ratio away from 1
    advantages = torch.linspace(-1, 1, old.numel())
    grads, clips = [], []
    for size in (None, 1, 3):
        parts = job._micro_batches(batch, prompts, completions, size, 0, 1.0)
        assert [p[1:] for p in parts][-1][1] == old.numel()
        model.zero_grad(set_to_none=True)
        clips.append(job._accumulate(model, parts, old, advantages, 0.2))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    for got, clip in zip(grads[1:], clips[1:], strict=True):
        torch.testing.assert_close(got, grads[0], rtol=1e-4, atol=1e-6)
        assert clip == pytest.approx(clips[0])


def test_a_long_context_job_runs_on_the_cpu(small_slabs: None) -> None:
    """The long-context step's code path, tiny: prompts brought to 64 tokens, the native head in
    blocks and slabs, micro-batched updates; natively and under the invariant kernels."""
    from isoaudit.collectors.rl.rollout import ReferenceRollout
    from isoaudit.collectors.sessions import MemoryDestination

    import isoaudit

    class Chars:
        pad_token_id = 0

        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) % 256 for c in text]}

        def batch_decode(self, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
            return ["".join(str(t % 10) for t in row) for row in rows]

    config = job.JobConfig(
        steps=2, prompts=2, group=2, max_new=3, updates=1, prompt_len=64, micro_batch=1, trainer_regions=None
    )
    for mode in ("native", "invariant"):
        model = _tiny(vocab=2048)  # past one slab of BLOCK_V columns
        rollout = ReferenceRollout(model, max_len=80)
        with (
            kernels.disable(),
            isoaudit.session(f"long-{mode}", destination=MemoryDestination(), report=False) as audit,
        ):
            if mode != "native":
                audit.control.set(mode)
            figures = job.run_job(audit, model, Chars(), rollout, config)
        assert [f.step for f in figures] == [0, 1]
        assert all(torch.isfinite(torch.tensor([f.entropy, f.clip_fraction])).all() for f in figures)
        if mode == "invariant":
            assert figures[-1].mode == "invariant" and figures[-1].exact_fraction == 1.0


def test_the_gpu_bench_runs_its_long_context_loop_on_the_cpu() -> None:
    """bench/rl_loop_gpu.py's own loop (both sides, the phase ratios), tiny, with long prompts."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "bench" / "rl_loop_gpu.py"
    cmd = [sys.executable, str(bench), "--device", "cpu", "--layers", "1", "--prompt-len", "64"]
    cmd += [
        "--prompts",
        "1",
        "--group",
        "2",
        "--max-new",
        "3",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--micro-batch",
        "1",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "update micro-batch: 1 sample(s)" in done.stdout
    for phase in ("generation", "training", "step"):
        assert any(line.startswith(phase) and "x " in line for line in done.stdout.splitlines())
    assert "invariant: applied invariant" in done.stdout and "exact ['1.0000', '1.0000']" in done.stdout
