"""Drop-in for AReaL's ``areal.utils.functional.apply_rejection_sampling`` (1.0.4, and the
``metric="binary_kl"`` of its main branch), and AReaL's PPO actor with this library's correction.

An AReaL user can swap one import::

    # from areal.utils.functional import apply_rejection_sampling
    from rollout_correction.compat.areal import apply_rejection_sampling

``apply_rejection_sampling(proximal_logprobs, old_logprobs, loss_mask, cu_seqlens, config)`` keeps
AReaL's signature and returns its :class:`RejectionSamplingResult` (``loss_mask``,
``behave_imp_weight``, ``filtered_fraction``), for padded (B, T) inputs or packed 1-D ones with
``cu_seqlens``. ``config`` is AReaL's ``RejectionSamplingConfig`` or any object or mapping with its
fields (``level``, ``action``, ``metric``, ``agg``, ``upper``, ``lower``). With x_t = log π_prox(y_t)
− log π_behave(y_t) and ρ_t = exp(x_t), each AReaL setting is one of this library's criteria,
computed by its core (π_prox in the role of π_old, π_behave in that of π_rollout):

==========================  ===========================  ===========================================
AReaL metric                token level (keep)           sequence level, agg sum | mean | max (keep)
==========================  ===========================  ===========================================
``ratio``                   L ≤ ρ_t ≤ U: ``token_k1``    exp(Σx) | exp(mean x) in [L, U]:
                                                         ``seq_sum_k1`` | ``seq_mean_k1``; max: every
                                                         ρ_t ≤ U, the veto's high side
``kl_k1`` (x_t)             e^L ≤ ρ_t ≤ e^U              the same on Σx | mean x | max x
``kl_k2`` (x_t²/2)          ``token_k2`` ≤ U             ``seq_sum_k2`` | ``seq_mean_k2`` | ``seq_max_k2``
``kl_k3`` (1/ρ_t − 1 + x_t) ``token_k3`` ≤ U of π_behave ``seq_*_k3`` of π_behave / π_prox
                            / π_prox
``binary_kl`` (KPop)        ``token_kpop`` ≤ U           ``seq_sum_kpop`` | ``seq_mean_kpop`` | ``seq_max_kpop``
==========================  ===========================  ===========================================

(AReaL's k3 is this library's k3 with the two policies exchanged, so it is computed on the pair
exchanged.) ``behave_imp_weight`` is ρ_t, or exp(mean x) of the sequence at sequence level with
``metric="ratio"``, 0 where the returned mask is 0. ``action="mask"`` zeroes the mask of what the
criterion rejects; ``action="clamp"`` keeps the mask and clamps the weight to [L (0 without), U] —
every token's at token level, the rejected sequences' at sequence level. ``filtered_fraction``: the
share of valid tokens masked (mask) or whose weight the clamp changed (clamp).

Denominators: the mask is returned and the caller divides; AReaL's ``ppo_actor_loss_fn`` divides by
the count of the mask it was given (rejected tokens stay counted), so does :class:`RolloutCorrectionPPOActor`.

Differences a caller can see: a NaN / ±inf log-prob at a valid position drops its sequence
(mask and weight 0) where AReaL sets x_t = 0 and keeps the token at weight 1; x_t is clamped to
±20 before every exponential (a bound beyond e^±20 acts as e^±20); KPop clamps the probabilities
to [1e-6, 1 − 1e-6] (AReaL: 1e-8, which float32 rounds to [1e-8, 1]); a lower bound that no
criterion here can express (a lower bound on k2 / k3 / KPop above 0, or on the maximum) raises a
ConfigError naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import ConfigError, RolloutCorrectionConfig, compute_rollout_correction
from .. import config_value as _get
from ..primitives import bound_weights, lengths_from_cu_seqlens, pack_index, to_padded

__all__ = ["RejectionSamplingResult", "apply_rejection_sampling", "correction_settings", "AREAL_DEFAULTS"]

#: AReaL's ``RejectionSamplingConfig`` fields and defaults.
AREAL_DEFAULTS = {"level": "token", "action": "mask", "metric": "ratio", "agg": "mean", "upper": 5.0, "lower": None}
_CHOICES = {"level": ("token", "sequence"), "action": ("mask", "clamp"),
            "metric": ("ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl"), "agg": ("sum", "mean", "max")}
_ESTIMATORS = {"kl_k2": "k2", "kl_k3": "k3", "binary_kl": "kpop"}
_LEGACY = {"token": "token", "sum": "sequence", "mean": "geometric"}  # ratio bands on ρ_t, ∏ρ_t, exp(mean log ρ_t)


@dataclass
class RejectionSamplingResult:
    """AReaL's result: ``loss_mask`` (the input's dtype; unchanged under ``action="clamp"``),
    ``behave_imp_weight`` (float32, 0 where the mask is 0), ``filtered_fraction`` (a float)."""

    loss_mask: torch.Tensor
    behave_imp_weight: torch.Tensor
    filtered_fraction: float


def _read(config: Any) -> dict[str, Any]:
    c = {k: _get(config, k, d) for k, d in AREAL_DEFAULTS.items()}
    for key, allowed in _CHOICES.items():
        if c[key] not in allowed:
            raise ConfigError(f"rejection_sampling.{key}={c[key]!r} is invalid: allowed values are {list(allowed)}")
    if c["action"] == "clamp" and c["metric"] != "ratio":
        raise ConfigError(f"rejection_sampling.action='clamp' only supports metric='ratio' (it clamps the "
                          f"importance weight), got metric={c['metric']!r}; use action='mask'")
    if c["upper"] is None:
        raise ConfigError("rejection_sampling.upper is required (a number)")
    c["upper"] = float(c["upper"])
    c["lower"] = None if c["lower"] is None else float(c["lower"])
    return c


def correction_settings(config: Any) -> tuple[dict[str, Any], bool]:
    """This library's rejection settings for AReaL's ``config`` (table in the module docstring), and
    whether they apply to the exchanged pair (π_behave in the role of π_old: AReaL's k3)."""
    c = _read(config)
    metric, upper, lower = c["metric"], c["upper"], c["lower"]
    agg = "token" if c["level"] == "token" else c["agg"]
    if metric in ("ratio", "kl_k1"):
        if metric == "ratio" and lower is not None and lower <= 0:
            lower = None  # ρ > 0: no bound (AReaL's clamp action sets lower = 0)
        as_ratio = (lambda v: v) if metric == "ratio" else (lambda v: math.exp(min(v, 700.0)))
        hi = as_ratio(upper)
        lo = 0.0 if lower is None else as_ratio(lower)
        if agg == "max":
            if lower is not None:
                raise ConfigError(f"rejection_sampling.lower={lower} with agg='max' and metric={metric!r} "
                                  "(keep a sequence whose largest token ratio is at least the bound) has no "
                                  "equivalent here; use agg='sum' or 'mean', or leave lower unset")
            return {"rollout_token_veto_threshold_high": hi}, False
        return {"rollout_rs": _LEGACY[agg], "rollout_rs_threshold": hi, "rollout_rs_threshold_lower": lo}, False
    if lower is not None and lower > 0:
        raise ConfigError(f"rejection_sampling.lower={lower} with metric={metric!r} has no equivalent here: its "
                          "divergence options take one upper bound; leave lower unset")
    option = f"{agg if agg == 'token' else 'seq_' + agg}_{_ESTIMATORS[metric]}"
    return {"rollout_rs": option, "rollout_rs_threshold": upper}, metric == "kl_k3"


def _weight_settings(c: dict[str, Any]) -> dict[str, Any]:
    level = "geometric" if c["level"] == "sequence" and c["metric"] == "ratio" else "token"
    return {"rollout_is": level, "rollout_is_threshold": math.inf}


def _padded(x: torch.Tensor, rows: Optional[torch.Tensor], cols: Optional[torch.Tensor], B: int, T: int):
    if rows is None:
        return x.unsqueeze(0) if x.dim() == 1 else x
    return to_padded(x, rows, cols, B, T, fill=False if x.dtype == torch.bool else 0)


def apply_rejection_sampling(proximal_logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                             cu_seqlens: Optional[torch.Tensor], config: Any) -> RejectionSamplingResult:
    """AReaL's rejection sampling of π_prox / π_behave (module docstring), by this library's core.

    Args:
        proximal_logprobs: (B, T) padded or (N,) packed log π_prox of the sampled tokens.
        old_logprobs: the same shape, log π_behave (the inference engine's).
        loss_mask: the same shape, 1 / True for valid tokens.
        cu_seqlens: (B + 1,) offsets of the packed sequences; needed for 1-D inputs at sequence level.
        config: AReaL's ``RejectionSamplingConfig`` or anything with its fields.
    """
    for name, x in (("old_logprobs", old_logprobs), ("loss_mask", loss_mask)):
        if x.shape != proximal_logprobs.shape:
            raise ValueError(f"proximal_logprobs shape {proximal_logprobs.shape} != {name} shape {x.shape}")
    if proximal_logprobs.dim() not in (1, 2):
        raise ValueError(f"Expected 1D (packed) or 2D (padded) tensors, got ndim={proximal_logprobs.dim()}")
    c = _read(config)
    settings, exchanged = correction_settings(c)
    rows = cols = None
    B, T = 1, proximal_logprobs.shape[-1]
    if proximal_logprobs.dim() == 1 and cu_seqlens is not None:
        lengths = lengths_from_cu_seqlens(cu_seqlens.to(proximal_logprobs.device))
        if int(lengths.sum()) != proximal_logprobs.numel():
            raise ValueError(f"cu_seqlens covers {int(lengths.sum())} tokens, the inputs hold {proximal_logprobs.numel()}")
        rows, cols, T = pack_index(lengths)
        B = lengths.numel()
    elif proximal_logprobs.dim() == 1 and c["level"] == "sequence":
        raise ValueError("cu_seqlens is required for 1D packed tensors in sequence-level filtering.")
    prox, behave = (_padded(x.detach(), rows, cols, B, T) for x in (proximal_logprobs, old_logprobs))
    mask = _padded(loss_mask, rows, cols, B, T)
    valid = mask.bool()
    weights_call = {} if exchanged else settings  # one core call unless the criterion needs the exchanged pair
    out = compute_rollout_correction(prox, behave, mask, config=RolloutCorrectionConfig(**_weight_settings(c),
                                                                                         **weights_call,
                                                                                         log_prob_ceiling=None))
    keep = out.response_mask.bool()
    if exchanged:
        keep &= compute_rollout_correction(behave, prox, mask, config=RolloutCorrectionConfig(
            **settings, log_prob_ceiling=None)).response_mask.bool()
    weight = out.weights
    n_valid = int(valid.sum())
    if c["action"] == "mask":
        new_mask = keep.to(loss_mask.dtype) if rows is None else keep
        filtered = int((valid & ~keep).sum())
        weight = weight * keep
    else:  # clamp: every token (token level), or the rejected sequences (sequence level)
        spec = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=c["upper"], rollout_is_mode="clip",
                                       rollout_is_threshold_lower=c["lower"] or 0.0).is_spec
        alive = weight > 0  # valid tokens of the rows the core kept (a finite weight is ≥ e^-20)
        clamped = bound_weights(weight, spec, alive.to(weight.dtype))
        rejected = alive.any(-1, keepdim=True) & ~keep.any(-1, keepdim=True)  # no token survives the criterion
        target = alive if c["level"] == "token" else alive & rejected
        filtered = int((target & (clamped != weight)).sum())
        weight = torch.where(target, clamped, weight)
        new_mask = loss_mask
    if rows is not None:
        weight = weight[rows, cols]
        new_mask = new_mask[rows, cols].to(loss_mask.dtype) if c["action"] == "mask" else new_mask
    elif proximal_logprobs.dim() == 1:
        weight = weight.squeeze(0)
        new_mask = new_mask.squeeze(0) if c["action"] == "mask" else new_mask
    return RejectionSamplingResult(new_mask, weight, filtered / max(n_valid, 1))
