"""Second-moment trust region (M2PO; Zheng et al. 2025, "Prosperity before Collapse").

With m_t = (log ρ_t)² (log ρ_t = log π_train − log π_rollout, clamped to ±20) over the tokens
still in the loss, M2PO masks the tokens with the largest m_t until the mean over the kept tokens
is at most τ:

    keep_t = 1[m_t ≤ c],   c = the largest value with  mean{m_s : m_s ≤ c} ≤ τ

(the mean grows with c, so c is well defined). Tokens with equal m_t are kept or masked together;
when even the smallest m_t exceeds τ no token is kept (the loss is then exactly 0). c is
batch-global: it is found by bisection over the (monotone) bit patterns of the float32 m_t, each
of the 32 steps all-reducing a count and a float64 sum over the given process groups, so a split
batch gets the same mask as one process holding it all, with no token tensor gathered and no
host synchronisation.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .constants import SAFETY_BOUND

__all__ = ["m2po_keep", "second_moment"]

_STEPS = 32  # bit patterns of non-negative float32 values lie in [0, 0x7F800000] < 2³¹


def second_moment(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """m_t = (clamp(old − rollout, ±20))² at kept tokens, 0 elsewhere (float32, (B, T))."""
    lr = (old_log_prob.float() - rollout_log_prob.float()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.where(keep, lr * lr, torch.zeros((), device=lr.device))


def _all_reduce(x: torch.Tensor, groups: Sequence[object]) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return x
    for g in groups:
        if g is not None:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=g)
    return x


def m2po_keep(m2: torch.Tensor, keep: torch.Tensor, threshold: float,
              process_groups: Sequence[Optional[object]] = ()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tokens M2PO keeps, and its statistics.

    Args:
        m2: (B, T) float32 m_t (see :func:`second_moment`); ignored where ``keep`` is False.
        keep: (B, T) bool, the tokens still in the loss.
        threshold: τ ≥ 0.
        process_groups: ``torch.distributed`` groups over which the batch's tokens are split
            (e.g. the data-parallel and the context-parallel group); sums are reduced over each.
    Returns:
        (keep (B, T) bool, unprefixed metrics): ``m2po_masked_fraction`` (share of the input tokens
        masked), ``m2po_m2_before`` / ``m2po_m2_after`` (mean m_t before / after; 0 over an empty set).
    """
    m2 = torch.where(keep, m2.float(), torch.zeros((), device=m2.device))
    bits = m2.view(torch.int32).to(torch.int64)
    dev = m2.device

    def below(c: torch.Tensor) -> torch.Tensor:
        inside = keep & (bits <= c)
        part = torch.stack([inside.sum(dtype=torch.float64), torch.where(inside, m2.double(), 0.0).sum()])
        return _all_reduce(part, process_groups)

    total = _all_reduce(torch.stack([keep.sum(dtype=torch.float64), m2.double().sum()]), process_groups)
    # Invariant: P(lo) holds and P(hi) fails, P(c) = [Σ m ≤ τ·count over kept tokens with bits ≤ c].
    # P(−1) holds (no token); m_t ≤ 400, so every token's bits are < hi and, when P holds for all
    # of them, lo ends at hi − 1 and every token is kept.
    lo = torch.full((), -1, dtype=torch.int64, device=dev)  # (fills on the device: no host-to-device copy)
    hi = torch.full((), 0x7F800000, dtype=torch.int64, device=dev)
    for _ in range(_STEPS):
        mid = (lo + hi) // 2
        n_s = below(mid)
        ok = n_s[1] <= threshold * n_s[0]
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    out = keep & (bits <= lo)
    kept = below(lo)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    metrics = {
        "m2po_masked_fraction": torch.where(total[0] > 0, 1.0 - kept[0] / total[0].clamp_min(1), zero),
        "m2po_m2_before": torch.where(total[0] > 0, total[1] / total[0].clamp_min(1), zero),
        "m2po_m2_after": torch.where(kept[0] > 0, kept[1] / kept[0].clamp_min(1), zero),
    }
    return out, metrics
