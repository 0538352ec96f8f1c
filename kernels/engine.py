"""A minimal rollout engine: batched requests of different lengths, (chunked) prefill, then
incremental decode with a KV cache, sampled tokens and their logprobs.

It exists to prove the kernels end to end without vLLM: the same model run as a trainer (whole
sequences, autograd) and through this engine must give bitwise-equal sampled-token logprobs when
:func:`kernels.enable` is on. Any model with ``new_cache``/``step``/``lm_head_weight`` works
(:class:`kernels.adapters.HFCausalLM`, :class:`kernels.models.gdn_lm.GDNLM`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import routing


class EngineModel(Protocol):
    lm_head_weight: torch.Tensor

    def new_cache(self, slots: int, max_len: int) -> Any: ...

    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, cu: torch.Tensor, slots: list[int], cache: Any
    ) -> torch.Tensor: ...


@dataclass
class Completion:
    """One request's result: sampled tokens and the engine's logprob of each."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class RolloutEngine:
    """Continuous-batching-lite: every step packs the pending tokens of all live requests."""

    def __init__(self, model: EngineModel, max_len: int = 512, prefill_chunk: int | None = None) -> None:
        self.model = model
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new: list[int], seed: int = 0, temperature: float = 1.0
    ) -> list[Completion]:
        """Sample ``max_new[i]`` tokens after ``prompts[i]`` for all requests at once."""
        w = self.model.lm_head_weight
        dev = w.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        cache = self.model.new_cache(len(prompts), self.max_len)
        outs = [Completion(list(p)) for p in prompts]
        done_prefill = [0] * len(prompts)  # prompt tokens already in the cache
        pending: list[list[int]] = [list(p) for p in prompts]
        while True:
            live = [i for i in range(len(prompts)) if len(outs[i].tokens) < max_new[i]]
            if not live:
                return outs
            ids, pos, cu, slots = [], [], [0], []
            for i in live:
                n = len(pending[i])
                if self.prefill_chunk is not None:
                    n = min(n, self.prefill_chunk)
                start = done_prefill[i]
                ids += pending[i][:n]
                pos += list(range(start, start + n))
                cu.append(cu[-1] + n)
                slots.append(i)
            hidden = self.model.step(
                torch.tensor(ids, device=dev),
                torch.tensor(pos, device=dev),
                torch.tensor(cu, device=dev, dtype=torch.int32),
                slots,
                cache,
            )
            last_rows, finishing = [], []
            for j, i in enumerate(live):
                n = cu[j + 1] - cu[j]
                done_prefill[i] += n
                pending[i] = pending[i][n:]
                if not pending[i]:
                    last_rows.append(cu[j + 1] - 1)
                    finishing.append(i)
            if not finishing:
                continue
            h = hidden[torch.tensor(last_rows, device=dev)]
            logits = routing.logits_fp32(h, w)
            probs = torch.softmax(logits / temperature, -1)
            tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
            lp = routing.token_logprobs(h, w, tok)
            for j, i in enumerate(finishing):
                outs[i].tokens.append(int(tok[j]))
                outs[i].logprobs.append(float(lp[j]))
                pending[i] = [int(tok[j])]
