"""The FlowGRPO clipped policy loss with per-element rollout-correction weights.

Each SDE step of each sample is one element (there is no padding). For element (i, s):

    Âᵢ    = clamp(Aᵢ, −A_max, A_max)
    rᵢₛ   = exp(clamp(log π_θ − log π_old, −20, 20))
    ℓᵢₛ   = max(−Âᵢ·rᵢₛ, −Âᵢ·clip(rᵢₛ, 1 − ε, 1 + ε))                (FlowGRPO; Liu et al., 2025)
    L     = Σᵢₛ wᵢₛ·ℓᵢₛ / D

with w the detached correction weights (IS weight × RS keep, 0 where rejected; 1 without
correction) and the denominator

    D = B·S                         denominator="all"  (FlowGRPO's mean over every element)
    D = #{(i, s) kept}              denominator="kept" (rejected elements leave the mean)

``"all"`` is what verl-omni's diffusion port does: at a rejection fraction f the gradient shrinks by
(1 − f) ("gradient dilution"). ``"kept"`` removes the rejected elements from the denominator, as
the token-mean loss of the LLM path does when rejection edits the response mask.

Rejected elements never reach the loss: the log-ratio is replaced by 0 there *before* the
exponential, so NaN or ±inf log-probabilities at rejected positions cannot leak into the value or
the gradient. When every element is rejected the loss is exactly 0, has zero gradient, and is still
attached to the autograd graph (so a data-parallel rank with nothing to learn from joins backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Optional, Union

import torch

from rollout_correction import SAFETY_BOUND
from rollout_correction.advantages import group_advantages

__all__ = ["flow_grpo_loss", "grpo_guard_loss", "sde_kl_loss", "flow_grpo_advantages"]


Denominator = Literal["all", "kept"]


def _as_2d(name: str, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Broadcast a (B,), (B, 1) or (B, S) tensor to (B, S), or raise naming ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    b, s = shape
    if x.shape == shape:
        return x
    if x.dim() == 1 and x.shape[0] == b:
        return x.unsqueeze(1).expand(b, s)
    if x.dim() == 2 and x.shape == (b, 1):
        return x.expand(b, s)
    raise ValueError(
        f"{name} has shape {tuple(x.shape)}; expected ({b},), ({b}, 1) or ({b}, {s}) "
        f"to match log_prob {tuple(shape)}"
    )


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    keep: Optional[torch.Tensor] = None,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    denominator: Denominator = "all",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """FlowGRPO clipped surrogate with per-element correction weights (formula in the module doc).

    Args:
        log_prob: log π_θ per SDE step, (B, S) (S = 1 for a single step), with grad.
        old_log_prob: log π_old, (B, S): the fp32 recompute (decoupled) or the rollout
            log-probs (bypass). Treated as a constant.
        advantages: (B,), (B, 1) or (B, S); one advantage per sample is broadcast over its steps.
        weights: optional (B, S) or (B, 1) non-negative correction weights (from
            :func:`apply_rollout_correction` or :func:`step_correction`); detached here. None = 1.
        keep: optional boolean (B, S) mask of elements that survived rejection. Defaults to
            ``weights > 0`` (all True without weights). Elements with keep = False contribute 0.
            Pass it explicitly when an IcePop IS weight can be 0 on a kept element and such
            elements should stay in the ``"kept"`` denominator.
        clip_range: ε of the ratio clip (FlowGRPO recipes use 1e-4 … 0.2).
        adv_clip_max: A_max, advantages are clamped to [−A_max, A_max].
        denominator: ``"all"`` (B·S) or ``"kept"`` (number of kept elements, at least 1).
    Returns:
        (loss, metrics): a 0-d loss attached to ``log_prob``'s graph, and 0-d metric tensors
        ``actor/ppo_kl``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_higher``,
        ``actor/pg_clipfrac_lower``, ``actor/kept_fraction`` (ratios over kept elements).
    """
    if not isinstance(log_prob, torch.Tensor) or log_prob.dim() != 2:
        raise ValueError(
            "log_prob must be a (B, S) tensor (S = SDE steps; use (B, 1) for one step), got "
            f"{tuple(log_prob.shape) if isinstance(log_prob, torch.Tensor) else type(log_prob)}"
        )
    if not isinstance(old_log_prob, torch.Tensor) or old_log_prob.shape != log_prob.shape:
        raise ValueError(
            f"old_log_prob must have the shape of log_prob {tuple(log_prob.shape)}, got "
            f"{tuple(old_log_prob.shape) if isinstance(old_log_prob, torch.Tensor) else old_log_prob}"
        )
    if denominator not in ("all", "kept"):
        raise ValueError(f"denominator must be 'all' or 'kept', got {denominator!r}")
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range!r}")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max!r}")
    shape = log_prob.shape
    adv = _as_2d("advantages", advantages, shape).detach().float()

    if weights is None:
        w = torch.ones(shape, dtype=torch.float32, device=log_prob.device)
    else:
        w = _as_2d("weights", weights, shape).detach().float()
    if keep is None:
        keep_mask = (
            w > 0 if weights is not None else torch.ones(shape, dtype=torch.bool, device=log_prob.device)
        )
    else:
        keep_mask = _as_2d("keep", keep, shape).bool()
    # A weight is used only where it is finite; a kept element with a non-finite weight is an error.
    w = torch.where(keep_mask, w, torch.zeros_like(w))

    old = old_log_prob.detach().float()
    cur = log_prob.float()
    bad = keep_mask & ~(
        torch.isfinite(cur.detach()) & torch.isfinite(old) & torch.isfinite(adv) & torch.isfinite(w)
    )
    if bool(bad.any()):
        n = int(bad.sum())
        raise ValueError(
            f"{n} kept element(s) have a non-finite log_prob, old_log_prob, advantage or weight; "
            "reject them (weight 0 / keep=False) or fix the inputs"
        )

    zero = torch.zeros((), dtype=torch.float32, device=log_prob.device)
    # where() on the log-ratio, before exp: rejected elements cannot poison value or gradient.
    log_ratio = torch.where(keep_mask, cur - old, zero)
    log_ratio = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    adv = torch.where(keep_mask, adv, zero).clamp(-adv_clip_max, adv_clip_max)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    per_element = torch.maximum(unclipped, clipped) * w

    n_kept = keep_mask.sum()
    if denominator == "all":
        denom = torch.tensor(float(shape[0] * shape[1]), device=log_prob.device)
    else:
        denom = n_kept.clamp(min=1).float()
    loss = per_element.sum() / denom

    with torch.no_grad():
        kept_f = keep_mask.float()
        n = n_kept.clamp(min=1).float()
        lr = log_ratio.detach()
        r = ratio.detach()
        metrics = {
            "actor/ppo_kl": (-lr * kept_f).sum() / n,
            "actor/pg_clipfrac": (((r - 1.0).abs() > clip_range).float() * kept_f).sum() / n,
            "actor/pg_clipfrac_higher": ((r - 1.0 > clip_range).float() * kept_f).sum() / n,
            "actor/pg_clipfrac_lower": ((1.0 - r > clip_range).float() * kept_f).sum() / n,
            "actor/kept_fraction": kept_f.mean() if kept_f.numel() else zero,
        }
    return loss, metrics


def _row_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.dim()))) if x.dim() > 1 else x


def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    prev_sample_mean: torch.Tensor,
    old_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    denominator: Denominator = "all",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard (Wang et al., 2025, arXiv:2510.22319) for one SDE step, with correction weights.

    With c = mean(√dt)·mean(s_t) the step's diffusion scale and the mean drift of the proposal

        bᵢ  = mean_d (μ_θ,ᵢ − μ_old,ᵢ)² / (2c²)
        r̃ᵢ  = exp((log π_θ − log π_old + bᵢ)·c)
        L   = FlowGRPO clipped surrogate on r̃ (weights, clip, denominator as :func:`flow_grpo_loss`)
              / mean(√dt)²

    Args:
        log_prob, old_log_prob: (B,) or (B, 1) log-probs of the step (current with grad; old constant).
        advantages: (B,) or (B, 1).
        prev_sample_mean, old_prev_sample_mean: μ_θ and μ_old, (B, …) (the old one is a constant).
        std_dev_t: s_t of the step (0-d or (B, 1, …)); sqrt_dt: √(σ − σ′), 0-d or (B,).
        weights: optional (B,) / (B, 1) rollout-correction weights (0 = rejected).
    Returns:
        (loss, metrics) with ``actor/ppo_kl`` of the raw log-ratio and the clip fractions of r̃.
    """
    lp = log_prob.reshape(-1, 1) if log_prob.dim() == 1 else log_prob
    old = old_log_prob.reshape(-1, 1) if old_log_prob.dim() == 1 else old_log_prob
    if lp.shape != old.shape or lp.dim() != 2 or lp.shape[1] != 1:
        raise ValueError(
            f"grpo_guard_loss works on one SDE step: log_prob and old_log_prob must be (B,) or (B, 1), got "
            f"{tuple(log_prob.shape)} and {tuple(old_log_prob.shape)}"
        )
    if prev_sample_mean.shape != old_prev_sample_mean.shape or prev_sample_mean.shape[0] != lp.shape[0]:
        raise ValueError(
            f"prev_sample_mean {tuple(prev_sample_mean.shape)} and old_prev_sample_mean "
            f"{tuple(old_prev_sample_mean.shape)} must share a (B, …) shape with B = {lp.shape[0]}"
        )
    c = sqrt_dt.float().mean() * std_dev_t.float().mean()
    if not bool(c > 0):
        raise ValueError("grpo_guard_loss needs a stochastic step: mean(sqrt_dt)·mean(std_dev_t) must be > 0")
    drift = _row_mean((prev_sample_mean.float() - old_prev_sample_mean.detach().float()) ** 2) / (2 * c * c)
    guarded = (lp.float() - old.detach().float() + drift.reshape(-1, 1)) * c
    w = None if weights is None else (weights.reshape(-1, 1) if weights.dim() == 1 else weights)
    loss, metrics = flow_grpo_loss(
        guarded, torch.zeros_like(guarded), advantages, w,
        clip_range=clip_range, adv_clip_max=adv_clip_max, denominator=denominator,
    )
    with torch.no_grad():
        metrics["actor/ppo_kl"] = (old.float() - lp.detach().float()).mean()
    return loss / sqrt_dt.float().mean() ** 2, metrics


def sde_kl_loss(
    prev_sample_mean: torch.Tensor, ref_prev_sample_mean: torch.Tensor, std_dev_t: torch.Tensor
) -> torch.Tensor:
    """KL penalty to a reference policy for one step: mean_i mean_d (μ_θ − μ_ref)² / (2·s_t²).

    The two step distributions share their variance, so the Gaussian KL is the squared mean gap
    over twice the variance; like FlowGRPO and verl-omni, s_t (not s_t·√dt) is the scale.
    ``ref_prev_sample_mean`` is a constant. Returns a 0-d tensor attached to ``prev_sample_mean``.
    """
    if prev_sample_mean.shape != ref_prev_sample_mean.shape:
        raise ValueError(
            f"prev_sample_mean {tuple(prev_sample_mean.shape)} and ref_prev_sample_mean "
            f"{tuple(ref_prev_sample_mean.shape)} must have the same shape"
        )
    s = std_dev_t.float()
    if not bool((s > 0).all()):
        raise ValueError("sde_kl_loss needs std_dev_t > 0 (a stochastic step)")
    gap = (prev_sample_mean.float() - ref_prev_sample_mean.detach().float()) ** 2
    s_row = s.reshape(-1) if s.dim() else s
    return (_row_mean(gap) / (2 * s_row * s_row)).mean()


def flow_grpo_advantages(
    scores: torch.Tensor,
    group_ids: Union[int, torch.Tensor, Sequence],
    *,
    std: Literal["global", "group"] = "global",
    epsilon: float = 1e-4,
) -> torch.Tensor:
    """FlowGRPO advantages Âᵢ = (rᵢ − μ_g(i)) / (σ + ε), (B,) float32.

    μ_g is the mean score of sample i's group (prompt). ``std="global"`` (FlowGRPO's and verl-omni's
    default) divides by the standard deviation σ of every score in the batch, ``std="group"`` by the
    group's own σ_g (GRPO). The group baseline is :func:`rollout_correction.group_advantages`'s; a
    group of one sample gets advantage 0 (it has nothing to be compared with).
    """
    if std not in ("global", "group"):
        raise ValueError(f"std must be 'global' or 'group', got {std!r}")
    if std == "group":
        return group_advantages(scores, group_ids, norm_by_std=True, epsilon=epsilon).advantages
    centred = group_advantages(scores, group_ids, norm_by_std=False, epsilon=epsilon).advantages
    sigma = scores.double().std() if scores.numel() > 1 else scores.new_zeros((), dtype=torch.float64)
    return (centred.double() / (sigma + epsilon)).float()
