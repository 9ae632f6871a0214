"""GSPO, CISPO, DPPO-TV / DPPO-KL and TOPR: per-token losses and gradients computed by hand,
and the same losses through ``compute_policy_loss`` (weights, masks, aggregation modes)."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_correction_core._src.policy_losses import (cispo_loss, dppo_loss, gspo_loss, sequence_advantage, topr_loss,
                                              topr_weights)

ln = math.log


def _grad(loss_mat: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss_mat.sum(), lp)
    return g


def test_gspo_hand_computed():
    # Row 0: log r = [ln 1.25, ln 0.8] → mean 0 → s = 1, inside the clip range: ℓ_t = −A, ∂ℓ_t/∂lp_t = −A·s.
    # Row 1: log r = [ln 1.5, ln 1.5] → s = 1.5 > 1.2 with A > 0: clipped, ℓ = −1.2·A, no gradient.
    # Row 2: same s = 1.5 with A < 0: max(−A·1.5, −A·1.2) = −A·1.5, unclipped, gradient −A·1.5.
    prox = torch.log(torch.tensor([[0.4, 0.5], [0.2, 0.2], [0.2, 0.2]]))
    lp = (prox + torch.log(torch.tensor([[1.25, 0.8], [1.5, 1.5], [1.5, 1.5]]))).requires_grad_(True)
    adv = torch.tensor([[2.0, 2.0], [1.0, 1.0], [-1.0, -1.0]])
    valid = torch.ones(3, 2, dtype=torch.bool)
    loss, clipped = gspo_loss(lp, prox, adv, valid, 0.2, 0.2)
    expected = torch.tensor([[-2.0, -2.0], [-1.2, -1.2], [1.5, 1.5]])
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert clipped.tolist() == [[False, False], [True, True], [False, False]]
    torch.testing.assert_close(_grad(loss, lp), torch.tensor([[-2.0, -2.0], [0.0, 0.0], [1.5, 1.5]]),
                               rtol=1e-6, atol=1e-6)


def test_gspo_sequence_ratio_uses_only_valid_tokens():
    prox = torch.full((1, 3), ln(0.5))
    lp = torch.tensor([[ln(0.6), ln(0.5), 7.0]])  # the last position is padding
    valid = torch.tensor([[True, True, False]])
    loss, _ = gspo_loss(lp, prox, torch.ones(1, 3), valid, 10.0, 10.0)
    s = math.exp(ln(1.2) / 2)
    torch.testing.assert_close(loss[0, :2], torch.tensor([-s, -s]), rtol=1e-6, atol=1e-6)


def test_cispo_hand_computed():
    # r = 1.5 → clip 1.2; r = 0.5 → 0.8; r = 1.1 → 1.1. ℓ = −sg(clip r)·A·lp, ∂ℓ/∂lp = −clip(r)·A.
    prox = torch.log(torch.tensor([[0.2, 0.4, 0.5]]))
    lp = torch.log(torch.tensor([[0.3, 0.2, 0.55]])).requires_grad_(True)
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    loss, clipped = cispo_loss(lp, prox, adv, 0.2, 0.2)
    coef = torch.tensor([[1.2 * 2.0, 0.8 * -1.0, 1.1 * 3.0]])
    torch.testing.assert_close(loss, -coef * lp.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_grad(loss, lp), -coef, rtol=1e-6, atol=1e-6)
    assert clipped.tolist() == [[True, True, False]]


def test_dppo_tv_hand_computed():
    # p − p' per token: 0.3 (A > 0, above δ_hi = 0.2: masked), 0.3 (A < 0: inside, r = 2 → min(2, c=3) = 2),
    # −0.25 (A < 0, below −δ_lo = −0.2: masked), −0.25 (A > 0: inside, r = 0.5), 0.1 with r = 5 > c (A > 0:
    # inside, truncated to c = 3).
    q = torch.tensor([[0.3, 0.3, 0.5, 0.5, 0.025]])
    p = torch.tensor([[0.6, 0.6, 0.25, 0.25, 0.125]])
    lp = p.log().requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, -2.0, 2.0, 1.0]])
    loss, outside, truncated = dppo_loss(lp, q.log(), adv, "tv", 0.2, 0.2, 3.0)
    coef = torch.tensor([[0.0, -1.0 * 2.0, 0.0, 2.0 * 0.5, 1.0 * 3.0]])
    torch.testing.assert_close(loss, -coef * lp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_grad(loss, lp), -coef, rtol=1e-5, atol=1e-6)
    assert outside.tolist() == [[True, False, True, False, False]]
    assert truncated.tolist() == [[False, False, False, False, True]]


def test_dppo_kl_hand_computed():
    # p' = 0.5, p = 0.8: D = 0.5·ln(0.5/0.8) + 0.5·ln(0.5/0.2) ≈ 0.2231 (the 1e-8 terms are negligible).
    d = 0.5 * ln(0.5 / 0.8) + 0.5 * ln((0.5 + 1e-8) / (0.2 + 1e-8))
    assert d == pytest.approx(0.22314, abs=1e-4)
    q = torch.full((1, 4), 0.5)
    p = torch.tensor([[0.8, 0.8, 0.8, 0.2]])
    lp = p.log().requires_grad_(True)
    # δ = 0.2 < D: A > 0 with p > p' is masked; A < 0 with p ≥ p' stays; with δ_hi = 0.3 > D it stays;
    # p = 0.2 < p' with A < 0: D(0.5 → 0.2) ≈ 0.2231 > δ_lo and p < p': masked.
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, outside, _ = dppo_loss(lp[:, :2], q[:, :2].log(), adv[:, :2], "kl", 0.2, 0.2, 3.0)
    assert outside.tolist() == [[True, False]]
    loss_hi, outside_hi, _ = dppo_loss(lp[:, 2:], q[:, 2:].log(), adv[:, 2:], "kl", 0.2, 0.3, 3.0)
    assert outside_hi.tolist() == [[False, True]]
    r = 0.8 / 0.5
    torch.testing.assert_close(loss, torch.tensor([[0.0, 1.0 * r * ln(0.8)]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_hi, torch.tensor([[-1.0 * r * ln(0.8), 0.0]]), rtol=1e-5, atol=1e-6)


def test_dppo_rejects_unknown_divergence():
    with pytest.raises(ValueError, match="divergence"):
        dppo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "js")


def test_topr_hand_computed():
    # Row 0: A > 0 → w = 1. Row 1: A < 0, Σ log r = ln 0.5 → w = 0.5. Row 2: A < 0, Σ log r = ln 2 → w = 1.
    # Row 3: A = 0 counts as non-negative → w = 1 (and the loss is 0 anyway).
    rollout = torch.full((4, 2), ln(0.5))
    lp = (rollout + torch.tensor([[0.3, -0.9], [ln(0.25), ln(2.0)], [ln(4.0), ln(0.5)], [1.0, 1.0]])
          ).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, -1.0, 0.0])[:, None].expand(4, 2)
    valid = torch.ones(4, 2, dtype=torch.bool)
    w = topr_weights(lp, rollout, adv, valid)
    torch.testing.assert_close(w, torch.tensor([1.0, 0.5, 1.0, 1.0]), rtol=1e-6, atol=1e-6)
    loss, tapered = topr_loss(lp, rollout, adv, valid)
    assert tapered.tolist() == [False, True, False, False]
    torch.testing.assert_close(_grad(loss, lp), -(w[:, None] * adv), rtol=1e-6, atol=1e-6)
    # Padding does not enter the product.
    lp_pad = torch.cat([lp.detach(), torch.full((4, 1), 9.0)], 1)
    valid_pad = torch.cat([valid, torch.zeros(4, 1, dtype=torch.bool)], 1)
    w_pad = topr_weights(lp_pad, torch.cat([rollout, torch.zeros(4, 1)], 1),
                         torch.cat([adv, torch.full((4, 1), 5.0)], 1), valid_pad)
    torch.testing.assert_close(w_pad, w)


def test_sequence_advantage_shapes():
    valid = torch.tensor([[True, True, False], [False, False, False]])
    adv = torch.tensor([[1.0, 3.0, 100.0], [5.0, 5.0, 5.0]])
    torch.testing.assert_close(sequence_advantage(adv, valid), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(sequence_advantage(adv[:, :1], valid), torch.tensor([1.0, 5.0]))
    torch.testing.assert_close(sequence_advantage(adv[:, 0], valid), torch.tensor([1.0, 5.0]))
