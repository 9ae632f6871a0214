"""The per-token log-ratio and the per-sequence reductions every estimator shares.

``LogRatioBatch`` is built once per call from ``(old_log_prob, rollout_log_prob,
response_mask)``; each derived quantity (clamped log-ratio, per-row sums and means, …) is
computed the first time an estimator asks for it and then reused, so a configuration pays only
for what it uses. Values at invalid positions are exactly 0 in every derived tensor (written
with ``where``, so a NaN in padding can never leak into a sum).
"""

from __future__ import annotations

from functools import cached_property
import torch

from .config import SAFETY_BOUND
from .stats import SufficientStats
from .validation import check_pair, first_nonfinite

__all__ = ["LogRatioBatch"]


class LogRatioBatch:
    """log ρ_t = log π_train(y_t) − log π_rollout(y_t) on valid tokens, 0 elsewhere.

    Args:
        old_log_prob: (B, T) π_train log-probs (π_old in decoupled mode, π_θ in bypass mode).
        rollout_log_prob: (B, T) π_rollout log-probs.
        response_mask: (B, T) bool or 0/1; non-zero marks a valid token.
        on_nonfinite: ``"reject"`` drops any sequence with a NaN/±inf log-prob at a valid
            position (counted in ``nonfinite_*`` statistics); ``"raise"`` raises ValueError
            naming the first bad position.
    """

    def __init__(self, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                 response_mask: torch.Tensor, on_nonfinite: str = "reject") -> None:
        check_pair(old_log_prob, rollout_log_prob, response_mask)
        self.old_log_prob = old_log_prob
        self.rollout_log_prob = rollout_log_prob
        self.response_mask = response_mask
        input_valid = response_mask.bool() if response_mask.dtype != torch.bool else response_mask
        # Upcast in one step: an fp32 copy of `old` receives `rollout` in place.
        lr = old_log_prob.to(torch.float32, copy=True) if old_log_prob.dtype != torch.float32 \
            else old_log_prob.clone()
        lr.sub_(rollout_log_prob)
        bad_tok = input_valid & ~torch.isfinite(lr)
        if on_nonfinite == "raise":
            pos = first_nonfinite(bad_tok)
            if pos is not None:
                b, t = pos
                raise ValueError(
                    f"non-finite log-prob at valid position (row {b}, column {t}): "
                    f"old_log_prob={old_log_prob[b, t].item()}, rollout_log_prob={rollout_log_prob[b, t].item()}; "
                    "fix the producer, or set on_nonfinite='reject' to drop such sequences")
        self.input_valid = input_valid
        self.bad_rows = bad_tok.any(-1)
        self.valid = input_valid & ~self.bad_rows.unsqueeze(-1)
        self.log_ratio = torch.where(self.valid, lr, 0.0)
        self.n_row = self.valid.sum(-1, dtype=torch.float32)
        self.row_valid = self.n_row > 0

    # -- token level -------------------------------------------------------------------
    @cached_property
    def log_ratio_clamped(self) -> torch.Tensor:
        """clamp(log ρ_t, ±20); 0 at invalid positions."""
        return self.log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)

    # -- sequence level ----------------------------------------------------------------
    @cached_property
    def row_sum(self) -> torch.Tensor:
        """Σ_t log ρ_t per row (unclamped), shape (B,)."""
        return self.log_ratio.sum(-1)

    @cached_property
    def row_mean(self) -> torch.Tensor:
        """mean_t log ρ_t per row (0 for empty rows), shape (B,)."""
        return self.row_sum / self.n_row.clamp_min(1.0)

    @cached_property
    def old_row_mean(self) -> torch.Tensor:
        """mean_t log π_train per row, float64, shape (B,)."""
        s = torch.where(self.valid, self.old_log_prob, 0.0).sum(-1, dtype=torch.float64)
        return s / self.n_row.double().clamp_min(1.0)

    @cached_property
    def rollout_row_mean(self) -> torch.Tensor:
        """mean_t log π_rollout per row, float64, from old and the log-ratio (no extra pass)."""
        return self.old_row_mean - self.row_sum.double() / self.n_row.double().clamp_min(1.0)

    # -- helpers for statistics ----------------------------------------------------------
    def token_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over valid tokens of a (B, T) tensor that is 0 at invalid positions, in float64."""
        return x.sum(dtype=torch.float64)

    def token_count(self, cond: torch.Tensor) -> torch.Tensor:
        """Number of valid tokens where ``cond`` holds."""
        return (cond & self.valid).sum(dtype=torch.float64)

    def token_max(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.valid, x, -torch.inf).amax() if x.numel() else _neg_inf(x)

    def token_min(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.valid, x, torch.inf).amin() if x.numel() else -_neg_inf(x)

    def row_sum_of(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over valid rows of a (B,) tensor, float64."""
        return torch.where(self.row_valid, x.double(), 0.0).sum()

    def row_count(self, cond: torch.Tensor) -> torch.Tensor:
        return (cond & self.row_valid).sum(dtype=torch.float64)

    def row_max(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.row_valid, x.double(), -torch.inf).amax() if x.numel() else _neg_inf(x)

    def row_min(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.row_valid, x.double(), torch.inf).amin() if x.numel() else -_neg_inf(x)

    def tokens_weighted_row_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ_rows n_row·x_row: the token sum of a per-row value broadcast over its tokens."""
        return (self.n_row.double() * torch.where(self.row_valid, x.double(), 0.0)).sum()

    def add_counts(self, stats: SufficientStats) -> None:
        """Counts every statistic family divides by (recorded once per call)."""
        stats.add_sum("n_tok", self.n_row.sum(dtype=torch.float64))
        stats.add_sum("n_rows", self.row_valid.sum(dtype=torch.float64))
        input_rows = self.input_valid.any(-1)
        stats.add_sum("n_rows_input", input_rows.sum(dtype=torch.float64))
        stats.add_sum("nonfinite_rows", (self.bad_rows & input_rows).sum(dtype=torch.float64))

    def expand_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-row (B,) value over the row's valid tokens, 0 elsewhere; (B, T)."""
        return torch.where(self.valid, x.unsqueeze(-1), 0.0)


def _neg_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(-torch.inf, dtype=torch.float64, device=x.device)

