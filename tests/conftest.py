"""Shared test helpers: build (old, rollout, mask) batches from per-token ratios chosen by hand."""

import builtins
import math

import pytest
import torch

torch.set_num_threads(1)


def batch_from_ratios(rows, T=None, pad_ratio=100.0, empty_rows=0, dtype=torch.float32,
                      mask_dtype=torch.bool):
    """(old_log_prob, rollout_log_prob, response_mask) whose valid log-ratios are log ρ.

    ``rows`` lists the ratios ρ_t of each row's valid tokens (left-aligned); the rest of the row
    is padding with ratio ``pad_ratio`` (so a leak of padding into any result shows up), and
    ``empty_rows`` all-padding rows are appended. Rollout log-probs differ per column so that
    the tests do not depend on a constant baseline.
    """
    T = T or max(len(r) for r in rows)
    B = len(rows) + empty_rows
    log_ratio = torch.full((B, T), math.log(pad_ratio), dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, r in enumerate(rows):
        for t, rho in enumerate(r):
            log_ratio[i, t] = math.log(rho)
            mask[i, t] = True
    # log-probs are ≤ 0: the rollout's lowered by the largest log-ratio, so that π_old's stay below 0 too
    rollout = (-0.5 - 0.25 * torch.arange(T, dtype=torch.float64) - log_ratio.max().clamp_min(0.0)).expand(B, T)
    old = rollout + log_ratio
    return old.to(dtype), rollout.to(dtype).contiguous(), mask.to(mask_dtype)


@pytest.fixture
def make_batch():
    return batch_from_ratios


def assert_same_correction(got, expected, *, weights_rtol: float, rel: float, abs: float,
                           std_scale: float = 0.0) -> None:
    """Two CorrectionOutputs agree: the same keep mask (and dtype), weights within ``weights_rtol``,
    the same metric names, every metric within ``rel`` / ``abs``. With ``std_scale`` a ``*std``
    metric is compared within ``std_scale`` × the largest |mean|, |max|, |min| of its family: a std
    is a difference of float32 sums, so its rounding scales with the values it is the spread of."""
    assert torch.equal(got.response_mask, expected.response_mask)
    assert got.response_mask.dtype == expected.response_mask.dtype
    if expected.weights is None:
        assert got.weights is None
    else:
        torch.testing.assert_close(got.weights, expected.weights, rtol=weights_rtol, atol=0)
    a, b = expected.metrics_as_floats(), got.metrics_as_floats()
    assert a.keys() == b.keys()
    for k in a:
        tol = abs
        if std_scale and k.endswith("std"):
            tol = max([abs] + [std_scale * builtins.abs(a[k[:-3] + s]) for s in ("mean", "max", "min")
                               if k[:-3] + s in a])
        assert b[k] == pytest.approx(a[k], rel=rel, abs=tol), k
