"""Per-token policy losses that trainers pair with rollout-correction weights.

Each function takes (B, T) log-probs and advantages already 0 at invalid positions and returns
the per-token loss ℓ_t (weighted and aggregated by :mod:`rollout_correction_core._src.losses`) plus the
indicator ``actor/pg_clipfrac`` counts. log r_t = log π_θ(y_t) − log π_prox(y_t) (π_prox: π_old in
decoupled mode, π_rollout in bypass mode), clamped to ±20 before ``exp``; A_t the advantage;
ε_lo / ε_hi the clip range (for DPPO: the divergence bounds δ_lo / δ_hi); sg(·) stop-gradient.

* GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one ratio per sequence,
  s = exp(mean_t log r_t) over the sequence's valid tokens, carried to each token as
  s_t = sg(s) · π_θ(y_t) / sg(π_θ(y_t)) (value s, gradient s·∇log π_θ(y_t)), then clipped:
      ℓ_t = max(−A_t s_t, −A_t clip(s_t, 1−ε_lo, 1+ε_hi))
* CISPO (MiniMax-M1, 2025): clip the ratio but keep every token's gradient,
      ℓ_t = −sg(clip(r_t, 1−ε_lo, 1+ε_hi)) · A_t · log π_θ(y_t)
* DPPO (Qi et al. 2026, "divergence PPO"): a REINFORCE term with a truncated ratio, masked where
  the per-token divergence between π_θ and π_prox (of the sampled token's probability p = π_θ(y_t),
  p' = π_prox(y_t)) leaves the trust region in the direction the advantage pushes:
      ℓ_t = −A_t · sg(min(r_t, c)) · log π_θ(y_t) · m_t
  TV:  m_t = 1[p − p' ≤ δ_hi] if A_t > 0 else 1[p − p' ≥ −δ_lo]
  KL:  D = p' log(p'/p) + (1−p') log((1−p'+1e-8)/(1−p+1e-8))  (binary KL of the token event);
       m_t = 1[D ≤ δ_hi or p ≤ p'] if A_t > 0 else 1[D ≤ δ_lo or p ≥ p']
* TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE"), in bypass mode (π_prox = π_rollout):
      ℓ_t = −sg(w) · A_t · log π_θ(y_t),   w = 1 if A(y) ≥ 0 else min(∏_t r_t, 1)
  with A(y) the sequence advantage (:func:`sequence_advantage`): positive samples are pushed up at
  full strength, negative ones only as far as π_θ has not already moved away from them.
* rollout-IS (GLM-5 tech report §4.1.2; SkyRL's ``policy_loss_type="rollout_is"``), in bypass mode
  (π_prox = π_rollout): REINFORCE with the ratio zeroed outside the open band (1 − ε_lo, 1 + ε_hi),
      ℓ_t = −sg(r_t · 1[1 − ε_lo < r_t < 1 + ε_hi]) · A_t · log π_θ(y_t)
* ratio-PG (prime-rl's policy term, ``ipo_loss_fn``): the ratio itself, unclipped, with gradient,
      ℓ_t = −A_t · r_t      (∇ℓ_t = −A_t · r_t · ∇log π_θ(y_t))
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from .constants import SAFETY_BOUND

__all__ = ["sequence_advantage", "gspo_loss", "cispo_loss", "dppo_loss", "topr_loss", "topr_weights",
           "rollout_is_loss", "ratio_pg_loss"]


def _log_ratio(log_prob: torch.Tensor, prox_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - prox_log_prob).clamp(-SAFETY_BOUND, SAFETY_BOUND)


def sequence_advantage(advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A(y): the mean of ``advantages`` ((B, T), (B, 1) or (B,)) over a sequence's valid tokens, (B,);
    0 for empty rows (for outcome rewards, GRPO or RLOO, the sequence's constant advantage)."""
    if advantages.dim() == 1:
        return advantages.float()
    if advantages.shape[-1] == 1 and valid.shape[-1] != 1:
        return advantages[:, 0].float()
    a = torch.where(valid, advantages.float(), torch.zeros((), device=advantages.device))
    return a.sum(-1) / valid.sum(-1).clamp_min(1)


def gspo_loss(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, advantages: torch.Tensor,
              valid: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
              seq_log_ratio: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO per-token loss (module docstring): (ℓ (B, T), clipped (B, T) bool). ``valid`` (B, T)
    selects the tokens of each sequence's mean log-ratio; ``seq_log_ratio`` (B,), if given, is it."""
    if seq_log_ratio is None:
        lr = torch.where(valid, log_prob - prox_log_prob, torch.zeros((), device=log_prob.device))
        seq = lr.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1)
    else:
        seq = seq_log_ratio.to(log_prob.dtype).unsqueeze(-1)
    log_s = (seq.detach() + log_prob - log_prob.detach()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    s = log_s.exp()
    l1 = -advantages * s
    l2 = -advantages * s.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(l1, l2), l2 > l1


def cispo_loss(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, advantages: torch.Tensor,
               clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO per-token loss (module docstring); returns (ℓ, clipped: r outside [1−ε_lo, 1+ε_hi])."""
    r = _log_ratio(log_prob, prox_log_prob).exp().detach()
    clipped_r = r.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return -clipped_r * advantages * log_prob, clipped_r != r


def dppo_loss(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, advantages: torch.Tensor,
              divergence: Literal["tv", "kl"], clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
              clip_ratio_c: float = 3.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPPO-TV / DPPO-KL per-token loss (module docstring): (ℓ (B, T), outside (B, T) bool, masked by
    the trust region, truncated (B, T) bool, inside the region with r_t > c)."""
    lr = _log_ratio(log_prob, prox_log_prob).detach()
    r = lr.exp()
    lp, lq = log_prob.detach(), prox_log_prob.detach()
    p, q = lp.exp(), lq.exp()
    if divergence == "tv":
        inside_pos, inside_neg = p - q <= clip_ratio_high, p - q >= -clip_ratio_low
    elif divergence == "kl":
        d = q * (lq - lp) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        inside_pos, inside_neg = (d <= clip_ratio_high) | (p <= q), (d <= clip_ratio_low) | (p >= q)
    else:
        raise ValueError(f"divergence={divergence!r} is invalid; expected 'tv' or 'kl'")
    inside = torch.where(advantages > 0, inside_pos, inside_neg)
    loss = -advantages * r.clamp(max=clip_ratio_c) * log_prob * inside
    return loss, ~inside, inside & (r > clip_ratio_c)


def topr_weights(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
                 valid: torch.Tensor, seq_log_ratio_sum: Optional[torch.Tensor] = None,
                 seq_advantage: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Detached TOPR sequence weights (B,): 1 where A(y) ≥ 0, min(exp(clamp(Σ_t log r_t, ±20)), 1)
    where A(y) < 0, log r_t = log π_θ − log π_rollout over valid tokens. ``seq_log_ratio_sum`` /
    ``seq_advantage`` (B,), if given, are Σ_t log r_t and A(y) (e.g. reduced over a CP group)."""
    if seq_log_ratio_sum is None:
        lr = torch.where(valid, (log_prob - rollout_log_prob).detach(), torch.zeros((), device=log_prob.device))
        seq_log_ratio_sum = lr.sum(-1)
    if seq_advantage is None:
        seq_advantage = sequence_advantage(advantages, valid)
    seq_ratio = seq_log_ratio_sum.float().clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().clamp(max=1.0)
    return torch.where(seq_advantage >= 0, torch.ones_like(seq_ratio), seq_ratio)


def topr_loss(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
              valid: torch.Tensor, seq_log_ratio_sum: Optional[torch.Tensor] = None,
              seq_advantage: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TOPR per-token loss −sg(w)·A_t·log π_θ(y_t) (per-sequence values as for :func:`topr_weights`):
    (ℓ (B, T), tapered (B,) bool, the negative-advantage sequences whose weight is below 1)."""
    w = topr_weights(log_prob, rollout_log_prob, advantages, valid, seq_log_ratio_sum, seq_advantage)
    return -(w.unsqueeze(-1) * advantages) * log_prob, w < 1.0


def rollout_is_loss(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
                    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """rollout-IS per-token loss (module docstring): (ℓ (B, T), outside (B, T) bool: r_t ∉ (1 − ε_lo, 1 + ε_hi))."""
    r = _log_ratio(log_prob, rollout_log_prob).exp().detach()
    inside = (r > 1.0 - clip_ratio_low) & (r < 1.0 + clip_ratio_high)
    return -(torch.where(inside, r, 0.0) * advantages) * log_prob, ~inside


def ratio_pg_loss(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """ratio-PG per-token loss −A_t·r_t (module docstring), r_t carrying the gradient."""
    return -advantages * _log_ratio(log_prob, prox_log_prob).exp()
