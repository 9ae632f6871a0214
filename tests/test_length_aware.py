"""Length-aware statistics: pre-truncation sequence weights (hand-computed) and the diagnose rule
that recommends the length-normalised (geometric) weight for long responses."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from rollout_correction.diagnose import diagnose_tensors



def test_pre_truncation_sequence_weight_statistics_hand_computed():
    # Row log weights Σ log ρ_t: [ln 4, ln 0.05, 0 (one token), −] — the last row is empty.
    old = torch.tensor([[math.log(2.0), math.log(2.0), 0.0], [math.log(0.05), 0.0, 0.0],
                        [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]) - 3.0  # log-probs ≤ 0, the same ratios
    rollout = torch.full((4, 3), -3.0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]]).float()
    full = ["default", "raw", "detail"]
    m = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig.decoupled_seq_is().replace(
        metrics=full)).metrics_as_floats()
    raw = [4.0, 0.05, 1.0]
    assert m["rollout_corr/rollout_is_seq_raw_mean"] == pytest.approx(sum(raw) / 3)
    assert m["rollout_corr/rollout_is_seq_raw_ess"] == pytest.approx(sum(raw) ** 2 / (3 * sum(w * w for w in raw)))
    assert m["rollout_corr/rollout_is_seq_log_mean"] == pytest.approx((math.log(4) + math.log(0.05)) / 3, rel=1e-6)
    assert m["rollout_corr/rollout_is_seq_collapsed_fraction"] == pytest.approx(1 / 3)
    # The truncated mean the loss uses hides the spread: (2 + 0.05 + 1) / 3 over sequences.
    assert m["rollout_corr/rollout_is_seq_mean"] == pytest.approx((2 + 0.05 + 1) / 3)
    # Geometric level: row log weights ln 2, ln(0.05)/2, 0 (means over the rows' tokens).
    g = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig(rollout_is="geometric",
                                                                                      metrics=full)).metrics_as_floats()
    # rollout_is_seq_raw_mean is the mean of ∏_t ρ_t at every level (the raw statistics)
    assert g["rollout_corr/rollout_is_seq_raw_mean"] == pytest.approx(sum(raw) / 3, rel=1e-6)
    assert g["rollout_corr/rollout_is_seq_raw_ess"] == pytest.approx(
        (2 + math.sqrt(0.05) + 1) ** 2 / (3 * (4 + 0.05 + 1)), rel=1e-6)
    assert g["rollout_corr/rollout_is_seq_collapsed_fraction"] == 0.0
    token = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig.decoupled_token_is().replace(
        metrics=full)).metrics
    assert not any("seq_raw_ess" in k or "seq_log_mean" in k for k in token)


def _long(length, sigma, rows=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rollout = -0.2 - torch.rand(rows, length, generator=gen)
    old = (rollout - 0.5 * sigma ** 2 + sigma * torch.randn(rows, length, generator=gen)).clamp(max=0.0)
    return old, rollout, torch.ones(rows, length)


def test_diagnose_recommends_geometric_weights_for_long_responses():
    """σ = 0.05 per token (KL ≈ 1.25e-3): at 4000 tokens Var(log ∏ρ) ≈ 10, the product weight collapses
    (ESS ≪ 0.5) while exp(mean log ρ) has spread σ/√L ≈ 8e-4 (ESS ≈ 1); at 100 tokens the same gap keeps
    sequence weights usable."""
    rec = diagnose_tensors(*_long(4000, 0.05), presets=[]).recommendation
    assert (rec.case, rec.preset) == ("long", "decoupled_geo_is"), rec.reason
    assert rec.inputs["seq_ess"] < 0.5 and rec.inputs["geo_ess"] > 0.99
    assert "collapsed" in rec.reason and "4000" in rec.reason
    short = diagnose_tensors(*_long(100, 0.05), presets=[]).recommendation
    assert short.case in ("seq", "seq+rs")
    m = compute_rollout_correction(*_long(4000, 0.05), config=RolloutCorrectionConfig.decoupled_seq_is().replace(
        metrics=["default", "detail"])).metrics_as_floats()
    assert m["rollout_corr/rollout_is_seq_collapsed_fraction"] > 0.5
    assert m["rollout_corr/rollout_is_mean"] < 0.4  # the truncated weights the loss would use
    geo = compute_rollout_correction(*_long(4000, 0.05), config=RolloutCorrectionConfig.decoupled_geo_is()).metrics_as_floats()
    assert geo["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=0.01)
