"""OpenRLHF: its train/rollout correction options mapped onto ours, and a drop-in policy loss.

OpenRLHF's ``PolicyLoss`` (``openrlhf/models/loss.py``) corrects the vLLM/DeepSpeed mismatch
inside its forward. Two generations of options exist:

* 0.10.x: ``--algo.advantage.is_correction_enable``, ``--algo.advantage.is_correction_type``
  ``tis | icepop | seq-mask-tis`` and ``--algo.advantage.is_correction_threshold LOW HIGH``
  (``PolicyLoss(enable_vllm_is_correction, vllm_is_truncated_threshold, vllm_is_correction_type)``);
* 0.11.x: ``--algo.advantage.is_correction_level off | token | seq``, ``..._mode mask | clip``,
  ``..._gating ratio | binary_kl | tv`` and the same threshold (one value = upper bound only).

:func:`config_from_openrlhf` maps either onto a :class:`~rollout_correction.RolloutCorrectionConfig`
(ρ_t = π_old(y_t)/π_rollout(y_t), ``[lo, hi]`` the threshold):

=================================  ==============================================================
OpenRLHF                           ours
=================================  ==============================================================
``tis`` (token + clip)             token IS, w_t = clamp(ρ_t, lo, hi)  (``rollout_is_mode="clip"``)
``icepop`` (token + mask)          token IcePop, w_t = ρ_t·1[lo ≤ ρ_t ≤ hi], mask unchanged
``seq-mask-tis`` (seq + mask)      rejection of sequences whose geometric mean ρ̄ = exp(mean log ρ_t)
                                   lies outside [lo, hi] (``seq_mean_k1``) and token IS
                                   w_t = clamp(ρ_t, lo, hi) on the kept ones
=================================  ==============================================================

Two deliberate differences, both fixes:

* ``seq-mask-tis`` in OpenRLHF multiplies the loss by the *unclamped* token ratio exp(log ρ_t)
  (no bound at all, OpenRLHF #1295): one token with log ρ_t ≳ 89 in an accepted sequence makes
  the fp32 loss ``inf`` and its gradient NaN. Here the token weight is clamped to [lo, hi]
  (OpenRLHF's own TIS bound) after a ±20 log-space clamp.
* a rejected sequence leaves the loss denominator (its tokens are removed from the action mask);
  OpenRLHF only zeroes their loss, so they still dilute the token mean.

The geometric mean is taken over per-token log-ratios clamped to ±20 (OpenRLHF: unclamped), so a
row whose band decision hinges on one log-ratio beyond ±20 can be decided differently.

:class:`RolloutCorrectionPolicyLoss` is the drop-in: it wraps an OpenRLHF ``PolicyLoss`` built
with its own correction off, computes our correction, and hands the wrapped loss the advantages
scaled by the weights and the action mask with the rejections applied:
``−min(r·wA, clip(r)·wA) = −w·min(r·A, clip(r)·A)`` for w ≥ 0, and the same holds for dual clip,
so the per-token loss is exactly ``w_t`` times OpenRLHF's, and OpenRLHF's aggregation
(token-level or per-sample mean, data-parallel denominators) is used unchanged.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

__all__ = [
    "OPENRLHF_CORRECTION_TYPES",
    "config_from_openrlhf",
    "config_from_openrlhf_args",
    "RolloutCorrectionPolicyLoss",
]

OPENRLHF_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")
_LEVEL_MODE_TO_TYPE = {("token", "clip"): "tis", ("token", "mask"): "icepop", ("seq", "mask"): "seq-mask-tis"}


def _band(threshold: Sequence[float] | float) -> tuple[float, float]:
    values = [float(threshold)] if isinstance(threshold, (int, float)) else [float(v) for v in threshold]
    if len(values) == 1:  # OpenRLHF 0.11: a single value is an upper bound only
        values = [0.0, values[0]]
    if len(values) != 2:
        raise ValueError(f"is_correction_threshold={threshold!r}: expected HIGH or LOW HIGH")
    lo, hi = values
    if not (0.0 <= lo < hi):
        raise ValueError(f"is_correction_threshold={threshold!r}: need 0 <= LOW < HIGH")
    return lo, hi


def _fmt(x: float) -> str:
    return repr(float(x))


def config_from_openrlhf(
    is_correction_type: Optional[str] = "tis",
    is_correction_threshold: Sequence[float] | float = (0.5, 5.0),
    *,
    is_correction_level: Optional[str] = None,
    is_correction_mode: str = "mask",
    is_correction_gating: str = "ratio",
) -> RolloutCorrectionConfig:
    """Our config for OpenRLHF's correction options (see the module table).

    Give ``is_correction_type`` (0.10.x) or ``is_correction_level``/``_mode``/``_gating`` (0.11.x;
    ``level="off"`` gives the disabled config). ``gating`` other than ``"ratio"`` (OpenRLHF's
    binary-KL / TV trust regions) has no counterpart here and raises.
    """
    if is_correction_level is not None:
        if is_correction_level == "off":
            return RolloutCorrectionConfig.disabled()
        if is_correction_gating != "ratio":
            raise ValueError(
                f"is_correction_gating={is_correction_gating!r} has no rollout-correction counterpart; "
                "only 'ratio' gating maps (tis / icepop / seq-mask-tis)"
            )
        key = (is_correction_level, is_correction_mode)
        if key not in _LEVEL_MODE_TO_TYPE:
            raise ValueError(
                f"is_correction_level={is_correction_level!r} with is_correction_mode={is_correction_mode!r} "
                f"is not a valid OpenRLHF combination; valid: {sorted(_LEVEL_MODE_TO_TYPE)}"
            )
        is_correction_type = _LEVEL_MODE_TO_TYPE[key]
    if is_correction_type is None:
        return RolloutCorrectionConfig.disabled()
    if is_correction_type not in OPENRLHF_CORRECTION_TYPES:
        raise ValueError(
            f"is_correction_type={is_correction_type!r} is not one of {list(OPENRLHF_CORRECTION_TYPES)}"
        )
    lo, hi = _band(is_correction_threshold)
    if is_correction_type == "icepop":
        return RolloutCorrectionConfig.from_dict(
            {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_threshold": hi,
             "rollout_is_threshold_lower": lo}
        )
    token_clip = {"rollout_is": "token", "rollout_is_mode": "clip", "rollout_is_threshold": hi,
                  "rollout_is_threshold_lower": lo}
    if is_correction_type == "tis":
        return RolloutCorrectionConfig.from_dict(token_clip)
    if lo <= 0.0:
        raise ValueError(
            "seq-mask-tis needs a positive LOW bound: the geometric-mean ratio band is [LOW, HIGH]"
        )
    return RolloutCorrectionConfig.from_dict(
        {**token_clip, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": f"{_fmt(lo)}_{_fmt(hi)}"}
    )


def config_from_openrlhf_args(args: Any) -> RolloutCorrectionConfig:
    """Read OpenRLHF's parsed CLI namespace (``args.algo.advantage.is_correction_*``), either generation."""
    adv = args.algo.advantage
    if hasattr(adv, "is_correction_level"):
        return config_from_openrlhf(
            None, adv.is_correction_threshold, is_correction_level=adv.is_correction_level,
            is_correction_mode=getattr(adv, "is_correction_mode", "mask"),
            is_correction_gating=getattr(adv, "is_correction_gating", "ratio"),
        )
    if not getattr(adv, "is_correction_enable", False):
        return RolloutCorrectionConfig.disabled()
    return config_from_openrlhf(adv.is_correction_type, adv.is_correction_threshold)


class RolloutCorrectionPolicyLoss(torch.nn.Module):
    """Drop-in for OpenRLHF's ``PolicyLoss`` with this library's correction step.

    Args:
        policy_loss: an OpenRLHF ``PolicyLoss`` built with its own correction off
            (``enable_vllm_is_correction=False`` in 0.10.x, ``is_correction_level="off"`` in 0.11.x).
        config: the correction (e.g. from :func:`config_from_openrlhf_args`).

    ``forward`` takes OpenRLHF's arguments and returns what the wrapped loss returns, with
    ``vllm_kl`` = mean over valid tokens of (log π_rollout − log π_old) and, for the 0.11.x
    five-tuple, ``is_filter_ratio`` = the fraction of valid tokens whose ratio lies outside the
    band (tis / icepop) or of sequences rejected (seq-mask-tis). Our metrics of the last call
    (``rollout_corr/...``, 0-d tensors) are in ``self.last_metrics``.
    """

    def __init__(self, policy_loss: torch.nn.Module, config: RolloutCorrectionConfig):
        super().__init__()
        if getattr(policy_loss, "enable_vllm_is_correction", False) or getattr(
            policy_loss, "is_correction_level", "off"
        ) != "off":
            raise ValueError(
                "wrap a PolicyLoss whose own correction is off (enable_vllm_is_correction=False / "
                "is_correction_level='off'); otherwise the correction would be applied twice"
            )
        if config.bypass_mode:
            raise ValueError("bypass configs replace π_old by π_rollout before the loss; pass "
                             "rollout log-probs as old_log_probs instead of wrapping the loss")
        self.policy_loss = policy_loss
        self.config = config
        self.last_metrics: dict[str, torch.Tensor] = {}

    @classmethod
    def from_args(cls, args: Any, policy_loss_cls: Any = None) -> "RolloutCorrectionPolicyLoss":
        """Build from OpenRLHF's parsed args, as ``ppo_actor.py`` builds its ``PolicyLoss``."""
        if policy_loss_cls is None:
            from openrlhf.models import PolicyLoss as policy_loss_cls  # noqa: N813
        kwargs = dict(
            clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
            dual_clip=args.actor.dual_clip, token_level_loss=args.actor.loss_agg_mode == "token-mean",
            policy_loss_type=args.actor.policy_loss_type,
        )
        if hasattr(args.algo.advantage, "is_correction_level"):
            kwargs["is_correction_level"] = "off"
        else:
            kwargs["enable_vllm_is_correction"] = False
        return cls(policy_loss_cls(**kwargs), config_from_openrlhf_args(args))

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ):
        if action_mask is None:
            action_mask = torch.ones_like(log_probs)
        if rollout_log_probs is None:
            raise ValueError("rollout_log_probs is required: enable vLLM log-probs in OpenRLHF's sampler")
        result = compute_rollout_correction(old_log_probs.detach(), rollout_log_probs, action_mask, self.config)
        self.last_metrics = result.metrics
        mask = result.response_mask.to(action_mask.dtype)
        if result.weights is not None:
            advantages = advantages * result.weights.to(advantages.dtype)
        out = self.policy_loss(
            log_probs, old_log_probs, advantages, action_mask=mask, rollout_log_probs=rollout_log_probs,
            dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
        )
        valid = action_mask.bool()
        n_valid = valid.sum().clamp(min=1)
        diff = torch.where(valid, rollout_log_probs.float() - old_log_probs.float(), 0.0)
        diff = torch.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0)
        vllm_kl = diff.sum() / n_valid
        out = list(out)
        out[3] = vllm_kl
        if len(out) >= 5:  # 0.11.x: the fraction of gated units, at the gate's own granularity
            m = result.metrics
            if self.config.rs_options:
                out[4] = m["rollout_corr/rollout_rs_seq_masked_fraction"]
            else:
                out[4] = m["rollout_corr/rollout_is_ratio_fraction_high"] + m["rollout_corr/rollout_is_ratio_fraction_low"]
        return tuple(out)
