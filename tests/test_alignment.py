"""One-token shift detector: hand-computed distances and the warning on shifted inputs."""

import re
import warnings

import pytest
import torch

from rollout_correction_core._src.alignment import (MisalignmentWarning, alignment_metrics, alignment_report,
                                          alignment_statistics, check_alignment)


def _llm_like(B=8, T=40, seed=0, noise=0.02):
    """Token log-probs shaped like a language model's (many near 0, some very negative)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.empty(B, T).exponential_(1.0, generator=g)
    rollout = (old + noise * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    return old, rollout, torch.ones(B, T, dtype=torch.bool)


def test_distances_by_hand():
    old = torch.tensor([[-1.0, -2.0, -3.0, -9.0]])
    roll = torch.tensor([[-1.5, -1.0, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])  # pairs (0,1), (1,2)
    stats = alignment_statistics(old, roll, mask)
    # aligned |o0-r0| + |o1-r1| = 0.5 + 1; late |o0-r1| + |o1-r2| = 0 + 0; early |o1-r0| + |o2-r1| = 0.5 + 2
    torch.testing.assert_close(stats, torch.tensor([2.0, 1.5, 0.0, 2.5], dtype=torch.float64))
    m = alignment_metrics(stats)
    assert m["rollout_corr/alignment_mae"].item() == 0.75
    assert m["rollout_corr/alignment_late_mae"].item() == 0.0
    rep = alignment_report(stats, min_pairs=2)
    assert rep.misaligned and rep.best_shift == 1 and rep.n_pairs == 2


def test_aligned_inputs_do_not_warn():
    old, roll, mask = _llm_like()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = check_alignment(old, roll, mask)
    assert not rep.misaligned and rep.best_shift == 0
    assert rep.aligned_mae < 0.03 < 0.5 < rep.late_mae


@pytest.mark.parametrize("shift", [1, -1])
def test_shifted_rollout_warns_with_the_direction(shift):
    old, roll, mask = _llm_like(seed=1)
    if shift == 1:  # rollout kept one extra leading log-prob (e.g. the last prompt token)
        shifted = torch.cat([torch.full((8, 1), -0.3), roll[:, :-1]], dim=1)
    else:  # rollout lost its first response token
        shifted = torch.cat([roll[:, 1:], torch.full((8, 1), -0.3)], dim=1)
    with pytest.warns(MisalignmentWarning, match=re.escape(f"shifted by {shift:+d} token")):
        rep = check_alignment(old, shifted, mask)
    assert rep.misaligned and rep.best_shift == shift
    assert rep.aligned_mae > 0.5 and min(rep.late_mae, rep.early_mae) < 0.05


def test_large_genuine_mismatch_is_not_mistaken_for_a_shift():
    old, roll, mask = _llm_like(seed=2, noise=0.7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = check_alignment(old, roll, mask)
    assert not rep.misaligned and rep.aligned_mae > 0.3


def test_guards_masked_values_nonfinite_and_small_samples():
    old, roll, mask = _llm_like(B=2, T=10, seed=3)
    shifted = torch.cat([torch.zeros(2, 1), roll[:, :-1]], dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not check_alignment(old, shifted, mask).misaligned  # 18 pairs < min_pairs
    assert check_alignment(old, shifted, mask, min_pairs=8, warn=False).misaligned
    # identical log-probs: nothing to explain, never a warning
    assert not check_alignment(old, old.clone(), mask, min_pairs=1).misaligned
    # garbage at masked positions and NaN/inf at valid ones are left out
    old2, roll2 = old.clone(), roll.clone()
    m2 = mask.clone()
    m2[:, 7:] = False
    old2[:, 7:] = float("nan")
    roll2[:, 8:] = 1e30
    roll2[0, 2] = float("-inf")
    stats = alignment_statistics(old2, roll2, m2)
    assert torch.isfinite(stats).all() and stats[0].item() == 2 * 6 - 2
    empty = alignment_statistics(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5))
    assert empty.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert alignment_report(empty).misaligned is False
    single = check_alignment(torch.zeros(3, 1), torch.ones(3, 1), torch.ones(3, 1), min_pairs=0)
    assert single.n_pairs == 0 and not single.misaligned


def test_statistics_add_across_chunks():
    old, roll, mask = _llm_like(B=6, T=12, seed=4)
    whole = alignment_statistics(old, roll, mask)
    parts = alignment_statistics(old[:2], roll[:2], mask[:2]) + alignment_statistics(old[2:], roll[2:], mask[2:])
    torch.testing.assert_close(whole, parts)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"shape mismatch: old_log_prob \(2, 3\), rollout_log_prob \(2, 4\)"):
        alignment_statistics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="rollout_log_prob must be a"):
        alignment_statistics(torch.zeros(2, 3), torch.zeros(6), torch.ones(2, 3))
    with pytest.raises(ValueError, match="shift_ratio"):
        alignment_report(torch.zeros(4), shift_ratio=1.5)
