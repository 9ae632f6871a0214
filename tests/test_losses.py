"""Policy losses: PPO clip with dual clip, agg_loss, decoupled / bypass PPO-clip / bypass REINFORCE,
and the safe results for all-masked or all-rejected batches — values and gradients by hand."""

import math

import pytest
import torch

from rollout_correction_core import (LOSS_AGG_MODES, Aggregation, ClipRange, PolicyLoss, RolloutCorrectionConfig, agg_loss,
                                     compute_policy_loss, ppo_clip_loss)

NAN = float("nan")

# PPO test batch: ratios r = π_θ/π_prox and advantages chosen so every branch is hit (ε = 0.2, c = 3).
R = [[1.5, 0.5, 1.0, 4.0], [1.5, 0.5, 4.0, 4.0]]
A = [[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -2.0]]
# ℓ = max(−A r, −A clip(r, 0.8, 1.2)), then min(ℓ, −3A) where A < 0.
LOSS = [[-1.2, -0.5, -1.0, -1.2], [1.5, 0.8, 3.0, 6.0]]
CLIPPED = [[True, False, False, True], [False, True, False, False]]
DUAL = [[False, False, False, False], [False, False, True, True]]


def _ppo_batch():
    prox = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -1.0, -2.0, -0.25]]) - 2.0  # π_θ's stay ≤ 0 too
    log_prob = (prox + torch.tensor(R).log()).requires_grad_(True)
    return log_prob, prox, torch.tensor(A)


def test_ppo_clip_loss_values_and_clip_flags():
    log_prob, prox, adv = _ppo_batch()
    loss, clipped, dual = ppo_clip_loss(log_prob, prox, adv)
    torch.testing.assert_close(loss, torch.tensor(LOSS))
    assert clipped.tolist() == CLIPPED
    assert dual.tolist() == DUAL


def test_ppo_clip_asymmetric_range_and_dual_constant():
    prox = torch.zeros(1, 3)
    log_prob = torch.tensor([[math.log(1.25), math.log(0.5), math.log(10.0)]])
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    loss, _, dual = ppo_clip_loss(log_prob, prox, adv, clip=ClipRange(low=0.1, high=0.3, dual=5.0))
    # 1.25 lies inside [0.9, 1.3]; 0.5 → max(0.5, 0.9) = 0.9; 10 → min(5, max(10, 1.3)) = 5.
    torch.testing.assert_close(loss, torch.tensor([[-1.25, 0.9, 5.0]]))
    assert dual.tolist() == [[False, False, True]]


def test_ppo_clip_rejects_invalid_constants():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"ppo_clip_loss: clip\.dual=1\.0 is invalid: the dual-clip constant c must be > 1"):
        ppo_clip_loss(x, x, x, clip=ClipRange(dual=1.0))
    with pytest.raises(ValueError, match=r"ppo_clip_loss: clip\.low=-0\.1, clip\.high=0\.2 are invalid: clip ratios"):
        ppo_clip_loss(x, x, x, clip=ClipRange(low=-0.1))


# ---------------------------------------------------------------------------- agg_loss
LOSS_MAT = [[1.0, 2.0, 3.0, NAN], [4.0, 5.0, NAN, NAN], [NAN, NAN, NAN, NAN]]
LOSS_MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("mode,kwargs,expected", [
    ("token-mean", {}, 15 / 5),
    ("token-sum", {}, 15.0),
    ("seq-mean-token-sum", {}, (6 + 9) / 2),  # the empty third row is not a sequence
    ("seq-mean-token-mean", {}, (6 / 3 + 9 / 2) / 2),
    ("seq-mean-token-sum-norm", {}, (6 + 9) / 2 / 4),  # divided by T = 4 by default
    ("seq-mean-token-sum-norm", {"scale_factor": 10.0}, (6 + 9) / 2 / 10),
    ("token-mean", {"global_num_tokens": 10}, 15 / 10),
    ("token-mean", {"global_num_tokens": torch.tensor(10.0), "dp_size": 2}, 15 / 10 * 2),
    ("token-sum", {"global_num_tokens": 10, "dp_size": 2}, 30.0),
    ("seq-mean-token-sum", {"global_num_seqs": 6}, 15 / 6),
    ("seq-mean-token-mean", {"global_num_seqs": 6, "dp_size": 3}, (2 + 4.5) / 6 * 3),
    ("seq-mean-token-sum-norm", {"global_num_seqs": 5}, 15 / 5 / 4),
])
def test_agg_loss_modes_and_denominators(mode, kwargs, expected):
    loss_mat = torch.tensor(LOSS_MAT, requires_grad=True)
    loss = agg_loss(loss_mat, torch.tensor(LOSS_MASK), Aggregation(mode, **kwargs))
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert torch.isfinite(loss_mat.grad).all()  # NaN at masked positions never reaches the gradient
    assert torch.all(loss_mat.grad[torch.tensor(LOSS_MASK) == 0] == 0)


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="agg_loss: aggregation.mode='mean' is invalid.*token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), aggregation=Aggregation("mean"))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_all_masked_is_zero_and_attached(mode):
    loss_mat = torch.tensor(LOSS_MAT, requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(3, 4), aggregation=Aggregation(mode))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(loss_mat.grad, torch.zeros(3, 4))


# ---------------------------------------------------------------------------- decoupled
def test_decoupled_with_precomputed_weights():
    log_prob, old, adv = _ppo_batch()
    w = torch.tensor([[2.0, 1.0, 0.5, 1.0], [1.0, 1.0, 1.0, 0.5]], requires_grad=True)
    mask = torch.ones(2, 4, dtype=torch.bool)
    loss, m = compute_policy_loss(log_prob, old, adv, mask, config=RolloutCorrectionConfig(), rollout_is_weights=w)
    expected = sum(wi * li for wr, lr in zip(w.tolist(), LOSS) for wi, li in zip(wr, lr)) / 8
    assert loss.item() == pytest.approx(expected)  # (−4.6 + 8.3) / 8
    assert m["actor/pg_clipfrac"].item() == pytest.approx(3 / 8)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(2 / 8)
    kl = sum(-math.log(r) for row in R for r in row) / 8
    assert m["actor/ppo_kl"].item() == pytest.approx(kl, rel=1e-5)
    loss.backward()
    assert w.grad is None  # IS weights never carry gradient


def test_decoupled_computes_weights_and_rejection_from_rollout_log_prob():
    # ρ = π_old/π_rollout; π_θ = π_old, so r = 1 and ℓ = −A·w on kept tokens.
    rho = [[1.5, 0.8, 3.0], [1.0, 0.4, 1.2]]
    rollout = torch.tensor([[-1.0, -0.5, -2.0], [-0.7, -1.2, -0.9]])
    old = rollout + torch.tensor(rho).log()
    log_prob = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 2.0, 1.0], [1.0, 1.0, 3.0]])
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                                  rollout_rs_threshold="0.5_2.0")
    loss, m = compute_policy_loss(log_prob, old, adv, torch.ones(2, 3), config=cfg, rollout_log_prob=rollout)
    # Kept: ρ ∈ [0.5, 2] → 1.5, 0.8, 1.0, 1.2 (3.0 and 0.4 leave the denominator too).
    expected = -(1 * 1.5 + 2 * 0.8 + 1 * 1.0 + 3 * 1.2) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(2 / 6)
    loss.backward()
    g = log_prob.grad
    assert g[0, 2].item() == 0.0 and g[1, 1].item() == 0.0


# ---------------------------------------------------------------------------- bypass
def test_bypass_ppo_clip_clips_against_rollout_and_ignores_is_weights():
    log_prob, rollout, adv = _ppo_batch()
    garbage_old = rollout + 5.0  # must not be used: π_old := π_rollout
    cfg = RolloutCorrectionConfig.ppo_is_bypass()
    loss, m = compute_policy_loss(log_prob, garbage_old, adv, torch.ones(2, 4), config=cfg, rollout_log_prob=rollout)
    assert loss.item() == pytest.approx(sum(map(sum, LOSS)) / 8, rel=1e-6)  # token weights would change it
    assert m["actor/pg_clipfrac"].item() == pytest.approx(3 / 8)
    assert "rollout_corr/rollout_is_mean" in m  # IS is reported as a diagnostic only
    # Same result when the trainer already put the rollout log-probs into old_log_prob.
    loss2, _ = compute_policy_loss(log_prob, rollout, adv, torch.ones(2, 4), config=cfg)
    assert loss2.item() == pytest.approx(loss.item())


def test_bypass_ppo_clip_applies_rejection_from_theta_vs_rollout():
    log_prob, rollout, adv = _ppo_batch()
    cfg = RolloutCorrectionConfig(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold="0.4_2.0")
    loss, _ = compute_policy_loss(log_prob, None, adv, torch.ones(2, 4), config=cfg, rollout_log_prob=rollout)
    # r = 4 tokens (three of them) are rejected; the other five average to (−1.2−0.5−1+1.5+0.8)/5.
    assert loss.item() == pytest.approx(-0.4 / 5, rel=1e-5)


def _reinforce_batch():
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, -2.0]])
    r = torch.tensor([[1.5, 0.5, 1.0], [2.0, 2.0, 1.5]])  # products 0.75 and 6
    log_prob = (rollout + r.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0], [0.5, 1.0, -1.0]])
    return log_prob, rollout, adv


@pytest.mark.parametrize("mode,den", [("token-mean", [6, 6]), ("seq-mean-token-mean", [3 * 2, 3 * 2]),
                                      ("token-sum", [1, 1])])
def test_bypass_reinforce_value_and_exact_gradient(mode, den):
    log_prob, rollout, adv = _reinforce_batch()
    w = [min(0.75, 2.0), min(6.0, 2.0)]  # sequence TIS at C = 2
    cfg = RolloutCorrectionConfig.bypass_pg_is()
    loss, _ = compute_policy_loss(
        log_prob, None, adv, torch.ones(2, 3), config=cfg, rollout_log_prob=rollout,
        loss=PolicyLoss(aggregation=Aggregation(mode)))
    lp = log_prob.tolist()
    expected = sum(-w[i] * adv[i, t].item() * lp[i][t] / den[i] for i in range(2) for t in range(3))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    grad = torch.tensor([[-w[i] * adv[i, t].item() / den[i] for t in range(3)] for i in range(2)])
    torch.testing.assert_close(log_prob.grad, grad, rtol=1e-6, atol=1e-7)


def test_bypass_reinforce_without_weights_is_plain_policy_gradient():
    log_prob, rollout, adv = _reinforce_batch()
    cfg = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce")
    loss, _ = compute_policy_loss(log_prob, None, adv, torch.ones(2, 3), config=cfg, rollout_log_prob=rollout)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, -adv / 6)


# ---------------------------------------------------------------------------- safe results
CONFIGS = {
    "plain": (RolloutCorrectionConfig(), {}),
    "decoupled_weights": (RolloutCorrectionConfig(), {"rollout_is_weights": True}),
    "decoupled_computed": (RolloutCorrectionConfig.decoupled_seq_is_rs(), {"rollout_log_prob": True}),
    "bypass_ppo": (RolloutCorrectionConfig.bypass_ppo_clip_k3_rs(rs_threshold=10.0),
                   {"rollout_log_prob": True}),
    "bypass_reinforce": (RolloutCorrectionConfig.bypass_pg_is(), {"rollout_log_prob": True}),
}


def _call(name, log_prob, other, adv, mask, mode):
    cfg, extra = CONFIGS[name]
    kw = {}
    if extra.get("rollout_is_weights"):
        kw["rollout_is_weights"] = torch.full_like(other, 1.5)
    if extra.get("rollout_log_prob"):
        kw["rollout_log_prob"] = other - 0.1
    return compute_policy_loss(
        log_prob, other, adv, mask, config=cfg, **kw, loss=PolicyLoss(aggregation=Aggregation(mode)))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_all_masked_batch_gives_zero_loss_with_zero_gradient(name, mode):
    log_prob, other, adv = _ppo_batch()
    loss, metrics = _call(name, log_prob, other, adv, torch.zeros(2, 4, dtype=torch.bool), mode)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(log_prob.grad, torch.zeros(2, 4))
    assert all(torch.isfinite(v).all() for v in metrics.values())


@pytest.mark.parametrize("name", ["decoupled_computed", "bypass_ppo"])
def test_all_rejected_batch_gives_zero_loss_with_zero_gradient(name):
    # Ratios of e^3 per token fail every default RS band of these presets.
    log_prob, other, adv = _ppo_batch()
    cfg, _ = CONFIGS[name]
    rollout = other - 3.0
    lp = (rollout + 3.0).detach().requires_grad_(True) if cfg.bypass_mode else log_prob
    loss, m = compute_policy_loss(lp, other, adv, torch.ones(2, 4), config=cfg, rollout_log_prob=rollout)
    assert m["rollout_corr/rollout_rs_masked_fraction"].item() == 1.0
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 4))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nan_at_masked_positions_never_reaches_loss_or_gradient(name):
    log_prob, other, adv = _ppo_batch()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        log_prob[0, 3] = NAN
        log_prob[1, 2] = float("inf")
    other = other.clone()
    other[1, 3] = NAN
    adv = adv.clone()
    adv[0, 3] = float("-inf")
    loss, metrics = _call(name, log_prob, other, adv, mask, "token-mean")
    assert math.isfinite(loss.item())
    loss.backward()
    assert torch.isfinite(log_prob.grad).all()
    assert torch.all(log_prob.grad[~mask] == 0)
    assert torch.any(log_prob.grad[mask] != 0)
    assert all(torch.isfinite(v).all() for v in metrics.values())


def test_bypass_reinforce_rejected_rows_leave_the_denominator():
    # Geometric-mean ratios: row 0 ≈ 1.0002 (inside ±0.1 %), row 1 ≈ 1.34 (rejected).
    rollout = torch.tensor([[-1.0, -2.0], [-1.5, -1.0]])
    log_prob = (rollout + torch.tensor([[1.0005, 0.9999], [1.5, 1.2]]).log()).requires_grad_(True)
    adv = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    cfg = RolloutCorrectionConfig.bypass_pg_geo_rs()
    loss, _ = compute_policy_loss(log_prob, None, adv, torch.ones(2, 2), config=cfg, rollout_log_prob=rollout)
    lp = log_prob.tolist()
    assert loss.item() == pytest.approx(-(1 * lp[0][0] + 2 * lp[0][1]) / 2, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.5, -1.0], [0.0, 0.0]]))


def test_decoupled_uses_batch_normalised_weights():
    rollout = torch.tensor([[-1.0, -2.0], [-1.5, -1.0]])
    old = rollout + torch.tensor([[1.5, 0.8], [3.0, 1.0]]).log()
    adv = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    cfg = RolloutCorrectionConfig.token_is().replace(rollout_is_batch_normalize=True)
    loss, m = compute_policy_loss(old.clone().requires_grad_(True), old, adv, torch.ones(2, 2), config=cfg,
                                  rollout_log_prob=rollout)
    w = [1.5, 0.8, 2.0, 1.0]  # truncated at 2, then divided by their mean 1.325
    expected = -sum(wi / (sum(w) / 4) * a for wi, a in zip(w, [1.0, 2.0, 3.0, 4.0])) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["rollout_corr/rollout_is_batch_norm_factor"].item() == pytest.approx(sum(w) / 4)


def test_no_config_is_plain_ppo_and_dict_config_is_accepted():
    log_prob, old, adv = _ppo_batch()
    loss, m = compute_policy_loss(log_prob, old, adv, torch.ones(2, 4), config=None)
    assert loss.item() == pytest.approx(sum(map(sum, LOSS)) / 8, rel=1e-6)
    assert sorted(m) == ["actor/nonfinite_seq_fraction", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                         "actor/ppo_kl"]
    rollout = old - torch.tensor(R).log()  # so that ρ = π_old/π_rollout = r
    as_dict, _ = compute_policy_loss(log_prob, old, adv, torch.ones(2, 4), config={"rollout_is": "token"},
                                     rollout_log_prob=rollout)
    typed, _ = compute_policy_loss(log_prob, old, adv, torch.ones(2, 4), config=RolloutCorrectionConfig.token_is(),
                                   rollout_log_prob=rollout)
    assert as_dict.item() == typed.item()
    w = [min(x, 2.0) for row in R for x in row]
    assert typed.item() == pytest.approx(sum(wi * li for wi, li in zip(w, sum(LOSS, []))) / 8, rel=1e-6)


@pytest.mark.parametrize("mode,missing", [("token-mean", "global_num_tokens"), ("seq-mean-token-sum", "global_num_seqs"),
                                          ("seq-mean-token-mean", "global_num_seqs"),
                                          ("seq-mean-token-sum-norm", "global_num_seqs")])
def test_agg_loss_with_dp_size_requires_the_global_denominator(mode, missing):
    loss_mat, mask = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=missing):
        agg_loss(loss_mat, mask, aggregation=Aggregation(mode, dp_size=2))
    assert agg_loss(loss_mat, mask, aggregation=Aggregation("token-sum", dp_size=2)).item() == 12.0  # needs no denominator
