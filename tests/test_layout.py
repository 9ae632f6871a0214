"""One statistics layout whatever a rank holds.

``SufficientStats`` packs its named sums and maxima into one vector that is reduced slot by slot
over a process group, so every rank must pack the same names in the same slots. These tests check
that the layout is fixed by what is recorded (never by tensor shapes: a rank with no rows, one row
or one segment per row packs the same slots), that a rank with nothing in a slot contributes the
reduction's identity, that the segment level split across gloo ranks (an empty rank, a rank whose
rows are all one segment, a rank with a non-finite row) equals one process on the whole batch, and
that ranks given different configurations fail with an error naming the first differing slot.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from rollout_correction_core._src.declared import Family, Stat
from rollout_correction_core._src.stats import LayoutMismatchError, SufficientStats
from test_distributed import _free_port, init_gloo
from rollout_correction import Parallel, Segments

# ----------------------------------------------------------------------------------------- units

T = Family("t.", "scalar rows seg_w seg_units row_sum", "row_max seg_max", "seg_min")
U = Family("u.", "s t", "m", "m_min")


def _record(stats: SufficientStats, B: int, S: int, gen: torch.Generator, scalar: float = 2.5) -> dict:
    """A family of statistics of three shapes — per row (B,), per segment (B·S,) and 0-d — in an
    interleaved recording order; returns the expected value of each slot, computed directly."""
    row = torch.randn(B, generator=gen, dtype=torch.float64)
    row_ok = torch.rand(B, generator=gen) > 0.3
    seg = torch.randn(B * S, generator=gen, dtype=torch.float64)
    seg_ok = torch.rand(B * S, generator=gen) > 0.3
    n = torch.randint(0, 5, (B * S,), generator=gen).double()
    stats.add(T.rows, row_ok)
    stats.add(T.seg_w, seg, rows=seg_ok, weight=n)
    stats.add(T.row_max, row, rows=row_ok)
    stats.add(T.row_sum, row, rows=row_ok)
    stats.add(T.seg_min, seg, rows=seg_ok)
    stats.add(T.scalar, torch.tensor(scalar, dtype=torch.float64))
    stats.add(T.seg_max, seg)
    stats.add(T.seg_units, seg_ok)

    def mx(x):
        return float(x.max()) if x.numel() else -math.inf

    return {"sums": {"t.rows": float(row_ok.sum()), "t.seg_w": float((seg * n)[seg_ok].sum()),
                     "t.row_sum": float(row[row_ok].sum()), "t.scalar": scalar, "t.seg_units": float(seg_ok.sum())},
            "maxes": {"t.row_max": mx(row[row_ok]), "-t.seg_min": mx(-seg[seg_ok]), "t.seg_max": mx(seg)}}


@pytest.mark.parametrize("B, S", [(0, 3), (1, 1), (4, 1), (3, 3), (2, 5)])
def test_layout_does_not_depend_on_shapes(B, S):
    """(0, S): every part is empty; (·, 1): per-row and per-segment parts share a shape."""
    reference = SufficientStats()
    _record(reference, 5, 3, torch.Generator().manual_seed(0))
    stats = SufficientStats()
    expected = _record(stats, B, S, torch.Generator().manual_seed(1))
    names_s, names_m, vec = stats.packed_vector()
    ref_s, ref_m, _ = reference.packed_vector()
    assert (names_s, names_m) == (ref_s, ref_m)
    # the slots: sums, then maxima and minima, in the declared order (not the recording order)
    assert names_s == ["t.scalar", "t.rows", "t.seg_w", "t.seg_units", "t.row_sum"]
    assert names_m == ["t.row_max", "t.seg_max", "-t.seg_min"]
    for name, value in expected["sums"].items():
        assert float(stats.sums[name]) == pytest.approx(value, rel=1e-12, abs=1e-12), name
    for name, value in expected["maxes"].items():
        assert float(stats.maxes[name]) == value, name
    assert vec.shape == (len(names_s) + len(names_m),)


def test_the_slots_follow_the_declaration_whatever_the_recording_order():
    forward, backward = SufficientStats(), SufficientStats()
    for stats, order in ((forward, [U.t, U.m_min, U.s, U.m]), (backward, [U.m, U.s, U.m_min, U.t])):
        for stat in order:
            stats.add(stat, torch.tensor([1.0, -2.0]), rows=torch.tensor([True, False]))
    assert forward.packed_vector()[:2] == backward.packed_vector()[:2] == (["u.s", "u.t"], ["u.m", "-u.m_min"])
    assert torch.equal(forward.packed_vector()[2], torch.tensor([1.0, 1.0, 1.0, -1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="'nowhere' is not declared"):
        forward.add(Stat("nowhere", "sum"), torch.ones(2))


def test_an_empty_part_contributes_the_identities():
    empty = SufficientStats()
    _record(empty, 0, 3, torch.Generator().manual_seed(2), scalar=0.0)
    assert all(float(v) == 0.0 for v in empty.sums.values())
    assert all(float(v) == -math.inf for v in empty.maxes.values())


def test_merging_an_empty_rank_changes_nothing():
    full, empty = SufficientStats(), SufficientStats()
    _record(full, 4, 3, torch.Generator().manual_seed(3))
    _record(empty, 0, 3, torch.Generator().manual_seed(4), scalar=0.0)
    names_s, names_m, vec = full.packed_vector()
    for merged in (SufficientStats().merge(empty).merge(full), SufficientStats().merge(full).merge(empty)):
        assert merged.packed_vector()[:2] == (names_s, names_m)
        assert torch.equal(merged.packed_vector()[2], vec)


def test_merge_equals_one_recording_of_the_concatenation():
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, generator=gen, dtype=torch.float64), torch.randn(0, dtype=torch.float64)
    a, b, both = SufficientStats(), SufficientStats(), SufficientStats()
    for stats, value in ((a, x), (b, y), (both, torch.cat([x, y]))):
        stats.add(U.s, value)
        stats.add(U.m, value)
        stats.add(U.m_min, value)
        stats.add(U.t, value.exp(), rows=value > 0)
    a.merge(b)
    assert a.packed_vector()[:2] == both.packed_vector()[:2]
    torch.testing.assert_close(a.packed_vector()[2], both.packed_vector()[2], rtol=1e-15, atol=0)


def test_a_name_recorded_in_two_shapes_is_combined():
    stats = SufficientStats()
    stats.add(U.s, torch.ones(3))
    stats.add(U.m, torch.tensor([1.0, 4.0]))
    stats.add(U.s, torch.ones(2))
    stats.add(U.m, torch.tensor([2.0, 3.0, 0.0]))
    assert stats.packed_vector()[:2] == (["u.s"], ["u.m"])
    assert float(stats.sum(U.s)) == 5.0 and float(stats.max(U.m)) == 4.0


# ------------------------------------------------------------------- split across gloo ranks

B_ALL, T_ALL, MAXSEG = 20, 60, 3
ONE_SEGMENT_ROWS = range(7, 14)  # rows whose tokens are all one segment
NAN_ROW = 16

CONFIGS = {
    "segment_is": dict(rollout_is="segment", rollout_is_threshold=2.0),
    "segment_is_bn": dict(rollout_is="segment", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
    "segment_icepop_mm": dict(rollout_is="segment", rollout_is_threshold="0.6_1.8", mismatch_metrics=True),
    "segment_rs": dict(rollout_rs="segment_sum_k1,segment_mean_k3,segment_max_k2",
                       rollout_rs_threshold=("0.5_2.0", 0.05, 0.3)),
    "segment_max_tv": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="segment_max_tv",
                           rollout_rs_threshold=0.3, rollout_token_veto_threshold=0.02),
    "mixed": dict(rollout_is="segment", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                  rollout_rs="token_k1,seq_mean_k3,segment_mean_binary_kl",
                  rollout_rs_threshold=("0.3_3.0", 0.08, 0.05), rollout_token_veto_threshold_high=8.0),
}

# (rows of each rank, the rank that passes no segment_ids: its rows are all one segment)
LAYOUTS = {
    "empty rank": ([(0, 0), (0, 9), (9, 20)], None),
    "one-segment rank": ([(0, 7), (7, 14), (14, 20)], 1),
    "one-row rank, empty rank": ([(7, 8), (8, 8), (0, 7)], None),
}


def make_batch():
    gen = torch.Generator().manual_seed(30)
    old = -torch.rand(B_ALL, T_ALL, generator=gen) * 3 - 0.05
    rollout = (old + 0.5 * torch.randn(B_ALL, T_ALL, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lengths = torch.randint(4, T_ALL + 1, (B_ALL,), generator=gen)
    lengths[5] = 0  # a row without a valid token
    mask = (torch.arange(T_ALL)[None] < lengths[:, None]).float()
    ids = (torch.arange(T_ALL)[None] * MAXSEG // lengths.clamp_min(1)[:, None]).clamp(max=MAXSEG - 1)
    ids[list(ONE_SEGMENT_ROWS)] = 0
    old[NAN_ROW, 2] = float("nan")  # dropped (on_nonfinite="reject")
    return old, rollout, mask, ids


def _layout_rows(layout):
    """The rows the ranks hold, in rank order (a layout may leave rows out)."""
    return torch.cat([torch.arange(lo, hi) for lo, hi in layout])


def _run(name, rows, ids_given=True, group=None):
    old, rollout, mask, ids = (x[rows] for x in make_batch())
    res = compute_rollout_correction(
        old, rollout, mask, config=RolloutCorrectionConfig(**CONFIGS[name]),
        parallel=Parallel(dp_group=group),
        segments=Segments(ids, count=MAXSEG) if ids_given else None)
    return {"weights": res.weights, "mask": res.response_mask, "floats": res.metrics_as_floats(),
            "tensors": {k: float(v) for k, v in dict(res.metrics).items()}}


def _worker(rank, world, port, out_dir):
    init_gloo(rank, world, port)
    try:
        results = {}
        # a rank given another configuration (first thing: no rank has agreed on a layout yet); the
        # mask mode records one more slot
        mine = dict(CONFIGS["segment_is"], rollout_is_mode="mask") if rank == 2 else CONFIGS["segment_is"]
        old, rollout, mask, ids = make_batch()
        try:
            compute_rollout_correction(
                old, rollout, mask, config=RolloutCorrectionConfig(**mine),
                parallel=Parallel(dp_group=dist.group.WORLD), segments=Segments(ids, count=MAXSEG))
            results["error"] = None
        except LayoutMismatchError as e:
            results["error"] = str(e)
        counts = []
        real = dist.all_reduce

        def counted(*a, **k):
            counts[-1] += 1
            return real(*a, **k)

        dist.all_reduce = counted
        for lname, (layout, one_segment_rank) in LAYOUTS.items():
            lo, hi = layout[rank]
            for cname in CONFIGS:
                counts.append(0)
                results[lname, cname] = _run(cname, torch.arange(lo, hi), rank != one_segment_rank, dist.group.WORLD)
                results[lname, cname]["all_reduces"] = counts[-1]
        dist.all_reduce = real
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)


@pytest.fixture(scope="module")
def split_results(tmp_path_factory):
    """Every rank's results, from one spawn of three gloo ranks."""
    world, out = 3, tmp_path_factory.mktemp("layout")
    mp.start_processes(_worker, args=(world, _free_port(), str(out)), nprocs=world, join=True, start_method="fork")
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def test_segment_level_split_with_empty_and_one_segment_ranks_equals_one_process(split_results):
    per_rank = split_results
    for lname, (layout, _) in LAYOUTS.items():
        rows = _layout_rows(layout)
        for cname in CONFIGS:
            whole = _run(cname, rows)
            offset = 0
            for rank, (lo, hi) in enumerate(layout):
                got = per_rank[rank][lname, cname]
                part = slice(offset, offset + hi - lo)
                offset += hi - lo
                where = f"{lname}, {cname}, rank {rank}"
                assert torch.equal(got["mask"], whole["mask"][part]), where
                if whole["weights"] is None:
                    assert got["weights"] is None
                else:
                    torch.testing.assert_close(got["weights"], whole["weights"][part], rtol=1e-6, atol=1e-7,
                                               msg=lambda m: f"{where}: {m}")
                for kind in ("floats", "tensors"):
                    assert got[kind].keys() == whole[kind].keys(), where
                    bad = {k: (whole[kind][k], v) for k, v in got[kind].items() if not _close(v, whole[kind][k])}
                    assert not bad, f"{where} ({kind}): whole vs split {bad}"
                # one SUM and one MAX per call, the agreement riding in the MAX (agreement.py); the group's
                # first exchange adds its explicit agreement; a configuration that every rank changes to
                # (each call here follows another configuration) exchanges the agreed layout first, then,
                # if its own layout differs, its own: 2 or 4
                first = (lname, cname) == (next(iter(LAYOUTS)), next(iter(CONFIGS)))
                assert got["all_reduces"] == 3 if first else got["all_reduces"] in (2, 4), where
    # the comparison is sensitive: the split ranks' own statistics differ from the whole batch's
    whole, alone = _run("segment_is", torch.arange(20)), _run("segment_is", torch.arange(9, 20))
    assert sum(not _close(v, alone["floats"][k]) for k, v in whole["floats"].items()) >= 10
    assert 0 < whole["floats"]["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    segment_rs = _run("segment_rs", torch.arange(20))
    assert 0 < segment_rs["mask"].sum() < make_batch()[2].sum() - make_batch()[2][NAN_ROW].sum()


def test_ranks_with_different_configurations_raise_naming_the_setting(split_results):
    for rank, results in enumerate(split_results):
        error = results["error"]
        assert error is not None, f"rank {rank} did not raise"
        assert "\"rollout_is_mode='mask'\" on rank 2" in error, error
        assert "on ranks 0, 1" in error and "same configuration" in error, error


def test_joined_blocks_equal_one_block_and_unlike_blocks_are_merged_by_name():
    rows = torch.tensor([True, False, True, True, True])
    whole, a, b = SufficientStats(), SufficientStats(), SufficientStats()
    x = torch.tensor([1.0, 2.0, -3.0, 4.0, 0.5])
    for stats, part, r in ((whole, x, rows), (a, x[:2], rows[:2]), (b, x[2:], rows[2:])):
        stats.add(U.s, part, rows=r)
        stats.add(U.m_min, part, rows=r)
    joined = SufficientStats.joined([a, b])
    assert joined.packed_vector()[:2] == whole.packed_vector()[:2]
    assert torch.equal(joined.packed_vector()[2], whole.packed_vector()[2])  # 2.5 and −(−3): min −3
    c = SufficientStats()  # a block that recorded another statistic: merged by name, not mis-paired
    c.add(U.t, torch.tensor([7.0]))
    mixed = SufficientStats.joined([a, c])
    assert mixed.sum(U.s) == 1.0 and mixed.sum(U.t) == 7.0 and mixed.min(U.m_min) == 1.0
