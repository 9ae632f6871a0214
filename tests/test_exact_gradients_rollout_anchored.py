"""SkyRL's rollout-anchored losses, its geometric band, KPop, NeMo-RL's log-prob error and prime-rl's
IPO and IcePop against their exact expectations on the enumerable toy (the setting of
tests/test_exact_gradients.py: every sequence one row, advantages scaled by μ(y)·B, ``seq-mean-token-sum``, so the library's
gradient is an exact expectation under the behaviour policy μ).

Bypass mode throughout: r_t = π_θ(y_t)/μ(y_t), ∇_t the score of token t; B/K the rescaling when K
of the B rows keep a token (rejected tokens leave the denominators).
"""

from __future__ import annotations

import pytest
import torch

from rollout_correction import ClipRange, RolloutCorrectionConfig
from test_exact_gradients import (SPACES, assert_grad, between, from_coefficients, library_gradient, make_toy,
                                  per_row, rel_err)
from toy import exact_policy_gradient

REINFORCE = dict(bypass_mode=True, loss_type="reinforce")


@pytest.fixture(params=list(SPACES))
def toy(request):
    return make_toy(request.param)


def _bypass(toy):
    th, mu = toy.tok(toy.theta), toy.tok(toy.mu)
    return toy.mask, per_row(toy.seq_prob(toy.mu) * toy.adv, toy), (th - mu).exp()


def test_rollout_is(toy):
    """g = Σ_y μ(y) A(y) Σ_t r_t 1[1 − ε_lo < r_t < 1 + ε_hi] ∇_t (SkyRL's rollout_is)."""
    valid, muA, r = _bypass(toy)
    lo, hi = between(r, 0.2, valid), between(r, 0.8, valid)
    inside = (r > lo) & (r < hi)
    assert (inside & valid).any() and (~inside & valid).any()
    expected = from_coefficients(toy, muA * r * inside)
    actual = library_gradient(toy, RolloutCorrectionConfig.bypass_rollout_is(), rollout_logits="mu",
                              clip=ClipRange(1 - lo, hi - 1))
    assert_grad(actual, expected)
    assert rel_err(expected, exact_policy_gradient(toy.theta, toy.space, toy.adv)) > 1e-2


def test_prime_rl_ipo(toy):
    """g = Σ_y μ(y) A(y) Σ_t r_t 1[|π_θ(y_t) − μ(y_t)| ≤ δ] ∇_t: prime-rl's IPO, the ratio's own gradient
    on the tokens whose probability moved at most δ (rejected tokens stay counted: no rescaling)."""
    valid, muA, r = _bypass(toy)
    dp = toy.tok(toy.theta).exp() - toy.tok(toy.mu).exp()
    delta = between(dp.abs(), 0.5, valid)
    keep = dp.abs() <= delta
    assert (keep & valid).any() and (~keep & valid).any()
    actual = library_gradient(toy, RolloutCorrectionConfig.prime_rl_ipo(threshold=delta))
    assert_grad(actual, from_coefficients(toy, muA * r * keep))


def test_prime_rl_icepop(toy):
    """g = Σ_y μ(y) A(y) Σ_t r_t 1[lo ≤ r_t ≤ hi] ∇_t: prime-rl's IcePop."""
    valid, muA, r = _bypass(toy)
    lo, hi = between(r, 0.2, valid), between(r, 0.8, valid)
    keep = (r >= lo) & (r <= hi)
    assert (keep & valid).any() and (~keep & valid).any()
    actual = library_gradient(toy, RolloutCorrectionConfig.prime_rl_icepop(threshold=hi, threshold_lower=lo))
    assert_grad(actual, from_coefficients(toy, muA * r * keep))


def test_cispo_anchored_on_the_rollout_policy(toy):
    """g = Σ_y μ(y) A(y) Σ_t clip(r_t, 1 − ε_lo, 1 + ε_hi) ∇_t: every token keeps a (bounded) gradient."""
    valid, muA, r = _bypass(toy)
    lo, hi = between(r, 0.2, valid), between(r, 0.8, valid)
    clipped = r.clamp(lo, hi)
    assert ((clipped != r) & valid).any()
    actual = library_gradient(toy, RolloutCorrectionConfig.bypass_cispo(), clip=ClipRange(1 - lo, hi - 1))
    assert_grad(actual, from_coefficients(toy, muA * clipped))


@pytest.mark.parametrize("space_name", list(SPACES))
def test_geometric_band_of_skyrl(space_name):
    """The preset's band [0.99, 1.01] on exp(mean_t log r_t), with pure-IS REINFORCE weights 1:
    g = (B/K) Σ_{kept y} μ(y) A(y) ∇(y). A toy close to on-policy, so that the band keeps some."""
    toy = make_toy(space_name, mismatch=0.01, step=0.01)
    valid, muA, r = _bypass(toy)
    geo = (r.log().where(valid, 0.0).sum(-1) / valid.sum(-1)).exp()
    keep = (geo >= 0.99) & (geo <= 1.01)
    B, K = toy.space.batch_size, int(keep.sum())
    assert 0 < K < B
    cfg = RolloutCorrectionConfig.decoupled_geo_rs_wide().replace(**REINFORCE)
    expected = from_coefficients(toy, torch.where(keep.unsqueeze(-1) & valid, muA * B / K, 0.0))
    assert_grad(library_gradient(toy, cfg), expected)


def _kl(a, b):
    return a * (a / b).log() + (1 - a) * ((1 - a) / (1 - b)).log()


@pytest.mark.parametrize("option", ["token_kpop", "seq_max_kpop", "seq_logprob_error"])
def test_kpop_and_logprob_error_rejection(toy, option):
    """Rejection by KPop (max of the two Bernoulli KLs of the sampled token, q = π_θ(y_t), p = μ(y_t))
    or by the mean exp(|log r_t|), under pure-IS REINFORCE weights 1: g = Σ_{kept} (B/K) μ(y) A(y) ∇_t."""
    valid, muA, r = _bypass(toy)
    q, p = toy.tok(toy.theta).exp(), toy.tok(toy.mu).exp()
    kpop = torch.where(valid, torch.maximum(_kl(p, q), _kl(q, p)), 0.0)
    if option == "token_kpop":
        u = between(kpop, 0.7, valid)
        keep = kpop <= u
    elif option == "seq_max_kpop":
        top = kpop.amax(-1)
        u = between(top, 0.6)
        keep = (top <= u).unsqueeze(-1).expand_as(valid)
    else:
        err = torch.where(valid, r.log().abs().exp(), 0.0).sum(-1) / valid.sum(-1)
        u = between(err, 0.6)
        keep = (err <= u).unsqueeze(-1).expand_as(valid)
    keep = keep & valid
    B, K = toy.space.batch_size, int(keep.any(-1).sum())
    assert 0 < K <= B and (valid & ~keep).any() and (option == "token_kpop" or K < B)
    cfg = RolloutCorrectionConfig(rollout_rs=option, rollout_rs_threshold=u, **REINFORCE)
    assert_grad(library_gradient(toy, cfg), from_coefficients(toy, torch.where(keep, muA * B / K, 0.0)))


def test_rollout_is_loss_by_hand():
    """r = 1.1, 0.7, 1.3 against the band (0.8, 1.2): only the first token keeps its ratio.
    token-mean over 3 tokens: loss = −1.1·A·log π_θ(y_0)/3, gradient −1.1·A/3 on log π_θ(y_0)."""
    from rollout_correction import compute_policy_loss

    rollout = torch.tensor([[-1.0, -0.5, -2.0]])
    ratio = torch.tensor([[1.1, 0.7, 1.3]])
    log_prob = (rollout + ratio.log()).requires_grad_(True)
    adv = torch.full((1, 3), 2.0)
    loss, metrics = compute_policy_loss(log_prob, None, adv, torch.ones(1, 3, dtype=torch.bool),
                                        config=RolloutCorrectionConfig.bypass_rollout_is(), rollout_log_prob=rollout)
    loss.backward()
    expected = -1.1 * 2.0 * float(log_prob[0, 0]) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert log_prob.grad.tolist()[0] == pytest.approx([-1.1 * 2.0 / 3, 0.0, 0.0], rel=1e-5)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(2 / 3)
    with pytest.raises(Exception, match="bypass"):
        RolloutCorrectionConfig(loss_type="rollout_is")
