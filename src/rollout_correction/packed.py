"""Variable-length (packed) inputs: flat token tensors with ``cu_seqlens`` or ``lengths``. The flat
stream is scattered into a (B, T_max) layout once, the usual computation runs, and the results are
gathered back: identical numbers to the padded form, by construction.
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
    segment_ids = segments.ids if segments is not None else None
    if (lengths is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of lengths= or cu_seqlens=")
    if lengths is None:
        lengths = lengths_from_cu_seqlens(cu_seqlens)
    if old_log_prob.dim() != 1 or old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(f"packed log-probs must be 1-D and equal in shape, got {tuple(old_log_prob.shape)} "
                         f"and {tuple(rollout_log_prob.shape)}")
    n = int(lengths.sum())
    if n != old_log_prob.numel():
        raise ValueError(f"lengths sum to {n} but the packed tensors hold {old_log_prob.numel()} tokens")
    if response_mask is None:
        response_mask = torch.ones_like(old_log_prob, dtype=torch.bool)
    elif response_mask.shape != old_log_prob.shape:
        raise ValueError(f"response_mask shape {tuple(response_mask.shape)} does not match the packed "
                         f"log-probs {tuple(old_log_prob.shape)}")
    if segment_ids is not None and (not isinstance(segment_ids, torch.Tensor)
                                    or segment_ids.shape != old_log_prob.shape):
        got = tuple(segment_ids.shape) if isinstance(segment_ids, torch.Tensor) else type(segment_ids).__name__
        raise ValueError(f"segment_ids must be a tensor shaped like the packed log-probs "
                         f"{tuple(old_log_prob.shape)}, got {got}")
    rows, cols, T = pack_index(lengths.to(old_log_prob.device))
    B = lengths.numel()
    out = compute_rollout_correction(
        to_padded(old_log_prob, rows, cols, B, T), to_padded(rollout_log_prob, rows, cols, B, T),
        to_padded(response_mask, rows, cols, B, T, fill=False if response_mask.dtype == torch.bool else 0),
        config=config, parallel=parallel,
        segments=None if segments is None else Segments(to_padded(segment_ids, rows, cols, B, T), segments.count))
    weights = out.weights[rows, cols] if out.weights is not None else None
    return CorrectionOutput(weights, out.response_mask[rows, cols], out.metrics)
