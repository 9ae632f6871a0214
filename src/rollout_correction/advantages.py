"""Group-relative advantages (GRPO, RLOO) whose baselines use accepted samples only.

Rejection sampling removes a sequence from the loss by zeroing its response mask; a baseline
still computed over every member lets a rejected sample (typically the most off-policy one) shift
its siblings' advantages although it never contributes a gradient itself (verl #6375). Here the
baseline of group g is computed over its accepted members A_g only, with n_g = |A_g| and scores r:

    GRPO:  μ_g = (1/n_g) Σ_{j∈A_g} r_j,   σ_g = sqrt( Σ_{j∈A_g} (r_j − μ_g)² / (n_g − 1) )
           Â_i = (r_i − μ_g) / (σ_g + ε)          (or r_i − μ_g without std normalisation)
    RLOO:  Â_i = r_i − (1/(n_g − 1)) Σ_{j∈A_g, j≠i} r_j  =  n_g/(n_g − 1) · (r_i − μ_g)

(Shao et al. 2024, DeepSeekMath, for GRPO; Ahmadian et al. 2024 for RLOO.) A rejected row gets
advantage 0; so does every row of a group left with no accepted member (``group_empty_count``) or
with one, which has nothing to compare with (``group_singleton_count``; verl hands a lone member
its raw score, not a group-relative signal). A row whose score is NaN or ±inf is rejected
(``on_nonfinite="reject"``, ``group_nonfinite_score_count``) or raises, so one bad reward cannot
poison its group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, Optional, Union

import torch

from rollout_correction import METRIC_PREFIX

__all__ = ["GroupAdvantages", "accepted_rows", "group_advantages", "grpo_advantages", "rloo_advantages"]

GroupIds = Union[int, torch.Tensor, Sequence]
Estimator = Literal["grpo", "rloo"]


class GroupAdvantages(NamedTuple):
    """Result of :func:`group_advantages`: ``advantages`` (B,) float32, 0 on rejected rows and in
    groups with fewer than two accepted members; ``token_advantages`` (B, T) float32, broadcast over
    the valid tokens of ``response_mask`` (None without one); ``accepted`` (B,) bool, the rows that
    entered a baseline; ``metrics``, 0-d tensors prefixed ``rollout_corr/``."""

    advantages: torch.Tensor
    token_advantages: Optional[torch.Tensor]
    accepted: torch.Tensor
    metrics: dict


def accepted_rows(response_mask: Optional[torch.Tensor] = None,
                  keep: Optional[torch.Tensor] = None, batch_size: Optional[int] = None) -> torch.Tensor:
    """(B,) bool: a row is accepted iff it has a valid token left in ``response_mask`` (after
    rejection sampling) and ``keep`` (an explicit (B,) accept vector) does not drop it."""
    accepted = None
    if response_mask is not None:
        if response_mask.dim() != 2:
            raise ValueError(f"response_mask must be (B, T); got shape {tuple(response_mask.shape)}")
        accepted = (response_mask != 0).any(dim=-1)
    if keep is not None:
        if keep.dim() != 1:
            raise ValueError(f"keep must be a (B,) vector; got shape {tuple(keep.shape)}")
        if accepted is not None and keep.shape[0] != accepted.shape[0]:
            raise ValueError(f"keep has {keep.shape[0]} rows but response_mask has {accepted.shape[0]}")
        k = keep.to(device=accepted.device if accepted is not None else keep.device) != 0
        accepted = k if accepted is None else accepted & k
    if accepted is None:
        if batch_size is None:
            raise ValueError("give response_mask, keep or batch_size")
        return torch.ones(batch_size, dtype=torch.bool)
    return accepted


def _group_index(group_ids: GroupIds, batch: int, device: torch.device) -> torch.Tensor:
    """Map group ids (an int group size, a (B,) integer tensor, or B hashable uids) to 0..G−1."""
    if isinstance(group_ids, bool):
        raise TypeError("group_ids must be a group size, a (B,) integer tensor or a sequence of B ids")
    if isinstance(group_ids, int):
        if group_ids <= 0 or batch % group_ids != 0:
            raise ValueError(f"group size {group_ids} does not divide the batch of {batch} rows into "
                             "whole groups; pass one group id per row instead")
        return torch.arange(batch, device=device) // group_ids
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != batch:
            raise ValueError(f"group_ids must be one id per row, shape ({batch},); got {tuple(group_ids.shape)}")
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise TypeError(f"group_ids must be an integer tensor; got {group_ids.dtype}")
        return torch.unique(group_ids.to(device), return_inverse=True)[1]
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries but scores has {batch} rows")
    codes: dict = {}
    return torch.tensor([codes.setdefault(u, len(codes)) for u in ids], dtype=torch.long, device=device)


def _scatter_sum(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.zeros(groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def group_advantages(scores: torch.Tensor, group_ids: GroupIds, *, estimator: Estimator = "grpo",
                     response_mask: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                     norm_by_std: bool = True, epsilon: float = 1e-6, unbiased_std: bool = True,
                     on_nonfinite: Literal["reject", "raise"] = "reject",
                     prefix: str = METRIC_PREFIX) -> GroupAdvantages:
    """GRPO or RLOO advantages with baselines over the accepted members of each group.

    Args:
      scores: (B,) sequence rewards, or (B, T) token-level rewards (summed over the valid tokens
        of ``response_mask``, or over all tokens without it).
      group_ids: an int group size (rows grouped contiguously), a (B,) integer tensor of group
        ids, or a sequence of B hashable ids (e.g. verl's ``uid`` strings).
      estimator: "grpo" or "rloo" (formulas in the module docstring).
      response_mask: (B, T) mask after rejection sampling; a row with no valid token is rejected.
      keep: (B,) bool/0-1, an explicit accept vector (AND-ed with the mask rule).
      norm_by_std: GRPO only: divide by σ_g + ε (Dr.GRPO-style when False).
      epsilon: ε > 0 added to σ_g.
      unbiased_std: σ_g with n_g − 1 (torch's default, as GRPO implementations use) or n_g.
      on_nonfinite: "reject" a row with a NaN/±inf score (counted) or "raise" naming the row.

    Returns:
      GroupAdvantages(advantages (B,), token_advantages (B, T) or None, accepted (B,), metrics).
    """
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"estimator must be 'grpo' or 'rloo'; got {estimator!r}")
    if on_nonfinite not in ("reject", "raise"):
        raise ValueError(f"on_nonfinite must be 'reject' or 'raise'; got {on_nonfinite!r}")
    if not (epsilon > 0):
        raise ValueError(f"epsilon must be > 0; got {epsilon!r}")
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        raise TypeError("scores must be a floating-point tensor of shape (B,) or (B, T)")
    if scores.dim() == 2:
        if response_mask is not None and response_mask.shape != scores.shape:
            raise ValueError(f"token-level scores have shape {tuple(scores.shape)} but response_mask has "
                             f"shape {tuple(response_mask.shape)}")
        valid = torch.ones_like(scores, dtype=torch.bool) if response_mask is None else response_mask != 0
        r = torch.where(valid, scores.double(), 0.0).sum(dim=-1)
    elif scores.dim() == 1:
        r = scores.double()
    else:
        raise ValueError(f"scores must be (B,) or (B, T); got shape {tuple(scores.shape)}")
    batch, device = r.shape[0], r.device
    if response_mask is not None and (response_mask.dim() != 2 or response_mask.shape[0] != batch):
        raise ValueError(f"response_mask must be (B, T) with B = {batch}; got shape {tuple(response_mask.shape)}")

    accepted = accepted_rows(response_mask, keep, batch_size=batch).to(device)
    if accepted.shape[0] != batch:
        raise ValueError(f"keep has {accepted.shape[0]} rows but scores has {batch}")
    nonfinite = accepted & ~torch.isfinite(r)
    if bool(nonfinite.any()):
        if on_nonfinite == "raise":
            row = int(nonfinite.nonzero()[0, 0])
            raise ValueError(f"score of row {row} is {r[row].item()} (non-finite); fix the reward or use "
                             "on_nonfinite='reject'")
        accepted = accepted & ~nonfinite
    index = _group_index(group_ids, batch, device)
    groups = int(index.max()) + 1 if batch else 0

    # Per-group statistics over accepted members (float64; deviations rescaled by their group
    # maximum, so huge rewards cannot overflow the sum of squares).
    r_acc = torch.where(accepted, r, 0.0)
    n = _scatter_sum(accepted.double(), index, groups)
    mean = _scatter_sum(r_acc, index, groups) / n.clamp(min=1)
    dev = torch.where(accepted, r - mean[index], 0.0)
    scale = torch.zeros(groups, dtype=dev.dtype, device=device).scatter_reduce_(
        0, index, dev.abs(), reduce="amax", include_self=True)
    scale_row = scale[index]
    unit = torch.where(scale_row > 0, dev / torch.where(scale_row > 0, scale_row, 1.0), 0.0)
    dof = (n - 1) if unbiased_std else n
    std = scale * torch.sqrt(_scatter_sum(unit * unit, index, groups) / dof.clamp(min=1))

    n_row = n[index]
    if estimator == "grpo":
        adv = dev / (std[index] + epsilon) if norm_by_std else dev
    else:
        adv = dev * n_row / (n_row - 1).clamp(min=1)
    live = accepted & (n_row >= 2)
    advantages = torch.where(live, adv, 0.0).float()

    token_advantages = None
    if response_mask is not None:
        token_advantages = torch.where(response_mask != 0, advantages.unsqueeze(-1), 0.0)

    n_groups = max(groups, 1)
    metrics = {
        f"{prefix}group_count": torch.tensor(float(groups), device=device),
        f"{prefix}group_empty_count": (n == 0).sum().float(),
        f"{prefix}group_empty_fraction": (n == 0).sum().float() / n_groups,
        f"{prefix}group_singleton_count": (n == 1).sum().float(),
        f"{prefix}group_accepted_size_mean": (n.sum() / (n > 0).sum().clamp(min=1)).float(),
        f"{prefix}group_rejected_row_fraction": (~accepted).sum().float() / max(batch, 1),
        f"{prefix}group_nonfinite_score_count": nonfinite.sum().float(),
    }
    return GroupAdvantages(advantages, token_advantages, accepted, metrics)


def grpo_advantages(scores: torch.Tensor, group_ids: GroupIds, **kwargs) -> GroupAdvantages:
    """GRPO: Â_i = (r_i − μ_g) / (σ_g + ε) over the accepted members of group g. See :func:`group_advantages`."""
    return group_advantages(scores, group_ids, estimator="grpo", **kwargs)


def rloo_advantages(scores: torch.Tensor, group_ids: GroupIds, **kwargs) -> GroupAdvantages:
    """RLOO: Â_i = r_i − mean_{j∈A_g, j≠i} r_j over the accepted members. See :func:`group_advantages`."""
    return group_advantages(scores, group_ids, estimator="rloo", **kwargs)
