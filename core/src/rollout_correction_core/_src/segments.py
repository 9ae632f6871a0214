"""Segments (turns) of a row: per-segment sums, and segment ids from the runs of a response mask.

A segment is a set of tokens of one row with equal segment id. Engines that interleave turns with
masked tool or environment output (ROLL's agentic pipeline) give no ids: their segments are the
maximal runs of consecutive valid tokens. :func:`segment_ids_from_mask` numbers those runs, so that
every segment option of this library applies to them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Segments", "segment_sums", "segment_ids_from_mask", "max_runs"]


@dataclass(frozen=True, eq=False)
class Segments:
    """How a batch's tokens group into sequences and turns.

    Turns (segments) of multi-turn rows: ``ids`` (B, T) integers, the valid tokens of a row with equal
    id form one segment, ids in [0, ``count``) at valid positions (ignored elsewhere); ``count`` the
    static number S of ids (default T; required with a context-parallel group, whose ids are global
    within the row). None: every row is one segment.

    Packed sequences (:mod:`~rollout_correction_core._src.packing`): ``cu_seqlens`` (B + 1,) integer
    offsets of B sequences laid end to end in (1, N) or (N,) inputs (flash-attn's convention), and
    ``max_seqlen`` the longest (optional: read from ``cu_seqlens`` when not given, one host read). The
    inputs and outputs are then packed, ``ids`` too; the results are those of the padded (B, T) form."""

    ids: Optional[torch.Tensor] = None
    count: Optional[int] = None
    cu_seqlens: Optional[torch.Tensor] = None
    max_seqlen: Optional[int] = None


def segment_sums(x: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """(B, S) Σ over each segment's positions of a (B, T) tensor: out[b, s] = Σ_{t: id[b,t]=s} x[b, t].
    ``x`` must be 0 at the positions that belong to no segment (their id is 0); differentiable in ``x``."""
    out = torch.zeros((x.shape[0], num_segments), dtype=x.dtype, device=x.device)
    return out.scatter_add_(1, segment_ids, x)


def max_runs(length: int) -> int:
    """The most runs of valid tokens a row of ``length`` columns can hold, ⌈T/2⌉ (runs are separated
    by at least one masked position): a static ``max_segments`` for :func:`segment_ids_from_mask`."""
    return max((length + 1) // 2, 1)


def segment_ids_from_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """Segment ids that make each maximal run of consecutive valid tokens of a row one segment.

    id[b, t] = (number of runs of row b that start at or before t) − 1 at valid positions, 0 at
    masked ones; a run starts at t when mask[b, t] ≠ 0 and (t = 0 or mask[b, t−1] = 0). E.g. the mask
    [0, 1, 1, 0, 1] gives ids [0, 0, 0, 0, 1]. Ids lie in [0, ⌈T/2⌉) (:func:`max_runs`), a static
    bound, so passing ``max_segments=max_runs(T)`` keeps the per-segment tensors small without a
    device sync. With context parallelism derive the ids on the whole row, then split them with the
    tokens (ids are global within a row).

    Args:
        response_mask: (B, T) bool or 0/1 mask (non-zero is valid).
    Returns:
        (B, T) int64 segment ids.
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (batch, response_length), got shape {tuple(response_mask.shape)}")
    valid = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    before = torch.zeros_like(valid)
    before[:, 1:] = valid[:, :-1]
    starts = valid & ~before
    return torch.where(valid, starts.cumsum(-1) - 1, 0)
