"""MinPRO prefix-minimum weights, rollout_is="prefix_min": w_t = min_{s≤t} ρ_s over the row's valid
tokens, then bounded like token weights.

By hand: log ρ = [0.1, −0.5, 0.3, −0.2] gives w = [e^0.1, e^−0.5, e^−0.5, e^−0.5]; a row with
log ρ = [0, ·, −0.1, ·] (positions 1 and 3 masked) gives [1, 0, e^−0.1, 0].
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from test_exact_gradients import (INF, SPACES, assert_grad, between, from_coefficients, library_gradient, make_toy,
                                  per_row, rel_err)
from toy import exact_policy_gradient

P = "rollout_corr/"


def test_prefix_min_by_hand():
    lr = torch.tensor([[0.1, -0.5, 0.3, -0.2], [0.0, 5.0, -0.1, -7.0], [0.0, 0.0, 0.0, 0.0]])
    roll = torch.full((3, 4), -1.0)
    roll[2, 1] = float("nan")  # a row dropped for a non-finite value: weight 0, never NaN
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    out = compute_rollout_correction(roll + lr, roll, mask, config=RolloutCorrectionConfig(
        rollout_is="prefix_min", rollout_is_threshold=1.05))
    e = math.exp
    expected = [[1.05, e(-0.5), e(-0.5), e(-0.5)], [1.0, 0.0, e(-0.1), 0.0], [0.0] * 4]  # e^0.1 truncated at 1.05
    torch.testing.assert_close(out.weights, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    m = out.metrics_as_floats()
    raw = [e(0.1), e(-0.5), e(-0.5), e(-0.5), 1.0, e(-0.1)]
    assert m[P + "rollout_is_max"] == pytest.approx(1.05, rel=1e-6)  # token statistics of the bounded weights
    assert m[P + "rollout_is_mean"] == pytest.approx((1.05 + 3 * e(-0.5) + 1.0 + e(-0.1)) / 6, rel=1e-6)
    assert m[P + "rollout_is_min"] == pytest.approx(min(raw), rel=1e-6)


@pytest.mark.parametrize("space_name", list(SPACES))
@pytest.mark.parametrize("truncated", [False, True])
def test_prefix_min_is_reinforce_matches_its_formula(space_name, truncated):
    """g = Σ_y μ(y) A(y) Σ_t min(min_{s≤t} ρ_s, C) ∇_t on the enumerable toy (bypass REINFORCE)."""
    toy = make_toy(space_name)
    valid = toy.mask
    log_rho = torch.where(valid, toy.tok(toy.theta) - toy.tok(toy.mu), INF)
    w = torch.where(valid, log_rho.cummin(-1).values.exp(), 0.0)
    C = between(w, 0.5, valid) if truncated else INF
    coef = per_row(toy.seq_prob(toy.mu) * toy.adv, toy) * w.clamp(max=C)
    cfg = RolloutCorrectionConfig(rollout_is="prefix_min", rollout_is_threshold=C, bypass_mode=True,
                                  loss_type="reinforce")
    expected = from_coefficients(toy, coef)
    assert_grad(library_gradient(toy, cfg), expected)
    assert rel_err(expected, exact_policy_gradient(toy.theta, toy.space, toy.adv)) > 1e-2


def test_prefix_min_refuses_split_sequences():
    from rollout_correction_core._src.config import as_config
    from rollout_correction_core._src.logratio import LogRatioBatch
    from rollout_correction_core._src.weights import importance_weights

    batch = LogRatioBatch.from_log_ratio(torch.zeros(1, 3), torch.ones(1, 3))
    spec = as_config({"rollout_is": "prefix_min", "rollout_is_threshold": 2.0}).is_spec
    split = batch.__class__(**{**batch.__dict__, "rows": object()})
    with pytest.raises(ValueError, match="prefix_min.*whole sequences"):
        importance_weights(split, spec)
