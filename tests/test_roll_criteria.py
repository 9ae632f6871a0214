"""ROLL's criteria in the core, by hand: the segment_geometric IS level (exp of the mean log-ratio
per segment), the signed Δp bands (token_dp, seq_sum_dp, seq_mean_dp, segment_sum_dp,
segment_mean_dp), their metrics, chaining, config reading, and segment ids from the runs of a mask."""

import math

import pytest
import torch

from rollout_correction import (ConfigError, RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction,
                                max_runs, segment_ids_from_mask)
from rollout_correction import Aggregation, PolicyLoss, Segments

# Two rows of four tokens; row 0's last token is padding, row 1's third.
P_TRAIN = torch.tensor([[0.5, 0.9, 0.2, 0.7], [0.3, 0.3, 0.3, 0.3]])
P_ROLL = torch.tensor([[0.4, 0.5, 0.25, 0.1], [0.3, 0.2, 0.3, 0.9]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]])
IDS = torch.tensor([[0, 0, 1, 7], [0, 1, 9, 1]])  # segments: row 0 {0, 1} {2}; row 1 {0} {1, 3}
# Δp = p_train − p_rollout at the valid tokens: row 0 [0.1, 0.4, −0.05], row 1 [0, 0.1, ·, −0.6]


def run(config, ids=IDS, **kw):
    cfg = RolloutCorrectionConfig(**config)
    out = compute_rollout_correction(
        P_TRAIN.log(), P_ROLL.log(), MASK, config=cfg, segments=None if ids is None else Segments(ids), **kw)
    return out, out.metrics_as_floats()


def kept(out):
    return out.response_mask.tolist()


def test_segment_geometric_weights_by_hand():
    # ρ: row 0 [1.25, 1.8, 0.8], row 1 [1, 1.5, ·, 1/3]. Per segment exp(mean log ρ):
    # row 0: √(1.25·1.8) = 1.5, 0.8; row 1: 1, √(1.5/3) = √0.5. Truncated at 1.2.
    out, m = run(dict(rollout_is="segment_geometric", rollout_is_threshold=1.2))
    h = math.sqrt(0.5)
    torch.testing.assert_close(out.weights, torch.tensor([[1.2, 1.2, 0.8, 0.0], [1.0, h, 0.0, h]]))
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((1.2 * 2 + 0.8 + 1.0 + 2 * h) / 6, rel=1e-6)
    assert m["rollout_corr/rollout_is_seq_mean"] == pytest.approx((1.2 + 0.8 + 1.0 + h) / 4, rel=1e-6)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.5, rel=1e-6)  # raw extremes
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(h, rel=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 4)  # 1.5 > 1.2
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(2 / 4)  # 0.8, √0.5 < 1/1.2
    # the product level differs where a segment has two tokens: 2.25 → 1.2 and 0.5
    prod, _ = run(dict(rollout_is="segment", rollout_is_threshold=1.2))
    torch.testing.assert_close(prod.weights, torch.tensor([[1.2, 1.2, 0.8, 0.0], [1.0, 0.5, 0.0, 0.5]]))
    # batch normalisation divides by the mean over segments
    bn, m_bn = run(dict(rollout_is="segment_geometric", rollout_is_threshold=1.2, rollout_is_batch_normalize=True))
    torch.testing.assert_close(bn.weights, out.weights / ((1.2 + 0.8 + 1.0 + h) / 4))
    # without segment ids a row is one segment: the geometric level
    one, _ = run(dict(rollout_is="segment_geometric", rollout_is_threshold=9.0), ids=None)
    geo, _ = run(dict(rollout_is="geometric", rollout_is_threshold=9.0), ids=None)
    torch.testing.assert_close(one.weights, geo.weights)


@pytest.mark.parametrize("option, band, expected", [
    ("token_dp", "-0.2_0.2", [[1, 0, 1, 0], [1, 1, 0, 0]]),  # 0.4 and −0.6 outside
    ("seq_mean_dp", "-0.16_0.16", [[1, 1, 1, 0], [0, 0, 0, 0]]),  # means 0.15, −1/6
    ("seq_sum_dp", "-0.4_0.5", [[1, 1, 1, 0], [0, 0, 0, 0]]),  # sums 0.45, −0.5
    ("segment_mean_dp", "-0.2_0.2", [[0, 0, 1, 0], [1, 0, 0, 0]]),  # 0.25, −0.05; 0, −0.25
    ("segment_sum_dp", "-0.6_0.3", [[0, 0, 1, 0], [1, 1, 0, 1]]),  # 0.5, −0.05; 0, −0.5
    ("token_dp", 0.09, [[0, 0, 1, 0], [1, 0, 0, 0]]),  # a single x: [−x, x]
    ("token_dp", "-0.7_-0.01", [[0, 0, 1, 0], [0, 0, 0, 1]]),  # a band below zero
])
def test_signed_delta_p_bands_by_hand(option, band, expected):
    out, m = run(dict(rollout_rs=option, rollout_rs_threshold=band))
    assert kept(out) == expected
    rejected = 6 - sum(map(sum, expected))
    assert m[f"rollout_corr/rollout_rs_{option}_masked_fraction"] == pytest.approx(rejected / 6)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / 6)
    # mean: the statistic of each token's unit, over valid tokens (a sum counts once per token of its unit)
    mean = (3 * 0.45 - 3 * 0.5) / 6 if option == "seq_sum_dp" else (0.45 - 0.5) / 6
    assert m[f"rollout_corr/rollout_rs_{option}_mean"] == pytest.approx(mean, abs=1e-6)


def test_delta_p_metrics_by_hand():
    _, m = run(dict(rollout_rs="token_dp", rollout_rs_threshold="-0.2_0.2"))
    p = "rollout_corr/rollout_rs_token_dp_"
    assert m[p + "max"] == pytest.approx(0.4, abs=1e-6) and m[p + "min"] == pytest.approx(-0.6, abs=1e-6)
    assert m[p + "fraction_high"] == pytest.approx(1 / 6) and m[p + "fraction_low"] == pytest.approx(1 / 6)
    assert m[p + "seq_mean"] == pytest.approx((0.15 - 0.5 / 3) / 2, abs=1e-6)  # per-row mean Δp
    assert m[p + "seq_masked_fraction"] == pytest.approx(1.0)  # both rows lose a token
    clamped = [0.1, 0.2, -0.05, 0.0, 0.1, -0.2]  # Δp clamped to the band for the std
    mean = sum(clamped) / 6
    assert m[p + "std"] == pytest.approx(math.sqrt(sum(c * c for c in clamped) / 6 - mean * mean), rel=1e-5)
    _, m = run(dict(rollout_rs="segment_mean_dp", rollout_rs_threshold="-0.2_0.2"))
    p = "rollout_corr/rollout_rs_segment_mean_dp_"
    assert m[p + "seq_masked_fraction"] == pytest.approx(2 / 4)  # segments rejected / segments
    assert m[p + "masked_fraction"] == pytest.approx(4 / 6)
    assert m[p + "fraction_high"] == pytest.approx(1 / 4) and m[p + "fraction_low"] == pytest.approx(1 / 4)
    assert m[p + "max"] == pytest.approx(0.25, abs=1e-6) and m[p + "min"] == pytest.approx(-0.25, abs=1e-6)


def test_delta_p_bands_chain_with_every_other_kind_of_option():
    chain = dict(rollout_rs="token_dp,seq_mean_k1,segment_mean_dp", rollout_rs_threshold="-0.5_0.5,0.5_2.0,-0.2_0.3",
                 rollout_token_veto_threshold=0.2)
    out, m = run(chain)
    alone = [kept(run(dict(rollout_rs=o, rollout_rs_threshold=t))[0])
             for o, t in (("token_dp", "-0.5_0.5"), ("seq_mean_k1", "0.5_2.0"), ("segment_mean_dp", "-0.2_0.3"))]
    veto = kept(run(dict(rollout_token_veto_threshold=0.2))[0])  # ρ = 1/3 ≥ 0.2: nothing vetoed
    expected = [[int(all(a[b][t] for a in alone + [veto])) for t in range(4)] for b in range(2)]
    assert kept(out) == expected == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 6)


def test_delta_p_uses_the_probabilities_not_the_ratio():
    # the same ratio ρ = 2 at p = 0.02 vs 0.01 (Δp 0.01) and at p = 0.8 vs 0.4 (Δp 0.4)
    train, roll = torch.tensor([[0.02, 0.8]]).log(), torch.tensor([[0.01, 0.4]]).log()
    cfg = RolloutCorrectionConfig(rollout_rs="token_dp", rollout_rs_threshold=0.1)
    assert compute_rollout_correction(train, roll, torch.ones(1, 2), config=cfg).response_mask.tolist() == [[1, 0]]


def test_non_finite_rows_are_dropped_and_padding_is_ignored():
    train, roll = P_TRAIN.log().clone(), P_ROLL.log().clone()
    train[0, 3] = float("nan")  # padding: ignored
    train[1, 1] = float("inf")  # a valid position: row 1 dropped
    cfg = RolloutCorrectionConfig(rollout_rs="seq_mean_dp,token_dp", rollout_rs_threshold="-1_1,-1_1",
                                  rollout_is="segment_geometric", rollout_is_threshold=2.0)
    out = compute_rollout_correction(train, roll, MASK, config=cfg, segments=Segments(IDS))
    assert kept(out) == [[1, 1, 1, 0], [0, 0, 0, 0]]
    assert out.weights[1].abs().sum() == 0 and torch.isfinite(out.weights).all()
    assert all(math.isfinite(v) for v in out.metrics_as_floats().values())


def test_signed_band_config():
    cfg = RolloutCorrectionConfig(rollout_rs="token_dp,seq_sum_dp", rollout_rs_threshold="-0.3_-0.1,0.25")
    assert [(o.stat_lower, o.stat_upper) for o in cfg.rs_options] == [(-0.3, -0.1), (-0.25, 0.25)]
    again = RolloutCorrectionConfig.from_dict(cfg.to_dict())
    assert again.rs_options == cfg.rs_options
    for bad, words in (("0.3_-0.3", "exceeds"), (-0.2, "≥ 0"), ("nan", "NaN"), ("-inf_0.1", "finite"),
                       ("inf", "finite"), ("a_b", "number")):
        with pytest.raises(ConfigError, match=words):
            RolloutCorrectionConfig(rollout_rs="token_dp", rollout_rs_threshold=bad)
    with pytest.raises(ConfigError, match="unknown option 'seq_max_dp'"):
        RolloutCorrectionConfig(rollout_rs="seq_max_dp", rollout_rs_threshold=0.1)
    seg = RolloutCorrectionConfig(rollout_is="segment_geometric", rollout_is_threshold=2.0)
    assert seg.uses_segments
    with pytest.raises(ValueError, match="rollout_is='segment_geometric'"):
        seg.refuse_segments("this route")


def test_policy_loss_takes_segment_geometric_weights():
    # REINFORCE in bypass mode: loss = −Σ w·A·log π / n_tokens (token-mean); ∂/∂log π_t = −w_t·A_t / n
    log_prob = P_TRAIN.log().clone().requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0], [0.5, 1.0, 3.0, -2.0]])
    cfg = RolloutCorrectionConfig(rollout_is="segment_geometric", rollout_is_threshold=1.2, bypass_mode=True,
                                  loss_type="reinforce")
    loss, _ = compute_policy_loss(
        log_prob, None, adv, MASK, config=cfg, rollout_log_prob=P_ROLL.log(), segments=Segments(IDS),
        loss=PolicyLoss(aggregation=Aggregation("token-mean")))
    loss.backward()
    h = math.sqrt(0.5)
    w = torch.tensor([[1.2, 1.2, 0.8, 0.0], [1.0, h, 0.0, h]])
    torch.testing.assert_close(log_prob.grad, -w * adv * MASK / 6)


@pytest.mark.parametrize("mask, ids", [
    ([[0, 1, 1, 0, 1]], [[0, 0, 0, 0, 1]]),
    ([[1, 1, 0, 0, 1, 1, 1, 0, 1]], [[0, 0, 0, 0, 1, 1, 1, 0, 2]]),
    ([[0, 0, 0], [1, 1, 1], [1, 0, 1]], [[0, 0, 0], [0, 0, 0], [0, 0, 1]]),
])
def test_segment_ids_from_mask_number_the_runs(mask, ids):
    for m in (torch.tensor(mask), torch.tensor(mask).bool(), torch.tensor(mask).float()):
        assert segment_ids_from_mask(m).tolist() == ids
    assert int(torch.tensor(ids).max()) < max_runs(len(mask[0]))


def test_runs_of_the_mask_as_segments():
    # the runs of [1, 1, 0, 1] and [1, 0, 1, 1]: each run is one segment of the segment level
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]])
    ids = segment_ids_from_mask(mask)
    cfg = RolloutCorrectionConfig(rollout_is="segment_geometric", rollout_is_threshold=10.0)
    rho = torch.tensor([[2.0, 0.5, 9.0, 3.0], [4.0, 9.0, 1.0, 0.25]])
    out = compute_rollout_correction(
        rho.log() - 3.0, torch.full((2, 4), -3.0), mask, config=cfg, segments=Segments(ids, count=max_runs(4)))
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0, 0.0, 3.0], [4.0, 0.0, 0.5, 0.5]]))
    assert segment_ids_from_mask(torch.zeros(3, 0)).shape == (3, 0) and max_runs(0) == 1
    with pytest.raises(ValueError, match="batch, response_length"):
        segment_ids_from_mask(torch.ones(4))
