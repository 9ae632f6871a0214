"""verl's own unit tests of its rollout-correction helper, run against ``rollout_correction.compat.verl``.

verl 0.9.1's wheel ships ``tests/trainer/ppo/test_rollout_corr.py`` (19 tests) and
``tests/trainer/ppo/test_rollout_corr_integration.py`` (11), which import its functions with
``from verl.trainer.ppo.rollout_corr_helper import ...``. ``tools/peer_suites.py`` collects both
files, unmodified and in place, with pytest in a child process whose first plugin puts this library's
drop-in in ``sys.modules`` under verl's module name before the files are imported: every one of
verl's tests then calls the drop-in. Nothing is redirected in this process or in any other.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

from verl_reference import require_verl

require_verl()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from peer_suites import SUITES, run_suite  # noqa: E402

COUNTS = {"tests/trainer/ppo/test_rollout_corr.py": 19, "tests/trainer/ppo/test_rollout_corr_integration.py": 11}


def _wheel_root() -> Path:
    """The directory the installed verl wheel's ``tests/`` lies in."""
    files = {str(f).replace(os.sep, "/"): f for f in importlib.metadata.files("verl") or []}
    found = [files[t] for t in SUITES["verl"].tests if t in files]
    assert len(found) == len(SUITES["verl"].tests), f"verl's wheel ships no {SUITES['verl'].tests}"
    path = Path(found[0].locate())
    return path.parents[len(Path(SUITES["verl"].tests[0]).parts) - 1]


def test_verls_own_rollout_corr_tests_pass_on_the_drop_in():
    assert sorted(COUNTS) == sorted(SUITES["verl"].tests)
    report = run_suite("verl", _wheel_root(), commit="verl 0.9.1 wheel")
    assert report["ok"], report["output_tail"]
    assert report["counts"] == {"passed": sum(COUNTS.values())}, report["counts"]
    assert report["modules"] == {"verl.trainer.ppo.rollout_corr_helper": "rollout_correction.compat.verl"}
    for test_file in COUNTS:  # each test module calls the drop-in's functions
        names = report["uses"].get(test_file[:-len(".py")].replace("/", "."), [])
        assert "compute_rollout_correction_and_rejection_mask" in names, (test_file, report["uses"])


def test_a_boolean_threshold_raises_verls_type():
    import rollout_correction.compat.verl as ours
    from rollout_correction import ConfigError

    import torch

    x = torch.zeros(1, 2)
    for call in (lambda: ours.compute_rollout_correction_and_rejection_mask(x, x, torch.ones(1, 2), rollout_is="token",
                                                                           rollout_is_threshold=True),
                 lambda: ours.compute_rollout_correction_weights(x, torch.ones(1, 2), "token", False)):
        with pytest.raises(TypeError, match="not a boolean") as info:
            call()
        assert isinstance(info.value, ConfigError)
