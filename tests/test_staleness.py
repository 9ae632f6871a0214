"""Staleness: lags, max_staleness rejection, metrics by lag and the version-driven three-policy loss."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_correction import RolloutCorrectionConfig, compute_policy_loss
from rollout_correction.staleness import (compute_staleness_policy_loss, max_staleness_mask,
                                          proximal_log_prob_from_versions, staleness_lag, staleness_metrics,
                                          staleness_split)

P = "rollout_corr/staleness/"


def test_lag_per_sample_and_per_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert staleness_lag(torch.tensor([5, 3]), 5, mask).tolist() == [[0, 0, 0], [2, 2, 2]]
    per_token = torch.tensor([[4, 5, 99], [3, 4, 5]])  # 99 sits on padding: ignored
    assert staleness_lag(per_token, torch.tensor(5), mask).tolist() == [[1, 0, 0], [2, 1, 0]]
    with pytest.raises(ValueError, match=r"version 6 at \(row 1, column 2\) is newer than the trainer's current_version 5"):
        staleness_lag(torch.tensor([[4, 5, 5], [3, 4, 6]]), 5, mask)
    with pytest.raises(ValueError, match=r"versions has shape \(3,\); expected \(2,\) per sample or \(2, 3\) per token"):
        staleness_lag(torch.tensor([1, 2, 3]), 5, mask)
    with pytest.raises(TypeError, match="integer tensor"):
        staleness_lag(torch.tensor([1.0, 2.0]), 5, mask)
    with pytest.raises(TypeError, match="current_version must be an integer"):
        staleness_lag(torch.tensor([1, 2]), 5.5, mask)


def test_max_staleness_mask_sequence_and_token_level():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float32)
    versions = torch.tensor([[8, 10, 10], [9, 10, 0], [0, 0, 0]])
    seq, m = max_staleness_mask(mask, versions, 10, max_staleness=1)
    assert seq.dtype == mask.dtype
    assert seq.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]  # row 0 has a token 2 versions old
    assert m["rollout_corr/staleness_masked_fraction"].item() == pytest.approx(3 / 5)
    assert m["rollout_corr/staleness_seq_masked_fraction"].item() == pytest.approx(1 / 2)
    tok, m = max_staleness_mask(mask, versions, 10, max_staleness=1, level="token")
    assert tok.tolist() == [[0, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert m["rollout_corr/staleness_masked_fraction"].item() == pytest.approx(1 / 5)
    assert m["rollout_corr/staleness_seq_masked_fraction"].item() == 0.0
    keep_all, _ = max_staleness_mask(mask, versions, 10, max_staleness=2)
    assert torch.equal(keep_all, mask)
    with pytest.raises(ValueError, match="max_staleness must be an integer ≥ 0"):
        max_staleness_mask(mask, versions, 10, max_staleness=-1)


def test_metrics_by_lag_bucket_by_hand():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0], [-1.0, -1.0, -1.0]])
    roll = torch.tensor([[-1.1, -0.9, -1.0], [-2.5, -2.5, -9.0], [-1.2, -1.2, -1.2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    versions = torch.tensor([7, 5, 2])  # lags 0, 2, 5 (5 falls in the last bucket "3plus")
    m = staleness_metrics(old, roll, mask, versions, 7, num_buckets=4)
    assert m[P + "lag_0/token_count"].item() == 3 and m[P + "lag_0/seq_count"].item() == 1
    assert m[P + "lag_1/token_count"].item() == 0 and m[P + "lag_1/kl"].item() == 0.0
    assert m[P + "lag_2/token_fraction"].item() == pytest.approx(2 / 8)
    assert m[P + "lag_3plus/seq_fraction"].item() == pytest.approx(1 / 3)
    # kl = mean over the bucket's tokens of (rollout − old)
    assert m[P + "lag_0/kl"].item() == pytest.approx(0.0, abs=1e-6)
    assert m[P + "lag_2/kl"].item() == pytest.approx(-0.5, abs=1e-6)
    assert m[P + "lag_3plus/kl"].item() == pytest.approx(-0.2, abs=1e-6)
    k3 = math.exp(0.5) - 1 - 0.5  # ρ = exp(old − rollout) = e^0.5
    assert m[P + "lag_2/k3_kl"].item() == pytest.approx(k3, rel=1e-5)
    assert m[P + "lag_mean"].item() == pytest.approx((0 * 3 + 2 * 2 + 5 * 3) / 8)
    assert m[P + "lag_max"].item() == 5
    assert all(torch.isfinite(v) for v in m.values())


def test_metrics_per_token_versions_and_empty_batch():
    old = torch.zeros(1, 4)
    roll = torch.tensor([[0.0, -0.1, -0.3, -0.3]])
    versions = torch.tensor([[3, 2, 1, 1]])  # a partial rollout across three weight updates
    m = staleness_metrics(old, roll, torch.ones(1, 4), versions, 3, num_buckets=3)
    assert [m[P + f"lag_{k}/token_count"].item() for k in ("0", "1", "2plus")] == [1, 1, 2]
    assert m[P + "lag_2plus/seq_count"].item() == 1  # the row's lag is its stalest token's
    assert m[P + "lag_2plus/kl"].item() == pytest.approx(-0.3, abs=1e-6)
    empty = staleness_metrics(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), 0)
    assert all(v.item() == 0 for v in empty.values())


def test_in_flight_and_in_queue_lag_by_hand():
    # Per token: a partial rollout generated at versions 1..3, trained at 3: in flight 2, queued 0.
    fl, q = staleness_split(torch.tensor([[3, 2, 1, 1]]), 3, torch.ones(1, 4))
    assert fl.tolist() == [2] and q.tolist() == [0]
    # Per sample, one version each: never in flight; the lag is all queue. The masked-out row counts nowhere.
    versions, mask = torch.tensor([7, 5, 2, 0]), torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])
    fl, q = staleness_split(versions, 7, mask)
    assert fl.tolist() == [0, 0, 0, 0] and q.tolist() == [0, 2, 5, 0]
    # With the version in force when each row finished (prime-rl's policy span end).
    finish = torch.tensor([7, 6, 4, 3])
    fl, q = staleness_split(versions, 7, mask, finish_versions=finish)
    assert fl.tolist() == [0, 1, 2, 0] and q.tolist() == [0, 1, 3, 0]
    old = torch.zeros(4, 2)
    m = staleness_metrics(old, old, mask, versions, 7, finish_versions=finish)
    assert m[P + "in_flight_mean"].item() == pytest.approx(3 / 3) and m[P + "in_flight_max"].item() == 2
    assert m[P + "in_queue_mean"].item() == pytest.approx(4 / 3) and m[P + "in_queue_max"].item() == 3
    assert m[P + "lag_max"].item() == 5  # the existing names are unchanged
    m = staleness_metrics(old, old, mask, versions, 7)
    assert m[P + "in_flight_max"].item() == 0 and m[P + "in_queue_mean"].item() == pytest.approx(7 / 3)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), per_token=st.booleans())
def test_in_flight_plus_in_queue_is_each_rows_lag(seed, per_token):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 5, 4, 9
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    versions = torch.randint(0, V + 1, (B, T) if per_token else (B,), generator=g)
    fl, q = staleness_split(versions, V, mask)
    row_lag = staleness_lag(versions, V, mask).amax(-1)
    assert torch.equal(fl + q, row_lag) and bool((fl >= 0).all() and (q >= 0).all())
    m = staleness_metrics(torch.zeros(B, T), torch.zeros(B, T), mask, versions, V)
    assert m[P + "lag_max"].item() == row_lag.max().item()
    assert max(m[P + "in_flight_max"].item(), m[P + "in_queue_max"].item()) <= row_lag.max().item()


def test_in_flight_split_bad_input_names_finish_versions():
    versions, mask = torch.tensor([[3, 2]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"finish_versions\[0\] = 2 is older than a version of its tokens"):
        staleness_split(versions, 4, mask, finish_versions=torch.tensor([2]))
    with pytest.raises(ValueError, match=r"finish_versions\[0\] = 5 is newer than the trainer's current_version 4"):
        staleness_split(versions, 4, mask, finish_versions=torch.tensor([5]))
    for bad in (torch.tensor([3.0]), torch.tensor([3, 3]), [3]):
        with pytest.raises(TypeError, match="finish_versions must be a \\(1,\\) integer tensor"):
            staleness_split(versions, 4, mask, finish_versions=bad)


def test_proximal_approximation_per_token():
    lb = torch.tensor([[-2.0, -2.0, -2.0, -2.0]])
    lt = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    lag = torch.tensor([[0, 1, 3, 0]])
    loglin = proximal_log_prob_from_versions(lb, lt, lag, "loglinear")
    torch.testing.assert_close(loglin, torch.tensor([[-2.0, -1.5, -1.25, -2.0]]))
    lin = proximal_log_prob_from_versions(lb, lt, lag, "linear")
    e2, e1 = math.exp(-2), math.exp(-1)
    expected = [math.log(e2), math.log(0.5 * e2 + 0.5 * e1), math.log(0.25 * e2 + 0.75 * e1), math.log(e2)]
    torch.testing.assert_close(lin, torch.tensor([expected]))
    assert torch.equal(proximal_log_prob_from_versions(lb, lt, lag, "behaviour"), lb)
    assert not proximal_log_prob_from_versions(lb, lt.requires_grad_(), lag).requires_grad


def _hand_loss(log_prob, prox, behav, adv, mask, cap=2.0, eps=0.2):
    """Decoupled PPO with token TIS, written out directly: mean over valid tokens."""
    w = torch.exp(prox - behav).clamp(max=cap)
    r = torch.exp(log_prob - prox)
    per_tok = torch.maximum(-adv * r, -adv * r.clamp(1 - eps, 1 + eps)) * w
    return (per_tok * mask).sum() / mask.sum()


def test_loss_with_recomputed_proximal_matches_the_formula_and_gradient():
    g = torch.Generator().manual_seed(0)
    behav = -torch.rand(3, 5, generator=g) * 2
    prox = (behav + 0.3 * torch.randn(3, 5, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    base = (prox + 0.1 * torch.randn(3, 5, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    adv = torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    lp = base.clone().requires_grad_(True)
    loss, metrics = compute_staleness_policy_loss(lp, behav, adv, mask, torch.tensor([4, 3, 4]), 4,
                                                  proximal_log_prob=prox)
    loss.backward()
    lp_ref = base.clone().requires_grad_(True)
    ref = _hand_loss(lp_ref, prox, behav, adv, mask)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(lp.grad, lp_ref.grad)
    assert metrics[P + "lag_1/seq_count"].item() == 1
    assert "rollout_corr/rollout_is_mean" in metrics and "actor/pg_clipfrac" in metrics


def test_loss_uses_per_token_versions_and_rejects_stale_samples():
    """The naive two-policy loss (π_old := π_behav, every sample kept) differs on both counts."""
    behav = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    base = torch.tensor([[-0.8, -0.8, -0.8], [-0.9, -0.9, -0.9]])
    adv = torch.ones(2, 3)
    mask = torch.ones(2, 3)
    versions = torch.tensor([[10, 9, 7], [6, 6, 6]])  # row 0: lags 0, 1, 3; row 1: lag 4
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=10.0)
    lp = base.clone().requires_grad_(True)
    loss, metrics = compute_staleness_policy_loss(lp, behav, adv, mask, versions, 10, cfg, max_staleness=3)
    loss.backward()
    # row 1 is 4 versions old: rejected, no gradient
    assert lp.grad[1].abs().max() == 0
    assert metrics["rollout_corr/staleness_seq_masked_fraction"].item() == 0.5
    # row 0: α = 0, 1/2, 3/4 → log π_prox = −1, −0.9, −0.85; w = e^{prox − behav}; r = e^{lθ − prox}
    prox = torch.tensor([-1.0, -0.9, -0.85])
    w = torch.exp(prox + 1.0)
    r = torch.exp(-0.8 - prox)
    unclipped = r <= 1.2
    expected = torch.where(unclipped, -w * r, torch.zeros(3)) / 3  # d(−A·w·r)/d log π_θ over 3 tokens
    torch.testing.assert_close(lp.grad[0], expected)
    naive_lp = base.clone().requires_grad_(True)
    naive, _ = compute_policy_loss(naive_lp, behav, adv, mask)  # plain PPO against π_behav
    naive.backward()
    assert naive_lp.grad[1].abs().max() > 0
    assert (naive_lp.grad[0] - lp.grad[0]).abs().max() > 1e-3


def test_loss_guards():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs decoupled mode"):
        compute_staleness_policy_loss(x.clone().requires_grad_(), x, x, torch.ones(2, 3), torch.tensor([1, 1]), 1,
                                      RolloutCorrectionConfig.bypass_ppo_clip())
    # everything stale: loss exactly 0, attached, zero gradient
    lp = x.clone().requires_grad_(True)
    loss, metrics = compute_staleness_policy_loss(lp, x, torch.ones(2, 3), torch.ones(2, 3), torch.tensor([0, 0]), 5,
                                                  max_staleness=2)
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().max() == 0
    assert all(torch.isfinite(v) for v in metrics.values())


# --- split across ranks: the same numbers as one process on the whole batch ---------------------

def _split_batch():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(7, 6, generator=g) * 3
    roll = (old + 0.2 * torch.randn(7, 6, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = (torch.rand(7, 6, generator=g) < 0.8).long()
    mask[3] = 0
    versions = torch.randint(0, 6, (7, 6), generator=g)
    return old, roll, mask, versions


def _split_worker(rank, world_size, port, result_dir):
    import datetime
    import os

    import torch.distributed as dist

    from rollout_correction_core._src.alignment import check_alignment

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        old, roll, mask, versions = _split_batch()
        lo, hi = [(0, 2), (2, 7)][rank]
        part = (old[lo:hi], roll[lo:hi], mask[lo:hi])
        m = staleness_metrics(*part, versions[lo:hi], 5, process_group=dist.group.WORLD)
        rep = check_alignment(*part, process_group=dist.group.WORLD, warn=False)
        torch.save(({k: float(v) for k, v in m.items()}, rep), os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_metrics_split_across_ranks_equal_the_whole_batch(tmp_path):
    import socket

    import torch.multiprocessing as mp

    from rollout_correction_core._src.alignment import check_alignment

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_split_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    old, roll, mask, versions = _split_batch()
    whole = {k: float(v) for k, v in staleness_metrics(old, roll, mask, versions, 5).items()}
    whole_rep = check_alignment(old, roll, mask, warn=False)
    for rank in range(2):
        got, rep = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert set(got) == set(whole)
        for k in whole:
            assert got[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-7), k
        assert rep.n_pairs == whole_rep.n_pairs
        assert rep.aligned_mae == pytest.approx(whole_rep.aligned_mae, rel=1e-9)
