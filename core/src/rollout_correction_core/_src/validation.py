"""Checks at the door: shapes, dtypes and devices, with messages that say what to change."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

__all__ = ["ShapeMismatchError", "check_pair", "check_same", "check_segment_ids", "first_nonfinite"]


class ShapeMismatchError(ValueError, RuntimeError):
    """Inputs that must be aligned token by token have different shapes. Also a ``RuntimeError``,
    the type torch (and so verl) raises when such tensors meet."""


def _describe(name: str, t: torch.Tensor) -> str:
    return f"{name} (shape {tuple(t.shape)}, {t.dtype}, {t.device})"


def check_same(names_tensors: list[tuple[str, Optional[torch.Tensor]]], *, float_names: tuple[str, ...] = ()) -> None:
    """Raise ValueError/TypeError unless the given (batch, response_length) tensors share shape and
    device; ``float_names`` must be floating point."""
    present = [(n, t) for n, t in names_tensors if t is not None]
    for n, t in present:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    if not present:
        return
    ref_name, ref = present[0]
    if ref.dim() != 2:
        raise ValueError(f"{_describe(ref_name, ref)} must be 2-D (batch, response_length)")
    for n, t in present[1:]:
        if t.shape != ref.shape:
            raise ShapeMismatchError(f"shape mismatch: {_describe(ref_name, ref)} vs {_describe(n, t)}; "
                             "all inputs must be (batch, response_length) and aligned token by token")
        if t.device != ref.device:
            raise ValueError(f"device mismatch: {_describe(ref_name, ref)} vs {_describe(n, t)}")
    for n, t in present:
        if n in float_names and not t.is_floating_point():
            raise TypeError(f"{_describe(n, t)} must be a floating-point tensor of log-probabilities")
        if n not in float_names and t.is_complex():
            raise TypeError(f"{_describe(n, t)} must be real")


def check_pair(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor) -> None:
    check_same(
        [("old_log_prob", old_log_prob), ("rollout_log_prob", rollout_log_prob), ("response_mask", response_mask)],
        float_names=("old_log_prob", "rollout_log_prob"),
    )


def first_nonfinite(bad: torch.Tensor) -> Optional[tuple[int, int]]:
    """(row, column) of the first True entry of a (B, T) bool tensor, or None (one sync)."""
    idx = bad.nonzero()
    if idx.numel() == 0:
        return None
    return int(idx[0, 0]), int(idx[0, 1])


def check_segment_ids(segment_ids: Optional[torch.Tensor], response_mask: torch.Tensor,
                      max_segments: Optional[int], row_offset: int = 0) -> Optional[tuple[torch.Tensor, int]]:
    """``(ids, S)``: the (B, T) int64 segment ids with 0 at masked positions and the static number
    of segments S (``max_segments``, default T), or None without ``segment_ids``. Raises TypeError /
    ValueError for a non-integer dtype, a shape or device other than the mask's, S < 1, and — on CPU,
    where reading them costs no device sync — for a valid position whose id is outside [0, S); on an
    accelerator such an id fails in the scatter's own index check."""
    if segment_ids is None:
        if max_segments is not None:
            raise ValueError(f"max_segments={max_segments!r} given without segment_ids")
        return None
    if not isinstance(segment_ids, torch.Tensor):
        raise TypeError(f"segment_ids must be a torch.Tensor, got {type(segment_ids).__name__}")
    if segment_ids.dtype == torch.bool or segment_ids.is_floating_point() or segment_ids.is_complex():
        raise TypeError(f"{_describe('segment_ids', segment_ids)} must be an integer tensor of segment ids")
    if segment_ids.shape != response_mask.shape:
        raise ShapeMismatchError(f"shape mismatch: {_describe('segment_ids', segment_ids)} vs "
                                 f"{_describe('response_mask', response_mask)}; segment_ids gives each token's "
                                 "segment (turn) and must be (batch, response_length)")
    if segment_ids.device != response_mask.device:
        raise ValueError(f"device mismatch: {_describe('segment_ids', segment_ids)} vs "
                         f"{_describe('response_mask', response_mask)}")
    S = response_mask.shape[-1] if max_segments is None else max_segments
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"max_segments={max_segments!r} must be an integer ≥ 1 "
                         "(segment ids lie in [0, max_segments))")
    valid = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    ids = torch.where(valid, segment_ids.to(torch.int64), 0)
    if ids.device.type == "cpu" and ids.numel() and not torch.compiler.is_compiling():
        bad = (ids < 0) | (ids >= S)
        pos = first_nonfinite(bad) if bool(bad.any()) else None
        if pos is not None:
            raise ValueError(f"segment id {int(ids[pos])} at valid position (row {pos[0] + row_offset}, column "
                             f"{pos[1]}) is outside [0, {S}); ids must be non-negative and below max_segments "
                             f"(default: the number of columns)")
    return ids, S


@contextmanager
def arguments_of(func: str, arguments: dict[str, str]) -> Iterator[None]:
    """Around a ``RolloutCorrectionConfig`` that ``func`` builds from its arguments: the config's error,
    of the same type, naming ``func`` and its arguments (``arguments``: config key → argument name)."""
    try:
        yield
    except (ValueError, TypeError) as error:
        text = re.sub(r"^RolloutCorrectionConfig\.", "", str(error))
        for key in sorted(arguments, key=len, reverse=True):
            text = re.sub(rf"\b{key}\b", arguments[key], text)
        raise type(error)(f"{func}: {text}") from None
