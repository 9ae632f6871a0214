"""Variable-length (packed) inputs: flat token tensors with ``cu_seqlens`` or ``lengths``. The core
takes packed batches itself (``Segments(cu_seqlens=...)``); :func:`compute_rollout_correction_packed`
is the same call with per-sequence ``lengths`` accepted too, and the index helpers serve the adapters
that pad an engine's packed layout themselves.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollout_correction_core import CorrectionOutput, Parallel, RolloutCorrectionConfig, Segments, compute_rollout_correction

__all__ = ["lengths_from_cu_seqlens", "pack_index", "to_padded", "compute_rollout_correction_packed"]


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(B + 1,) cumulative offsets starting at 0 → (B,) lengths."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with B + 1 entries, got shape {tuple(cu_seqlens.shape)}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if (lengths < 0).any() or int(cu_seqlens[0]) != 0:
        raise ValueError("cu_seqlens must start at 0 and be non-decreasing")
    return lengths


def pack_index(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row and column of every flat token, and T_max."""
    lengths = lengths.to(torch.long)
    B = lengths.numel()
    T = int(lengths.max()) if B else 0
    rows = torch.repeat_interleave(torch.arange(B, device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(rows.numel(), device=lengths.device) - starts[rows]
    return rows, cols, T


def to_padded(flat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, B: int, T: int,
              fill: float | bool = 0) -> torch.Tensor:
    out = torch.full((B, T), fill, dtype=flat.dtype, device=flat.device)
    out[rows, cols] = flat
    return out


def compute_rollout_correction_packed(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    *,
    config: Optional[RolloutCorrectionConfig] = None,
    lengths: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    parallel: Optional[Parallel] = None,
    segments: Optional[Segments] = None,
) -> CorrectionOutput:
    """:func:`compute_rollout_correction` for flat (N,) token tensors.

    Give ``lengths`` (B,) or ``cu_seqlens`` (B + 1,); ``response_mask`` (N,) marks valid tokens
    inside each sequence (default: all). Returns flat (N,) ``weights`` and ``response_mask``.

    With ``parallel.cp_group`` (context parallelism) each rank passes its own tokens of the same B
    sequences, in the same order: ``lengths`` are then this rank's token counts per sequence
    (0 for an empty slice); see :func:`compute_rollout_correction` for the rest.

    ``segments``: :class:`Segments` with (N,) ``ids``, the segment (turn) of each token, as for
    :func:`compute_rollout_correction` (``count`` defaults to the longest sequence's length).
    """
    if (lengths is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of lengths= or cu_seqlens=")
    if lengths is not None:
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be 1-D (one length per sequence), got shape {tuple(lengths.shape)}")
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    if old_log_prob.dim() != 1 or old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(f"packed log-probs must be 1-D and equal in shape, got {tuple(old_log_prob.shape)} "
                         f"and {tuple(rollout_log_prob.shape)}")
    if response_mask is None:
        response_mask = torch.ones_like(old_log_prob, dtype=torch.bool)
    return compute_rollout_correction(
        old_log_prob, rollout_log_prob, response_mask, config=config, parallel=parallel,
        segments=Segments(None if segments is None else segments.ids, None if segments is None else segments.count,
                          cu_seqlens=cu_seqlens))
