"""``on_nonfinite="raise"`` over several ranks: when one rank holds a NaN / ±inf at a valid position,
every rank of the data-parallel and context-parallel groups raises, the rank holding it names the
position, and none is left waiting in a collective. With no such value nothing is raised and the
results equal one process holding the whole batch."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_correction import (RolloutCorrectionConfig, compute_offpolicy_metrics, compute_policy_loss,
                                compute_rollout_correction)
from test_distributed import _free_port, init_gloo
from rollout_correction import Parallel

B, T = 6, 10
CONFIG = RolloutCorrectionConfig.from_dict({"rollout_is": "sequence", "rollout_is_threshold": 2.0,
                                            "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.05,
                                            "on_nonfinite": "raise"})


def _batch(rank: int, bad: tuple | None):
    gen = torch.Generator().manual_seed(100 + rank)
    old = -torch.rand(B, T, generator=gen) * 3
    rollout = (old + 0.1 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.ones(B, T)
    mask[:, 7:] = 0
    log_prob = (old + 0.05 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    adv = torch.randn(B, 1, generator=gen).expand(B, T).contiguous()
    if bad is not None and bad[0] == rank:
        name, value = bad[1], bad[2]
        {"old": old, "rollout": rollout, "log_prob": log_prob, "adv": adv}[name][2, 4] = value
    rollout[:, 8] = math.nan  # padding is never read
    return old, rollout, mask, log_prob, adv


def _calls(old, rollout, mask, log_prob, adv, pg, sg):
    yield "correction", lambda: compute_rollout_correction(
        old, rollout, mask, config=CONFIG, parallel=Parallel(dp_group=pg, cp_group=sg)).metrics_as_floats()
    yield "offpolicy", lambda: {k: float(v) for k, v in compute_offpolicy_metrics(
        old, rollout, mask, on_nonfinite="raise", parallel=Parallel(dp_group=pg, cp_group=sg)).items()}
    yield "loss", lambda: float(compute_policy_loss(
        log_prob, old, adv, mask, config=CONFIG, rollout_log_prob=rollout,
        parallel=Parallel(dp_group=pg, cp_group=sg))[0])


def _worker(rank, world, port, out, bad, topology):
    init_gloo(rank, world, port)
    try:
        if topology == "dp":
            pg, sg = dist.group.WORLD, None
        else:  # 2 x 2: sequence groups {0, 1}, {2, 3}; data-parallel groups {0, 2}, {1, 3}
            cps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            sg, pg = cps[rank // 2], dps[rank % 2]
        old, rollout, mask, log_prob, adv = _batch(rank, bad)
        if sg is not None:  # this rank's half of every sequence (columns 0-4 or 5-9)
            half = slice(0, 5) if rank % 2 == 0 else slice(5, T)
            cut = torch.zeros(B, T)
            cut[:, half] = 1
            mask = mask * cut
        results = {}
        for name, call in _calls(old, rollout, mask, log_prob, adv, pg, sg):
            try:
                results[name] = ["ok", call()]
            except ValueError as exc:
                results[name] = ["ValueError", str(exc)]
        dist.barrier()  # every rank gets here: nobody is stuck in a collective
        (out / f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, world, bad, topology):
    mp.start_processes(_worker, args=(world, _free_port(), tmp_path, bad, topology), nprocs=world, join=True,
                       start_method="fork")
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("where", ["old", "rollout", "log_prob", "adv"])
def test_one_rank_with_a_nonfinite_value_makes_every_rank_raise(tmp_path, where):
    results = _spawn(tmp_path, 3, (1, where, math.nan), "dp")
    for rank, res in enumerate(results):
        names = ("loss",) if where in ("log_prob", "adv") else ("correction", "offpolicy", "loss")
        for name in names:
            kind, message = res[name]
            assert kind == "ValueError", (rank, name, res[name])
            if rank == 1:
                assert "row 2, column 4" in message and "this rank" in message
            else:
                assert "another rank" in message
        for name in set(res) - set(names):  # the calls that do not read the bad input run normally
            assert res[name][0] == "ok", (rank, name, res[name])


def test_data_by_context_parallel_groups_all_raise(tmp_path):
    """The bad value is on rank 0; rank 3 shares neither its sequence group nor its data group."""
    results = _spawn(tmp_path, 4, (0, "old", math.inf), "dpxcp")
    for rank, res in enumerate(results):
        for name in ("correction", "offpolicy", "loss"):
            assert res[name][0] == "ValueError", (rank, name, res[name])


def test_without_nonfinite_values_raise_mode_equals_one_process(tmp_path):
    results = _spawn(tmp_path, 3, None, "dp")
    batches = [_batch(r, None) for r in range(3)]
    whole = [torch.cat([b[i] for b in batches]) for i in range(5)]
    expected = dict((name, call()) for name, call in _calls(*whole, None, None))
    for res in results:
        for name in ("correction", "offpolicy"):
            assert res[name][0] == "ok"
            for k, v in expected[name].items():
                assert res[name][1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (name, k)
