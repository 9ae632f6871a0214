"""``rollout-correction diagnose --certify DUMP --atol X``: pass when every valid token's
|Δ log p| ≤ X, otherwise fail as the bitwise certificate does (exit 1, naming the spot).

The dumps are float64 log-probs with gaps set by hand: 5e-7 at (row 2, position 1) and 3e-7 at
(row 5, position 4); the failing one adds 2e-6 at (row 4, position 6). Padded positions carry a
gap of 1.0 that must never count.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollout_correction.cli import main
from rollout_correction.diagnose.certify import certify_file

LENGTHS = np.array([9, 3, 5, 1, 9, 6, 2])
ROWS, T = 7, 9


def _dump(tmp_path, name, gaps):
    rng = np.random.default_rng(1)
    old = np.log(rng.uniform(0.05, 1.0, (ROWS, T)))
    mask = (np.arange(T) < LENGTHS[:, None]).astype(np.int64)
    roll = np.where(mask > 0, old, old + 1.0)  # padding differs, and must never count
    for (r, c), g in gaps.items():
        roll[r, c] = old[r, c] + g
    path = tmp_path / f"{name}.npz"
    np.savez(path, old_log_probs=old, rollout_log_probs=roll, response_mask=mask)
    return str(path)


def _certify(tmp_path, path, *extra):
    out = tmp_path / ("out_" + "_".join(x.strip("-") for x in extra) + path.rsplit("/", 1)[-1])
    code = main(["diagnose", "--certify", path, "--out", str(out), "--quiet", *extra])
    return code, json.loads((out / "certificate.json").read_text())


def test_atol_passes_a_dump_within_it_and_fails_one_beyond_naming_the_spot(tmp_path):
    small = _dump(tmp_path, "small", {(2, 1): 5e-7, (5, 4): 3e-7})
    code, cert = _certify(tmp_path, small, "--atol", "1e-6")
    assert code == 0 and cert["passed"] and cert["differing"] == 0 and cert["atol"] == 1e-6
    assert cert["max_abs_diff"] == pytest.approx(5e-7, rel=1e-6)

    code, cert = _certify(tmp_path, small)  # bit for bit: the same dump fails
    assert code == 1 and cert["differing"] == 2 and cert["first"] == {"row": 2, "position": 1}
    assert cert["atol"] is None

    big = _dump(tmp_path, "big", {(2, 1): 5e-7, (5, 4): 3e-7, (4, 6): 2e-6})
    code, cert = _certify(tmp_path, big, "--atol", "1e-6")
    assert code == 1 and not cert["passed"] and cert["differing"] == 1
    assert cert["first"] == {"row": 4, "position": 6}
    (largest,) = cert["largest"]
    assert (largest["row"], largest["position"]) == (4, 6)
    assert largest["abs_diff"] == pytest.approx(2e-6, rel=1e-6)
    assert cert["max_abs_diff"] == pytest.approx(2e-6, rel=1e-6)


def test_atol_zero_is_exact_equality_of_values_and_non_finite_needs_equal_bits(tmp_path):
    path = _dump(tmp_path, "zero", {(0, 0): 0.0})
    assert certify_file(path, atol=0.0).passed
    # −inf on both sides agrees bit for bit; −inf against a finite value is an infinite gap
    old = np.full((1, 2), -np.inf)
    roll = np.array([[-np.inf, -3.0]])
    p = tmp_path / "inf.npz"
    np.savez(p, old_log_probs=old, rollout_log_probs=roll, response_mask=np.array([[1, 0]]))
    assert certify_file(str(p), atol=1.0).passed
    np.savez(p, old_log_probs=old, rollout_log_probs=roll, response_mask=np.array([[1, 1]]))
    cert = certify_file(str(p), atol=1e3)
    assert not cert.passed and cert.first == (0, 1)


def test_bad_atol_is_refused(tmp_path, capsys):
    path = _dump(tmp_path, "any", {})
    assert main(["diagnose", "--certify", path, "--atol", "-1", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "atol" in capsys.readouterr().err
    assert main(["diagnose", path, "--atol", "1e-6", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "--certify" in capsys.readouterr().err
