"""Engine sentinels, raw statistics and the self-normalised χ², the outcome bias of rejection, and
expect-zero mode: hand-computed cases and properties."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_correction import (ConfigError, MismatchError, MismatchWarning, RolloutCorrectionConfig,
                                compute_policy_loss, compute_rollout_correction)

P = "rollout_corr/"


# --- engine sentinels -------------------------------------------------------------------------

def _sentinel_batch():
    """Row 0 holds vLLM's −9999 at one valid token; every other log-ratio is log 1.5."""
    old = torch.full((3, 4), -1.0)
    rollout = old - math.log(1.5)
    rollout[0, 2] = -9999.0
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    return old, rollout, mask


def test_sentinel_row_is_dropped_not_truncated():
    old, rollout, mask = _sentinel_batch()
    cfg = RolloutCorrectionConfig.decoupled_token_is().replace(metrics=["default", "sentinel"])
    # Without the floor (the behaviour before it existed): the token keeps weight 2.0 (truncated)
    # and the batch reports a KL of about −1110, which the row's one token makes up.
    off = compute_rollout_correction(old, rollout, mask, config=cfg.replace(log_prob_floor=None))
    assert off.weights[0, 2].item() == 2.0
    assert off.metrics_as_floats()[P + "kl"] < -1000
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    m = out.metrics_as_floats()
    assert out.weights[0].tolist() == [0.0] * 4 and out.response_mask[0].tolist() == [False] * 4
    torch.testing.assert_close(out.weights[1:], torch.tensor([[1.5] * 4, [1.5, 1.5, 0.0, 0.0]]))
    assert m[P + "sentinel_token_fraction"] == pytest.approx(1 / 9)  # 1 of 9 valid tokens
    assert m[P + "nonfinite_seq_fraction"] == pytest.approx(1 / 3)
    assert m[P + "kl"] == pytest.approx(-math.log(1.5), rel=1e-6)


def test_sentinel_in_old_log_prob_and_at_padding():
    old, rollout, mask = _sentinel_batch()
    rollout[0, 2] = old[0, 2] - math.log(1.5)
    old[1, 1] = -1000.0  # at the floor: a sentinel
    rollout[2, 3] = -9999.0  # padding: ignored
    m = compute_rollout_correction(old, rollout, mask, config={"metrics": ["default", "sentinel"]}).metrics_as_floats()
    assert m[P + "sentinel_token_fraction"] == pytest.approx(1 / 9)
    assert m[P + "nonfinite_seq_fraction"] == pytest.approx(1 / 3)


def test_sentinel_raises_under_on_nonfinite_raise():
    old, rollout, mask = _sentinel_batch()
    with pytest.raises(ValueError, match=r"row 0, column 2.*sentinel|sentinel.*row 0, column 2"):
        compute_rollout_correction(old, rollout, mask, config={"on_nonfinite": "raise"})
    lp = old.clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"log_prob_floor=-1000.0.*row 0, column 2"):
        compute_policy_loss(lp, old, torch.ones(3, 4), mask, rollout_log_prob=rollout,
                            config={"on_nonfinite": "raise", "rollout_is": "token"})


def test_sentinel_row_leaves_the_policy_loss():
    old, rollout, mask = _sentinel_batch()
    lp = old.clone().requires_grad_(True)
    loss, m = compute_policy_loss(lp, old, torch.ones(3, 4), mask, rollout_log_prob=rollout,
                                  config=RolloutCorrectionConfig.decoupled_token_is())
    loss.backward()
    assert lp.grad[0].tolist() == [0.0] * 4 and bool((lp.grad[1:][mask[1:]] != 0).all())
    assert float(m["actor/nonfinite_seq_fraction"]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("floor", [0.0, 1.0, float("nan"), "x"])
def test_log_prob_floor_must_be_negative(floor):
    with pytest.raises(ConfigError, match="log_prob_floor"):
        RolloutCorrectionConfig(log_prob_floor=floor)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-3, 0), min_size=3, max_size=3), min_size=2, max_size=5),
       st.data())
def test_a_sentinel_row_never_changes_another_rows_weights(rows, data):
    old = torch.tensor(rows)
    rollout = old - 0.2 * torch.arange(old.numel(), dtype=torch.float32).reshape(old.shape).sin()
    mask = torch.ones(old.shape, dtype=torch.bool)
    cfg = RolloutCorrectionConfig(rollout_is=data.draw(st.sampled_from(["token", "sequence"])),
                                  rollout_is_batch_normalize=data.draw(st.booleans()))
    b = data.draw(st.integers(0, old.shape[0] - 1))
    t = data.draw(st.integers(0, 2))
    spoiled = rollout.clone()
    spoiled[b, t] = data.draw(st.sampled_from([-9999.0, -1000.0, -1e20]))
    clean = compute_rollout_correction(old, rollout, mask, config=cfg)
    hit = compute_rollout_correction(old, spoiled, mask, config=cfg)
    assert hit.weights[b].abs().sum().item() == 0.0
    others = [i for i in range(old.shape[0]) if i != b]
    if cfg.rollout_is_batch_normalize:  # the batch mean is taken over the other rows only
        base = compute_rollout_correction(old[others], rollout[others], mask[others], config=cfg)
        torch.testing.assert_close(hit.weights[others], base.weights)
    else:
        torch.testing.assert_close(hit.weights[others], clean.weights[others])


# --- raw statistics and the self-normalised χ² ---------------------------------------------------

def test_raw_statistics_are_taken_before_truncation_and_rejection():
    # log ρ: row 0 [ln 4, ln 4], row 1 [0, ln 0.5]; TIS at 2 and a token band reject the ln 4 tokens.
    old = torch.tensor([[math.log(4.0), math.log(4.0)], [0.0, math.log(0.5)]]) - 3.0  # log-probs ≤ 0
    rollout = torch.full((2, 2), -3.0)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                                  rollout_rs_threshold="0.25_3.0")
    out = compute_rollout_correction(old, rollout, torch.ones(2, 2), config=cfg.replace(metrics=["default", "raw", "chi2"]))
    m = out.metrics_as_floats()
    assert out.response_mask[0].tolist() == [0.0, 0.0]
    rho, seq = [4.0, 4.0, 1.0, 0.5], [16.0, 0.5]
    assert m[P + "rollout_is_raw_mean"] == pytest.approx(sum(rho) / 4)
    assert m[P + "rollout_is_mean"] == pytest.approx((2 + 2 + 1 + 0.5) / 4)  # truncated
    assert m[P + "rollout_is_seq_raw_mean"] == pytest.approx(sum(seq) / 2)
    assert m[P + "chi2_token_sn"] == pytest.approx(4 * sum(x * x for x in rho) / sum(rho) ** 2 - 1)
    assert m[P + "chi2_seq_sn"] == pytest.approx(2 * sum(x * x for x in seq) / sum(seq) ** 2 - 1)


def test_chi2_sn_is_not_negative_where_e_rho2_minus_1_is():
    # every ρ = 0.5: E[ρ²] − 1 = −0.75 (verl#7242's −0.88 is of this kind); the self-normalised χ² is 0
    old, rollout = torch.full((2, 3), math.log(0.5)), torch.zeros(2, 3)
    m = compute_rollout_correction(old, rollout, torch.ones(2, 3), config={"metrics": ["default", "chi2"]}).metrics_as_floats()
    assert m[P + "chi2_token"] == pytest.approx(-0.75)
    assert m[P + "chi2_token_sn"] == pytest.approx(0.0, abs=1e-12)
    assert m[P + "chi2_seq_sn"] == pytest.approx(0.0, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-25, 25), min_size=1, max_size=12), st.integers(1, 4))
def test_chi2_sn_is_never_negative(log_ratios, rows):
    lr = torch.tensor(log_ratios)
    n = (lr.numel() + rows - 1) // rows
    lr = torch.nn.functional.pad(lr, (0, n * rows - lr.numel())).reshape(rows, n)
    mask = torch.ones(rows, n, dtype=torch.bool)
    m = compute_rollout_correction(lr - 1.0, torch.full_like(lr, -1.0), mask,
                                   config={"metrics": ["chi2"]}).metrics_as_floats()
    assert m[P + "chi2_token_sn"] >= 0.0 and m[P + "chi2_seq_sn"] >= 0.0


# --- outcome bias of rejection -----------------------------------------------------------------

def _rejection_batch():
    """Rows 0, 2 and 3 have mean log ρ −1 (rejected by seq_mean_k1 at 0.9_1.1); row 1 has 0."""
    old = torch.full((4, 3), -1.0)
    rollout = old.clone()
    rollout[[0, 2, 3]] += 1.0
    mask = torch.ones(4, 3, dtype=torch.bool)
    return old, rollout, mask, RolloutCorrectionConfig(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1")


def test_rejected_positive_fraction_by_hand():
    old, rollout, mask, cfg = _rejection_batch()
    per_row = torch.tensor([0.5, 2.0, -1.0, 0.0])  # rejected rows 0, 2, 3: one positive of three
    m = compute_rollout_correction(old, rollout, mask, config=cfg, advantages=per_row).metrics_as_floats()
    assert m[P + "rollout_rs_rejected_positive_fraction"] == pytest.approx(1 / 3)
    # (B, T): a row's advantage is its mean over valid tokens (row 2: (3 − 1 − 1)/3 > 0; the padding is ignored)
    per_token = torch.tensor([[1.0, 1.0, 1.0], [5.0, 5.0, 5.0], [3.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])
    mask2 = mask.clone()
    mask2[3, 2] = False
    per_token[3, 2] = 100.0
    m = compute_rollout_correction(old, rollout, mask2, config=cfg, advantages=per_token).metrics_as_floats()
    assert m[P + "rollout_rs_rejected_positive_fraction"] == pytest.approx(2 / 3)
    none = compute_rollout_correction(old, old, mask, config=cfg, advantages=per_row).metrics_as_floats()
    assert none[P + "rollout_rs_rejected_positive_fraction"] == 0.0  # nothing rejected
    assert P + "rollout_rs_rejected_positive_fraction" not in compute_rollout_correction(old, rollout, mask,
                                                                                         config=cfg).metrics


def test_policy_loss_passes_its_advantages_through():
    old, rollout, mask, cfg = _rejection_batch()
    adv = torch.tensor([[1.0] * 3, [1.0] * 3, [-1.0] * 3, [-1.0] * 3])
    _, m = compute_policy_loss(old.clone().requires_grad_(True), old, adv, mask, rollout_log_prob=rollout,
                               config=cfg)
    assert float(m[P + "rollout_rs_rejected_positive_fraction"]) == pytest.approx(1 / 3)


def test_every_row_rejected_warns_on_read_or_raises():
    old, rollout, mask, cfg = _rejection_batch()
    rollout[1] += 1.0
    out = compute_rollout_correction(old, rollout, mask, config=cfg)  # no host read here
    with pytest.warns(RuntimeWarning, match="rejection dropped all 4 sequences"):
        out.metrics_as_floats()
    with pytest.raises(ValueError, match="rejection dropped all 4 sequences"):
        compute_rollout_correction(old, rollout, mask, config=cfg.replace(rollout_rs_all_rejected="raise"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compute_rollout_correction(old, old, mask, config=cfg.replace(rollout_rs_all_rejected="raise"))
    with pytest.raises(ConfigError, match="rollout_rs_all_rejected"):
        RolloutCorrectionConfig(rollout_rs_all_rejected="ignore")


@pytest.mark.parametrize("shape", [(4,), (4, 2), (3, 3), (4, 3, 1)])
def test_advantages_of_the_wrong_shape_name_the_argument(shape):
    old, rollout, mask, cfg = _rejection_batch()
    if shape == (4,):
        compute_rollout_correction(old, rollout, mask, config=cfg, advantages=torch.zeros(shape))
        return
    with pytest.raises(ValueError, match=r"advantages has shape"):
        compute_rollout_correction(old, rollout, mask, config=cfg, advantages=torch.zeros(shape))


# --- expect-zero mode ----------------------------------------------------------------------------

def test_expect_zero_applies_no_correction_and_reports_the_gap():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 7.0]])
    rollout = old.clone()
    rollout[0, 1] += 4e-7
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = compute_rollout_correction(old, rollout, mask, config={"expect_zero_atol": 1e-6})
    assert out.weights.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert out.response_mask is mask
    gap = (rollout[0, 1] - old[0, 1]).item()  # 4e-7 in float32
    assert out.metrics_as_floats()[P + "max_abs_log_ratio"] == pytest.approx(gap)


def test_expect_zero_raises_naming_the_first_row_and_column():
    old = torch.zeros(3, 4)
    rollout = old.clone()
    rollout[1, 2], rollout[2, 0] = 4.5e-4, 1e-3  # slime#830's regression size, then a larger one
    mask = torch.ones(3, 4)
    with pytest.raises(MismatchError, match=r"is 0.001, first at row 1, column 2"):
        compute_rollout_correction(old, rollout, mask, config={"expect_zero_atol": 1e-6})
    assert issubclass(MismatchError, ValueError)
    with pytest.warns(MismatchWarning, match="row 1, column 2"):
        out = compute_rollout_correction(old, rollout, mask,
                                         config={"expect_zero_atol": 1e-6, "expect_zero_action": "warn"})
    assert out.weights.tolist() == [[1.0] * 4] * 3
    rollout[1, 2] = float("nan")  # a NaN is a mismatch, never a pass
    with pytest.raises(MismatchError, match="row 1, column 2"):
        compute_rollout_correction(old, rollout, mask, config={"expect_zero_atol": 1e-2})


def test_expect_zero_in_the_policy_loss_is_plain_ppo():
    old = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    lp = (old + 0.1).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
    mask = torch.ones(2, 2)
    a, _ = compute_policy_loss(lp, old, adv, mask, rollout_log_prob=old.clone(), config={"expect_zero_atol": 0.0})
    b, _ = compute_policy_loss(lp, old, adv, mask, config=RolloutCorrectionConfig.disabled())
    assert a.item() == pytest.approx(b.item())
    with pytest.raises(MismatchError):
        compute_policy_loss(lp, old, adv, mask, rollout_log_prob=old + 1e-3, config={"expect_zero_atol": 1e-4})


@pytest.mark.parametrize("settings_", [{"expect_zero_atol": -1e-6}, {"expect_zero_atol": float("nan")},
                                       {"expect_zero_atol": 1e-6, "rollout_is": "token"},
                                       {"expect_zero_atol": 1e-6, "expect_zero_action": "ignore"}])
def test_expect_zero_bad_settings_name_the_key(settings_):
    with pytest.raises(ConfigError, match="expect_zero"):
        RolloutCorrectionConfig.from_dict(settings_)
