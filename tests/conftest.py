"""Shared test helpers: build (old, rollout, mask) batches from per-token ratios chosen by hand."""

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
    rollout = (-0.5 - 0.25 * torch.arange(T, dtype=torch.float64)).expand(B, T)
    old = rollout + log_ratio
    return old.to(dtype), rollout.to(dtype).contiguous(), mask.to(mask_dtype)


@pytest.fixture
def make_batch():
    return batch_from_ratios
