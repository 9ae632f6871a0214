"""TRL: a ``GRPOTrainer`` whose rollout correction comes from this library.

Tested with TRL 1.16 (``SUPPORTED_TRL``): the trainer overrides private ``GRPOTrainer`` steps, so
constructing it under another TRL release raises, naming the installed and the supported versions.

TRL (``trl.GRPOTrainer``) corrects the vLLM/trainer mismatch with its own
``vllm_importance_sampling_correction`` (four modes, see :func:`config_from_trl_args`) and only
when generation runs on vLLM. :class:`RolloutCorrectionGRPOTrainer` replaces that step:

* any :class:`~rollout_correction.RolloutCorrectionConfig` (preset name, dict or config) — or,
  when none is given, TRL's own four modes mapped onto ours;
* the correction is computed once per generation batch, in TRL's generation/scoring step
  (batch-level statistics over the whole batch — across all processes under
  ``torch.distributed`` — not per micro-batch), right where TRL computes its loss counts, so every
  ``loss_type`` sees the same masks and counts;
* every ``rollout_corr/...`` metric is logged through TRL's logger (``trainer._metrics`` → the
  ``log`` call → W&B / TensorBoard / ``trainer.state.log_history``);
* the sampling log-probs come from vLLM, from ``transformers`` ``generate`` (log-softmax of the
  processed scores — after temperature / top-k / top-p — at the sampled token) or from
  ``transformers`` continuous batching (``generate_batch`` with ``return_logprobs``, switched on
  by the trainer). ``rollout_autocast_dtype`` runs plain ``generate`` under CPU/GPU autocast
  (e.g. ``torch.bfloat16``), which reproduces the precision gap between a reduced-precision
  sampler and the fp32 trainer.

What reaches TRL's loss, per generation batch (m = TRL's loss mask, a = this library's
acceptance mask, w = IS weights):

* **Loss mask** m·a, through ``inputs["tool_mask"]`` (TRL multiplies it into the loss mask only;
  the attention mask is untouched). Rejected tokens therefore leave every per-micro-batch token
  count TRL takes from the mask (``grpo``/``sapo`` per-sequence lengths, ``bnpo``, the entropy
  bonus).
* **``num_items_in_batch``** (``dapo``/``cispo``/``vespo``) recomputed from m·a exactly as TRL
  computes it from m: the sum of the mask over the local generation batch, gathered and summed
  over all processes; TRL then rescales it to one accumulation window itself.
* **Sequence averages** (``grpo``/``sapo``/``luspo`` average over the rows of a micro-batch,
  ``dr_grpo`` divides by rows × ``max_completion_length``): a row whose every loss token was
  rejected leaves them. TRL divides by the row count B of each micro-batch; the policy term is
  multiplied by s = N / N_kept (N rows in the generation batch over all processes, N_kept of them
  with a token left), and so is ``beta`` for the KL term, so that over the accumulation window
  and the processes the loss is Σ_kept(row term) / N_kept. Rows TRL itself masks
  (``mask_truncated_completions``) stay counted, as in TRL.
* **IS weights**: with vLLM and TRL's correction switched on, through
  ``inputs["importance_sampling_ratio"]``, which TRL multiplies into its per-token loss;
  otherwise folded into the per-token advantages, ``A_t ← w_t · s · A``, the same thing for every
  TRL loss, all positively homogeneous in the advantage:
  ``−min(r·wA, clip(r)·wA) = −w · min(r·A, clip(r)·A)`` for w ≥ 0 (PPO-clip ``grpo``/``bnpo``/
  ``dr_grpo``/``dapo``/``luspo``; ``cispo`` and ``sapo`` are linear in A). ``vespo`` builds its
  gamma weight φ from the sequence ratio times TRL's ``importance_sampling_ratio``; there our
  token weights go into that input (1 off the loss mask), as TRL's ``token_*`` modes do.
* **Bypass** configs (``bypass_mode=True`` with ``loss_type="ppo_clip"``) replace TRL's
  ``old_per_token_logps`` by the sampling log-probs so PPO clips against the rollout policy.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Mapping, Optional, Union

import torch

from rollout_correction import RolloutCorrectionConfig, as_config, compute_rollout_correction
from rollout_correction_core import Parallel

try:  # the adapter is importable without TRL; the trainer class needs it.
    import trl as _trl
    from trl import GRPOTrainer as _GRPOTrainer
except ImportError:  # pragma: no cover - exercised only without trl installed
    _trl = None
    _GRPOTrainer = None

__all__ = [
    "SUPPORTED_TRL",
    "TRL_LOSS_TYPES",
    "TRL_IS_MODES",
    "check_trl_version",
    "config_from_trl_args",
    "resolve_config",
    "SamplingLogProbRecorder",
    "RolloutCorrectionGRPOTrainer",
]

SUPPORTED_TRL = ">=1.16,<1.17"
"""The TRL releases this adapter is tested with (also the pin of the ``[trl]`` extra)."""

TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

TRL_LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "cispo", "dapo", "vespo", "luspo")
"""Every ``GRPOConfig.loss_type`` of TRL 1.16."""

_SEQUENCE_AVERAGED = ("grpo", "sapo", "luspo", "dr_grpo")  # TRL divides by the micro-batch's row count
_SCALE_KEY = "rollout_corr_sequence_scale"  # s = N / N_kept, a 0-d tensor in the loss inputs


def check_trl_version(version: Optional[str] = None) -> None:
    """Raise unless ``version`` (default: the installed TRL's) is in :data:`SUPPORTED_TRL`.

    The trainer overrides private ``GRPOTrainer`` steps (generation, scoring, loss) whose inputs
    change between TRL releases; outside the tested range it would train with wrong masks or
    denominators without a word, so it refuses instead.
    """
    from packaging.specifiers import SpecifierSet

    if version is None:
        if _trl is None:
            raise ImportError(f"RolloutCorrectionGRPOTrainer needs TRL: pip install 'trl{SUPPORTED_TRL}'")
        version = _trl.__version__
    if version not in SpecifierSet(SUPPORTED_TRL, prereleases=True):
        raise RuntimeError(
            f"RolloutCorrectionGRPOTrainer is tested with trl{SUPPORTED_TRL} and overrides private "
            f"GRPOTrainer methods; the installed trl is {version}. Install a supported release: "
            f"pip install 'rollout-correction[trl]' (or 'trl{SUPPORTED_TRL}')"
        )


def config_from_trl_args(
    mode: str = "sequence_mask",
    clip_min: Optional[float] = None,
    clip_max: Optional[float] = 3.0,
) -> RolloutCorrectionConfig:
    """Map TRL's ``vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max`` onto our config.

    ρ_t = π_old(y_t)/π_rollout(y_t); "sequence" means ∏_t ρ_t.

    ========================  ===================================================================
    TRL mode                  our config
    ========================  ===================================================================
    ``token_truncate``        ``rollout_is="token"``, w = min(ρ_t, C_max)  (TIS); with C_min set,
                              w = clamp(ρ_t, C_min, C_max)  (``rollout_is_mode="clip"``)
    ``sequence_truncate``     the same with ``rollout_is="sequence"``
    ``token_mask``            ``rollout_is="token"``, ``rollout_is_mode="mask"`` (IcePop):
                              w = ρ_t·1[C_min ≤ ρ_t ≤ C_max], loss mask unchanged; C_min = 0 when
                              TRL's is None (TRL then has no lower bound)
    ``sequence_mask``         the same with ``rollout_is="sequence"``
    ========================  ===================================================================

    Differences from TRL, on purpose: log-ratios are clamped to ±20 before ``exp`` (TRL's
    sequence product overflows to ``inf`` on long sequences), and a NaN/±inf log-prob at a valid
    position rejects its sequence (TRL sets the token's ratio to 1 instead).
    """
    if mode not in TRL_IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of {list(TRL_IS_MODES)}")
    if clip_max is None or not math.isfinite(float(clip_max)) or float(clip_max) <= 0:
        raise ValueError(
            f"vllm_importance_sampling_clip_max={clip_max!r}: an upper bound > 0 is required to map "
            f"mode {mode!r} onto a rollout-correction config"
        )
    level = "token" if mode.startswith("token") else "sequence"
    data: dict[str, Any] = {"rollout_is": level, "rollout_is_threshold": float(clip_max)}
    if mode.endswith("_mask"):
        data["rollout_is_mode"] = "mask"
        data["rollout_is_threshold_lower"] = 0.0 if clip_min is None else float(clip_min)
    elif clip_min is not None:
        data["rollout_is_mode"] = "clip"
        data["rollout_is_threshold_lower"] = float(clip_min)
    return RolloutCorrectionConfig.from_dict(data)


def resolve_config(
    rollout_correction: Union[None, str, Mapping[str, Any], RolloutCorrectionConfig],
    trl_args: Any = None,
) -> RolloutCorrectionConfig:
    """Turn what a user passes (preset name, dict, config, or None) into a config.

    ``None`` reads TRL's own settings from ``trl_args`` (a ``GRPOConfig``): with
    ``vllm_importance_sampling_correction=False`` the correction is disabled (metrics only),
    otherwise its mode is mapped by :func:`config_from_trl_args`.
    """
    if isinstance(rollout_correction, (RolloutCorrectionConfig, str, Mapping)):
        return as_config(rollout_correction)
    if rollout_correction is not None:
        raise TypeError(
            "rollout_correction must be a preset name, a dict of config keys, a RolloutCorrectionConfig "
            f"or None, not {type(rollout_correction).__name__}"
        )
    if trl_args is None or not getattr(trl_args, "vllm_importance_sampling_correction", True):
        return RolloutCorrectionConfig.disabled()
    return config_from_trl_args(
        trl_args.vllm_importance_sampling_mode,
        trl_args.vllm_importance_sampling_clip_min,
        trl_args.vllm_importance_sampling_clip_max,
    )


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


class SamplingLogProbRecorder(contextlib.AbstractContextManager):
    """Record the sampler's per-token log-probs while ``model.generate`` runs.

    log π_rollout(y_t) = log_softmax(s_t)[y_t], with s_t the scores the sampler drew y_t from
    (logits after temperature, top-k, top-p — ``output_scores`` of ``generate``).

    Inside the ``with`` block, ``model.generate`` is wrapped (on the instance only) so that it
    asks for ``output_scores`` / ``return_dict_in_generate``, stores the log-probs of the
    generated tokens, and returns the token tensor as the unwrapped call would. With
    ``autocast_dtype`` the generation runs under ``torch.autocast`` in that dtype.
    The recorded tensor is ``(B, N)`` float32 for the N generated positions (positions after a
    row's EOS hold the log-prob of padding and are cut off by :meth:`per_row`).
    """

    def __init__(self, model: torch.nn.Module, autocast_dtype: Optional[torch.dtype] = None):
        self.model = model
        self.autocast_dtype = autocast_dtype
        self.log_probs: Optional[torch.Tensor] = None
        self._had_attr = False

    def __enter__(self) -> "SamplingLogProbRecorder":
        model = self.model
        original = model.generate
        self._had_attr = "generate" in vars(model)
        self._original = vars(model).get("generate")
        recorder = self

        def generate(*args: Any, **kwargs: Any):
            config = kwargs.get("generation_config")
            if config is not None:  # ask through the config the caller passed, on a copy
                config = copy.deepcopy(config)
                config.output_scores = True
                config.return_dict_in_generate = True
                kwargs["generation_config"] = config
            else:
                kwargs["output_scores"] = True
                kwargs["return_dict_in_generate"] = True
            ctx = contextlib.nullcontext()
            if recorder.autocast_dtype is not None:
                device_type = next(model.parameters()).device.type
                ctx = torch.autocast(device_type=device_type, dtype=recorder.autocast_dtype)
            with ctx:
                out = original(*args, **kwargs)
            n = len(out.scores)
            generated = out.sequences[:, out.sequences.shape[1] - n:]
            scores = torch.stack(out.scores, dim=1).float()  # (B, N, V)
            log_probs = torch.log_softmax(scores, dim=-1)
            recorder.log_probs = log_probs.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
            return out.sequences

        model.generate = generate
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._had_attr:
            self.model.generate = self._original
        else:
            del self.model.generate

    def per_row(self, lengths: list[int]) -> list[list[float]]:
        """The recorded log-probs cut to each row's kept completion length."""
        if self.log_probs is None:
            raise RuntimeError("model.generate was not called inside the recorder; no log-probs recorded")
        if len(lengths) != self.log_probs.shape[0]:
            raise ValueError(f"{len(lengths)} lengths for {self.log_probs.shape[0]} generated rows")
        rows = self.log_probs.cpu()
        return [rows[i, :n].tolist() for i, n in enumerate(lengths)]


def _check_supported(rollout_correction: Any, grpo_args: Any,
                     rollout_autocast_dtype: Optional[torch.dtype]) -> RolloutCorrectionConfig:
    """The config for ``grpo_args`` (a ``GRPOConfig``), or a ValueError naming what to change."""
    cfg = resolve_config(rollout_correction, grpo_args)
    cfg.refuse_segments("TRL's GRPOTrainer")
    loss_type = grpo_args.loss_type
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of TRL 1.16's {list(TRL_LOSS_TYPES)}")
    if cfg.loss_type != "ppo_clip":
        raise ValueError(
            f"rollout_correction has loss_type={cfg.loss_type!r}, a policy loss of this library; "
            f"under TRL the policy loss is TRL's own (GRPOConfig.loss_type={loss_type!r}). Keep "
            f"loss_type='ppo_clip' in the correction config and choose the loss in GRPOConfig "
            f"(e.g. loss_type='cispo'; importance_sampling_level='sequence' for GSPO); TRL has no "
            f"REINFORCE loss, so the bypass_pg_* presets have no TRL counterpart"
        )
    if cfg.loss_denominator == "valid":
        raise ValueError(
            "loss_denominator='valid' is not available with TRL: TRL's loss adds its KL (beta) and "
            "entropy terms on every token of the loss mask, so a rejected token kept in the mask would "
            "still carry them; rejected tokens leave TRL's loss mask and its denominators "
            "(loss_denominator='kept', the default)"
        )
    if cfg.rollout_opsm_delta is not None:
        raise ValueError(
            "rollout_opsm_delta (off-policy sequence masking) acts inside this library's loss, which "
            "TRL does not call; use TRL's own GRPOConfig.off_policy_mask_threshold instead"
        )
    if loss_type == "vespo" and cfg.rollout_is is not None and cfg.rollout_is != "token" and not cfg.bypass_mode:
        raise ValueError(
            f"loss_type='vespo' takes token-level IS weights into its gamma weight (as TRL's own "
            f"VESPO accepts only vllm_importance_sampling_mode='token_truncate'/'token_mask'); "
            f"rollout_is={cfg.rollout_is!r} is not supported with it: use rollout_is='token' "
            f"(or, with rollout_correction=None, vllm_importance_sampling_mode='token_truncate' or "
            f"'token_mask') or another loss_type"
        )
    if rollout_autocast_dtype is not None and (grpo_args.use_vllm or grpo_args.use_transformers_continuous_batching):
        raise ValueError(
            "rollout_autocast_dtype applies to plain transformers generate only; with use_vllm or "
            "use_transformers_continuous_batching the sampler's precision is its own: leave it None"
        )
    return cfg


@contextlib.contextmanager
def _recording_generate_batch(model: torch.nn.Module):
    """While active, ``model.generate_batch`` (transformers continuous batching) stores, in the
    yielded list, each request's sampled-token log-probs in the order of the returned dict."""
    recorded: list[list[float]] = []
    original = model.generate_batch
    had_attr = "generate_batch" in vars(model)

    def generate_batch(*args: Any, **kwargs: Any):
        outputs = original(*args, **kwargs)
        recorded[:] = [list(out.logprobs) for out in outputs.values()]
        return outputs

    model.generate_batch = generate_batch
    try:
        yield recorded
    finally:
        if had_attr:
            model.generate_batch = original
        else:
            del model.generate_batch


if _GRPOTrainer is not None:

    class RolloutCorrectionGRPOTrainer(_GRPOTrainer):
        """``trl.GRPOTrainer`` with this library's rollout correction (see the module docstring).

        Extra arguments:
            rollout_correction: preset name, dict, :class:`RolloutCorrectionConfig`, or None
                (map TRL's ``vllm_importance_sampling_*`` settings).
            rollout_autocast_dtype: dtype for plain ``generate`` under autocast (no vLLM, no
                continuous batching), e.g. ``torch.bfloat16``; None generates in the model's own
                precision.
            rollout_correction_dump_dir: a directory (default None: no dump) where each training
                generation batch's sampling and trainer log-probs, loss mask, completion lengths and
                ``state.global_step`` are written once, before the correction, as
                ``step_{N}[_rank_{R}].pt`` (:mod:`rollout_correction.integrations.dump`), for
                ``rollout-correction diagnose DIR``.
        """

        def __init__(
            self,
            *args: Any,
            rollout_correction: Union[None, str, Mapping[str, Any], RolloutCorrectionConfig] = None,
            rollout_autocast_dtype: Optional[torch.dtype] = None,
            rollout_correction_dump_dir: Optional[str] = None,
            **kwargs: Any,
        ):
            check_trl_version()
            # Refuse what cannot work before TRL loads models or starts vLLM (GRPOTrainer's third
            # positional argument is its GRPOConfig); without one, after TRL has built its default.
            grpo_args = kwargs.get("args", args[2] if len(args) > 2 else None)
            if grpo_args is not None:
                config = _check_supported(rollout_correction, grpo_args, rollout_autocast_dtype)
            super().__init__(*args, **kwargs)
            if grpo_args is None:
                config = _check_supported(rollout_correction, self.args, rollout_autocast_dtype)
            self.rollout_correction = config
            self.rollout_autocast_dtype = rollout_autocast_dtype
            self.rollout_correction_dump_dir = rollout_correction_dump_dir
            generate_every = self.args.steps_per_generation * self.num_iterations
            trl_computes_old = (self.use_vllm and self.vllm_importance_sampling_correction) or \
                self.args.gradient_accumulation_steps % generate_every != 0
            if self._is_vlm and not trl_computes_old:
                raise ValueError(
                    "a vision-language model needs TRL's own old log-probs (the trainer's extra forward has "
                    "no image inputs): use vLLM with vllm_importance_sampling_correction=True, or "
                    "num_iterations > 1, or gradient_accumulation_steps not a multiple of steps_per_generation"
                )
            if self.use_transformers_continuous_batching:
                # transformers' continuous batching returns the sampled tokens' log-probs (after the
                # logits processors: temperature, top-k, top-p) only when asked.
                self.continuous_batching_config.return_logprobs = True

        # ---------------------------------------------------------------- generation
        def _generate_single_turn(self, *args: Any, **kwargs: Any):
            if self.use_vllm:
                return super()._generate_single_turn(*args, **kwargs)
            model = self.accelerator.unwrap_model(self.model)
            if self.use_transformers_continuous_batching:
                with _recording_generate_batch(model) as recorded:
                    completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
                if logprobs is None:
                    lengths = [len(ids) for ids in completion_ids]
                    if [len(lp) for lp in recorded] != lengths:
                        raise RuntimeError(
                            "transformers generate_batch returned no log-prob per generated token "
                            f"(lengths {[len(lp) for lp in recorded]} for completions of {lengths}); "
                            "continuous_batching_config.return_logprobs must stay True"
                        )
                    logprobs = recorded
                return completion_ids, logprobs
            with SamplingLogProbRecorder(model, self.rollout_autocast_dtype) as recorder:
                completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            if logprobs is None and recorder.log_probs is not None:
                logprobs = recorder.per_row([len(ids) for ids in completion_ids])
            return completion_ids, logprobs

        # ---------------------------------------------------------------- correction
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            return self._apply_rollout_correction(out, "train" if self.model.training else "eval")

        def _global_sums(self, *counts: torch.Tensor) -> list[torch.Tensor]:
            """Σ over processes of each integer count, as TRL sums ``num_items_in_batch``: one gather."""
            local = torch.stack([c.to(torch.int64) for c in counts])
            total = self.accelerator.gather(local).view(-1, len(counts)).sum(0)
            return list(total.unbind())

        def _apply_rollout_correction(self, out: dict[str, Any], mode: str) -> dict[str, Any]:
            """Compute the correction for one generation batch and route it into TRL's loss inputs."""
            rollout = out.get("sampling_per_token_logps")
            if rollout is None:
                raise RuntimeError(
                    "no sampling log-probs reached the trainer: a custom rollout_func must return the "
                    "sampled tokens' log-probs under the key 'logprobs'"
                )
            completion_mask = out["completion_mask"]
            mask = completion_mask if "tool_mask" not in out else completion_mask * out["tool_mask"]
            old = out.get("old_per_token_logps")
            if old is None:
                old = self._trainer_log_probs(out, mode)
            if self.rollout_correction_dump_dir and mode == "train":
                from rollout_correction.integrations.dump import write_step_dump

                write_step_dump(self.rollout_correction_dump_dir, self.state.global_step, old_log_probs=old,
                                rollout_log_probs=rollout, response_mask=mask,
                                response_lengths=completion_mask.sum(-1),
                                rank=self.accelerator.process_index if self.accelerator.num_processes > 1 else None)
            cfg = self.rollout_correction
            # Each process holds its slice of the generation batch; batch statistics (normalisation,
            # ESS, every metric) are reduced over all of them.
            group = torch.distributed.group.WORLD if _distributed() else None
            result = compute_rollout_correction(
                old, rollout.to(old.dtype), mask, config=cfg, parallel=Parallel(dp_group=group))

            # Rejected tokens (rejection sampling, veto, non-finite rows) leave the loss mask only.
            new_mask = result.response_mask.to(completion_mask.dtype)
            out["tool_mask"] = new_mask
            rejected_rows = mask.bool().any(-1) & ~new_mask.bool().any(-1)
            num_items, num_rows, num_rejected = self._global_sums(
                new_mask.sum(), torch.tensor(mask.shape[0], device=mask.device), rejected_rows.sum())
            out["num_items_in_batch"] = num_items.to(out["num_items_in_batch"].dtype)
            scale = 1.0
            num_rows, num_rejected = int(num_rows), int(num_rejected)
            if self.loss_type in _SEQUENCE_AVERAGED and num_rows > num_rejected:
                scale = num_rows / (num_rows - num_rejected)
            out[_SCALE_KEY] = torch.tensor(scale, device=mask.device)

            weights = result.weights
            if cfg.bypass_mode:
                out["old_per_token_logps"] = torch.where(new_mask.bool(), rollout.to(old.dtype), old)
                weights = None  # bypass PPO: IS is diagnostic only
            elif out.get("old_per_token_logps") is None:
                out["old_per_token_logps"] = old
            adv = out["advantages"]
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
            if self.loss_type == "vespo":
                # TRL's VESPO reads the ratio inside its gamma weight: log w summed over the row.
                if weights is not None:
                    out["importance_sampling_ratio"] = torch.where(new_mask.bool(), weights, torch.ones_like(weights))
                else:
                    out.pop("importance_sampling_ratio", None)
            elif self.use_vllm and self.vllm_importance_sampling_correction:
                # TRL multiplies its per-token loss by this input itself.
                out["importance_sampling_ratio"] = weights if weights is not None else torch.ones_like(old)
            elif weights is not None:
                adv = adv * weights.to(adv.dtype)
            if scale != 1.0:
                adv = adv * scale
            if adv.dim() == 2 and adv.shape[1] == 1:
                adv = adv.squeeze(1)
            out["advantages"] = adv
            for name, value in result.metrics_as_floats().items():
                self._metrics[mode][name].append(value)
            return out

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            # The KL term sits inside TRL's per-token loss, added after the advantage-weighted
            # policy term: give it the same sequence scale through beta.
            scale = inputs.get(_SCALE_KEY)
            if self.beta == 0.0 or scale is None or float(scale) == 1.0:
                return super()._compute_loss(model, inputs)
            beta = self.beta
            self.beta = beta * float(scale)
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self.beta = beta

        def _trainer_log_probs(self, out: dict[str, Any], mode: str) -> torch.Tensor:
            """π_old on the generated tokens: one no-grad forward of the training model (text only;
            vision-language models are refused at construction unless TRL computes π_old)."""
            input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            batch_size = (
                self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
            )
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, out["completion_ids"].size(1), batch_size=batch_size
                )
            return old

else:  # pragma: no cover

    class RolloutCorrectionGRPOTrainer:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any):
            raise ImportError(f"RolloutCorrectionGRPOTrainer needs TRL: pip install 'trl{SUPPORTED_TRL}'")
