"""Ratio-band shares (MaxText #5231): ``ratio_band_tight_fraction`` (ρ ∈ [0.999, 1.002]),
``ratio_band_1pct_fraction`` (|ρ − 1| ≤ 0.01) and ``ratio_band_5pct_fraction`` (|ρ − 1| ≤ 0.05), ρ =
π_train/π_rollout, as shares of the valid tokens; the metric family ``ratio_bands`` (not in the default set).

The bands are tested on the float32 log-ratio log ρ = old − rollout against the logarithms of the
bounds (rounded to float32 by the comparison), so a token's membership depends on its log-ratio only,
with no rounding of exp in between: the edge cases below put log ρ exactly on float32(log bound) and
one float32 step outside it.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo import _free_port, init_gloo
from rollout_correction_core import Parallel, RolloutCorrectionConfig, compute_rollout_correction, metrics_to_floats

P = "rollout_corr/"
BANDS = {"tight": (0.999, 1.002), "1pct": (0.99, 1.01), "5pct": (0.95, 1.05)}
NAMES = [f"{P}ratio_band_{b}_fraction" for b in BANDS]
CONFIG = RolloutCorrectionConfig(metrics=["default", "ratio_bands"])


def _pair(log_ratio: float) -> tuple[float, float]:
    """(old, rollout) log-probs ≤ 0 whose float32 difference is exactly ``log_ratio`` (a float32 value)."""
    return (0.0, -log_ratio) if log_ratio > 0 else (log_ratio, 0.0)


def _edge_cases():
    """For every band edge: log ρ = float32(log bound) (inside) and one float32 step outward (outside)."""
    cases = []  # (log ρ, {band: inside?})
    for name, (lo, hi) in BANDS.items():
        for bound, outward in ((lo, -math.inf), (hi, math.inf)):
            at = torch.tensor(math.log(bound), dtype=torch.float32)
            past = torch.nextafter(at, torch.tensor(outward))
            for x, inside in ((at, True), (past, False)):
                x = float(x)
                cases.append((x, {b: (math.log(l2) <= x <= math.log(h2)) if b != name else inside
                                  for b, (l2, h2) in BANDS.items()}))
    return cases


def test_tokens_at_the_band_edges():
    cases = _edge_cases()
    old, rollout = zip(*(_pair(x) for x, _ in cases))
    old, rollout = torch.tensor([old]), torch.tensor([rollout])
    assert torch.equal(old - rollout, torch.tensor([[x for x, _ in cases]]))  # exactly the log-ratios intended
    # padding holding values inside every band must not count
    old, rollout = torch.cat([old, torch.zeros(1, 3)], 1), torch.cat([rollout, torch.zeros(1, 3)], 1)
    mask = torch.ones_like(old, dtype=torch.bool)
    mask[0, -3:] = False
    got = compute_rollout_correction(old, rollout, mask, config=CONFIG).metrics_as_floats()
    for band, name in zip(BANDS, NAMES):
        inside = sum(flags[band] for _, flags in cases)
        assert got[name] == inside / len(cases), band
    # each band's own edges: 2 inside of its 4 cases; the tight band's edges lie inside the wider ones
    assert [sum(f[b] for _, f in cases[i * 4:(i + 1) * 4]) for i, b in enumerate(BANDS)] == [2, 2, 2]


def test_by_hand_over_rows_with_padding():
    ratios = [[1.0, 1.0015, 0.9995, 1.005], [0.98, 1.04, 1.2, 0.5]]
    old = torch.tensor(ratios).log() - 1.0
    rollout = torch.full_like(old, -1.0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    got = compute_rollout_correction(old, rollout, mask, config=CONFIG).metrics_as_floats()
    # 7 valid tokens: tight 1.0, 1.0015, 0.9995; ±1 % adds 1.005; ±5 % adds 0.98 and 1.04
    assert [got[n] for n in NAMES] == pytest.approx([3 / 7, 4 / 7, 6 / 7], abs=1e-15)


def test_default_calls_compute_no_band():
    old, rollout = torch.zeros(2, 3), torch.full((2, 3), -0.001)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = compute_rollout_correction(old, rollout, mask)
    assert not any("ratio_band" in k for k in out.metrics)
    assert not any(name.startswith("band.") for name in out.metrics._sources[0][0].packed_vector()[0])
    assert all(k in compute_rollout_correction(old, rollout, mask, config=CONFIG).metrics for k in NAMES)


def test_empty_batch_gives_zero_shares():
    old = torch.zeros(2, 3)
    got = compute_rollout_correction(old, old, torch.zeros(2, 3, dtype=torch.bool), config=CONFIG).metrics_as_floats()
    assert [got[n] for n in NAMES] == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------- two ranks

ROWS, LENGTH = 6, 10


def _batch():
    gen = torch.Generator().manual_seed(5)
    rollout = -torch.rand(ROWS, LENGTH, generator=gen) * 3
    old = (rollout + 0.03 * torch.randn(ROWS, LENGTH, generator=gen)).clamp(max=0.0)  # spread across the three bands
    lengths = torch.tensor([10, 3, 7, 1, 9, 5])
    return old, rollout, torch.arange(LENGTH) < lengths[:, None]


def _worker(rank, world, port, result_dir):
    init_gloo(rank, world, port)
    try:
        old, rollout, mask = _batch()
        rows = slice(0, 5) if rank == 0 else slice(5, 6)  # uneven data-parallel split
        dp = compute_rollout_correction(old[rows], rollout[rows], mask[rows], config=CONFIG,
                                        parallel=Parallel(dp_group=dist.group.WORLD)).metrics_as_floats()
        empty = slice(0, 6) if rank == 0 else slice(6, 6)  # one rank without rows
        none = compute_rollout_correction(old[empty], rollout[empty], mask[empty], config=CONFIG,
                                          parallel=Parallel(dp_group=dist.group.WORLD)).metrics_as_floats()
        cols = slice(0, 4) if rank == 0 else slice(4, LENGTH)  # every row split across the sequence group
        cp = compute_rollout_correction(old[:, cols], rollout[:, cols], mask[:, cols], config=CONFIG,
                                        parallel=Parallel(cp_group=dist.group.WORLD)).metrics_as_floats()
        torch.save({"dp": dp, "empty": none, "cp": cp}, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_shares_are_exact_across_two_ranks(tmp_path):
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    whole = compute_rollout_correction(*_batch(), config=CONFIG).metrics_as_floats()
    shares = [whole[n] for n in NAMES]
    assert 0 < shares[0] < shares[1] < shares[2] < 1  # the data lands in every band and outside
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for layout in ("dp", "empty", "cp"):
            assert [got[layout][n] for n in NAMES] == shares, (rank, layout)  # counts over a count: exact


def test_diagnose_shows_the_bands(tmp_path):
    from rollout_correction.diagnose import diagnose_tensors, summary_dict, write_report

    old, rollout, mask = _batch()
    diag = diagnose_tensors(old, rollout, mask, presets=[])
    summary = summary_dict(diag)
    whole = compute_rollout_correction(old, rollout, mask, config=CONFIG).metrics_as_floats()
    for name in NAMES:
        assert summary[name] == pytest.approx(whole[name], abs=1e-12)
    write_report(diag, str(tmp_path))
    report = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "ratio_band_tight_fraction" in report and "[0.999, 1.002]" in report
