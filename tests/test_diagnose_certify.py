"""``rollout-correction diagnose --certify``: the zero-diff certificate, through the CLI.

An exact dump (the trainer's log-probs copied into the rollout column) passes with exit code 0;
the same dump with one bit of one valid rollout log-prob flipped fails with exit code 1 and names
that row and position; a difference at a padded position does not count; float64 dumps are compared
at full precision (a change below float32 resolution is found); every reader format works.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rollout_correction.cli import main
from rollout_correction.diagnose.certify import certify_file
from rollout_correction.diagnose.readers import Columns

ROWS, T = 7, 9
LENGTHS = np.array([9, 3, 5, 1, 9, 6, 2])


def _dump(dtype=np.float32):
    rng = np.random.default_rng(0)
    old = np.log(rng.uniform(0.01, 1.0, (ROWS, T))).astype(dtype)
    mask = (np.arange(T) < LENGTHS[:, None]).astype(np.int64)
    return old, old.copy(), mask


def _flip_lowest_bit(x: np.ndarray, row: int, pos: int) -> None:
    view = x.view(np.int32 if x.dtype == np.float32 else np.int64)
    view[row, pos] ^= 1


def _save_npz(path, old, roll, mask):
    np.savez(path, old_log_probs=old, rollout_log_probs=roll, response_mask=mask)
    return path


def test_exact_dump_passes_and_one_changed_bit_fails_naming_row_and_position(tmp_path):
    old, roll, mask = _dump()
    out = tmp_path / "exact"
    assert main(["diagnose", "--certify", str(_save_npz(tmp_path / "exact.npz", old, roll, mask)),
                 "--out", str(out), "--quiet"]) == 0
    cert = json.loads((out / "certificate.json").read_text())
    assert cert["passed"] and cert["tokens"] == LENGTHS.sum() and cert["differing"] == 0 and cert["first"] is None
    assert not (out / "certificate_positions.png").exists()

    _flip_lowest_bit(roll, 4, 6)  # row 4 has 9 valid positions
    out = tmp_path / "one_bit"
    assert main(["diagnose", "--certify", str(_save_npz(tmp_path / "one_bit.npz", old, roll, mask)),
                 "--out", str(out), "--quiet"]) == 1
    cert = json.loads((out / "certificate.json").read_text())
    assert not cert["passed"] and cert["differing"] == 1
    assert cert["first"] == {"row": 4, "position": 6}
    (largest,) = cert["largest"]
    assert (largest["row"], largest["position"]) == (4, 6)
    assert largest["trainer"] == float(old[4, 6]) and largest["rollout"] == float(roll[4, 6])
    assert largest["abs_diff"] == abs(float(old[4, 6]) - float(roll[4, 6])) > 0
    assert [p[1] for p in cert["per_position"]] == [0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert [p[0] for p in cert["per_position"]] == [int((LENGTHS > t).sum()) for t in range(T)]
    assert (out / "certificate_positions.png").stat().st_size > 0


def test_first_divergence_is_the_first_in_file_order_and_largest_are_sorted(tmp_path):
    old, roll, mask = _dump()
    roll[5, 1] += 0.5    # row 5 position 1: |Δ| 0.5
    roll[2, 4] -= 2.0    # row 2 position 4: |Δ| 2, the first in file order
    roll[6, 0] = -np.inf  # non-finite: counts as infinitely large
    roll[1, 7] = 123.0   # padding of row 1 (3 valid positions): never counts
    cert = certify_file(str(_save_npz(tmp_path / "d.npz", old, roll, mask)), chunk_rows=3)  # 3 blocks
    assert cert.differing == 3 and cert.first == (2, 4)
    assert [(d["row"], d["position"]) for d in cert.largest] == [(6, 0), (2, 4), (5, 1)]
    assert cert.largest[0]["abs_diff"] == float("inf")
    assert cert.largest[1]["abs_diff"] == pytest.approx(2.0, rel=1e-6)


def test_sign_of_zero_and_float64_precision_count(tmp_path):
    old, roll, mask = _dump(np.float64)
    old[0, 0], roll[0, 0] = 0.0, -0.0  # equal as numbers, not as bits
    _flip_lowest_bit(roll, 3, 0)        # 2⁻⁵² relative: invisible in float32
    assert float(np.float32(old[3, 0])) == float(np.float32(roll[3, 0]))
    cert = certify_file(str(_save_npz(tmp_path / "d.npz", old, roll, mask)))
    assert cert.differing == 2 and cert.first == (0, 0)
    assert {(d["row"], d["position"]) for d in cert.largest} == {(0, 0), (3, 0)}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "pt"])
def test_every_reader_format(tmp_path, fmt):
    old, roll, mask = _dump()
    _flip_lowest_bit(roll, 2, 3)
    rows_old = [old[i, :n].tolist() for i, n in enumerate(LENGTHS)]
    rows_roll = [roll[i, :n].tolist() for i, n in enumerate(LENGTHS)]
    path = tmp_path / f"d.{fmt}"
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"old_log_probs": rows_old, "rollout_log_probs": rows_roll}), path)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"old_log_probs": o, "rollout_log_probs": r}) + "\n"
                                for o, r in zip(rows_old, rows_roll)))
    else:
        torch.save({"old_log_probs": torch.from_numpy(old), "rollout_log_probs": torch.from_numpy(roll),
                    "response_mask": torch.from_numpy(mask)}, path)
    cert = certify_file(str(path), Columns())
    assert cert.tokens == LENGTHS.sum() and cert.differing == 1 and cert.first == (2, 3)


def test_unreadable_input_is_exit_code_2(tmp_path):
    assert main(["diagnose", "--certify", str(tmp_path / "missing.npz"), "--out", str(tmp_path), "--quiet"]) == 2
