"""Group advantages that exclude rejected samples (verl #6375): hand values and verl 0.9.1 itself."""

import math

import numpy as np
import pytest
import torch

from rollout_correction.advantages import accepted_rows, group_advantages, grpo_advantages, rloo_advantages

M = "rollout_corr/"


def _mask(rows, T=3):
    """Response mask with the listed rows fully rejected (all-zero)."""
    m = torch.ones(rows[0], T, dtype=torch.long)
    for r in rows[1]:
        m[r] = 0
    return m


def test_grpo_baseline_ignores_rejected_rows_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    mask = _mask((8, [0, 5]))
    out = grpo_advantages(scores, 4, response_mask=mask)
    # group 0 accepted: [0, 0, 1] -> mean 1/3, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    lo, hi = (0 - 1 / 3) / (s + 1e-6), (1 - 1 / 3) / (s + 1e-6)
    expected = [0.0, lo, lo, hi, hi, 0.0, lo, lo]  # group 1 accepted: [1, 0, 0]
    torch.testing.assert_close(out.advantages, torch.tensor(expected), rtol=0, atol=1e-6)
    # The naive baseline over all four members gives 0.5 mean: row 1 would get -0.866, not -0.577.
    naive = (0 - 0.5) / (torch.tensor([1.0, 0, 0, 1]).std() + 1e-6)
    assert abs(out.advantages[1].item() - naive.item()) > 0.2
    assert out.accepted.tolist() == [False, True, True, True, True, False, True, True]
    torch.testing.assert_close(out.token_advantages, out.advantages.unsqueeze(-1) * mask)
    assert out.metrics[M + "group_rejected_row_fraction"].item() == 0.25
    assert out.metrics[M + "group_empty_count"].item() == 0


def test_rloo_leave_one_out_over_accepted_rows_by_hand():
    scores = torch.tensor([3.0, 1.0, 2.0, 10.0])
    out = rloo_advantages(scores, torch.tensor([7, 7, 7, 7]), keep=torch.tensor([1, 1, 1, 0]))
    # accepted 3, 1, 2: baselines (1+2)/2, (3+2)/2, (3+1)/2
    torch.testing.assert_close(out.advantages, torch.tensor([1.5, -1.5, 0.0, 0.0]))


def test_groups_that_lose_all_or_all_but_one_member():
    scores = torch.tensor([1.0, 2.0, 5.0, 7.0, 4.0, 4.5])
    ids = ["a", "a", "b", "b", "c", "c"]
    keep = torch.tensor([0, 0, 1, 0, 1, 1], dtype=torch.bool)
    for estimator in ("grpo", "rloo"):
        out = group_advantages(scores, ids, estimator=estimator, keep=keep)
        assert out.advantages[:4].tolist() == [0.0, 0.0, 0.0, 0.0]  # empty group, lone survivor
        assert out.advantages[4].item() < 0 < out.advantages[5].item()
        assert out.metrics[M + "group_empty_count"].item() == 1
        assert out.metrics[M + "group_empty_fraction"].item() == pytest.approx(1 / 3)
        assert out.metrics[M + "group_singleton_count"].item() == 1
        assert out.metrics[M + "group_accepted_size_mean"].item() == 1.5
        assert out.metrics[M + "group_count"].item() == 3


def test_nonfinite_scores_are_rejected_and_counted_or_raise():
    scores = torch.tensor([1.0, float("nan"), 3.0, float("inf"), 0.0, 1.0])
    out = grpo_advantages(scores, 3, norm_by_std=False)
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 0.0, 1.0, 0.0, -0.5, 0.5]))
    assert torch.isfinite(out.advantages).all()
    assert out.metrics[M + "group_nonfinite_score_count"].item() == 2
    assert out.metrics[M + "group_singleton_count"].item() == 0
    with pytest.raises(ValueError, match=r"score of row 1 is nan"):
        grpo_advantages(scores, 3, on_nonfinite="raise")
    # a NaN reward on a row that is already rejected is ignored, even with "raise"
    out = grpo_advantages(scores, 3, keep=torch.tensor([1, 0, 1, 0, 1, 1]), on_nonfinite="raise")
    assert out.metrics[M + "group_nonfinite_score_count"].item() == 0


def test_token_level_rewards_sum_over_valid_tokens_and_extreme_values_stay_finite():
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rewards[0, 0] = 100.0  # a padding position: must not count
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    out = grpo_advantages(rewards, 4, response_mask=mask, norm_by_std=False)
    torch.testing.assert_close(out.advantages, torch.tensor([-1.5, -0.5, 0.5, 1.5]))
    huge = torch.tensor([3e38, -3e38, 1e38, 0.0], dtype=torch.float32)
    out = grpo_advantages(huge, 4)
    assert torch.isfinite(out.advantages).all()
    ref = (huge.double() - huge.double().mean()) / huge.double().std()
    torch.testing.assert_close(out.advantages.double(), ref, rtol=1e-5, atol=0)
    same = grpo_advantages(torch.full((4,), 0.7), 2)  # zero std: advantage 0, not NaN
    assert same.advantages.tolist() == [0.0] * 4


def test_empty_batch_and_low_precision():
    out = grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert out.advantages.shape == (0,) and out.metrics[M + "group_count"].item() == 0
    out = rloo_advantages(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), 2)
    assert out.advantages.dtype == torch.float32
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 1.0]))


def test_bad_arguments_are_named():
    s = torch.zeros(6)
    with pytest.raises(ValueError, match="group size 4 does not divide the batch of 6"):
        grpo_advantages(s, 4)
    with pytest.raises(ValueError, match=r"one id per row, shape \(6,\)"):
        grpo_advantages(s, torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        grpo_advantages(s, torch.zeros(6))
    with pytest.raises(ValueError, match="group_ids has 5 entries"):
        grpo_advantages(s, ["a"] * 5)
    with pytest.raises(ValueError, match="estimator must be"):
        group_advantages(s, 3, estimator="ppo")
    with pytest.raises(ValueError, match="keep has 5 rows"):
        grpo_advantages(s, 3, keep=torch.ones(5))
    with pytest.raises(TypeError, match="floating-point"):
        grpo_advantages(torch.zeros(6, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        grpo_advantages(s, 3, epsilon=0.0)
    assert accepted_rows(torch.tensor([[0, 0], [0, 1]])).tolist() == [False, True]


def _verl_grpo_rloo():
    from verl_reference import load_verl_core_algos
    ca = load_verl_core_algos()
    return ca.compute_grpo_outcome_advantage, ca.compute_rloo_outcome_advantage


def _random_batch(seed, groups=6, size=5, T=4):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(groups * size, generator=g)
    rewards = torch.zeros(groups * size, T)
    rewards[:, -1] = scores
    uid = np.array([f"u{i // size}" for i in range(groups * size)], dtype=object)
    return scores, rewards, uid, torch.ones(groups * size, T)


def test_without_rejection_matches_verl_grpo_and_rloo():
    verl_grpo, verl_rloo = _verl_grpo_rloo()
    scores, rewards, uid, mask = _random_batch(0)
    for norm in (True, False):
        ref, _ = verl_grpo(rewards, mask, uid, norm_adv_by_std_in_grpo=norm)
        ours = grpo_advantages(scores, list(uid), response_mask=mask, norm_by_std=norm)
        torch.testing.assert_close(ours.token_advantages, ref, rtol=1e-5, atol=1e-6)
    ref, _ = verl_rloo(rewards, mask, uid)
    torch.testing.assert_close(rloo_advantages(scores, list(uid), response_mask=mask).token_advantages, ref,
                               rtol=1e-5, atol=1e-6)


def test_with_rejection_equals_verl_on_the_accepted_rows_only_and_differs_from_verl_on_all():
    verl_grpo, verl_rloo = _verl_grpo_rloo()
    scores, rewards, uid, mask = _random_batch(1)
    rejected = [0, 3, 7, 12, 13, 21]  # at most two per group: every group keeps ≥ 2 members
    mask[rejected] = 0
    acc = mask.any(-1)
    for ours_fn, verl_fn in ((grpo_advantages, verl_grpo), (rloo_advantages, verl_rloo)):
        ours = ours_fn(scores, list(uid), response_mask=mask)
        ref_acc, _ = verl_fn(rewards[acc], mask[acc], uid[acc.numpy()])
        torch.testing.assert_close(ours.token_advantages[acc], ref_acc, rtol=1e-5, atol=1e-6)
        naive, _ = verl_fn(rewards, mask, uid)  # today's behaviour: rejected rows in the baseline
        assert (naive[acc] - ours.token_advantages[acc]).abs().max() > 0.05
