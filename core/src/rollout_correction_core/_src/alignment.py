"""One-token misalignment detector for rollout vs trainer log-probs.

If the rollout engine's log-probs are off by one position against the trainer's (the last prompt
token's log-prob kept, the first response token's dropped), the log-ratio compares unrelated tokens
and every correction built on it is wrong (ms-swift #8196); the two sequences then agree far better
after shifting one of them by a single position.

Over the pairs of adjacent valid positions (t, t+1) of each row, with o = old_log_prob and
r = rollout_log_prob (non-finite values left out):

    D₀  = mean |o_t − r_t|            aligned
    D₊₁ = mean |o_t − r_{t+1}|        rollout one position late  (r has an extra leading entry)
    D₋₁ = mean |o_{t+1} − r_t|        rollout one position early (r lost its first entry)

and the inputs are reported as misaligned by s ∈ {+1, −1} when

    n_pairs ≥ min_pairs,   D₀ ≥ min_aligned_mae   and   D_s < shift_ratio · D₀.

For aligned log-probs D₀ is the engine mismatch (typically 1e-3 – 1e-1 nats) while a shift
compares neighbouring tokens (typically ≥ 0.5 nats). The statistics are four sums
(:func:`alignment_statistics`): they add across micro-batches and ranks.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

from .constants import METRIC_PREFIX
from .declared import ALIGN
from .stats import SufficientStats, Value, maximum

__all__ = ["MisalignmentWarning", "AlignmentReport", "alignment_statistics", "alignment_metrics",
           "alignment_report", "check_alignment"]


class MisalignmentWarning(UserWarning):
    """Rollout log-probs look shifted by one token against the trainer's."""


class AlignmentReport(NamedTuple):
    """Result of :func:`alignment_report`: ``n_pairs`` compared, D₀ / D₊₁ / D₋₁ (``aligned_mae``,
    ``late_mae``, ``early_mae``), ``best_shift`` (0, +1 or −1: the smallest distance), ``misaligned``
    (the decision rule above) and ``message``, a sentence for logs ("" when aligned)."""

    n_pairs: int
    aligned_mae: float
    late_mae: float
    early_mae: float
    best_shift: int
    misaligned: bool
    message: str


def alignment_statistics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                         response_mask: torch.Tensor) -> torch.Tensor:
    """Sufficient statistics [n_pairs, Σ|o_t − r_t|, Σ|o_t − r_{t+1}|, Σ|o_{t+1} − r_t|] (float64, (4,))
    of (B, T) log-probs (any float dtype) and a (B, T) bool or 0/1 mask of valid tokens."""
    for name, t in (("old_log_prob", old_log_prob), ("rollout_log_prob", rollout_log_prob),
                    ("response_mask", response_mask)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a (B, T) tensor; got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not (old_log_prob.shape == rollout_log_prob.shape == response_mask.shape):
        raise ValueError(f"shape mismatch: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)}, response_mask {tuple(response_mask.shape)}")
    o = old_log_prob.detach().double()
    r = rollout_log_prob.detach().to(device=o.device, dtype=torch.float64)
    ok = (response_mask.to(o.device) != 0) & torch.isfinite(o) & torch.isfinite(r)
    pair = ok[:, :-1] & ok[:, 1:]
    zero = torch.zeros((), dtype=torch.float64, device=o.device)

    def total(d: torch.Tensor) -> torch.Tensor:
        return torch.where(pair, d.abs(), zero).sum()

    return torch.stack([pair.sum().double(), total(o[:, :-1] - r[:, :-1]),
                        total(o[:, :-1] - r[:, 1:]), total(o[:, 1:] - r[:, :-1])])


def alignment_metrics(stats, prefix: str = METRIC_PREFIX) -> dict[str, Value]:
    """``alignment_pairs`` and the mean |o − r| at shifts 0, +1, −1 (``alignment_mae``, ``_late_mae``,
    ``_early_mae``; 0 with no pair) from the (4,) sums of :func:`alignment_statistics`, or from reduced
    statistics holding them (0-d tensors without a device sync, or floats)."""
    stats = SufficientStats.from_vector(list(ALIGN), stats) if isinstance(stats, torch.Tensor) else stats
    n = stats.sum(ALIGN.n)
    den = maximum(n, 1.0)
    return {f"{prefix}alignment_pairs": n, f"{prefix}alignment_mae": stats.sum(ALIGN.d0) / den,
            f"{prefix}alignment_late_mae": stats.sum(ALIGN.late) / den,
            f"{prefix}alignment_early_mae": stats.sum(ALIGN.early) / den}


def alignment_report(stats: torch.Tensor, *, shift_ratio: float = 0.5, min_pairs: int = 32,
                     min_aligned_mae: float = 1e-2) -> AlignmentReport:
    """Apply the decision rule of the module docstring to :func:`alignment_statistics` (one sync)."""
    if not 0 < shift_ratio < 1:
        raise ValueError(f"shift_ratio must be in (0, 1); got {shift_ratio!r}")
    n, s0, sp, sm = (float(v) for v in stats.detach().cpu().tolist())
    d0, dp, dm = (s / n if n > 0 else 0.0 for s in (s0, sp, sm))
    best_shift, best = (1, dp) if dp <= dm else (-1, dm)
    if not best < d0:
        best_shift = 0
    misaligned = n >= min_pairs and d0 >= min_aligned_mae and best_shift != 0 and best < shift_ratio * d0
    message = ""
    if misaligned:
        where = "one position later" if best_shift == 1 else "one position earlier"
        cause = ("it has an extra leading entry, e.g. the log-prob of the last prompt token"
                 if best_shift == 1 else "its first response token is missing")
        message = (f"rollout_log_prob looks shifted by {best_shift:+d} token against old_log_prob: "
                   f"mean |old - rollout| is {d0:.4g} as given but {best:.4g} when rollout_log_prob is "
                   f"read {where} ({int(n)} adjacent token pairs). Check how the rollout log-probs are "
                   f"sliced: {cause}. The log-ratio, IS weights and rejection are meaningless until the "
                   "two are aligned token by token.")
    return AlignmentReport(int(n), d0, dp, dm, best_shift, misaligned, message)


def check_alignment(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                    *, process_group: Optional[object] = None, warn: bool = True, shift_ratio: float = 0.5,
                    min_pairs: int = 32, min_aligned_mae: float = 1e-2) -> AlignmentReport:
    """Compare aligned vs ±1-shifted distances of (B, T) inputs as for the correction, the four sums
    all-reduced over ``process_group`` first, and with ``warn`` warn (:class:`MisalignmentWarning`)
    on a shift; ``shift_ratio``, ``min_pairs``, ``min_aligned_mae``: the rule of the module docstring."""
    sums = SufficientStats.from_vector(list(ALIGN), alignment_statistics(old_log_prob, rollout_log_prob, response_mask))
    reduced = sums.all_reduce(process_group, ("alignment",))  # a checked collective (the same object without a group)
    stats = torch.stack([reduced.sum(k) for k in ALIGN])
    report = alignment_report(stats, shift_ratio=shift_ratio, min_pairs=min_pairs, min_aligned_mae=min_aligned_mae)
    if warn and report.misaligned:
        warnings.warn(report.message, MisalignmentWarning, stacklevel=2)
    return report
