"""TRL's ``GRPOTrainer`` with both isoaudit collectors attached in one call.

Usage::

    from isoaudit.collectors.integrations.trl import IsoauditCallback

    args = GRPOConfig(..., use_vllm=True, vllm_mode="colocate")
    trainer = GRPOTrainer(model=..., args=args, reward_funcs=..., train_dataset=...,
                          callbacks=[IsoauditCallback(run="grpo-7")])   # or trainer.add_callback(...)
    trainer.train()        # the summary is in callback.summary afterwards

Where records go comes from the session arguments (``url=``/``token=``, ``database_url=``) or the
environment, as for :func:`isoaudit.session`.

What the callback does, and why it has to reach past the callback API: transformers hands a
callback the model, never the batch, and TRL keeps the engine's outputs inside its generation
method. So on ``on_train_begin`` (once, lazily, on every rank or only world process zero) it opens
a session, hooks the policy model (``watch_trainer``) and, when TRL generates with vLLM in
colocate mode, the engine ``trainer.vllm_generation.llm`` (``watch_vllm``); then it wraps three
methods *of this trainer instance* (never the classes), all put back on ``on_train_end``:

* ``trainer._generate_and_score_completions``: after TRL built a generation batch, its samples are
  recorded as step ``state.global_step`` on both sides: the trainer side with TRL's own
  ``old_per_token_logps`` (the no-grad recompute before the update; the collector's own forward
  when TRL skipped it), the rollout side with what vLLM returned (the logprobs TRL keeps as
  ``sampling_per_token_logps``) plus the engine's fingerprints;
* ``llm.generate``: keeps this generation's ``RequestOutput`` objects for the rollout side;
* ``vllm_generation.sync_weights``: both sides get weight version ``state.global_step`` after each
  sync (``weight_sync="trl"``: TRL's own copy, then ``weights_changed``), or the sync goes through
  :func:`isoaudit.collectors.vllm.load_weights` (``weight_sync="isoaudit"``: vLLM's in-place reload, which
  also re-runs post-load processing; TRL's per-parameter ``load_weights`` fails on the CPU build of
  vLLM, whose linear weights are repacked after loading). ``"auto"`` picks ``isoaudit`` on the CPU
  platform, TRL's own elsewhere.

TRL's logged figures (reward, entropy, clip ratios, its own ``sampling/*`` mismatch figures) go to
the store as :class:`isoaudit.audit.records.StepStats` from world process zero, so the dashboard sets them
beside isoaudit's (``isoaudit metrics list --framework trl`` names TRL's aliases).

With ``vllm_mode="server"`` the engine runs in ``trl vllm-serve``, out of reach: the rollout side is
recorded from TRL's ``sampling_per_token_logps`` (:mod:`isoaudit.collectors.integrations.given`, no engine
fingerprints). TRL's transformers-generate path keeps no sampling logprobs: only the trainer side
is recorded. A warning says which, once.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, Unpack, cast

import torch
from isoaudit.audit.records import StepStats
from isoaudit.collectors.counting import LogOnce
from isoaudit.collectors.integrations.declare import declaration_args
from isoaudit.collectors.integrations.given import GivenLogprobs, watch_given
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sessions import SessionOptions
from isoaudit.collectors.sessions import session as audit_session
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

if TYPE_CHECKING:
    from isoaudit.collectors.sessions import Session, Summary
    from isoaudit.collectors.trainer import TrainerCollector
    from isoaudit.collectors.vllm.collector import VllmCollector
    from isoaudit.collectors.vllm.selection import SelectionArg

log = logging.getLogger(__name__)

WeightSync = Literal["auto", "trl", "isoaudit"]
Ranks = Literal["all", "zero"]


class _GRPOParts(Protocol):
    """What this module reads of TRL's ``GRPOTrainer`` beyond transformers' ``Trainer`` (TRL ships no
    type information, and these are set in ``GRPOTrainer.__init__``)."""

    vllm_generation: Any  # TRL's vLLM generation helper (llm, sync_weights, tp_group): untyped
    temperature: float

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]: ...


def _grpo(trainer: Trainer) -> _GRPOParts:
    """``trainer`` as the ``GRPOTrainer`` this callback is added to (its GRPO attributes typed)."""
    return cast(_GRPOParts, trainer)


#: TRL's logged names that fill StepStats' own fields; every other finite figure goes to extras.
STAT_FIELDS: dict[str, str] = {
    "reward": "reward_mean",
    "reward_std": "reward_std",
    "entropy": "entropy",
    "clip_ratio/region_mean": "clip_fraction",
}
MAX_EXTRAS = 64


class InstancePatch:
    """``setattr(obj, name, value)`` on one instance, undone by :meth:`restore` (an attribute the
    instance did not hold itself is deleted again, so the class's method shows through)."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name = obj, name
        self._had = name in vars(obj)
        self._old = vars(obj).get(name)
        setattr(obj, name, value)

    def restore(self) -> None:
        if self._had:
            setattr(self.obj, self.name, self._old)
        else:
            vars(self.obj).pop(self.name, None)


class IsoauditCallback(TrainerCallback):
    """Records both sides of every GRPO generation batch of the ``GRPOTrainer`` it is added to.

    ``run``: the isoaudit run (an id or :class:`isoaudit.audit.records.Run`). ``trainer``: the trainer, when
    known at construction (else found when training starts). ``sample_every``: fingerprint the
    trainer side every N-th step; ``regions``: the trainer's regions (see ``watch_trainer``);
    ``fingerprint``: which vLLM requests to fingerprint (see ``watch_vllm``). ``weight_sync``: see
    the module docstring; ``weight_digest``: also take the SHA-256 of the weights at each sync (one
    pass over every tensor). ``ranks``: ``"all"`` (each process records its own samples) or
    ``"zero"`` (world process zero only). ``step_stats``: send TRL's logged figures.
    ``**session_args``: :func:`isoaudit.session`'s (``url``, ``token``, ``database_url``, …).
    """

    def __init__(
        self,
        trainer: Trainer | None = None,
        *,
        run: str | Any,
        sample_every: int = 1,
        regions: Any = "auto",
        fingerprint: SelectionArg = "all",
        weight_sync: WeightSync = "auto",
        weight_digest: bool = False,
        ranks: Ranks = "all",
        step_stats: bool = True,
        **session_args: Unpack[SessionOptions],
    ) -> None:
        if weight_sync not in ("auto", "trl", "isoaudit"):
            raise ValueError(f"weight_sync: expected 'auto', 'trl' or 'isoaudit', got {weight_sync!r}")
        if ranks not in ("all", "zero"):
            raise ValueError(f"ranks: expected 'all' or 'zero', got {ranks!r}")
        if not isinstance(sample_every, int) or sample_every < 1:
            raise ValueError(f"sample_every: must be an integer >= 1, got {sample_every!r}")
        self.trainer = trainer
        self.run = run
        self.sample_every = sample_every
        self.regions = regions
        self.fingerprint = fingerprint
        self.weight_sync = weight_sync
        self.weight_digest = weight_digest
        self.ranks = ranks
        self.step_stats = step_stats
        self.session_args = session_args
        self.session: Session | None = None
        self.trainer_side: TrainerCollector | None = None
        self.rollout_side: VllmCollector | GivenLogprobs | None = None
        self.summary: Summary | None = None
        self.errors = 0
        self.steps_recorded: list[int] = []
        self._patches: list[InstancePatch] = []
        self._outputs: list[Any] = []
        self._started = False
        self._warn = LogOnce(log)

    # ------------------------------------------------------------------ TrainerCallback

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self._started:
            return
        self._started = True
        if self.ranks == "zero" and not state.is_world_process_zero:
            return
        try:
            self._setup(self.trainer or find_trainer(self))
        except Exception as exc:
            if self.session_args.get("strict"):
                raise
            self._failed("setup", exc)
            self.close()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: object,
    ) -> None:
        if not (self.step_stats and logs and state.is_world_process_zero and self.trainer_side):
            return
        if "reward" not in logs:  # the end-of-training summary, or an eval log
            return
        step = self.steps_recorded[-1] if self.steps_recorded else state.global_step
        side = self.trainer_side
        self._guard("step stats", lambda: side.sink.send([step_stats_of(self._run_id, step, logs)]))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ public

    def close(self) -> Summary | None:
        """Put the trainer's methods back, detach every hook, flush and close the session (what
        ``on_train_end`` does; call it yourself when training raised). Idempotent."""
        while self._patches:
            self._patches.pop().restore()
        if self.session is not None and self.summary is None:
            self.summary = self.session.close()
        return self.summary

    # ------------------------------------------------------------------ setup

    @property
    def _run_id(self) -> str:
        assert self.session is not None
        return self.session.run.run_id

    def _setup(self, trainer: Trainer) -> None:
        self.trainer = trainer
        declared: dict[str, Any] = {}
        if "framework" not in self.session_args:
            import trl

            declared = declaration_args("trl", getattr(trl, "__version__", None), trainer.args)
        session = audit_session(self.run, **{**declared, **self.session_args})
        self.session = session.start()
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.trainer_side = session.watch_trainer(
            model, regions=self.regions, sample_every=self.sample_every, case="trainer_recompute"
        )
        llm = engine_of(trainer)
        if llm is not None:
            self.rollout_side = session.watch_vllm(llm, fingerprint=self.fingerprint)
            self._patch(llm, "generate", self._capturing(llm.generate))
            sync = (
                self._sync_with_isoaudit
                if self._isoaudit_sync()
                else self._after_sync(_grpo(trainer).vllm_generation.sync_weights)
            )
            self._patch(_grpo(trainer).vllm_generation, "sync_weights", sync)
        elif getattr(trainer, "use_vllm", False):
            # server mode: the rollout side from TRL's sampling logprobs
            self.rollout_side = watch_given(session, "rollout", framework="trl+vllm-server")
            self._warn.warn(
                "server",
                "isoaudit TRL callback: vLLM runs in `trl vllm-serve`, out of reach: the rollout side is "
                "recorded from TRL's sampling logprobs, without engine fingerprints",
            )
        else:
            self._warn.warn(
                "no-engine",
                "isoaudit TRL callback: TRL generates with transformers, which keeps no sampling logprobs; "
                "only the trainer side is recorded (use_vllm=True, vllm_mode='colocate' records both)",
            )
        self._patch(
            trainer,
            "_generate_and_score_completions",
            self._recording(_grpo(trainer)._generate_and_score_completions),
        )

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._patches.append(InstancePatch(obj, name, value))

    def _isoaudit_sync(self) -> bool:
        if self.weight_sync != "auto":
            return self.weight_sync == "isoaudit"
        try:
            from vllm.platforms import current_platform

            return bool(current_platform.is_cpu())
        except Exception:
            return False

    # ------------------------------------------------------------------ wrappers

    def _capturing(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        def generate_and_keep(*args: Any, **kwargs: Any) -> Any:
            outputs = generate(*args, **kwargs)
            self._outputs.extend(outputs)
            return outputs

        return generate_and_keep

    def _recording(self, original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        def generate_score_and_record(*args: Any, **kwargs: Any) -> dict[str, Any]:
            trainer = self.trainer
            assert trainer is not None and trainer.model is not None  # set up on a trainer with its model
            training = bool(trainer.model.training)
            step = int(trainer.state.global_step)
            if training and self.trainer_side is not None:
                self._guard("begin_step", self.trainer_side.begin_step, step)
            self._outputs = []
            out = original(*args, **kwargs)
            if training:
                self._guard("record_step", self._record, step, out)
            self._outputs = []
            return out

        return generate_score_and_record

    def _after_sync(self, sync: Callable[[], None]) -> Callable[[], None]:
        def sync_and_tell() -> None:
            sync()
            assert self.trainer is not None and self.session is not None
            digest = self._digest() if self.weight_digest else None
            self._guard(
                "weights_changed", self.session.weights_changed, int(self.trainer.state.global_step), digest
            )

        return sync_and_tell

    def _sync_with_isoaudit(self) -> None:
        """TRL's colocate sync through vLLM's in-place reload; both sides then carry the version."""
        trainer = self.trainer
        assert trainer is not None
        version = int(trainer.state.global_step)
        digest = reload_sync(_grpo(trainer).vllm_generation, version, digest=self.weight_digest)
        if self.trainer_side is not None:
            self._guard("weights_changed", self.trainer_side.weights_changed, version, digest)

    def _digest(self) -> str:
        from isoaudit.collectors.vllm.weights import weight_digest

        assert self.trainer is not None
        return weight_digest(list(_grpo(self.trainer).vllm_generation._iter_named_params()))

    # ------------------------------------------------------------------ recording

    def _record(self, step: int, out: Mapping[str, Any]) -> None:
        trainer = self.trainer
        assert trainer is not None and self.trainer_side is not None
        pad = getattr(trainer.processing_class, "pad_token_id", None)
        batch = batch_of(out, temperature=float(_grpo(trainer).temperature), pad_token_id=pad)
        logprobs = out.get("old_per_token_logps")
        self.trainer_side.record_step(
            step, batch, logprobs=logprobs, logprobs_layout="completion" if logprobs is not None else "auto"
        )
        if isinstance(self.rollout_side, GivenLogprobs):
            sampled = out.get("sampling_per_token_logps")
            if sampled is not None:
                self.rollout_side.record_step(step, batch, sampled, logprobs_layout="completion")
        elif self.rollout_side is not None and self._outputs:
            self.rollout_side.record_step(step, local_outputs(trainer, self._outputs, batch.num_samples))
        self.steps_recorded.append(step)

    def _guard(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            if self.session_args.get("strict"):
                raise
            self._failed(where, exc)
            return None

    def _failed(self, where: str, exc: Exception) -> None:
        self.errors += 1
        self._warn.warn(
            where, f"isoaudit TRL callback: {where} failed ({type(exc).__name__}: {exc}); counted"
        )


# ---------------------------------------------------------------------- helpers


def reload_sync(generation: Any, version: int, *, digest: bool = False) -> str | None:
    """What TRL's colocate ``VLLMGeneration.sync_weights`` does, through vLLM's in-place reload
    (:func:`isoaudit.collectors.vllm.load_weights`) instead of per-parameter ``load_weights``, which the CPU
    build of vLLM cannot take: the tensors TRL would send, by TRL's own names, as weight
    ``version``. Unsharded parameters only (no FSDP/ZeRO-3 gather). Returns the digest, if asked."""
    from isoaudit.collectors.vllm.weights import load_weights

    if getattr(generation, "enable_sleep_mode", False):
        generation.llm.wake_up(tags=["weights"])
        generation._llm_weights_sleeping = False
    items = [(name, param.detach()) for name, param in generation._iter_named_params()]
    value = load_weights(generation.llm, items, version, digest=digest)
    generation.llm.reset_prefix_cache()
    return value


def find_trainer(callback: TrainerCallback) -> Trainer:
    """The ``Trainer`` whose callback handler holds ``callback``, found in the calling frames
    (transformers passes callbacks the model, not the trainer; ``on_train_begin`` runs inside
    ``Trainer.train``)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in owner.callback_handler.callbacks:
            return owner
        frame = frame.f_back  # type: ignore[assignment]  # the walk stops when f_back is None
    raise RuntimeError("trainer: not found from the callback; pass it: IsoauditCallback(trainer, run=...)")


def engine_of(trainer: Trainer) -> Any | None:
    """The ``vllm.LLM`` TRL generates with in this process (colocate mode), else ``None``."""
    if not getattr(trainer, "use_vllm", False) or getattr(trainer, "vllm_mode", None) != "colocate":
        return None
    generation = getattr(trainer, "vllm_generation", None)
    return getattr(generation, "llm", None)


def local_outputs(trainer: Trainer, outputs: Sequence[Any], n_local: int) -> list[Any]:
    """This rank's share of the engine's outputs: with ``vllm_tensor_parallel_size > 1`` every rank
    of a TP group generates the group's prompts and keeps its own slice (as TRL does)."""
    generation = _grpo(trainer).vllm_generation
    if getattr(generation, "tensor_parallel_size", 1) > 1:
        rank = torch.distributed.get_rank(group=generation.tp_group)
        return list(outputs[rank * n_local : (rank + 1) * n_local])
    return list(outputs)


def batch_of(out: Mapping[str, Any], *, temperature: float, pad_token_id: int | None) -> StepBatch:
    """A :class:`StepBatch` over exactly the tensors TRL's recompute forward ran on (left-padded
    prompts ‖ right-padded completions), so the trainer collector can reuse that forward."""
    prompt_ids, prompt_mask = out["prompt_ids"], out["prompt_mask"]
    completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
    lengths = completion_mask.sum(1)
    empty = lengths == 0  # mask_truncated_completions zeroes a truncated row: its tokens stay
    if bool(empty.any()):
        real = (
            completion_ids != pad_token_id
            if pad_token_id is not None
            else torch.ones_like(completion_ids, dtype=torch.bool)
        )
        width = completion_ids.shape[1]
        last = width - real.flip(1).int().argmax(1)
        lengths = torch.where(empty, torch.where(real.any(1), last, torch.zeros_like(last)), lengths)
    columns = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    mask = torch.cat([prompt_mask, (columns < lengths.unsqueeze(1)).to(prompt_mask.dtype)], dim=1)
    advantages = out.get("advantages")  # this process's slice of TRL's advantages, one per sample
    if not isinstance(advantages, torch.Tensor) or advantages.numel() != prompt_ids.shape[0]:
        advantages = None
    return StepBatch.from_tensors(
        torch.cat([prompt_ids, completion_ids], dim=1),
        prompt_mask.sum(1).tolist(),
        attention_mask=mask,
        temperature=temperature,
        advantages=advantages.reshape(-1) if advantages is not None else None,
    )


def step_stats_of(run_id: str, step: int, logs: Mapping[str, Any]) -> StepStats:
    """TRL's logged figures as one :class:`StepStats` (named fields where they fit, the rest as
    extras under TRL's own names; non-numbers and non-finite values are left out)."""
    named: dict[str, float] = {}
    extras: dict[str, float] = {}
    for name, value in logs.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        if name in STAT_FIELDS:
            named[STAT_FIELDS[name]] = float(value)
        elif len(extras) < MAX_EXTRAS and 0 < len(name) <= 128:
            extras[name] = float(value)
    if named.get("reward_std", 0.0) < 0 or named.get("entropy", 0.0) < 0:
        named = {k: v for k, v in named.items() if k not in ("reward_std", "entropy") or v >= 0}
    if not 0 <= named.get("clip_fraction", 0.0) <= 1:
        named.pop("clip_fraction")
    # validated as the keyword call would be; a dict, as the named fields vary (all floats)
    return StepStats.model_validate({"run_id": run_id, "step": step, "extras": extras, **named})
