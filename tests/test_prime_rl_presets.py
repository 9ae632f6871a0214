"""prime-rl's losses as presets, by hand: ``prime_rl_ipo`` (|π_θ − π_rollout| ≤ 0.3, prime-rl's default
since #3418 / #3586) and ``prime_rl_icepop`` (ratio kept in [0.2, 5], #3526), both −A·r with r =
π_θ/π_rollout carrying the gradient, divided by every valid token (prime-rl's ``rl_scale``).

The side-by-side comparison with prime-rl's own ``ipo_loss_fn`` is tests/test_prime_rl.py (nightly:
prime-rl is not on PyPI). No reference code exists for IcePop at the snapshot's commit; the cases
below are computed from its description.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_correction_core import (Aggregation, ConfigError, PolicyLoss, RolloutCorrectionConfig,
                                     compute_policy_loss, metrics_to_floats)
from rollout_correction_core.primitives import ratio_pg_loss


def _loss(config, trainer, rollout, adv, mask, aggregation=Aggregation("token-mean")):
    lp = torch.tensor(trainer, dtype=torch.float32).reshape(1, -1).requires_grad_(True)
    loss, metrics = compute_policy_loss(
        lp, None, torch.tensor(adv, dtype=torch.float32).reshape(1, -1), torch.tensor(mask).reshape(1, -1),
        config=config, rollout_log_prob=torch.tensor(rollout, dtype=torch.float32).reshape(1, -1),
        loss=PolicyLoss(aggregation=aggregation))
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad[0], metrics_to_floats(metrics)


def test_ratio_pg_is_the_ratio_with_its_gradient():
    lp = torch.tensor([math.log(0.5), math.log(0.9), -1.0], requires_grad=True)
    prox = torch.tensor([math.log(0.25), math.log(0.9), -30.0])
    adv = torch.tensor([1.5, -2.0, 1.0])
    loss = ratio_pg_loss(lp, prox, adv)
    # r = 2, 1, and exp(29) clamped to exp(20) (no gradient beyond the clamp)
    assert loss.tolist() == pytest.approx([-3.0, 2.0, -math.exp(20.0)], rel=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad.tolist() == pytest.approx([-3.0, 2.0, 0.0], rel=1e-6)  # −A·r·∇log π


def test_ipo_masks_tokens_whose_probability_moved_more_than_delta():
    p_rollout = [0.5, 0.5, 0.9, 0.2, 0.6, 0.3]
    p_train = [0.55, 0.85, 0.55, 0.21, 0.6, 0.3]    # Δp = 0.05, 0.35, −0.35, 0.01, 0, (padding)
    adv = [1.0, -2.0, 0.5, 3.0, -1.0, 7.0]
    mask = [True, True, True, True, True, False]
    rollout = [math.log(p) for p in p_rollout[:5]] + [-9999.0]
    loss, grad, m = _loss(RolloutCorrectionConfig.prime_rl_ipo(), [math.log(q) for q in p_train], rollout, adv, mask)
    r = [q / p for q, p in zip(p_train, p_rollout)]
    kept = [0, 3, 4]
    # every valid token divides, the two rejected ones included: N = 5
    assert float(loss) == pytest.approx(-sum(adv[t] * r[t] for t in kept) / 5, rel=1e-6)
    expected = [-adv[t] * r[t] / 5 if t in kept else 0.0 for t in range(6)]
    assert grad.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert m["rollout_corr/rollout_rs_token_dp_masked_fraction"] == pytest.approx(2 / 5)


def test_ipo_threshold_and_global_count():
    p_rollout, p_train = [0.5, 0.5], [0.55, 0.75]  # Δp 0.05, 0.25: kept at 0.3, the second rejected at 0.1
    trainer, rollout = [math.log(q) for q in p_train], [math.log(p) for p in p_rollout]
    adv, mask = [1.0, 1.0], [True, True]
    wide, _, _ = _loss(RolloutCorrectionConfig.prime_rl_ipo(), trainer, rollout, adv, mask)
    tight, _, _ = _loss(RolloutCorrectionConfig.prime_rl_ipo(threshold=0.1), trainer, rollout, adv, mask)
    assert float(wide) == pytest.approx(-(1.1 + 1.5) / 2, rel=1e-6)
    assert float(tight) == pytest.approx(-1.1 / 2, rel=1e-6)
    # a micro-batch of a larger step divides by the step's count of valid tokens (prime-rl's rl_scale)
    step, _, _ = _loss(RolloutCorrectionConfig.prime_rl_ipo(), trainer, rollout, adv, mask,
                       Aggregation("token-mean", global_num_tokens=8))
    assert float(step) == pytest.approx(-(1.1 + 1.5) / 8, rel=1e-6)


def _edges():
    """(trainer, rollout) log-prob pairs whose float32 log-ratio is exactly log 5 / log 0.2 as float32,
    and one float32 step outside each: (t − 2, −2) for t > 0 (t − 2 and its sum with 2 are exact in
    float32), (t, 0) for t < 0."""
    out = []
    for bound, away in ((math.log(5.0), math.inf), (math.log(0.2), -math.inf)):
        t = torch.tensor(bound, dtype=torch.float32)
        for x in (t, torch.nextafter(t, torch.tensor(away))):
            out.append((float(x - 2.0), -2.0) if bound > 0 else (float(x), 0.0))
    return out


def test_icepop_keeps_the_ratio_band_tested_on_log_ratio():
    ratios = [0.1, 0.2 * 1.01, 1.0, 4.9, 5.1]
    edges = _edges()
    trainer = [-2.0 + math.log(r) for r in ratios] + [e[0] for e in edges] + [0.0, -2.0 - 30.0]  # log r: 2, −30
    rollout = [-2.0] * len(ratios) + [e[1] for e in edges] + [-2.0, -2.0]
    n = len(trainer)
    adv = [1.0] * n
    loss, grad, m = _loss(RolloutCorrectionConfig.prime_rl_icepop(), trainer, rollout, adv, [True] * n)
    log_r = torch.tensor(trainer) - torch.tensor(rollout)
    assert log_r[5:9].tolist() == [float(torch.tensor(math.log(5.0))), float(torch.nextafter(
        torch.tensor(math.log(5.0)), torch.tensor(9.0))), float(torch.tensor(math.log(0.2))),
        float(torch.nextafter(torch.tensor(math.log(0.2)), torch.tensor(-9.0)))]  # exactly at and past the edges
    kept = [False, True, True, True, False] + [True, False, True, False] + [False, False]
    expected = sum(math.exp(float(x)) for x, k in zip(log_r, kept) if k)
    assert float(loss) == pytest.approx(-expected / n, rel=1e-6)
    assert (grad != 0).tolist() == kept
    assert torch.isfinite(grad).all()
    assert m["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(6 / n)


def test_icepop_rejects_a_ratio_that_overflows_without_nan():
    """log r = 100 (r = inf in float32 unclamped) and −100 (r = 0): rejected in log space, a zero
    contribution to loss and gradient, never 0·inf."""
    trainer, rollout = [0.0, -100.0, -0.5], [-100.0, 0.0, -0.5]
    loss, grad, m = _loss(RolloutCorrectionConfig.prime_rl_icepop(), trainer, rollout, [2.0, 2.0, 2.0], [True] * 3)
    assert float(loss) == pytest.approx(-2.0 / 3, rel=1e-6)
    assert grad.tolist() == pytest.approx([0.0, 0.0, -2.0 / 3], rel=1e-6)
    assert all(math.isfinite(v) for v in m.values())


def test_presets_and_their_arguments():
    ipo, icepop = RolloutCorrectionConfig.prime_rl_ipo(), RolloutCorrectionConfig.prime_rl_icepop(6.0, 0.1)
    for cfg in (ipo, icepop):
        assert (cfg.bypass_mode, cfg.loss_type, cfg.loss_denominator, cfg.rollout_is) == (True, "ratio_pg", "valid", None)
    assert (ipo.rs_options[0].name, ipo.rs_options[0].stat_lower, ipo.rs_options[0].stat_upper) == ("token_dp", -0.3, 0.3)
    opt = icepop.rs_options[0]
    assert (opt.name, opt.stat_lower, opt.stat_upper) == ("token_k1", -math.log(6.0), -math.log(0.1))
    with pytest.raises(ConfigError, match="prime_rl_ipo.*threshold"):
        RolloutCorrectionConfig.from_preset("prime_rl_ipo", eps=0.2)
    with pytest.raises(ConfigError, match="bounds must be positive"):
        RolloutCorrectionConfig.prime_rl_icepop(threshold_lower=-1.0)
