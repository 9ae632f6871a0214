"""TRL: a ``GRPOTrainer`` whose rollout correction comes from this library.

TRL (``trl.GRPOTrainer``) corrects the vLLM/trainer mismatch with its own
``vllm_importance_sampling_correction`` (four modes, see :func:`config_from_trl_args`) and only
when generation runs on vLLM. :class:`RolloutCorrectionGRPOTrainer` replaces that step:

* any :class:`~rollout_correction.RolloutCorrectionConfig` (preset name, dict or config) — or,
  when none is given, TRL's own four modes mapped onto ours;
* the correction is computed once per generation batch (batch-level statistics over the whole
  batch — across all processes under ``torch.distributed`` — not per micro-batch), its IS weights
  reach the loss and its rejection mask removes the rejected tokens from the loss denominator;
* every ``rollout_corr/...`` metric is logged through TRL's logger (``trainer._metrics`` → the
  ``log`` call → W&B / TensorBoard / ``trainer.state.log_history``);
* when generation is plain ``transformers`` ``generate`` (no vLLM), the per-token sampling
  log-probs are taken from the generation step itself: log-softmax of the processed scores
  (after temperature / top-k / top-p) at the sampled token. ``rollout_autocast_dtype`` runs that
  generation under CPU/GPU autocast (e.g. ``torch.bfloat16``), which reproduces the precision
  gap between a reduced-precision sampler and the fp32 trainer.

How the weights reach TRL's loss: with vLLM and TRL's correction switched on, TRL multiplies its
per-token loss by ``inputs["importance_sampling_ratio"]``; we put our weights there. Otherwise
the weights are folded into the per-token advantages, ``A_t ← w_t · A``, which is the same thing
for every TRL loss that is positively homogeneous in the advantage (PPO-clip ``grpo``/``bnpo``/
``dr_grpo``/``dapo``/``luspo``, ``cispo``, ``sapo``):
``−min(r·wA, clip(r)·wA) = −w · min(r·A, clip(r)·A)`` for w ≥ 0. The rejection mask goes into
``inputs["tool_mask"]``, which TRL multiplies into the loss mask only (the attention mask is
untouched). Bypass configs (``bypass_mode=True`` with ``loss_type="ppo_clip"``) replace TRL's
``old_per_token_logps`` by the sampling log-probs so PPO clips against the rollout policy.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Mapping, Optional, Union

import torch

from rollout_correction import RolloutCorrectionConfig, as_config, compute_rollout_correction

try:  # the adapter is importable without TRL; the trainer class needs it.
    from trl import GRPOTrainer as _GRPOTrainer
except ImportError:  # pragma: no cover - exercised only without trl installed
    _GRPOTrainer = None

__all__ = [
    "TRL_IS_MODES",
    "config_from_trl_args",
    "resolve_config",
    "SamplingLogProbRecorder",
    "RolloutCorrectionGRPOTrainer",
]

TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


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


if _GRPOTrainer is not None:

    class RolloutCorrectionGRPOTrainer(_GRPOTrainer):
        """``trl.GRPOTrainer`` with this library's rollout correction (see the module docstring).

        Extra arguments:
            rollout_correction: preset name, dict, :class:`RolloutCorrectionConfig`, or None
                (map TRL's ``vllm_importance_sampling_*`` settings).
            rollout_autocast_dtype: dtype for generation under autocast when generation is not
                vLLM (e.g. ``torch.bfloat16``); None generates in the model's own precision.
        """

        def __init__(
            self,
            *args: Any,
            rollout_correction: Union[None, str, Mapping[str, Any], RolloutCorrectionConfig] = None,
            rollout_autocast_dtype: Optional[torch.dtype] = None,
            **kwargs: Any,
        ):
            super().__init__(*args, **kwargs)
            self.rollout_correction = resolve_config(rollout_correction, self.args)
            self.rollout_autocast_dtype = rollout_autocast_dtype
            if self.rollout_correction.bypass_mode and self.rollout_correction.loss_type != "ppo_clip":
                raise ValueError(
                    "bypass_mode with loss_type='reinforce' needs a REINFORCE loss, which TRL's GRPO "
                    "losses do not have; use loss_type='ppo_clip' (bypass PPO) or a decoupled preset"
                )
            if self.loss_type == "vespo":
                raise ValueError("loss_type='vespo' builds its own weights from TRL's ratio; not supported here")

        # ---------------------------------------------------------------- generation
        def _generate_single_turn(self, *args: Any, **kwargs: Any):
            if self.use_vllm:
                return super()._generate_single_turn(*args, **kwargs)
            model = self.accelerator.unwrap_model(self.model)
            with SamplingLogProbRecorder(model, self.rollout_autocast_dtype) as recorder:
                completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            if logprobs is None and recorder.log_probs is not None:
                logprobs = recorder.per_row([len(ids) for ids in completion_ids])
            return completion_ids, logprobs

        # ---------------------------------------------------------------- correction
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            return self._apply_rollout_correction(out, "train" if self.model.training else "eval")

        def _apply_rollout_correction(self, out: dict[str, Any], mode: str) -> dict[str, Any]:
            """Compute the correction for one generation batch and route it into TRL's loss inputs."""
            rollout = out.get("sampling_per_token_logps")
            if rollout is None:
                raise RuntimeError(
                    "no sampling log-probs reached the trainer: use vLLM or plain transformers "
                    "generate (paged generation returns no scores), and a custom rollout_func must "
                    "return the sampled tokens' log-probs under the key 'logprobs'"
                )
            completion_mask = out["completion_mask"]
            mask = completion_mask if "tool_mask" not in out else completion_mask * out["tool_mask"]
            old = out.get("old_per_token_logps")
            if old is None:
                old = self._trainer_log_probs(out, mode)
            cfg = self.rollout_correction
            # Each process holds its slice of the generation batch; batch statistics (normalisation,
            # ESS, every metric) are reduced over all of them.
            group = torch.distributed.group.WORLD if _distributed() else None
            result = compute_rollout_correction(old, rollout.to(old.dtype), mask, cfg, process_group=group)

            # Rejected tokens (rejection sampling, veto, non-finite rows) leave the loss mask only.
            new_mask = result.response_mask.to(completion_mask.dtype)
            out["tool_mask"] = new_mask
            weights = result.weights
            trl_applies_ratio = self.use_vllm and self.vllm_importance_sampling_correction
            if cfg.bypass_mode:
                out["old_per_token_logps"] = torch.where(new_mask.bool(), rollout.to(old.dtype), old)
                weights = None  # bypass PPO: IS is diagnostic only
            elif out.get("old_per_token_logps") is None:
                out["old_per_token_logps"] = old
            if trl_applies_ratio:
                out["importance_sampling_ratio"] = (
                    weights if weights is not None else torch.ones_like(old)
                )
            elif weights is not None:
                adv = out["advantages"]
                adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
                out["advantages"] = adv * weights.to(adv.dtype)
            for name, value in result.metrics_as_floats().items():
                self._metrics[mode][name].append(value)
            return out

        def _trainer_log_probs(self, out: dict[str, Any], mode: str) -> torch.Tensor:
            """π_old on the generated tokens: one no-grad forward of the training model."""
            if "pixel_values" in out:
                raise NotImplementedError(
                    "multimodal inputs without TRL's own old log-probs are not supported; set "
                    "steps_per_generation so that TRL computes old_per_token_logps"
                )
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
            raise ImportError("RolloutCorrectionGRPOTrainer needs TRL: pip install 'trl==1.16.0'")
