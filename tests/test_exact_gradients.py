"""Gradient estimators against exact expectations on an enumerable toy (docs/validation.md).

Every sequence of a tabular autoregressive policy (tests/toy.py) is one row of the
batch; advantages are scaled by μ(y)·B so that a ``seq-mean-token-sum`` loss over the rows is an
exact expectation under the behaviour policy μ. The gradient the library's loss produces
(through torch autograd) is compared with the estimator's formula, evaluated in float64 from
the toy's closed-form scores ∇ log π(y_t | y_<t). The library computes in float32, hence the
relative tolerance of 1e-5.

Sign convention: g = −∇_θ loss, the ascent direction, compared with Σ_y … A(y) ∇ log π(y).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rollout_correction import RolloutCorrectionConfig, compute_policy_loss
from toy import (SequenceSpace, enumerate_sequences, exact_policy_gradient, perturb,
                                    random_logits, scaled_advantages, sequence_log_probs, token_log_probs,
                                    token_scores)
from rollout_correction import Aggregation, ClipRange, PolicyLoss, Segments

RTOL = 1e-5
INF = float("inf")

# Fixed length (B = 27, no padding) and variable length (a stop token; B = 31, padded rows).
SPACES = {
    "V3-T3": dict(vocab_size=3, horizon=3),
    "V3-T4-stop": dict(vocab_size=3, horizon=4, stop_token=0),
}


@dataclass
class Toy:
    space: SequenceSpace
    theta: torch.Tensor  # π_θ logits (S, V)
    old: torch.Tensor    # π_old logits: ≠ θ and ≠ μ
    mu: torch.Tensor     # behaviour (rollout) policy logits
    adv: torch.Tensor    # (B,) A(y) = R(y) − E_πθ[R]

    def lp(self, logits: torch.Tensor) -> torch.Tensor:
        """Token log-probs as the library receives them: NaN at padding (it must never leak)."""
        return token_log_probs(logits, self.space, fill=math.nan)

    def tok(self, logits: torch.Tensor) -> torch.Tensor:
        """Token log-probs, 0 at padding (for the reference formulas)."""
        return token_log_probs(logits, self.space)

    def seq_prob(self, logits: torch.Tensor) -> torch.Tensor:
        return sequence_log_probs(logits, self.space).exp()

    @property
    def mask(self) -> torch.Tensor:
        return self.space.mask

    @property
    def scaled_adv(self) -> torch.Tensor:
        return scaled_advantages(self.adv, sequence_log_probs(self.mu, self.space), self.space)


def make_toy(space_name: str, seed: int = 0, mismatch: float = 0.3, step: float = 0.5) -> Toy:
    space = enumerate_sequences(**SPACES[space_name])
    gen = torch.Generator().manual_seed(seed)
    theta = random_logits(space, 1.0, gen)
    old = perturb(theta, step, gen)
    mu = perturb(old, mismatch, gen)
    reward = torch.randn(space.batch_size, generator=gen, dtype=torch.float64)
    adv = reward - (sequence_log_probs(theta, space).exp() * reward).sum()
    # The toy stays well inside the library's ±20 log clamp, so no weight is silently capped.
    for p, q in ((theta, mu), (old, mu), (theta, old)):
        assert (sequence_log_probs(p, space) - sequence_log_probs(q, space)).abs().max() < 5.0
    return Toy(space, theta, old, mu, adv)


@pytest.fixture(params=list(SPACES))
def toy(request) -> Toy:
    return make_toy(request.param)


def library_gradient(toy: Toy, cfg, log_prob_logits=None, old_logits=None, rollout_logits="mu",
                     loss_agg_mode="seq-mean-token-sum", clip=ClipRange(), segments=None, rollout_is_weights=None,
                     **counts) -> torch.Tensor:
    """−∇_θ of the library's loss, with advantages A(y)·μ(y)·B."""
    theta = (toy.theta if log_prob_logits is None else log_prob_logits).clone().requires_grad_(True)
    rollout = toy.mu if rollout_logits == "mu" else rollout_logits
    loss, _ = compute_policy_loss(
        toy.lp(theta), None if old_logits is None else toy.lp(old_logits), toy.scaled_adv, toy.mask,
        config=cfg, rollout_log_prob=None if rollout is None else toy.lp(rollout), rollout_is_weights=rollout_is_weights,
        loss=PolicyLoss(clip, Aggregation(loss_agg_mode, **counts)), segments=segments)
    (grad,) = torch.autograd.grad(loss, theta)
    assert torch.isfinite(grad).all()
    return -grad


def from_coefficients(toy: Toy, coef: torch.Tensor, logits=None) -> torch.Tensor:
    """Σ_{y,t} coef[y, t] ∇ log π(y_t | y_<t), with the closed-form scores (no autograd)."""
    scores = token_scores(toy.theta if logits is None else logits, toy.space)
    return torch.einsum("bt,btsv->sv", torch.where(toy.mask, coef, 0.0), scores)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def assert_grad(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    assert expected.norm() > 1e-3, "the reference gradient is degenerate; the check would mean nothing"
    err = rel_err(actual, expected)
    assert err < rtol, f"relative gradient error {err:.3e} ≥ {rtol}"


def between(values: torch.Tensor, q: float, valid=None) -> float:
    """A threshold strictly inside a gap (relative width ≥ 1e-3) of the sorted ``values`` near
    quantile ``q``: some values fall on each side, and float32 rounding cannot move any across."""
    v = (values if valid is None else values[valid]).flatten().unique().sort().values
    gaps = [k for k in range(len(v) - 1) if v[k + 1] > v[k] * (1 + 1e-3) + 1e-9]
    k = min(gaps, key=lambda k: abs(k - q * (len(v) - 1)))
    return float((v[k] + v[k + 1]) / 2)


def per_row(x: torch.Tensor, toy: Toy) -> torch.Tensor:
    """Broadcast a (B,) value over each row's tokens."""
    return torch.where(toy.mask, x.unsqueeze(-1), 0.0)


# ---------------------------------------------------------------------------------------------
# 0. The toy itself


@pytest.mark.parametrize("space_name", list(SPACES))
def test_toy_probabilities_and_scores_are_exact(space_name):
    toy = make_toy(space_name)
    space = toy.space
    assert space.batch_size == (27 if space.stop_token is None else 31)
    assert len({tuple(r[m].tolist()) for r, m in zip(space.tokens, space.mask)}) == space.batch_size
    for logits in (toy.theta, toy.mu):
        assert float(toy.seq_prob(logits).sum()) == pytest.approx(1.0, abs=1e-12)
    # Closed-form scores = autograd Jacobian of the token log-probs.
    jac = torch.autograd.functional.jacobian(lambda th: token_log_probs(th, space), toy.theta)
    torch.testing.assert_close(token_scores(toy.theta, space), jac, rtol=1e-12, atol=1e-12)
    # Policy-gradient theorem: Σ π A ∇log π = ∇_θ Σ_y π_θ(y) R(y) (the baseline drops out).
    reward = toy.adv + 0.7
    theta = toy.theta.clone().requires_grad_(True)
    (grad_j,) = torch.autograd.grad((sequence_log_probs(theta, space).exp() * reward).sum(), theta)
    exact = exact_policy_gradient(toy.theta, space, toy.adv)
    torch.testing.assert_close(exact, grad_j, rtol=1e-12, atol=1e-12)


def test_toy_rejects_bad_input():
    space = enumerate_sequences(2, 2)
    with pytest.raises(ValueError, match="shape"):
        token_log_probs(torch.zeros(2, 2, dtype=torch.float64), space)
    with pytest.raises(ValueError, match="stop_token"):
        enumerate_sequences(2, 2, stop_token=2)
    with pytest.raises(ValueError, match="vocab_size"):
        enumerate_sequences(1, 2)


# ---------------------------------------------------------------------------------------------
# 1. Untruncated sequence IS through bypass REINFORCE = the exact on-policy gradient


@pytest.mark.parametrize("threshold", [INF, 1e8])
def test_untruncated_sequence_is_reinforce_is_the_on_policy_gradient(toy, threshold):
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True,
                                  loss_type="reinforce")
    exact = exact_policy_gradient(toy.theta, toy.space, toy.adv)
    assert_grad(library_gradient(toy, cfg), exact)
    # Without the weights the same loss estimates E_μ[A ∇log π] instead: far from the target.
    plain = library_gradient(toy, RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce"))
    assert rel_err(plain, exact) > 1e-2
    # A trainer that already put the rollout log-probs in old_log_prob gets the same gradient.
    assert_grad(library_gradient(toy, cfg, old_logits=toy.mu, rollout_logits=None), exact)


@pytest.mark.parametrize("mode", ["token-sum", "token-mean", "token-mean-global", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm", "seq-mean-token-sum-global"])
def test_aggregation_modes_scale_the_on_policy_gradient_as_documented(toy, mode):
    """Same untruncated sequence-IS REINFORCE; each aggregation mode divides row y's token sum by
    its own denominator: B·E_π[A∇log π] for token-sum, (B/N_tok)·… for token-mean, Σ_y π A ∇(y)/n_y
    for seq-mean-token-mean, 1/T of the on-policy gradient for seq-mean-token-sum-norm."""
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=INF, bypass_mode=True,
                                  loss_type="reinforce")
    B, T = toy.space.batch_size, toy.space.horizon
    n = toy.mask.sum(-1).double()
    n_tok = float(n.sum())
    pi_a = toy.seq_prob(toy.theta) * toy.adv
    kwargs, row = {}, pi_a
    if mode == "token-sum":
        row = pi_a * B
    elif mode == "token-mean":
        row = pi_a * B / n_tok
    elif mode == "token-mean-global":  # three ranks' worth of tokens in the global denominator
        mode, kwargs, row = "token-mean", dict(global_num_tokens=3 * n_tok), pi_a * B / (3 * n_tok)
    elif mode == "seq-mean-token-mean":
        row = pi_a / n
    elif mode == "seq-mean-token-sum-norm":
        row = pi_a / T
    else:  # global sequence count over two ranks, gradients averaged (dp_size=2): the local result
        mode, kwargs = "seq-mean-token-sum", dict(global_num_seqs=2 * B, dp_size=2)
    expected = from_coefficients(toy, per_row(row, toy))
    assert_grad(library_gradient(toy, cfg, loss_agg_mode=mode, **kwargs), expected)


# ---------------------------------------------------------------------------------------------
# 2. Truncated, masked, clipped, normalised and rejecting variants match their formulas


def _is_quantities(toy: Toy):
    tok_lr = toy.tok(toy.theta) - toy.tok(toy.mu)                     # log ρ_t, 0 at padding
    n = toy.mask.sum(-1).double()
    return tok_lr.exp(), tok_lr.sum(-1).exp(), (tok_lr.sum(-1) / n).exp()  # ρ_t, π/μ, geometric


def _variant(toy: Toy, name: str):
    """(config, per-token coefficient of ∇log π(y_t|y_<t)) of each estimator, by its formula."""
    mu_y = toy.seq_prob(toy.mu)
    rho_t, rho_seq, rho_geo = _is_quantities(toy)
    A = toy.adv
    B = toy.space.batch_size
    valid = toy.mask
    base = dict(bypass_mode=True, loss_type="reinforce")
    if name == "sequence-TIS":
        C = between(rho_seq, 0.5)
        w = rho_seq.clamp(max=C)
        assert (rho_seq > C).any() and (rho_seq < C).any()
        return (RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=C, **base),
                per_row(mu_y * w * A, toy))
    if name == "token-TIS":
        C = between(rho_t, 0.5, valid)
        assert (rho_t[valid] > C).any() and (rho_t[valid] < C).any()
        return (RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=C, **base),
                per_row(mu_y * A, toy) * rho_t.clamp(max=C))
    if name == "token-IS-untruncated":  # biased: Σ_y μ Σ_t ρ_t A ∇log π_t ≠ the on-policy gradient
        return (RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=INF, **base),
                per_row(mu_y * A, toy) * rho_t)
    if name == "geometric-TIS":
        C = between(rho_geo, 0.5)
        assert (rho_geo > C).any() and (rho_geo < C).any()
        return (RolloutCorrectionConfig(rollout_is="geometric", rollout_is_threshold=C, **base),
                per_row(mu_y * rho_geo.clamp(max=C) * A, toy))
    if name == "sequence-IcePop":
        lo, hi = between(rho_seq, 0.2), between(rho_seq, 0.8)
        keep = (rho_seq >= lo) & (rho_seq <= hi)
        assert keep.any() and (~keep).any()
        return (RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=f"{lo!r}_{hi!r}", **base),
                per_row(mu_y * torch.where(keep, rho_seq, 0.0) * A, toy))
    if name == "token-IcePop":
        lo, hi = between(rho_t, 0.2, valid), between(rho_t, 0.8, valid)
        keep = (rho_t >= lo) & (rho_t <= hi)
        assert (keep & valid).any() and (~keep & valid).any()
        return (RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=f"{lo!r}_{hi!r}", **base),
                per_row(mu_y * A, toy) * torch.where(keep, rho_t, 0.0))
    if name == "sequence-clip":  # slime's two-sided clamp
        lo, hi = between(rho_seq, 0.25), between(rho_seq, 0.75)
        assert (rho_seq < lo).any() and (rho_seq > hi).any()
        return (RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=hi,
                                        rollout_is_threshold_lower=lo, rollout_is_mode="clip", **base),
                per_row(mu_y * rho_seq.clamp(lo, hi) * A, toy))
    if name == "sequence-TIS-batchnorm":  # w / mean over rows (a plain row mean, not E_μ[w])
        C = between(rho_seq, 0.5)
        w = rho_seq.clamp(max=C)
        return (RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=C,
                                        rollout_is_batch_normalize=True, **base),
                per_row(mu_y * w / w.mean() * A, toy))
    if name == "token-TIS-batchnorm":  # w_t / mean over valid tokens
        C = between(rho_t, 0.5, valid)
        w = rho_t.clamp(max=C)
        return (RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=C,
                                        rollout_is_batch_normalize=True, **base),
                per_row(mu_y * A, toy) * w / w[valid].mean())
    # Rejection sampling: the rejected tokens leave the loss and its denominator, which counts the
    # K rows that keep ≥ 1 token, so every kept row is scaled by B / K.
    if name == "RS-seq_sum_k1+sequence-IS":
        lo, hi = between(rho_seq, 0.2), between(rho_seq, 0.8)
        keep_tok = per_row(((rho_seq >= lo) & (rho_seq <= hi)).double(), toy) > 0
        cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=INF,
                                      rollout_rs="seq_sum_k1", rollout_rs_threshold=f"{lo!r}_{hi!r}", **base)
        coef = per_row(toy.seq_prob(toy.theta) * A, toy)  # μ·(π/μ)·A = π·A
    elif name == "RS-token_k1+token-TIS":
        lo, hi = between(rho_t, 0.15, valid), between(rho_t, 0.85, valid)
        C = between(rho_t, 0.6, valid)
        keep_tok = (rho_t >= lo) & (rho_t <= hi)
        cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=C, rollout_rs="token_k1",
                                      rollout_rs_threshold=f"{lo!r}_{hi!r}", **base)
        coef = per_row(mu_y * A, toy) * rho_t.clamp(max=C)
    elif name == "RS-seq_mean_k3":
        k3 = torch.where(valid, rho_t - 1 - rho_t.log(), 0.0).sum(-1) / valid.sum(-1)
        u = between(k3, 0.6)
        keep_tok = per_row((k3 <= u).double(), toy) > 0
        cfg = RolloutCorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=u, **base)
        coef = per_row(mu_y * A, toy)
    elif name == "RS-geometric-legacy+veto":
        lo, hi = between(rho_geo, 0.1), between(rho_geo, 0.9)
        veto = between(rho_t, 0.1, valid)
        vetoed = (valid & (rho_t < veto)).any(-1)
        keep_tok = per_row(((rho_geo >= lo) & (rho_geo <= hi) & ~vetoed).double(), toy) > 0
        assert vetoed.any() and ((rho_geo >= lo) & (rho_geo <= hi) & vetoed).any()
        cfg = RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=hi,
                                      rollout_rs_threshold_lower=lo,
                                      rollout_token_veto_threshold=veto, **base)
        coef = per_row(mu_y * A, toy)
    elif name.startswith("RS-prob"):  # probability space: q = π_θ(y_t) (bypass: π_train = π_θ), p = μ(y_t)
        q, p = toy.tok(toy.theta).exp(), toy.tok(toy.mu).exp()
        tv = torch.where(valid, (p - q).abs(), 0.0)
        bkl = torch.where(valid, p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log(), 0.0)
        if name == "RS-prob-token_tv+token-TIS":
            u, C = between(tv, 0.15, valid), between(rho_t, 0.6, valid)
            keep_tok = tv <= u
            cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=C, rollout_rs="token_tv",
                                          rollout_rs_threshold=u, **base)
            coef = per_row(mu_y * A, toy) * rho_t.clamp(max=C)
        elif name == "RS-prob-seq_mean_binary_kl":
            mean = bkl.sum(-1) / valid.sum(-1)
            u = between(mean, 0.6)
            keep_tok = per_row((mean <= u).double(), toy) > 0
            cfg = RolloutCorrectionConfig(rollout_rs="seq_mean_binary_kl", rollout_rs_threshold=u, **base)
            coef = per_row(mu_y * A, toy)
        else:  # "RS-prob-seq_max_tv+veto_high": the largest TV of a row, and the high-side veto
            top = tv.amax(-1)
            u, veto = between(top, 0.7), between(rho_t, 0.9, valid)
            vetoed = (valid & (rho_t > veto)).any(-1)
            assert vetoed.any() and ((top <= u) & vetoed).any()
            keep_tok = per_row(((top <= u) & ~vetoed).double(), toy) > 0
            cfg = RolloutCorrectionConfig(rollout_rs="seq_max_tv", rollout_rs_threshold=u,
                                          rollout_token_veto_threshold_high=veto, **base)
            coef = per_row(mu_y * A, toy)
    else:
        raise AssertionError(name)
    keep_tok = keep_tok & valid
    K = keep_tok.any(-1).sum()
    assert 0 < K < B, "the rejection must be active and must keep something"
    return cfg, torch.where(keep_tok, coef * B / K, 0.0)


VARIANTS = ["sequence-TIS", "token-TIS", "token-IS-untruncated", "geometric-TIS", "sequence-IcePop",
            "token-IcePop", "sequence-clip", "sequence-TIS-batchnorm", "token-TIS-batchnorm",
            "RS-seq_sum_k1+sequence-IS", "RS-token_k1+token-TIS", "RS-seq_mean_k3",
            "RS-geometric-legacy+veto", "RS-prob-token_tv+token-TIS", "RS-prob-seq_mean_binary_kl",
            "RS-prob-seq_max_tv+veto_high"]


@pytest.mark.parametrize("name", VARIANTS)
def test_bypass_reinforce_variant_matches_its_formula(toy, name):
    cfg, coef = _variant(toy, name)
    expected = from_coefficients(toy, coef)
    assert_grad(library_gradient(toy, cfg), expected)
    # Each variant is a different estimator: its gradient is measurably not the on-policy one.
    assert rel_err(expected, exact_policy_gradient(toy.theta, toy.space, toy.adv)) > 1e-2


# ---------------------------------------------------------------------------------------------
# 2b. Segment level: per turn of a multi-turn row (turns of two tokens: segment id = position // 2)


def turns(toy: Toy) -> torch.Tensor:
    return torch.arange(toy.space.horizon).div(2, rounding_mode="floor").expand(toy.space.batch_size, -1)


def per_segment(toy: Toy, x: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """Per token, the sum / mean / max over its segment of a (B, T) value (0 at padding)."""
    ids, valid = turns(toy), toy.mask
    out = torch.zeros_like(x)
    for s in range(int(ids.max()) + 1):
        inside = valid & (ids == s)
        if reduce == "max":
            v = torch.where(inside, x, -INF).amax(-1, keepdim=True)
        else:
            v = torch.where(inside, x, 0.0).sum(-1, keepdim=True)
            if reduce == "mean":
                v = v / inside.sum(-1, keepdim=True).clamp_min(1)
        out = torch.where(inside, v, out)
    return out


def test_segment_is_with_one_segment_per_row_is_the_on_policy_gradient(toy):
    cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=INF, bypass_mode=True,
                                  loss_type="reinforce")
    exact = exact_policy_gradient(toy.theta, toy.space, toy.adv)
    assert_grad(library_gradient(toy, cfg), exact)  # no segment ids: a row is one segment
    one = torch.full_like(turns(toy), 3)
    assert_grad(library_gradient(toy, cfg, segments=Segments(one, count=4)), exact)
    # One segment per token: the token-level estimator, not the on-policy gradient.
    per_token = library_gradient(toy, cfg, segments=Segments(torch.arange(toy.space.horizon).expand_as(one)))
    expected = from_coefficients(toy, per_row(toy.seq_prob(toy.mu) * toy.adv, toy) * _is_quantities(toy)[0])
    assert_grad(per_token, expected)
    assert rel_err(per_token, exact) > 1e-2


SEGMENT_VARIANTS = ["segment-TIS", "segment-IcePop", "RS-segment_sum_k1+segment-IS", "RS-segment_max_k3+token-TIS",
                    "segment_geometric-TIS", "RS-segment_mean_dp+segment_geometric-IS",
                    "RS-token_dp+seq_sum_dp+segment_sum_dp+token-TIS"]


def signed_between(values: torch.Tensor, q: float, valid=None) -> float:
    """:func:`between` for signed values in [−1, 1] (shifted by 2, so that its gaps are ≥ 2e-3)."""
    return between(values + 2.0, q, valid) - 2.0


@pytest.mark.parametrize("name", SEGMENT_VARIANTS)
def test_bypass_reinforce_segment_variant_matches_its_formula(toy, name):
    """Per turn s: w_s = ∏_{t∈s} ρ_t bounded; the segment options drop a turn's tokens only (the
    loss divides by the K rows that keep ≥ 1 token: kept rows scaled by B / K)."""
    mu_y, A, valid, B = toy.seq_prob(toy.mu), toy.adv, toy.mask, toy.space.batch_size
    rho_t = _is_quantities(toy)[0]
    log_rho = torch.where(valid, rho_t.log(), 0.0)
    w_seg = per_segment(toy, log_rho).exp()  # ∏_{t∈s} ρ_t on each token of s
    base = dict(bypass_mode=True, loss_type="reinforce")
    keep_tok = valid
    if name == "segment-TIS":
        C = between(w_seg, 0.5, valid)
        assert (w_seg[valid] > C).any() and (w_seg[valid] < C).any()
        cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=C, **base)
        coef = per_row(mu_y * A, toy) * w_seg.clamp(max=C)
    elif name == "segment-IcePop":
        lo, hi = between(w_seg, 0.2, valid), between(w_seg, 0.8, valid)
        inside = (w_seg >= lo) & (w_seg <= hi)
        cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=f"{lo!r}_{hi!r}", **base)
        coef = per_row(mu_y * A, toy) * torch.where(inside, w_seg, 0.0)
    elif name == "RS-segment_sum_k1+segment-IS":
        lo, hi = between(w_seg, 0.2, valid), between(w_seg, 0.8, valid)
        keep_tok = (w_seg >= lo) & (w_seg <= hi)
        cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=INF, rollout_rs="segment_sum_k1",
                                      rollout_rs_threshold=f"{lo!r}_{hi!r}", **base)
        coef = per_row(mu_y * A, toy) * w_seg
    elif name == "segment_geometric-TIS":  # w_s = exp(mean_{t∈s} log ρ_t), truncated
        w_geo = per_segment(toy, log_rho, "mean").exp()
        C = between(w_geo, 0.5, valid)
        assert (w_geo[valid] > C).any() and (w_geo[valid] < C).any()
        cfg = RolloutCorrectionConfig(rollout_is="segment_geometric", rollout_is_threshold=C, **base)
        coef = per_row(mu_y * A, toy) * w_geo.clamp(max=C)
    elif name.startswith("RS-") and "_dp" in name:  # Δp_t = π_θ(y_t) − μ(y_t), signed bands
        dp = torch.where(valid, toy.tok(toy.theta).exp() - toy.tok(toy.mu).exp(), 0.0)
        if name == "RS-segment_mean_dp+segment_geometric-IS":
            seg = per_segment(toy, dp, "mean")
            lo, hi = signed_between(seg, 0.2, valid), signed_between(seg, 0.8, valid)
            keep_tok = (seg >= lo) & (seg <= hi)
            cfg = RolloutCorrectionConfig(rollout_is="segment_geometric", rollout_is_threshold=INF,
                                          rollout_rs="segment_mean_dp", rollout_rs_threshold=f"{lo!r}_{hi!r}", **base)
            coef = per_row(mu_y * A, toy) * per_segment(toy, log_rho, "mean").exp()
        else:  # token band ∧ sequence-sum band ∧ segment-sum band, token TIS
            row, seg = per_row(dp.sum(-1), toy), per_segment(toy, dp)
            bands = [(signed_between(x, 0.1, valid), signed_between(x, 0.95, valid)) for x in (dp, row, seg)]
            keep_tok = valid
            for x, (lo, hi) in zip((dp, row, seg), bands):
                keep_tok = keep_tok & (x >= lo) & (x <= hi)
            C = between(rho_t, 0.6, valid)
            cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=C,
                                          rollout_rs="token_dp,seq_sum_dp,segment_sum_dp",
                                          rollout_rs_threshold=",".join(f"{lo!r}_{hi!r}" for lo, hi in bands), **base)
            coef = per_row(mu_y * A, toy) * rho_t.clamp(max=C)
    else:  # "RS-segment_max_k3+token-TIS"
        k3 = torch.where(valid, rho_t - 1 - rho_t.log(), 0.0)
        top = per_segment(toy, k3, "max")
        u, C = between(top, 0.6, valid), between(rho_t, 0.6, valid)
        keep_tok = top <= u
        cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=C, rollout_rs="segment_max_k3",
                                      rollout_rs_threshold=u, **base)
        coef = per_row(mu_y * A, toy) * rho_t.clamp(max=C)
    keep_tok = keep_tok & valid
    K = keep_tok.any(-1).sum()
    if name.startswith("RS-"):
        assert (valid & ~keep_tok).any() and keep_tok.any(), "the rejection must be active and must keep something"
        # some rows lose a turn but keep another: the decision is per segment, not per row
        assert (keep_tok.any(-1) & (valid & ~keep_tok).any(-1)).any()
    expected = from_coefficients(toy, torch.where(keep_tok, coef * B / K, 0.0))
    assert_grad(library_gradient(toy, cfg, segments=Segments(turns(toy))), expected)
    assert rel_err(expected, exact_policy_gradient(toy.theta, toy.space, toy.adv)) > 1e-2


# ---------------------------------------------------------------------------------------------
# 3. PPO clip (dual clip) in decoupled and bypass mode = gradient of the clipped surrogate

EPS_LO, EPS_HI, CLIP_C = 0.2, 0.28, 1.6


def clipped_surrogate(log_p: torch.Tensor, log_prox: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """ℓ_t = max(−A r, −A clip(r, 1−ε_lo, 1+ε_hi)); min(ℓ_t, −c A) when A < 0 (plain torch ops)."""
    r = torch.exp(log_p - log_prox)
    loss = torch.maximum(-A * r, -A * torch.clamp(r, 1 - EPS_LO, 1 + EPS_HI))
    return torch.where(A < 0, torch.minimum(loss, -CLIP_C * A), loss)


def ppo_reference(toy: Toy, prox_logits: torch.Tensor, w: torch.Tensor, keep: torch.Tensor):
    """−∇_θ Σ_{y,t kept} (B/K) μ(y) w_t ℓ_t(θ) with the raw A(y) inside ℓ, two ways: autograd of
    the surrogate, and the closed form (B/K) μ w A r_t ∇log π_t on tokens whose unclipped branch is
    active. Also returns the count of tokens in each branch (unclipped, clipped, dual clip)."""
    B = toy.space.batch_size
    keep = keep & toy.mask
    row_scale = toy.seq_prob(toy.mu) * B / keep.any(-1).sum()
    A = per_row(toy.adv, toy)
    theta = toy.theta.clone().requires_grad_(True)
    surrogate = clipped_surrogate(toy.tok(theta), toy.tok(prox_logits), A)
    objective = -torch.where(keep, row_scale.unsqueeze(-1) * w * surrogate, 0.0).sum()
    (auto,) = torch.autograd.grad(objective, theta)

    r = (toy.tok(toy.theta) - toy.tok(prox_logits)).exp()
    unclipped_side = torch.where(A > 0, r <= 1 + EPS_HI, r >= 1 - EPS_LO)
    plain = torch.maximum(-A * r, -A * r.clamp(1 - EPS_LO, 1 + EPS_HI))
    dual = (A < 0) & (plain > -CLIP_C * A)
    active = keep & unclipped_side & ~dual
    closed = from_coefficients(toy, torch.where(active, row_scale.unsqueeze(-1) * w * A * r, 0.0))
    counts = (int(active.sum()), int((keep & ~unclipped_side & ~dual).sum()), int((keep & dual).sum()))
    return auto, closed, counts


PPO_VARIANTS = ["decoupled-token-TIS", "decoupled-sequence-IS", "decoupled-precomputed-weights",
                "bypass-ppo-clip", "bypass-ppo-clip+RS"]


@pytest.mark.parametrize("name", PPO_VARIANTS)
def test_ppo_clip_gradient_matches_the_clipped_surrogate(toy, name):
    old_tok, mu_tok = toy.tok(toy.old), toy.tok(toy.mu)
    rho_t = (old_tok - mu_tok).exp()
    valid = toy.mask
    ones = torch.ones_like(rho_t)
    kwargs = dict(clip=ClipRange(EPS_LO, EPS_HI, CLIP_C))
    keep = valid
    if name == "decoupled-token-TIS":
        C = between(rho_t, 0.6, valid)
        cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=C)
        prox, w = toy.old, rho_t.clamp(max=C)
        actual = library_gradient(toy, cfg, old_logits=toy.old, **kwargs)
    elif name == "decoupled-sequence-IS":
        cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=INF)
        prox, w = toy.old, per_row((old_tok - mu_tok).sum(-1).exp(), toy)
        actual = library_gradient(toy, cfg, old_logits=toy.old, **kwargs)
    elif name == "decoupled-precomputed-weights":  # the trainer hands in its own weights
        w = per_row(((old_tok - mu_tok).sum(-1) / valid.sum(-1)).exp(), toy)
        prox = toy.old
        actual = library_gradient(toy, RolloutCorrectionConfig(), old_logits=toy.old, rollout_logits=None,
                                  rollout_is_weights=torch.where(valid, w, math.nan), **kwargs)
    elif name == "bypass-ppo-clip":  # π_old := μ, no IS weights
        prox, w = toy.mu, ones
        actual = library_gradient(toy, RolloutCorrectionConfig(bypass_mode=True), **kwargs)
    else:  # bypass PPO with sequence rejection, judged on π_θ / μ
        seq = (toy.tok(toy.theta) - mu_tok).sum(-1).exp()
        lo, hi = between(seq, 0.15), between(seq, 0.85)
        keep = per_row(((seq >= lo) & (seq <= hi)).double(), toy) > 0
        cfg = RolloutCorrectionConfig(bypass_mode=True, rollout_rs="seq_sum_k1",
                                      rollout_rs_threshold=f"{lo!r}_{hi!r}")
        prox, w = toy.mu, ones
        actual = library_gradient(toy, cfg, **kwargs)
    auto, closed, (n_unclipped, n_clipped, n_dual) = ppo_reference(toy, prox, w, keep)
    # The setting exercises every branch of the surrogate.
    assert n_unclipped > 0 and n_clipped > 0 and n_dual > 0, (n_unclipped, n_clipped, n_dual)
    torch.testing.assert_close(auto, closed, rtol=1e-12, atol=1e-12)
    assert_grad(actual, auto)


# ---------------------------------------------------------------------------------------------
# 4. The motivating claim: naive PPO is biased; decoupled sequence IS is exact (at θ = π_old)

NO_CLIP = dict(clip=ClipRange(1e6, 1e6, 1e9))


@pytest.mark.parametrize("space_name", list(SPACES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_naive_ppo_is_biased_and_decoupled_sequence_is_is_exact(space_name, seed):
    toy = make_toy(space_name, seed)
    toy.theta = toy.old  # evaluate at θ = π_old, where r = 1 and no clipping is active
    toy.adv = toy.adv - (toy.seq_prob(toy.old) * toy.adv).sum()  # A = R − E_πold[R]
    on_policy = exact_policy_gradient(toy.old, toy.space, toy.adv)

    naive = library_gradient(toy, None, old_logits=toy.old, rollout_logits=None, **NO_CLIP)
    # What naive PPO computes: E_μ[A ∇log π_old], the expectation under the wrong policy.
    assert_grad(naive, from_coefficients(toy, per_row(toy.seq_prob(toy.mu) * toy.adv, toy)))
    assert rel_err(naive, on_policy) > 0.05

    seq_is = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=INF)
    assert_grad(library_gradient(toy, seq_is, old_logits=toy.old, **NO_CLIP), on_policy)
    # Same with the default clip range: at θ = π_old the ratio is 1 and the clip is inactive.
    assert_grad(library_gradient(toy, seq_is, old_logits=toy.old), on_policy)
