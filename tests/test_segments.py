"""The segment level: IS weights and rejection per segment (turn) of a multi-turn row.

Hand-computed cases, the equivalence with the sequence level on an "exploded" batch (each
segment its own row: an independent evaluation through the sequence-level code), the errors for
bad segment ids, the blocked eager pass, compute_policy_loss, and data- and context-parallel runs
(gloo ranks on 127.0.0.1) against one process on the whole batch.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_correction_core import RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction
from rollout_correction_core._src import correction as correction_module
from gloo import _free_port, init_dp_cp
from rollout_correction_core import Aggregation, Parallel, PolicyLoss, Segments

LR = torch.tensor([[0.1, 0.2, -0.3, 0.5, 0.0],
                   [0.4, 0.4, 9.9, -1.0, 7.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0]], dtype=torch.float32)
IDS = torch.tensor([[0, 0, 1, 1, 2], [4, 4, 4, 2, 2]])


def _inputs():
    old = (LR - 1.0).float()
    rollout = torch.full_like(old, -1.0)
    return old, rollout


def test_segment_weights_and_metrics_by_hand():
    old, rollout = _inputs()
    cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=1.25, metrics=["default", "detail"])
    out = compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(IDS))
    # row 0: segments {0, 1} Σ = 0.3, {2, 3} Σ = 0.2, {4} Σ = 0; row 1: {0, 1} Σ = 0.8 (column 2 is
    # masked: its 9.9 and its id are ignored), {3} Σ = −1.0
    s = [math.exp(0.3), math.exp(0.2), 1.0, math.exp(0.8), math.exp(-1.0)]
    w = [min(x, 1.25) for x in s]
    expected = torch.tensor([[w[0], w[0], w[1], w[1], w[2]], [w[3], w[3], 0.0, w[4], 0.0]])
    torch.testing.assert_close(out.weights, expected)
    m = out.metrics_as_floats()
    tokens = [w[0], w[0], w[1], w[1], w[2], w[3], w[3], w[4]]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(tokens) / 8, rel=1e-6)
    assert m["rollout_corr/rollout_is_seq_mean"] == pytest.approx(sum(w) / 5, rel=1e-6)  # over segments
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.8), rel=1e-6)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-1.0), rel=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)  # e^0.3, e^0.8 > 1.25
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)   # e^−1 < 0.8
    assert m["rollout_corr/rollout_is_seq_log_mean"] == pytest.approx((0.3 + 0.2 + 0.0 + 0.8 - 1.0) / 5, rel=1e-5)
    assert torch.equal(out.response_mask, MASK)
    # batch normalisation: over the five segments
    cfg_bn = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=1.25, rollout_is_batch_normalize=True)
    bn = compute_rollout_correction(old, rollout, MASK, config=cfg_bn, segments=Segments(IDS))
    torch.testing.assert_close(bn.weights, expected / (sum(w) / 5))


def test_segment_rejection_by_hand():
    old, rollout = _inputs()
    k3 = [math.exp(x) - 1 - x for x in LR.flatten().tolist()]
    k3 = torch.tensor(k3).view(2, 5)
    seg_max_k3 = [max(k3[0, 0], k3[0, 1]), max(k3[0, 2], k3[0, 3]), k3[0, 4], k3[1, 0], k3[1, 3]]
    bound = float(sorted(seg_max_k3)[2]) * 1.001  # three segments kept, two rejected
    cfg = RolloutCorrectionConfig(rollout_rs="segment_sum_k1,segment_mean_k1,segment_max_k3",
                                  rollout_rs_threshold=("0.5_1.3", "0.8_1.4", bound))
    out = compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(IDS))
    # segment_sum_k1: ratios e^0.3 (out), e^0.2, 1, e^0.8 (out), e^−1 (out)
    # segment_mean_k1: e^0.15, e^0.1, 1, e^0.4 (out), e^−1 (out)
    keep_sum = [False, True, True, False, False]
    keep_max = [float(x) <= bound for x in seg_max_k3]
    keep = [a and b for a, b in zip(keep_sum, keep_max)]
    tok = [0, 0, 1, 1, 2], [3, 3, None, 4, None]
    expected = torch.tensor([[float(keep[s]) if s is not None else 0.0 for s in row] for row in tok])
    assert torch.equal(out.response_mask, expected)
    m = out.metrics_as_floats()
    p = "rollout_corr/rollout_rs_"
    assert m[p + "segment_sum_k1_masked_fraction"] == pytest.approx(5 / 8)  # 2 + 2 + 1 tokens
    assert m[p + "segment_sum_k1_seq_masked_fraction"] == pytest.approx(3 / 5)  # over segments
    assert m[p + "segment_sum_k1_fraction_high"] == pytest.approx(1 / 5)  # k1 > −log 0.5: ratio e^−1 < 0.5
    assert m[p + "segment_sum_k1_fraction_low"] == pytest.approx(2 / 5)  # k1 < −log 1.3: e^0.3, e^0.8
    assert m[p + "segment_mean_k1_seq_masked_fraction"] == pytest.approx(2 / 5)
    assert m[p + "segment_mean_k1_seq_mean"] == pytest.approx(-(0.15 + 0.1 + 0.0 + 0.4 - 1.0) / 5, rel=1e-5)
    assert m[p + "segment_max_k3_seq_max"] == pytest.approx(float(max(seg_max_k3)), rel=1e-5)
    assert m[p + "segment_max_k3_seq_masked_fraction"] == pytest.approx(2 / 5)
    assert m[p + "seq_masked_fraction"] == pytest.approx(1.0)  # every row loses a token
    assert m[p + "masked_fraction"] == pytest.approx(1 - expected.sum().item() / 8)


def test_without_segment_ids_a_row_is_one_segment():
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 9, generator=gen) * 2
    rollout = (old + 0.3 * torch.randn(6, 9, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = (torch.rand(6, 9, generator=gen) > 0.2).float()
    mask[1] = 0
    for seg_cfg, seq_cfg in (
            (dict(rollout_is="segment", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
             dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True)),
            (dict(rollout_rs="segment_mean_k3", rollout_rs_threshold=0.02),
             dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.02))):
        a = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig(**seg_cfg))
        b = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig(**seq_cfg))
        const = compute_rollout_correction(
            old, rollout, mask, config=RolloutCorrectionConfig(**seg_cfg),
            segments=Segments(torch.full((6, 9), 4)))
        for x in (a, const):
            if b.weights is not None:
                torch.testing.assert_close(x.weights, b.weights)
            assert torch.equal(x.response_mask, b.response_mask)
            ma, mb = x.metrics_as_floats(), b.metrics_as_floats()
            rename = {k: k.replace("segment_", "seq_") for k in ma}
            assert {rename[k] for k in ma} == set(mb)
            for k, v in ma.items():
                assert v == pytest.approx(mb[rename[k]], rel=1e-6, abs=1e-9), k


def explode(old, rollout, mask, ids, S):
    """Each (row, segment) as its own row: (B·S, T) inputs for the sequence level."""
    B, T = mask.shape
    seg = torch.arange(S).view(1, S, 1)
    m = (mask.bool().unsqueeze(1) & (ids.unsqueeze(1) == seg)).reshape(B * S, T).float()
    rep = lambda x: x.unsqueeze(1).expand(B, S, T).reshape(B * S, T)  # noqa: E731
    return rep(old), rep(rollout), m


def fold(x, B, S, T):
    return x.reshape(B, S, T).sum(1)


def segment_vs_exploded(old, rollout, mask, ids, S, seg_cfg: dict, seq_cfg: dict):
    """(segment-level result, sequence-level result on the exploded batch folded back)."""
    B, T = mask.shape
    a = compute_rollout_correction(
        old, rollout, mask, config=RolloutCorrectionConfig(**seg_cfg), segments=Segments(ids, count=S))
    eo, er, em = explode(old, rollout, mask, ids, S)
    b = compute_rollout_correction(eo, er, em, config=RolloutCorrectionConfig(**seq_cfg))
    return a, b, (None if b.weights is None else fold(b.weights, B, S, T)), fold(b.response_mask, B, S, T)


def assert_matches_exploded(a, b, w, keep, mask):
    if w is not None:
        torch.testing.assert_close(a.weights, w, rtol=2e-6, atol=1e-7)
    assert torch.equal(a.response_mask, keep * mask)
    ma, mb = a.metrics_as_floats(), b.metrics_as_floats()
    for k, v in ma.items():  # the IS and the options' metrics: over segments = over the exploded rows
        # (rollout_is_seq_raw_mean is the off-policy mean of ∏ρ over whole sequences, not segments)
        if k.startswith(("rollout_corr/rollout_is_", "rollout_corr/rollout_rs_segment_")) and \
                k != "rollout_corr/rollout_is_seq_raw_mean":
            kb = k.replace("segment_", "seq_")
            assert v == pytest.approx(mb[kb], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("seed", range(4))
def test_segment_level_equals_the_sequence_level_on_segments_as_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    B, T, S = 5, 11, 4
    old = -torch.rand(B, T, generator=gen) * 2 - 0.05
    rollout = (old + 0.4 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = (torch.rand(B, T, generator=gen) > 0.25).float()
    ids = torch.randint(0, S, (B, T), generator=gen)
    ids = torch.where(mask > 0, ids, torch.randint(-5, 50, (B, T), generator=gen))  # ignored where masked
    cases = [
        (dict(rollout_is="segment", rollout_is_threshold=1.3), dict(rollout_is="sequence", rollout_is_threshold=1.3)),
        (dict(rollout_is="segment", rollout_is_threshold="0.6_1.8", rollout_is_batch_normalize=True),
         dict(rollout_is="sequence", rollout_is_threshold="0.6_1.8", rollout_is_batch_normalize=True)),
        (dict(rollout_is="segment", rollout_is_threshold=1.5, rollout_is_mode="clip", rollout_is_threshold_lower=0.7),
         dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_mode="clip", rollout_is_threshold_lower=0.7)),
        (dict(rollout_rs="segment_sum_k1,segment_max_k2,segment_mean_tv", rollout_rs_threshold=("0.6_1.4", 0.05, 0.1)),
         dict(rollout_rs="seq_sum_k1,seq_max_k2,seq_mean_tv", rollout_rs_threshold=("0.6_1.4", 0.05, 0.1))),
        (dict(rollout_rs="segment_mean_k3,segment_max_binary_kl", rollout_rs_threshold=(0.03, 0.02)),
         dict(rollout_rs="seq_mean_k3,seq_max_binary_kl", rollout_rs_threshold=(0.03, 0.02))),
        (dict(rollout_is="segment_geometric", rollout_is_threshold=1.2, rollout_is_batch_normalize=True),
         dict(rollout_is="geometric", rollout_is_threshold=1.2, rollout_is_batch_normalize=True)),
        (dict(rollout_rs="segment_mean_dp,segment_sum_dp", rollout_rs_threshold="-0.04_0.05,-0.15_0.1"),
         dict(rollout_rs="seq_mean_dp,seq_sum_dp", rollout_rs_threshold="-0.04_0.05,-0.15_0.1")),
    ]
    for seg_cfg, seq_cfg in cases:
        a, b, w, keep = segment_vs_exploded(old, rollout, mask, ids, S, seg_cfg, seq_cfg)
        assert_matches_exploded(a, b, w, keep, mask)
        if "rollout_rs" in seg_cfg:  # the cases are active: some segments rejected, some kept
            assert 0 < a.response_mask.sum() < mask.sum()


def test_segment_options_combine_with_row_and_token_options():
    gen = torch.Generator().manual_seed(9)
    B, T = 4, 10
    old = -torch.rand(B, T, generator=gen) * 2
    rollout = (old + 0.3 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.ones(B, T)
    ids = torch.arange(T).div(3, rounding_mode="floor").expand(B, T)
    both = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0,
                                   rollout_rs="token_k3,segment_mean_k3,seq_max_k3",
                                   rollout_rs_threshold=(0.05, 0.01, 0.1))
    out = compute_rollout_correction(old, rollout, mask, config=both, segments=Segments(ids))
    single = [compute_rollout_correction(
        old, rollout, mask,
        config=RolloutCorrectionConfig(
        rollout_rs=name, rollout_rs_threshold=thr),
        segments=Segments(ids)).response_mask
        for name, thr in (("token_k3", 0.05), ("segment_mean_k3", 0.01), ("seq_max_k3", 0.1))]
    assert torch.equal(out.response_mask, single[0] * single[1] * single[2])


def test_bad_segment_ids_raise_clear_errors():
    old, rollout = _inputs()
    cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=2.0)
    with pytest.raises(TypeError, match="segment_ids.*integer"):
        compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(IDS.float()))
    with pytest.raises(TypeError, match="segment_ids.*integer"):
        compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(IDS > 0))
    with pytest.raises(ValueError, match="shape mismatch.*segment_ids"):
        compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(IDS[:, :4]))
    neg = IDS.clone()
    neg[1, 3] = -1
    with pytest.raises(ValueError, match=r"segment id -1 at valid position \(row 1, column 3\)"):
        compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(neg))
    with pytest.raises(ValueError, match=r"segment id 4 .*outside \[0, 3\)"):
        compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(IDS, count=3))
    with pytest.raises(ValueError, match="max_segments"):
        compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(IDS, count=0))
    neg[1, 3] = 0
    neg[1, 2] = -7  # at a masked position: ignored
    out = compute_rollout_correction(old, rollout, MASK, config=cfg, segments=Segments(neg))
    assert torch.isfinite(out.weights).all()
    with pytest.raises(ValueError, match="rollout_rs.*segment_max_k1"):
        RolloutCorrectionConfig(rollout_rs="segment_max_k1", rollout_rs_threshold=2.0)


def test_blocked_pass_equals_one_block(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    B, T = 13, 8
    old = -torch.rand(B, T, generator=gen) * 2
    rollout = (old + 0.3 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = (torch.rand(B, T, generator=gen) > 0.2).float()
    ids = torch.randint(0, 3, (B, T), generator=gen)
    cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=1.4, rollout_is_batch_normalize=True,
                                  rollout_rs="segment_mean_k3", rollout_rs_threshold=0.02)
    whole = compute_rollout_correction(old, rollout, mask, config=cfg, segments=Segments(ids))
    monkeypatch.setattr(correction_module, "BLOCK_TOKENS", 3 * T)  # blocks of 3 rows
    blocked = compute_rollout_correction(old, rollout, mask, config=cfg, segments=Segments(ids))
    torch.testing.assert_close(blocked.weights, whole.weights)
    assert torch.equal(blocked.response_mask, whole.response_mask)
    assert blocked.metrics_as_floats() == pytest.approx(whole.metrics_as_floats(), rel=1e-9)
    bad = ids.clone()
    bad[10, 0] = 9
    mask[10, 0] = 1
    with pytest.raises(ValueError, match=r"row 10, column 0"):
        compute_rollout_correction(old, rollout, mask, config=cfg, segments=Segments(bad, count=3))


def test_policy_loss_uses_segment_weights():
    gen = torch.Generator().manual_seed(2)
    B, T = 3, 7
    old = -torch.rand(B, T, generator=gen) * 2
    rollout = (old + 0.3 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    adv = torch.randn(B, T, generator=gen)
    mask = torch.ones(B, T)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2]).expand(B, T)
    cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=1.6, bypass_mode=True,
                                  loss_type="reinforce")
    lp = old.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        lp, None, adv, mask, config=cfg, rollout_log_prob=rollout, segments=Segments(ids),
        loss=PolicyLoss(aggregation=Aggregation("token-sum")))
    lr = old - rollout
    seg_sum = torch.stack([lr[:, :3].sum(-1), lr[:, 3:5].sum(-1), lr[:, 5:].sum(-1)], -1)
    w = seg_sum.exp().clamp(max=1.6).gather(1, ids)
    torch.testing.assert_close(loss, -(w * adv * old).sum())
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, -w * adv)
    assert "rollout_corr/rollout_is_seq_mean" in metrics


# -- data and context parallelism ------------------------------------------------------------

ROWS, LENGTH, MAXSEG = 6, 13, 5
CONFIGS = {
    "is": dict(rollout_is="segment", rollout_is_threshold=1.4, rollout_is_batch_normalize=True),
    "icepop": dict(rollout_is="segment", rollout_is_threshold="0.7_1.5"),
    "rs": dict(rollout_is="token", rollout_is_threshold=2.0,
               rollout_rs="segment_sum_k1,segment_mean_k3,segment_max_tv", rollout_rs_threshold=("0.6_1.5", 0.03, 0.2)),
    "roll": dict(rollout_is="segment_geometric", rollout_is_threshold=1.3, rollout_is_batch_normalize=True,
                 rollout_rs="segment_mean_dp,token_dp,seq_mean_dp,segment_sum_dp,seq_sum_dp,segment_mean_k1",
                 rollout_rs_threshold="-0.1_0.08,-0.3_0.3,-0.06_0.06,-0.4_0.3,-0.6_0.5,0.7_1.4"),
    "kpop_logprob_error": dict(rollout_rs="segment_mean_kpop,segment_max_kpop,segment_logprob_error",
                               rollout_rs_threshold=(0.05, 0.1, 1.4)),
}


def make_rows(dp_rank: int):
    gen = torch.Generator().manual_seed(77 + dp_rank)
    old = -torch.rand(ROWS, LENGTH, generator=gen) * 2 - 0.05
    rollout = (old + 0.35 * torch.randn(ROWS, LENGTH, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lengths = torch.randint(3, LENGTH + 1, (ROWS,), generator=gen)
    lengths[1] = 0
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).float()
    mask[3, 4:6] = 0  # a tool turn between two model turns
    # turns: consecutive runs with increasing ids (a segment may span the shards)
    bounds = torch.sort(torch.randint(1, LENGTH, (ROWS, MAXSEG - 1), generator=gen), dim=-1).values
    ids = (torch.arange(LENGTH)[None, None, :] >= bounds[:, :, None]).sum(1)
    if dp_rank == 0:
        old[4, 2] = float("nan")  # a dropped row
    return old, rollout, mask, ids


def _columns(cp: int, cp_rank: int) -> torch.Tensor:
    cuts = {2: [0, 5, LENGTH]}[cp]
    return torch.arange(cuts[cp_rank], cuts[cp_rank + 1])


def _compute(old, rollout, mask, ids, **kw):
    out = {}
    for name, cfg in CONFIGS.items():
        res = compute_rollout_correction(
            old, rollout, mask, config=RolloutCorrectionConfig(**cfg), **kw,
            segments=Segments(ids, count=MAXSEG))
        out[name] = (res.weights, res.response_mask, res.metrics_as_floats())
    return out


LOSS_CONFIGS = {
    "ppo-rs": dict(CONFIGS["rs"], rollout_is="segment", rollout_is_threshold=1.4),
    "gspo-rs": dict(CONFIGS["rs"], loss_type="gspo"),
    "reinforce": dict(rollout_is="segment", rollout_is_threshold=1.4, rollout_rs="segment_mean_k3",
                      rollout_rs_threshold=0.03, bypass_mode=True, loss_type="reinforce"),
}


def _losses(old, rollout, mask, ids, cols=None, **kw):
    """Losses, gradients and metrics; the random inputs are drawn for whole rows (columns ``cols`` taken)."""
    gen = torch.Generator().manual_seed(5)
    out = {}
    cols = torch.arange(LENGTH) if cols is None else cols
    for name, cfg in LOSS_CONFIGS.items():
        for mode in ("token-mean", "seq-mean-token-mean"):
            lp = (old.nan_to_num(-1.0) + 0.2 * torch.randn(ROWS, LENGTH, generator=gen)[:, cols]).clamp(max=0.0).requires_grad_(True)
            adv = torch.randn(ROWS, LENGTH, generator=gen)[:, cols]
            loss, metrics = compute_policy_loss(
                lp, old, adv, mask, config=RolloutCorrectionConfig(**cfg), rollout_log_prob=rollout, **kw,
                segments=Segments(ids, count=MAXSEG), loss=PolicyLoss(aggregation=Aggregation(mode)))
            loss.backward()
            out[(name, mode)] = (float(loss.detach()), lp.grad.clone(), {k: float(v) for k, v in metrics.items()})
    return out


def _worker(rank, world_size, cp, port, result_dir):
    dp_rank, cp_rank, cp_group, dp_group = init_dp_cp(rank, world_size, cp, port)
    try:
        cols = _columns(cp, cp_rank)
        whole_rows = make_rows(dp_rank)
        old, rollout, mask, ids = (x[:, cols] for x in whole_rows)
        results = {"dp": _compute(old, rollout, mask, ids, parallel=Parallel(dp_group=dp_group, cp_group=cp_group))}
        # the loss on split rows: random inputs drawn for the whole rows, this rank's columns taken
        results["loss"] = {k: (v[0], v[1][:, cols], v[2]) for k, v in _losses(*whole_rows).items()}
        split = _losses(old, rollout, mask, ids, cols, parallel=Parallel(cp_group=cp_group))
        results["loss_split"] = split
        gathers = []
        real = dist.all_gather_into_tensor

        def counted(*a, **k):
            gathers.append(k.get("group"))
            return real(*a, **k)
        dist.all_gather_into_tensor = counted
        if hasattr(dist, "all_gather_single"):
            dist.all_gather_single = counted
        compute_rollout_correction(
            old, rollout, mask, config=RolloutCorrectionConfig(**CONFIGS["rs"]),
            parallel=Parallel(cp_group=cp_group), segments=Segments(ids, count=MAXSEG))
        results["gathers"] = len(gathers)
        try:
            compute_rollout_correction(
                old, rollout, mask, config=RolloutCorrectionConfig(**CONFIGS["is"]),
                parallel=Parallel(cp_group=cp_group), segments=Segments(ids))
            results["error"] = None
        except ValueError as e:
            results["error"] = str(e)
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_segments_are_data_and_context_parallel_exact(tmp_path):
    cp, dp = 2, 2
    world = cp * dp
    mp.start_processes(_worker, args=(world, cp, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="fork")
    rows = [make_rows(d) for d in range(dp)]
    whole = _compute(*[torch.cat([r[i] for r in rows]) for i in range(4)])
    one = _compute(*rows[0])
    assert sum(not math.isclose(whole["is"][2][k], one["is"][2][k], rel_tol=1e-3) for k in whole["is"][2]) >= 5
    for rank in range(world):
        dp_rank, cp_rank = divmod(rank, cp)
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["gathers"] == 1  # one all-gather over the sequence group
        assert "max_segments" in got["error"]
        cols = _columns(cp, cp_rank)
        sl = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
        for name in CONFIGS:
            w, keep, metrics = got["dp"][name]
            ew, ekeep, emetrics = whole[name]
            if ew is not None:
                torch.testing.assert_close(w, ew[sl][:, cols], rtol=2e-6, atol=1e-7)
            assert torch.equal(keep, ekeep[sl][:, cols]), (rank, name)
            assert set(metrics) == set(emetrics)
            for k, v in metrics.items():
                assert v == pytest.approx(emetrics[k], rel=2e-6, abs=1e-7), (rank, name, k)
    assert 0 < whole["rs"][1].sum() < torch.cat([r[2] for r in rows]).sum()  # the options are active
    # compute_policy_loss with the rows split: the ranks' loss shares add up to the unsplit loss,
    # each rank's gradient is the unsplit one on its columns, the metrics are the unsplit ones
    for d in range(dp):
        ranks = [torch.load(tmp_path / f"rank{d * cp + c}.pt") for c in range(cp)]
        for key, (loss, _, metrics) in ranks[0]["loss"].items():
            unsplit = _losses_whole(rows[d])[key]
            assert sum(r["loss_split"][key][0] for r in ranks) == pytest.approx(unsplit[0], rel=1e-5, abs=1e-7), key
            for c, r in enumerate(ranks):
                torch.testing.assert_close(r["loss_split"][key][1], unsplit[1][:, _columns(cp, c)],
                                           rtol=1e-5, atol=1e-7)
                got = r["loss_split"][key][2]
                assert set(got) == set(unsplit[2]), key
                for k, v in got.items():
                    assert v == pytest.approx(unsplit[2][k], rel=1e-5, abs=1e-7), (key, k)


def _losses_whole(rows):
    return _losses(*rows)


def test_compiled_pass_equals_eager():
    """compile=True traces the segment scatter and gather too (one shape: ~15 s of compilation on CPU);
    bad ids are refused before the compiled pass runs."""
    cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                                  rollout_rs="segment_mean_k3,segment_sum_k1", rollout_rs_threshold=(0.03, "0.6_1.6"))
    gen = torch.Generator().manual_seed(11)
    B, T = 4, 9
    rollout = -torch.rand(B, T, generator=gen) * 2
    old = (rollout + 0.3 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.rand(B, T, generator=gen) > 0.2
    old[0, 0], mask[0, 0] = float("nan"), True  # a dropped row
    ids = torch.randint(0, 3, (B, T), generator=gen)
    fast = compute_rollout_correction(
        old, rollout, mask, config=cfg, compile=True, segments=Segments(ids, count=3))
    eager = compute_rollout_correction(old, rollout, mask, config=cfg, segments=Segments(ids, count=3))
    assert torch.equal(fast.response_mask, eager.response_mask)
    torch.testing.assert_close(fast.weights, eager.weights, rtol=1e-6, atol=1e-7)
    assert fast.metrics_as_floats() == pytest.approx(eager.metrics_as_floats(), rel=1e-5, abs=1e-6)
    bad = ids.clone()
    bad[1, 2], mask[1, 2] = 3, True
    with pytest.raises(ValueError, match=r"segment id 3 at valid position \(row 1, column 2\)"):
        compute_rollout_correction(
            old, rollout, mask, config=cfg, compile=True, segments=Segments(bad, count=3))
