"""OPSM, M2PO, TOPR, GSPO, CISPO and DPPO-TV / DPPO-KL against their exact expectations on the
enumerable toy (the setting of tests/test_exact_gradients.py: every sequence one row, advantages
scaled by μ(y)·B, ``seq-mean-token-sum``, so the library's gradient is an exact expectation under
the behaviour policy μ).

Each test writes the estimator's gradient from its formula, in float64 from the toy's closed-form
scores, and requires the library's autograd gradient to match it to 1e-5 — in a setting where
every branch of the method (clipped / not, masked / not, tapered / not) is taken by some tokens.
Notation as in docs/validation.md: ρ_t = π_old/μ per token (decoupled), r_t = π_θ/π_old, ∇_t the
score of token t, B/K the rescaling when K of the B rows keep a token.
"""

from __future__ import annotations

import pytest
import torch

from rollout_correction import ClipRange, RolloutCorrectionConfig
from toy import exact_policy_gradient
from test_exact_gradients import (CLIP_C, EPS_HI, EPS_LO, SPACES, assert_grad, between, from_coefficients,
                                  library_gradient, make_toy, per_row, rel_err)

CLIP = dict(clip=ClipRange(EPS_LO, EPS_HI, CLIP_C))


@pytest.fixture(params=list(SPACES))
def toy(request):
    return make_toy(request.param)


def _decoupled(toy):
    old, mu, th = toy.tok(toy.old), toy.tok(toy.mu), toy.tok(toy.theta)
    valid = toy.mask
    rho_t = (old - mu).exp()
    C = between(rho_t, 0.6, valid)
    return dict(valid=valid, mu_y=toy.seq_prob(toy.mu), A=per_row(toy.adv, toy), r=(th - old).exp(),
                w_tok=rho_t.clamp(max=C), C=C, p=th.exp(), q=old.exp(), old=old, mu=mu, th=th)


def test_cispo_decoupled_token_tis(toy):
    d = _decoupled(toy)
    clipped_r = d["r"].clamp(1 - EPS_LO, 1 + EPS_HI)
    assert ((clipped_r != d["r"]) & d["valid"]).any() and ((clipped_r == d["r"]) & d["valid"]).any()
    coef = per_row(d["mu_y"], toy) * d["w_tok"] * clipped_r * d["A"]
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=d["C"], loss_type="cispo")
    assert_grad(library_gradient(toy, cfg, old_logits=toy.old, **CLIP), from_coefficients(toy, coef))


def test_gspo_decoupled_geometric_tis(toy):
    d = _decoupled(toy)
    n = d["valid"].sum(-1)
    s = ((d["th"] - d["old"]).sum(-1) / n).exp()                 # exp(mean log π_θ/π_old)
    geo = ((d["old"] - d["mu"]).sum(-1) / n).exp()
    C = between(geo, 0.5)
    A = toy.adv
    clipped = torch.maximum(-A * s, -A * s.clamp(1 - EPS_LO, 1 + EPS_HI)) > -A * s
    assert clipped.any() and (~clipped).any()
    coef = per_row(d["mu_y"] * geo.clamp(max=C) * A * s * (~clipped), toy)
    cfg = RolloutCorrectionConfig(rollout_is="geometric", rollout_is_threshold=C, loss_type="gspo")
    assert_grad(library_gradient(toy, cfg, old_logits=toy.old, **CLIP), from_coefficients(toy, coef))


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_decoupled_token_tis(toy, divergence):
    d = _decoupled(toy)
    p, q, A, valid = d["p"], d["q"], d["A"], d["valid"]
    D = q * (q.log() - p.log()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    if divergence == "tv":
        eps = between((p - q).abs(), 0.7, valid)  # the toy's probability moves are small: a bound inside them
        inside = torch.where(A > 0, p - q <= eps, p - q >= -eps)
    else:
        eps = between(D, 0.7, valid)
        inside = torch.where(A > 0, (D <= eps) | (p <= q), (D <= eps) | (p >= q))
    inside &= valid
    truncated = inside & (d["r"] > CLIP_C)
    assert (valid & ~inside).any() and inside.any() and truncated.any()
    coef = per_row(d["mu_y"], toy) * d["w_tok"] * d["r"].clamp(max=CLIP_C) * A * inside
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=d["C"], loss_type=f"dppo_{divergence}")
    actual = library_gradient(toy, cfg, old_logits=toy.old, clip=ClipRange(eps, eps, CLIP_C))
    assert_grad(actual, from_coefficients(toy, coef))


def test_topr(toy):
    """g = Σ_y μ(y) w(y) A(y) ∇(y), w = 1 for A ≥ 0 and min(π_θ(y)/μ(y), 1) for A < 0."""
    ratio = toy.seq_prob(toy.theta) / toy.seq_prob(toy.mu)
    A = toy.adv
    assert ((A < 0) & (ratio < 1)).any() and ((A < 0) & (ratio > 1)).any()
    w = torch.where(A >= 0, torch.ones_like(ratio), ratio.clamp(max=1.0))
    expected = from_coefficients(toy, per_row(toy.seq_prob(toy.mu) * w * A, toy))
    assert_grad(library_gradient(toy, RolloutCorrectionConfig.bypass_topr()), expected)
    assert rel_err(expected, exact_policy_gradient(toy.theta, toy.space, toy.adv)) > 1e-2


def test_opsm_with_untruncated_sequence_is(toy):
    """Kept rows: A ≥ 0 or D(y) = mean_t log(μ/π_θ) ≤ δ; g = (B/K) Σ_{kept} π_θ(y) A(y) ∇(y)."""
    th, mu = toy.tok(toy.theta), toy.tok(toy.mu)
    D = (mu - th).sum(-1) / toy.mask.sum(-1)
    neg = toy.adv < 0
    delta = between(D[neg], 0.5)
    keep = (toy.adv >= 0) | (D <= delta)
    B, K = toy.space.batch_size, int(keep.sum())
    assert 0 < K < B
    coef = per_row(toy.seq_prob(toy.theta) * toy.adv * keep * B / K, toy)
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=float("inf"), bypass_mode=True,
                                  loss_type="reinforce", rollout_opsm_delta=delta)
    assert_grad(library_gradient(toy, cfg), from_coefficients(toy, coef))


def test_m2po_with_untruncated_sequence_is(toy):
    """Tokens kept: the smallest (log π_θ/μ)² whose batch mean stays ≤ τ (found here by sorting);
    g = (B/K) Σ_y μ(y) ρ(y) A(y) Σ_{t kept} ∇_t, K = rows keeping a token."""
    lr = toy.tok(toy.theta) - toy.tok(toy.mu)
    m2 = torch.where(toy.mask, lr * lr, 0.0)
    vals = m2[toy.mask].sort().values
    tau = float(vals.mean()) * 0.4
    # Shared prefixes repeat a (state, token) pair across rows: equal values are kept or masked together.
    cutoff = max(float(v) for v in vals.unique() if float(vals[vals <= v].mean()) <= tau)
    keep = toy.mask & (m2 <= cutoff)
    B, K = toy.space.batch_size, int(keep.any(-1).sum())
    assert keep.sum() < toy.mask.sum() and K > 0
    rho = lr.sum(-1).exp()
    coef = torch.where(keep, per_row(toy.seq_prob(toy.mu) * rho * toy.adv * B / K, toy), 0.0)
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=float("inf"), bypass_mode=True,
                                  loss_type="reinforce", rollout_m2po_threshold=tau)
    assert_grad(library_gradient(toy, cfg), from_coefficients(toy, coef))
