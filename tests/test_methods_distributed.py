"""M2PO and OPSM under a data-parallel split (gloo on 127.0.0.1): the same mask and metrics as one
process holding the whole batch.

M2PO's cutoff depends on every token of the batch; each rank holds a slice of rows (uneven
slices, one rank with a single row), finds the cutoff through the process group, and must keep
exactly the tokens the whole-batch computation keeps.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_correction import RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction
from test_distributed import _free_port, init_gloo
from rollout_correction import Aggregation, Parallel, PolicyLoss

ROWS, LENGTH = 11, 9
LAYOUTS = [[(0, 4), (4, 11)], [(0, 10), (10, 11)]]
M2PO = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_m2po_threshold=0.005)
OPSM = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_opsm_delta=0.01)


def make_batch():
    gen = torch.Generator().manual_seed(77)
    old = -torch.rand(ROWS, LENGTH, generator=gen) * 2 - 0.05
    rollout = (old + 0.25 * torch.randn(ROWS, LENGTH, generator=gen) * torch.rand(ROWS, 1, generator=gen)).clamp(max=0.0)
    lp = (old + 0.05 * torch.randn(ROWS, LENGTH, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = (torch.arange(LENGTH)[None] < torch.randint(1, LENGTH + 1, (ROWS,), generator=gen)[:, None]).float()
    adv = torch.randn(ROWS, 1, generator=gen).expand(ROWS, LENGTH).contiguous()
    return old, rollout, lp, mask, adv


def compute(old, rollout, lp, mask, adv, group, n_tok):
    out = compute_rollout_correction(old, rollout, mask, config=M2PO, parallel=Parallel(dp_group=group))
    _, metrics = compute_policy_loss(
        lp, old, adv, mask, config=OPSM, rollout_log_prob=rollout, parallel=Parallel(dp_group=group),
        loss=PolicyLoss(aggregation=Aggregation(global_num_tokens=n_tok)))
    opsm = {k: float(v) for k, v in metrics.items() if "opsm" in k}
    return out.response_mask.clone(), out.metrics_as_floats(), opsm


def _worker(rank, world, port, result_dir):
    init_gloo(rank, world, port)
    try:
        batch = make_batch()
        n_tok = int(batch[3].sum())
        res = []
        for layout in LAYOUTS:
            lo, hi = layout[rank]
            res.append(compute(*(t[lo:hi] for t in batch), group=dist.group.WORLD, n_tok=n_tok))
        torch.save(res, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_m2po_and_opsm_split_across_ranks_equal_the_whole_batch(tmp_path):
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    batch = make_batch()
    whole_mask, whole_metrics, whole_opsm = compute(*batch, group=None, n_tok=int(batch[3].sum()))
    assert 0.05 < whole_metrics["rollout_corr/m2po_masked_fraction"] < 0.95
    assert 0 < whole_opsm["rollout_corr/opsm_seq_masked_fraction"] < 1
    # Without the group a slice decides differently: the check can fail.
    part_mask, _, _ = compute(*(t[:4] for t in batch), group=None, n_tok=None)
    assert not torch.equal(part_mask, whole_mask[:4])
    for i, layout in enumerate(LAYOUTS):
        for rank, (lo, hi) in enumerate(layout):
            mask, metrics, opsm = per_rank[rank][i]
            assert torch.equal(mask, whole_mask[lo:hi]), f"layout {layout} rank {rank}"
            for name in ("m2po_masked_fraction", "m2po_m2_before", "m2po_m2_after"):
                key = "rollout_corr/" + name
                assert math.isclose(metrics[key], whole_metrics[key], rel_tol=1e-9, abs_tol=1e-12), key
            for key, value in whole_opsm.items():
                assert math.isclose(opsm[key], value, rel_tol=1e-9, abs_tol=1e-12), key
