"""Distributed-exact statistics: a batch split across gloo ranks gives the whole-batch result.

Each test spawns one CPU process group (gloo on 127.0.0.1) and, inside it, runs every
scenario; each rank holds a slice of the same deterministic batch (uneven slices, a rank
whose rows are all padding, a rank with zero rows). Every metric, the batch-normalised
weights, the rejection masks and the policy loss computed with global denominators must
equal what a single process computes on the whole batch.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rollout_correction.compat.verl as compat
from gloo import _free_port, init_dp_cp, init_gloo  # noqa: F401 (other test files import them from here)

from rollout_correction import (
    RolloutCorrectionConfig,
    compute_offpolicy_metrics,
    compute_policy_loss,
    compute_rollout_correction,
)
from rollout_correction import Aggregation, Parallel, PolicyLoss

ROWS = 13
LENGTH = 17
EMPTY_ROWS = (5, 6)  # rows without valid tokens

CONFIGS = {
    "metrics_only": dict(rollout_is=None),
    "token_tis_bn": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
    "seq_tis_bn": dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
    "geo_clip_bn": dict(rollout_is="geometric", rollout_is_threshold=1.2, rollout_is_mode="clip",
                        rollout_is_batch_normalize=True),
    "icepop_bn": dict(rollout_is="token", rollout_is_threshold="0.6_1.8", rollout_is_batch_normalize=True),
    "rs_chain": dict(rollout_is="token", rollout_is_threshold=2.0,
                     rollout_rs="token_k1,seq_sum_k1,seq_mean_k3,seq_max_k2",
                     rollout_rs_threshold="0.3_3.0,0.4_2.5,0.05,0.3"),
    "rs_k2_k3": dict(rollout_rs="token_k2,seq_sum_k2,seq_mean_k2,token_k3,seq_sum_k3,seq_max_k3",
                     rollout_rs_threshold="0.3,1.0,0.05,0.3,1.0,0.3"),
    "veto_legacy": dict(rollout_is="sequence", rollout_is_threshold=4.0, rollout_rs="geometric",
                        rollout_rs_threshold=1.3, rollout_token_veto_threshold=0.45),
    "prob_gates": dict(rollout_is="token", rollout_is_threshold=2.0,
                       rollout_rs="token_tv,seq_mean_binary_kl,seq_max_tv", rollout_rs_threshold="0.15,0.02,0.3",
                       rollout_token_veto_threshold_high=2.5),
    "roll_dp_bands": dict(rollout_is="geometric", rollout_is_threshold=1.3,
                          rollout_rs="token_dp,seq_mean_dp,seq_sum_dp,seq_mean_k1",
                          rollout_rs_threshold="-0.25_0.2,-0.05_0.04,-0.3_0.5,0.8_1.25"),
    "kpop_logprob_error": dict(rollout_is="token", rollout_is_threshold=2.0,
                               rollout_rs="token_kpop,seq_sum_kpop,seq_mean_kpop,seq_max_kpop,seq_logprob_error",
                               rollout_rs_threshold="0.1,0.5,0.02,0.1,1.35"),
    "rs_valid_denominator": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3",
                                 rollout_rs_threshold="0.6_1.6,0.05", loss_denominator="valid"),
}

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# Row ranges (start, stop) held by each rank, per layout. Rows 5 and 6 have no valid token.
SPLITS = {
    2: [
        [(0, 5), (5, 13)],  # uneven; rank 1 starts with the two empty rows
        [(0, 12), (12, 13)],  # rank 1: a single row
    ],
    3: [
        [(0, 5), (5, 7), (7, 13)],  # rank 1: zero valid tokens
        [(0, 9), (9, 9), (9, 13)],  # rank 1: zero rows
        [(0, 0), (0, 4), (4, 13)],  # rank 0: zero rows
    ],
}


def make_batch():
    gen = torch.Generator().manual_seed(1234)
    old = -torch.rand(ROWS, LENGTH, generator=gen) * 3.0 - 0.05
    rollout = (old + 0.35 * torch.randn(ROWS, LENGTH, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=gen)
    lengths[list(EMPTY_ROWS)] = 0
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).float()
    log_prob = (old + 0.3 * torch.randn(ROWS, LENGTH, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    adv = torch.randn(ROWS, 1, generator=gen).expand(ROWS, LENGTH).contiguous()
    return old, rollout, mask, log_prob, adv


def compute_all(old, rollout, mask, log_prob, adv, group, global_tokens=None, global_seqs=None):
    """Everything the test compares, for one (possibly partial) batch."""
    out = {}
    for name, settings in CONFIGS.items():
        cfg = RolloutCorrectionConfig.from_dict(settings)
        res = compute_rollout_correction(old, rollout, mask, config=cfg, parallel=Parallel(dp_group=group))
        out[f"{name}/metrics"] = {k: float(v) for k, v in res.metrics_as_floats().items()}
        out[f"{name}/weights"] = None if res.weights is None else res.weights.clone()
        out[f"{name}/mask"] = res.response_mask.clone()
    out["offpolicy"] = {k: float(v) for k, v in compute_offpolicy_metrics(
        old, rollout, mask, parallel=Parallel(dp_group=group)).items()}
    cfg = RolloutCorrectionConfig.decoupled_token_is()
    weights = compute_rollout_correction(old, rollout, mask, config=cfg, parallel=Parallel(dp_group=group)).weights
    for mode in AGG_MODES:
        lp = log_prob.clone().requires_grad_(True)
        loss, _ = compute_policy_loss(
            lp, old, adv, mask, config=cfg, rollout_is_weights=weights,
            loss=PolicyLoss(
                aggregation=Aggregation(mode, global_num_tokens=global_tokens, global_num_seqs=global_seqs)))
        loss.backward()
        out[f"loss/{mode}"] = float(loss.detach())
        out[f"grad/{mode}"] = lp.grad.clone()
        lp = log_prob.clone().requires_grad_(True)  # rejected tokens stay in the denominators
        loss, _ = compute_policy_loss(
            lp, old, adv, mask,
            config=RolloutCorrectionConfig.from_dict(
            CONFIGS["rs_valid_denominator"]),
            rollout_log_prob=rollout, parallel=Parallel(dp_group=group),
            loss=PolicyLoss(
                aggregation=Aggregation(mode, global_num_tokens=global_tokens, global_num_seqs=global_seqs)))
        loss.backward()
        out[f"loss_valid/{mode}"] = float(loss.detach())
        out[f"grad_valid/{mode}"] = lp.grad.clone()
    return out


def compat_batch_norm(old, rollout, mask):
    """The verl drop-in with batch normalisation and its default group (WORLD when initialised)."""
    holder, new_mask, metrics = compat.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True,
        rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05)
    return holder.batch["rollout_is_weights"].clone(), new_mask.clone(), metrics


def _worker(rank, world_size, port, result_dir):
    init_gloo(rank, world_size, port)
    try:
        old, rollout, mask, log_prob, adv = make_batch()
        global_tokens = int(mask.sum())
        global_seqs = int((mask.sum(-1) > 0).sum())
        results = []
        for layout in SPLITS[world_size]:
            lo, hi = layout[rank]
            part = [t[lo:hi] for t in (old, rollout, mask, log_prob, adv)]
            res = compute_all(*part, group=dist.group.WORLD, global_tokens=global_tokens, global_seqs=global_seqs)
            res["compat"] = compat_batch_norm(*part[:3])  # verl's default group: WORLD
            results.append(res)
        # A sub-group: ranks 0 and 1 split the batch, the last rank is not a member.
        sub = dist.new_group(ranks=[0, 1])
        if rank in (0, 1):
            lo, hi = [(0, 8), (8, 13)][rank]
            part = [t[lo:hi] for t in (old, rollout, mask, log_prob, adv)]
            results.append(compute_all(*part, group=sub, global_tokens=global_tokens, global_seqs=global_seqs))
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _assert_scalars_equal(expected: dict, got: dict, context: str):
    assert set(expected) == set(got), f"{context}: metric names differ: {set(expected) ^ set(got)}"
    bad = [f"{k}: whole={expected[k]!r} split={got[k]!r}" for k in expected
           if not math.isclose(got[k], expected[k], rel_tol=1e-5, abs_tol=1e-6)]
    assert not bad, f"{context}:\n  " + "\n  ".join(bad)


def _check_layout(whole, per_rank, bounds, world_group_size, context):
    losses_sum = {}
    for rank, (lo, hi) in enumerate(bounds):
        got = per_rank[rank]
        for name in CONFIGS:
            _assert_scalars_equal(whole[f"{name}/metrics"], got[f"{name}/metrics"], f"{context} rank {rank} {name}")
            if whole[f"{name}/weights"] is None:
                assert got[f"{name}/weights"] is None
            else:
                torch.testing.assert_close(got[f"{name}/weights"], whole[f"{name}/weights"][lo:hi],
                                           rtol=1e-5, atol=1e-6, msg=lambda m: f"{context} rank {rank} {name}: {m}")
            assert torch.equal(got[f"{name}/mask"], whole[f"{name}/mask"][lo:hi]), f"{context} rank {rank} {name}"
        _assert_scalars_equal(whole["offpolicy"], got["offpolicy"], f"{context} rank {rank} offpolicy")
        for mode in AGG_MODES:
            for key in ("", "_valid"):
                losses_sum[key + mode] = losses_sum.get(key + mode, 0.0) + got[f"loss{key}/{mode}"]
                # The gradient of the summed per-rank losses equals the whole-batch gradient.
                torch.testing.assert_close(got[f"grad{key}/{mode}"], whole[f"grad{key}/{mode}"][lo:hi], rtol=1e-5,
                                           atol=1e-7, msg=lambda m: f"{context} rank {rank} grad{key} {mode}: {m}")
    for mode in AGG_MODES:
        for key in ("", "_valid"):
            assert losses_sum[key + mode] == pytest.approx(whole[f"loss{key}/{mode}"], rel=1e-5, abs=1e-7), \
                f"{context} {key} {mode}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_split_batch_equals_whole_batch(world_size, tmp_path):
    # fork: the ranks inherit the imported modules (spawning re-imports torch in every rank).
    mp.start_processes(_worker, args=(world_size, _free_port(), str(tmp_path)), nprocs=world_size, join=True,
                       start_method="fork")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]

    old, rollout, mask, log_prob, adv = make_batch()
    global_tokens = int(mask.sum())
    global_seqs = int((mask.sum(-1) > 0).sum())
    whole = compute_all(old, rollout, mask, log_prob, adv, group=None, global_tokens=global_tokens,
                        global_seqs=global_seqs)
    # The comparison is sensitive: without the group, a part's statistics differ from the whole's.
    local = compute_all(*(t[:5] for t in (old, rollout, mask, log_prob, adv)), group=None)
    for name in CONFIGS:
        differing = [k for k, v in whole[f"{name}/metrics"].items()
                     if not math.isclose(v, local[f"{name}/metrics"][k], rel_tol=1e-3, abs_tol=1e-6)]
        assert len(differing) >= 5, f"{name}: test batch too uniform ({differing})"
    whole_compat = compat_batch_norm(old, rollout, mask)
    for i, layout in enumerate(SPLITS[world_size]):
        _check_layout(whole, [per_rank[r][i] for r in range(world_size)], layout, world_size,
                      f"world {world_size} layout {layout}")
        for rank, (lo, hi) in enumerate(layout):
            weights, new_mask, metrics = per_rank[rank][i]["compat"]
            torch.testing.assert_close(weights, whole_compat[0][lo:hi], rtol=1e-5, atol=1e-6)
            assert torch.equal(new_mask, whole_compat[1][lo:hi])
            _assert_scalars_equal(whole_compat[2], metrics, f"compat world {world_size} rank {rank}")
    sub_index = len(SPLITS[world_size])
    _check_layout(whole, [per_rank[r][sub_index] for r in (0, 1)], [(0, 8), (8, 13)], 2,
                  f"world {world_size} sub-group")
