"""Off-policy sequence masking (OPSM) and the second-moment trust region (M2PO).

OPSM is checked by hand and side by side with TRL 1.16's own ``GRPOTrainer.get_off_policy_mask``
(the installed function, called with the same tensors); M2PO by hand and against a brute-force
reference that sorts the values (what a single process holding the whole batch would do).
"""

from __future__ import annotations

import math

import pytest
import torch

from trl.trainer.grpo_trainer import GRPOTrainer  # CI: pip install trl==1.16.0

from rollout_correction_core._src.m2po import m2po_keep, second_moment
from rollout_correction_core._src.opsm import compute_opsm, opsm_keep
from rollout_correction import Aggregation, PolicyLoss

ln = math.log


# ---------------------------------------------------------------------------------------------- OPSM


def test_opsm_hand_computed():
    # D(y) = mean_t (log π_rollout − log π_θ). δ = 0.1.
    # Row 0: A < 0, D = 0.2 → dropped. Row 1: A > 0, D = 0.2 → kept. Row 2: A < 0, D = 0.05 → kept.
    # Row 3: A < 0, D = (0.3 + 0.1)/2 = 0.2 over its two valid tokens (the padding holds 9) → dropped.
    # Row 4: A = 0 → kept.
    lp = torch.full((5, 3), -1.0)
    rollout = lp + torch.tensor([[0.2, 0.2, 0.2], [0.2, 0.2, 0.2], [0.0, 0.1, 0.05], [0.3, 0.1, 9.0],
                                 [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([-1.0, 1.0, -1.0, -0.5, 0.0])[:, None].expand(5, 3)
    res = opsm_keep(lp, rollout, adv, mask, 0.1)
    assert res.row_keep.tolist() == [False, True, True, False, True]
    torch.testing.assert_close(res.divergence, torch.tensor([0.2, 0.2, 0.05, 0.2, 0.5]), rtol=1e-5, atol=1e-6)
    keep, metrics = compute_opsm(lp, rollout, adv, mask, 0.1)
    assert torch.equal(keep, res.row_keep)
    assert float(metrics["opsm_seq_masked_fraction"]) == pytest.approx(2 / 5)
    assert float(metrics["opsm_masked_fraction"]) == pytest.approx(5 / 14)  # 3 + 2 of 14 valid tokens
    assert float(metrics["opsm_seq_kl_mean"]) == pytest.approx((0.2 + 0.2 + 0.05 + 0.2 + 0.5) / 5, rel=1e-5)


def test_opsm_uses_the_sequence_advantage_not_each_tokens_sign():
    """A sequence whose advantage is negative overall is dropped as a whole even where some token
    advantages are positive (a per-token rule would keep those tokens)."""
    lp = torch.full((1, 4), -2.0)
    rollout = lp + 1.0
    adv = torch.tensor([[0.5, -2.0, 0.5, -1.0]])  # mean −0.5
    res = opsm_keep(lp, rollout, adv, torch.ones(1, 4), 0.5)
    assert res.row_keep.tolist() == [False]


def test_opsm_nonfinite_tokens_carry_no_evidence():
    # Row 0: one NaN and one −inf rollout log-prob among four tokens; the others give D = 0.05 ≤ δ: kept.
    # Row 1: the finite tokens give D = 1.0 > δ: dropped, whatever the NaN. Row 2: no finite token: kept.
    lp = torch.full((3, 4), -1.0)
    rollout = lp + torch.tensor([[0.05, math.nan, 0.05, -math.inf], [1.0, 1.0, math.nan, 1.0],
                                 [math.nan, math.nan, math.inf, math.nan]])
    adv = -torch.ones(3, 4)
    res = opsm_keep(lp, rollout, adv, torch.ones(3, 4), 0.1)
    assert res.row_keep.tolist() == [True, False, True]
    torch.testing.assert_close(res.evidence, torch.tensor([2.0, 3.0, 0.0]))
    assert torch.isfinite(res.divergence).all()


def _trl_mask(lp, rollout, adv_rows, mask, delta):
    return GRPOTrainer.get_off_policy_mask(advantages=adv_rows[:, None], per_token_logps=lp,
                                           sampling_per_token_logps=rollout, mask=mask, off_policy_threshold=delta)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("delta", [0.0, 0.02, 0.1])
def test_opsm_matches_trl_get_off_policy_mask(seed, delta):
    gen = torch.Generator().manual_seed(seed)
    B, T = 24, 13
    lp = -torch.rand(B, T, generator=gen) * 3
    rollout = (lp + 0.2 * torch.randn(B, T, generator=gen) + 0.05 * torch.randn(B, 1, generator=gen)).clamp(max=0.0)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    adv_rows = torch.randn(B, generator=gen)
    adv_rows[:3] = 0.0
    trl = _trl_mask(lp, rollout, adv_rows, mask, delta)[:, 0].bool()
    ours = opsm_keep(lp, rollout, adv_rows[:, None].expand(B, T), mask, delta).row_keep
    assert torch.equal(ours, trl)
    assert (~ours).any() and ours.any(), "the batch must exercise both outcomes"


def test_opsm_differs_from_trl_only_where_a_token_is_nan():
    """TRL turns a NaN divergence into 0 but still counts the token, diluting D(y); ours leaves the
    token out. With D = 0.3 on three finite tokens and one NaN, δ = 0.25: TRL's 0.225 keeps the
    sequence, ours drops it."""
    lp = torch.full((1, 4), -1.0)
    rollout = lp + torch.tensor([[0.3, 0.3, 0.3, math.nan]])
    mask = torch.ones(1, 4)
    adv = torch.tensor([-1.0])
    assert _trl_mask(lp, rollout, adv, mask, 0.25).tolist() == [[1.0]]
    assert opsm_keep(lp, rollout, adv, mask, 0.25).row_keep.tolist() == [False]
    rollout_finite = lp + torch.tensor([[0.3, 0.3, 0.3, 0.0]])
    assert _trl_mask(lp, rollout_finite, adv, mask, 0.25).tolist() == [[1.0]]
    assert opsm_keep(lp, rollout_finite, adv, mask, 0.25).row_keep.tolist() == [True]


# ---------------------------------------------------------------------------------------------- M2PO


def brute_force_m2po(m2: torch.Tensor, keep: torch.Tensor, tau: float) -> torch.Tensor:
    """Sort the kept values; keep the longest run of smallest distinct values whose mean ≤ τ."""
    vals = m2[keep].double().sort().values
    cutoff = -1.0
    for v in vals.unique():
        sel = vals[vals <= v]
        if float(sel.mean()) <= tau:
            cutoff = float(v)
    return keep & (m2.double() <= cutoff)


def test_m2po_hand_computed():
    m2 = torch.tensor([[0.01, 0.5, 0.02, 7.0], [0.3, 0.04, 0.0, 0.2]])
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    # Kept ascending: 0, .01, .02, .04 (mean .0175 ≤ .05); adding .2 gives .054 > .05: stop.
    out, m = m2po_keep(m2, keep, 0.05)
    assert out.tolist() == [[True, False, True, False], [False, True, True, False]]
    assert float(m["m2po_masked_fraction"]) == pytest.approx(3 / 7)
    assert float(m["m2po_m2_before"]) == pytest.approx((0.01 + 0.5 + 0.02 + 0.3 + 0.04 + 0.0 + 0.2) / 7, rel=1e-6)
    assert float(m["m2po_m2_after"]) == pytest.approx(0.0175, rel=1e-6)
    # τ above the overall mean keeps every token; τ below the smallest value keeps none.
    out_all, m_all = m2po_keep(m2, keep, 1.0)
    assert torch.equal(out_all, keep) and float(m_all["m2po_masked_fraction"]) == 0.0
    out_none, m_none = m2po_keep(m2 + 0.1, keep, 0.05)
    assert not out_none.any() and float(m_none["m2po_masked_fraction"]) == 1.0
    assert float(m_none["m2po_m2_after"]) == 0.0


def test_m2po_ties_are_kept_or_masked_together():
    m2 = torch.tensor([[0.0, 0.1, 0.1, 0.1]])
    keep = torch.ones(1, 4, dtype=torch.bool)
    # Keeping 0 and one 0.1 would give mean 0.05 ≤ 0.06, but all three 0.1s give 0.075 > 0.06.
    out, _ = m2po_keep(m2, keep, 0.06)
    assert out.tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [0.0, 0.01, 0.05, 0.3])
def test_m2po_matches_brute_force(seed, tau):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(9, 15, generator=gen) * 2
    rollout = (old + 0.3 * torch.randn(9, 15, generator=gen) * torch.rand(9, 1, generator=gen)).clamp(max=0.0)
    keep = torch.rand(9, 15, generator=gen) > 0.2
    m2 = second_moment(old, rollout, keep)
    out, metrics = m2po_keep(m2, keep, tau)
    assert torch.equal(out, brute_force_m2po(m2, keep, tau))
    kept = m2[out].double()
    assert kept.numel() == 0 or float(kept.mean()) <= tau
    assert float(metrics["m2po_m2_after"]) <= tau + 1e-12


def test_second_moment_is_clamped_and_masked():
    old = torch.tensor([[0.0, 0.0, math.nan]])
    rollout = torch.tensor([[-30.0, -0.5, 0.0]])
    m2 = second_moment(old, rollout, torch.tensor([[True, True, False]]))
    torch.testing.assert_close(m2, torch.tensor([[400.0, 0.25, 0.0]]))


# ------------------------------------------------------------------ through the library's entry points

from rollout_correction import RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction  # noqa: E402
from rollout_correction import ConfigError  # noqa: E402


def _batch(seed=3, B=8, T=6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen) * 2 - 0.05
    rollout = (old + 0.3 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lp = (old + 0.1 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=gen)[:, None]).float()
    adv = torch.randn(B, 1, generator=gen).expand(B, T).contiguous()
    return old, rollout, lp, mask, adv


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_opsm_in_the_loss_equals_the_loss_on_the_reduced_mask(mode):
    old, rollout, lp, mask, adv = _batch()
    delta = 0.02
    keep = opsm_keep(lp, rollout, adv, mask, delta).row_keep
    assert (~keep).any() and keep.any()
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_opsm_delta=delta)
    weights = compute_rollout_correction(old, rollout, mask, config=cfg).weights
    lp1 = lp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        lp1, old, adv, mask, config=cfg, rollout_log_prob=rollout,
        loss=PolicyLoss(aggregation=Aggregation(mode)))
    loss.backward()
    lp2 = lp.clone().requires_grad_(True)
    ref, _ = compute_policy_loss(
        lp2, old, adv, mask * keep[:, None], config=cfg.replace(rollout_opsm_delta=None),
        rollout_is_weights=weights, loss=PolicyLoss(aggregation=Aggregation(mode)))
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(lp1.grad, lp2.grad)
    assert float(metrics["rollout_corr/opsm_seq_masked_fraction"]) == pytest.approx(float((~keep).sum()) / 8)
    assert torch.equal(lp1.grad[~keep], torch.zeros_like(lp1.grad[~keep]))


def test_opsm_dropping_everything_gives_an_attached_zero_loss():
    old, rollout, lp, mask, _ = _batch()
    adv = -torch.ones_like(lp)
    cfg = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_opsm_delta=-1.0)
    lp1 = lp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(lp1, None, adv, mask, config=cfg, rollout_log_prob=rollout)
    loss.backward()
    assert float(loss.detach()) == 0.0 and loss.requires_grad and torch.equal(lp1.grad, torch.zeros_like(lp))
    assert float(metrics["rollout_corr/opsm_masked_fraction"]) == 1.0


def test_m2po_through_compute_rollout_correction():
    old, rollout, _, mask, _ = _batch(5)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_m2po_threshold=0.05)
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    expected = brute_force_m2po(second_moment(old, rollout, mask > 0), mask > 0, 0.05)
    assert torch.equal(out.response_mask > 0, expected)
    assert out.response_mask.dtype == mask.dtype
    frac = 1 - float(expected.sum()) / float(mask.sum())
    assert 0 < frac < 1
    assert float(out.metrics["rollout_corr/m2po_masked_fraction"]) == pytest.approx(frac)
    # Chained after rejection: M2PO decides among the tokens the rejection option keeps.
    cfg_rs = cfg.replace(rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4")
    out_rs = compute_rollout_correction(old, rollout, mask, config=cfg_rs)
    rs_keep = compute_rollout_correction(old, rollout, mask, config=cfg_rs.replace(rollout_m2po_threshold=None)).response_mask
    assert (rs_keep < mask).any()
    expected_rs = brute_force_m2po(second_moment(old, rollout, rs_keep > 0), rs_keep > 0, 0.05)
    assert torch.equal(out_rs.response_mask > 0, expected_rs)


def test_topr_through_compute_policy_loss():
    """Gradient of the token-sum loss = −Σ w(y)·A·∇log π; w = 1 (A ≥ 0) or min(∏ π_θ/π_rollout, 1)."""
    _, rollout, lp, mask, adv = _batch(9)
    cfg = RolloutCorrectionConfig.bypass_topr()
    lp1 = lp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        lp1, None, adv, mask, config=cfg, rollout_log_prob=rollout,
        loss=PolicyLoss(aggregation=Aggregation("token-sum")))
    loss.backward()
    seq_ratio = ((lp - rollout) * mask).sum(-1).exp()
    a = adv[:, 0]
    w = torch.where(a >= 0, torch.ones_like(seq_ratio), seq_ratio.clamp(max=1.0))
    assert ((a < 0) & (seq_ratio < 1)).any() and ((a < 0) & (seq_ratio > 1)).any()
    torch.testing.assert_close(lp1.grad, -(w[:, None] * adv) * mask, rtol=1e-5, atol=1e-7)
    assert "actor/pg_clipfrac" in metrics


def test_new_keys_are_validated():
    with pytest.raises(ConfigError, match="loss_type.*bypass"):
        RolloutCorrectionConfig(loss_type="topr")
    with pytest.raises(ConfigError, match="rollout_opsm_delta"):
        RolloutCorrectionConfig(rollout_opsm_delta=float("nan"))
    with pytest.raises(ConfigError, match="rollout_m2po_threshold"):
        RolloutCorrectionConfig(rollout_m2po_threshold=-0.1)
    with pytest.raises(ConfigError, match="loss_type"):
        RolloutCorrectionConfig(loss_type="gpspo")
    cfg = RolloutCorrectionConfig.from_dict({"rollout_opsm_delta": "0.1", "rollout_m2po_threshold": "0.04"})
    assert (cfg.rollout_opsm_delta, cfg.rollout_m2po_threshold) == (0.1, 0.04)
    assert RolloutCorrectionConfig.from_dict(cfg.to_dict()) == cfg
