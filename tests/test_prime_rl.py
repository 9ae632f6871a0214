"""``prime_rl_ipo`` side by side with prime-rl's own ``ipo_loss_fn`` and ``compute_loss``.

prime-rl's files come from a checkout at the commit :data:`prime_rl_reference.COMMIT`, named by
``$ROLLOUT_CORRECTION_PRIME_RL_SOURCE`` (prime-rl is not on PyPI, so CI cannot fetch them; the suite
is ``nightly``: docs/methods.md, "prime-rl's losses", says how to run it). The fast suite's hand-computed cases of the
same formulas are in tests/test_prime_rl_presets.py.

At that commit prime-rl's IPO is, per sample, ℓ_t = −keep_t·A_t·r_t + kl_tau·(log r_t)² on its loss
mask, keep_t = 1[|exp(log π_θ) − exp(log π_infer)| ≤ δ], r_t = exp(log π_θ − log π_infer) with gradient,
summed over the micro-batch and divided by ``rl_scale``, the number of loss-mask tokens of the whole
step over every data- and context-parallel rank. The preset sets δ = 0.3 and no KL term (prime-rl
#3586); the comparison runs prime-rl's function with ``kl_tau=0`` at δ = 0.3 and at the snapshot's
default δ = 0.1. prime-rl's IcePop (#3526) is not in the snapshot: no reference code for it.
"""

from __future__ import annotations

import math

import pytest
import torch

import prime_rl_reference
from rollout_correction_core import (Aggregation, PolicyLoss, RolloutCorrectionConfig, compute_policy_loss,
                                     metrics_to_floats)

pytestmark = pytest.mark.nightly


@pytest.fixture(scope="module")
def prime():
    return prime_rl_reference.loss_module()


def _batch(seed: int, rows: int, length: int, scale: float):
    """Per-sample log-probs, advantages and loss masks, and the same right-padded to (B, T)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    T = int(lengths.max())
    infer = -torch.rand(rows, T, generator=gen).pow(2) * 4.0  # probabilities spread over (0.02, 1]
    trainer = (infer + scale * torch.randn(rows, T, generator=gen)).clamp(max=0.0)
    adv = torch.randn(rows, 1, generator=gen).expand(rows, T).contiguous() + 0.1 * torch.randn(rows, T, generator=gen)
    in_row = torch.arange(T)[None, :] < lengths[:, None]
    loss_mask = in_row & (torch.rand(rows, T, generator=gen) > 0.1)
    return trainer, infer, adv, loss_mask, in_row, lengths


def _prime_loss(prime, config, trainer, infer, adv, loss_mask, lengths, rl_scale):
    rows = [slice(0, int(n)) for n in lengths]
    loss, metrics = prime.compute_loss(
        trainer_logprobs=[trainer[i, s] for i, s in enumerate(rows)],
        inference_logprobs=[infer[i, s] for i, s in enumerate(rows)], ref_logprobs=None,
        advantages=[adv[i, s] for i, s in enumerate(rows)], loss_mask=[loss_mask[i, s] for i, s in enumerate(rows)],
        rl_weights=None, ce_weights=None, ref_kl_weights=None, rl_loss_fn=prime.setup_rl_loss_fn(config),
        rl_scale=rl_scale, ce_scale=1, ref_kl_scale=1)
    return loss, metrics


def _both(prime, delta, trainer, infer, adv, loss_mask, lengths, micro=1):
    """(prime-rl's loss, its gradient, ours, ours, our metrics) over ``micro`` micro-batches of rows,
    each divided by the step's count of loss-mask tokens, as prime-rl's train loop does."""
    config = prime.configs.IPOLossConfig(ipo_threshold=delta, kl_tau=0.0)
    preset = RolloutCorrectionConfig.prime_rl_ipo(threshold=delta)
    n = int(loss_mask.sum())
    out = []
    metrics = {}
    for side in ("prime", "ours"):
        lp = trainer.clone().requires_grad_(True)
        total = 0.0
        for rows in torch.arange(trainer.shape[0]).tensor_split(micro):
            if side == "prime":
                loss, _ = _prime_loss(prime, config, lp[rows], infer[rows], adv[rows], loss_mask[rows], lengths[rows],
                                      rl_scale=max(n, 1))
            else:
                loss, m = compute_policy_loss(lp[rows], None, adv[rows], loss_mask[rows], config=preset,
                                              rollout_log_prob=infer[rows],
                                              loss=PolicyLoss(aggregation=Aggregation("token-mean",
                                                                                      global_num_tokens=n)))
                metrics[len(metrics)] = metrics_to_floats(m)
            total = total + loss
        (grad,) = torch.autograd.grad(total, lp)
        out += [total.detach(), grad]
    return (*out, metrics)


CASES = [(seed, rows, length, scale) for seed in range(4)
         for rows, length in ((3, 8), (16, 40), (64, 128)) for scale in (0.05, 0.4, 2.0)]


@pytest.mark.parametrize("seed,rows,length,scale", CASES)
@pytest.mark.parametrize("delta", [0.3, 0.1])
def test_ipo_loss_and_gradient_equal_prime_rls(prime, seed, rows, length, scale, delta):
    trainer, infer, adv, loss_mask, _, lengths = _batch(seed, rows, length, scale)
    p_loss, p_grad, o_loss, o_grad, _ = _both(prime, delta, trainer, infer, adv, loss_mask, lengths)
    torch.testing.assert_close(o_loss, p_loss.to(o_loss.dtype), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(o_grad, p_grad, rtol=1e-5, atol=1e-8)
    # the same tokens are masked: exactly the same gradient entries are zero
    assert torch.equal(o_grad == 0, p_grad == 0)


@pytest.mark.parametrize("seed", range(3))
def test_micro_batches_divide_by_the_steps_token_count(prime, seed):
    trainer, infer, adv, loss_mask, _, lengths = _batch(seed, 24, 64, 0.5)
    p_loss, p_grad, o_loss, o_grad, _ = _both(prime, 0.3, trainer, infer, adv, loss_mask, lengths, micro=3)
    torch.testing.assert_close(o_loss, p_loss.to(o_loss.dtype), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(o_grad, p_grad, rtol=1e-5, atol=1e-8)


def test_masked_share_equals_prime_rls(prime):
    """prime-rl's ``is_masked`` (per sample, over its loss-mask tokens) weighted by the samples' token
    counts is our ``rollout_rs_token_dp_masked_fraction``."""
    trainer, infer, adv, loss_mask, _, lengths = _batch(7, 32, 50, 1.0)
    config = prime.configs.IPOLossConfig(ipo_threshold=0.3, kl_tau=0.0)
    _, metrics = _prime_loss(prime, config, trainer, infer, adv, loss_mask, lengths, rl_scale=1)
    counts = loss_mask.sum(-1).double()
    theirs = float((metrics["is_masked"].double() * counts).sum() / counts.sum())
    *_, ours = _both(prime, 0.3, trainer, infer, adv, loss_mask, lengths)
    assert ours[0]["rollout_corr/rollout_rs_token_dp_masked_fraction"] == pytest.approx(theirs, abs=1e-7)  # theirs: float32 per sample
    assert 0.05 < theirs < 0.95


def _edge_pair(rollout_prob: float, delta: float) -> tuple[float, float]:
    """Two float32 trainer log-probs, adjacent, whose |p_train − p_rollout| lies on either side of δ
    (as float32, the way both compute it)."""
    lr = torch.tensor(math.log(rollout_prob), dtype=torch.float32)
    bound = torch.tensor(delta, dtype=torch.float32)
    x = torch.tensor(math.log(rollout_prob + delta), dtype=torch.float32)
    diff = lambda v: (torch.exp(v) - torch.exp(lr)).abs()  # noqa: E731
    step = torch.tensor(-math.inf if diff(x) > bound else 0.0)
    while (diff(x) > bound) == (diff(torch.nextafter(x, step)) > bound):
        x = torch.nextafter(x, step)
    y = torch.nextafter(x, step)
    return float(min(x, y)), float(max(x, y))


def test_tokens_at_the_gates_edge_are_decided_alike(prime):
    """Trainer log-probs one float32 step either side of |Δp| = δ (and a rollout probability of 1,
    where ``token_tv``'s clamp of p to 1 − 1e-6 would decide otherwise: the IPO gate is ``token_dp``)."""
    cols = []
    for p in (0.05, 0.3, 0.5, 0.69):
        cols += [(lo, math.log(p)) for lo in _edge_pair(p, 0.3)]
    cols += [(math.log(0.6999995), 0.0), (math.log(0.7000005), 0.0)]  # |Δp| 0.3000005 and 0.2999995
    trainer = torch.tensor([[c[0] for c in cols]])
    infer = torch.tensor([[c[1] for c in cols]])
    adv = torch.ones_like(trainer)
    mask = torch.ones_like(trainer, dtype=torch.bool)
    p_loss, p_grad, o_loss, o_grad, ours = _both(prime, 0.3, trainer, infer, adv, mask, torch.tensor([len(cols)]))
    kept = p_grad != 0
    assert torch.equal(o_grad != 0, kept)
    assert kept[0].tolist() == [True, False] * 4 + [False, True]  # the larger trainer log-prob crosses δ
    tv = compute_policy_loss(trainer.clone().requires_grad_(True), None, adv, mask, rollout_log_prob=infer,
                             config=RolloutCorrectionConfig.prime_rl_ipo().replace(rollout_rs="token_tv", rollout_rs_threshold=0.3))[1]
    # token_tv clamps p_rollout = 1 to 1 − 1e-6: |Δp| = 0.3000005 then reads 0.2999995 and is kept
    assert metrics_to_floats(tv)["rollout_corr/rollout_rs_token_tv_masked_fraction"] == pytest.approx(4 / 10)
    assert ours[0]["rollout_corr/rollout_rs_token_dp_masked_fraction"] == pytest.approx(5 / 10)


def test_snapshot_defaults_are_the_ones_the_docs_name(prime):
    """At the snapshot, IPOLossConfig() is δ = 0.1 with kl_tau = 1e-3; the preset follows #3586
    (δ = 0.3, kl_tau = 0), which the comparisons above pass explicitly."""
    default = prime.configs.IPOLossConfig()
    assert (default.ipo_threshold, default.kl_tau, default.adv_tau) == (0.1, 1e-3, 1.0)
    assert RolloutCorrectionConfig.prime_rl_ipo().rollout_rs_threshold.hi == 0.3
