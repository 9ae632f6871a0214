"""Engine sentinels in diagnose: log-probs at or below the floor, per side, with their positions."""

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_correction.diagnose import diagnose_file, diagnose_tensors, print_summary, summary_dict, write_report
from rollout_correction.diagnose.sentinels import DEFAULT_LOG_PROB_FLOOR, log_prob_floor


def _batch(seed=0, rows=6, width=5):
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 3.0, (rows, width)).astype(np.float32)
    roll = (old + rng.normal(0, 0.05, (rows, width))).astype(np.float32)
    mask = np.ones((rows, width), dtype=bool)
    mask[5, 3:] = False
    return old, roll, mask


def _with_sentinels():
    old, roll, mask = _batch()
    roll[2, 3] = -9999.0      # vLLM's sentinel, rollout side
    roll[4, 0] = -1000.0      # at the floor: counted
    roll[4, 1] = -999.5       # above it: a (very unlikely) log-prob
    old[0, 1] = -5000.0       # trainer side
    roll[5, 4] = -9999.0      # masked out: not counted
    roll[1, 2] = -np.inf      # non-finite: reported as such, not as a sentinel
    return old, roll, mask


def test_sentinels_by_side_with_positions():
    diag = diagnose_tensors(*_with_sentinels(), presets=[])
    s = diag.profile.sentinels
    assert s["floor"] == DEFAULT_LOG_PROB_FLOOR == -1000.0 and s["tokens"] == 3
    assert s["rollout"]["tokens"] == 2 and s["rollout"]["rows"] == 2 and s["rollout"]["lowest"] == -9999.0
    assert s["rollout"]["positions"] == [[2, 3], [4, 0]]
    assert s["trainer"] == {"source": "trainer", "tokens": 1, "rows": 1, "lowest": -5000.0, "positions": [[0, 1]]}
    check = next(c for c in diag.health if c.name.startswith("engine sentinels"))
    assert check.verdict == "fail" and check.value == 3
    assert "2 from the rollout engine in 2 row(s), lowest -9999, first at (row, column) (2, 3), (4, 0)" in check.detail
    assert "1 from the trainer in 1 row(s)" in check.detail and "(0, 1)" in check.detail
    assert diag.worst_verdict == "fail"


def test_rows_of_later_chunks_count_from_the_start_of_the_dump():
    old, roll, mask = _batch(rows=6)
    roll[5, 2] = -9999.0
    diag = diagnose_tensors(old, roll, mask, presets=[], chunk_rows=4)  # the row is the second chunk's second
    assert diag.profile.sentinels["rollout"]["positions"] == [[5, 2]]


def test_clean_input_passes_the_check():
    diag = diagnose_tensors(*_batch(), presets=[])
    check = next(c for c in diag.health if c.name.startswith("engine sentinels"))
    assert check.verdict == "ok" and diag.profile.sentinels["tokens"] == 0


def test_report_json_html_and_terminal_name_the_positions(tmp_path):
    diag = diagnose_tensors(*_with_sentinels(), presets=["decoupled_token_is"])
    summary = summary_dict(diag)
    assert summary["sentinels"]["rollout"]["positions"] == [[2, 3], [4, 0]]
    written = write_report(diag, str(tmp_path))
    on_disk = json.loads(open(written["summary.json"], encoding="utf-8").read())
    assert on_disk["sentinels"]["trainer"]["positions"] == [[0, 1]]
    for name in ("report.md", "report.html"):
        text = open(written[name], encoding="utf-8").read()
        assert "Engine sentinels" in text and "(2, 3) (4, 0)" in text and "(0, 1)" in text, name
    out = io.StringIO()
    print_summary(diag, file=out)
    assert "Engine sentinels" in out.getvalue() and "(2, 3)" in out.getvalue()


def test_the_floor_comes_from_the_config():
    data = _with_sentinels()
    lower = diagnose_tensors(*data, presets=[], config=SimpleNamespace(log_prob_floor=-6000.0))
    assert lower.profile.sentinels["tokens"] == 1 and lower.profile.sentinels["rollout"]["positions"] == [[2, 3]]
    off = diagnose_tensors(*data, presets=[], config=SimpleNamespace(log_prob_floor=None))
    assert off.profile.sentinels["tokens"] == 0
    assert not any(c.name.startswith("engine sentinels") for c in off.health)
    # a preset name is read as the correction reads it; its floor is the default
    assert log_prob_floor("decoupled_token_is") == DEFAULT_LOG_PROB_FLOOR and log_prob_floor() == -1000.0
    for bad in (0.0, 5, float("nan"), "low", True):
        with pytest.raises(ValueError, match="log_prob_floor must be a finite number < 0 or None"):
            diagnose_tensors(*data, presets=[], config=SimpleNamespace(log_prob_floor=bad))


def test_per_file_counts_in_a_folder(tmp_path):
    old, roll, mask = _batch()
    np.savez(tmp_path / "step_1.npz", rollout_log_probs=roll, old_log_probs=old, response_mask=mask)
    roll2 = roll.copy()
    roll2[3, 4] = -9999.0
    np.savez(tmp_path / "step_2.npz", rollout_log_probs=roll2, old_log_probs=old, response_mask=mask)
    diag = diagnose_file(str(tmp_path), presets=[])
    assert [f["sentinel_tokens"] for f in diag.source["files"]] == [0, 1]
    assert diag.profile.sentinels["rollout"]["positions"] == [[6 + 3, 4]]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunk_rows=st.integers(1, 7))
def test_counts_and_positions_equal_a_direct_scan_whatever_the_chunks(seed, chunk_rows):
    rng = np.random.default_rng(seed)
    old, roll, mask = _batch(seed, rows=9, width=6)
    mask &= rng.random(mask.shape) < 0.8
    for col in (old, roll):
        col[rng.random(col.shape) < 0.08] = rng.choice([-9999.0, -1000.0, -2e4])
    diag = diagnose_tensors(old, roll, mask, presets=[], chunk_rows=chunk_rows)
    if not diag.profile.counters.tokens:
        return
    for key, col in (("rollout", roll), ("trainer", old)):
        hit = mask & (col <= -1000.0)
        side = diag.profile.sentinels[key]
        assert side["tokens"] == int(hit.sum()) and side["rows"] == int(hit.any(1).sum())
        assert side["positions"] == [[int(r), int(c)] for r, c in zip(*np.nonzero(hit))][:20]
