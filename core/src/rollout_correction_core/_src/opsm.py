"""Off-policy sequence masking (OPSM; DeepSeek-AI 2025, DeepSeek-V3.2, eq. 9).

A sequence y is dropped from the loss when the policy has learned to avoid it *and* it lies far
from the current policy:

    keep(y) = 1[A(y) ≥ 0  or  D(y) ≤ δ],     D(y) = mean_{t ∈ E(y)} (log π_rollout(y_t) − log π_θ(y_t))

with A(y) the sequence advantage (mean over its valid tokens) and E(y) the valid tokens whose two
log-probs are both finite (a token the engine could not score carries no evidence; a sequence with
no such token is kept). π_θ is taken without gradient. Every token of a dropped sequence leaves
the loss and its denominator, whatever its own advantage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .policy_losses import sequence_advantage
from .declared import OPSM
from .stats import SufficientStats, safe_div

__all__ = ["OPSMResult", "opsm_keep", "compute_opsm"]


@dataclass
class OPSMResult:
    """``row_keep`` (B,) bool; ``divergence`` (B,) float32 D(y) (0 without evidence);
    ``evidence`` (B,) float32 |E(y)|."""

    row_keep: torch.Tensor
    divergence: torch.Tensor
    evidence: torch.Tensor


def opsm_keep(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, delta: float) -> OPSMResult:
    """Which sequences OPSM keeps (module docstring), from (B, T) ``log_prob`` (log π_θ, used without
    gradient), ``rollout_log_prob`` and ``response_mask`` (bool or 0/1), (B, T), (B, 1) or (B,)
    ``advantages``, and δ (``delta``), the divergence a negative-advantage sequence may have."""
    if log_prob.shape != rollout_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError(f"log_prob {tuple(log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have the same (batch, response_length) shape")
    valid = response_mask.bool()
    d = rollout_log_prob.float() - log_prob.detach().float()
    evidence = valid & torch.isfinite(d)
    d = torch.where(evidence, d, torch.zeros((), device=d.device))
    n = evidence.sum(-1).to(torch.float32)
    div = d.sum(-1) / n.clamp_min(1.0)
    adv = sequence_advantage(torch.nan_to_num(advantages.detach().float()), valid)
    keep = (adv >= 0) | (div <= delta) | (n == 0)
    return OPSMResult(keep, div, n)


def compute_opsm(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, delta: float, process_group: Optional[object] = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OPSM keep mask and metrics reduced over ``process_group``: (row_keep (B,) bool, unprefixed
    ``opsm_masked_fraction`` (share of valid tokens dropped), ``opsm_seq_masked_fraction`` (share of
    sequences dropped), ``opsm_seq_kl_mean`` (mean D(y) over sequences with evidence))."""
    res = opsm_keep(log_prob, rollout_log_prob, advantages, response_mask, delta)
    n_row = response_mask.bool().sum(-1)
    rows = n_row > 0
    dropped = rows & ~res.row_keep
    has = rows & (res.evidence > 0)
    stats = SufficientStats()
    stats.add(OPSM.n_tok, n_row)
    stats.add(OPSM.n_rows, rows)
    stats.add(OPSM.masked, torch.where(dropped, n_row, 0))
    stats.add(OPSM.seq_masked, dropped)
    stats.add(OPSM.div_rows, has)
    stats.add(OPSM.div_sum, torch.where(has, res.divergence.double(), 0.0))
    stats.all_reduce(process_group, ("opsm", f"delta={delta!r}"))
    return res.row_keep, {
        "opsm_masked_fraction": safe_div(stats.sum(OPSM.masked), stats.sum(OPSM.n_tok)),
        "opsm_seq_masked_fraction": safe_div(stats.sum(OPSM.seq_masked), stats.sum(OPSM.n_rows)),
        "opsm_seq_kl_mean": safe_div(stats.sum(OPSM.div_sum), stats.sum(OPSM.div_rows)),
    }
