"""Checks at the door: shapes, dtypes and devices, with messages that say what to change."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ShapeMismatchError", "check_pair", "check_same", "first_nonfinite"]


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
