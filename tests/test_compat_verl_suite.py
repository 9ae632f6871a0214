"""verl's own unit tests of its rollout-correction helper, run against ``rollout_correction.compat.verl``.

verl 0.9.1's wheel ships ``tests/trainer/ppo/test_rollout_corr.py``, which imports its functions with
``from verl.trainer.ppo.rollout_corr_helper import ...``. Here that file, unmodified, is collected by
pytest in a child process whose ``conftest.py`` puts this library's drop-in in ``sys.modules`` under
verl's module name before the file is imported: every one of verl's tests then calls the drop-in.
Nothing is redirected in this process or in any other.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verl_reference import require_verl

require_verl()

SUITE = "tests/trainer/ppo/test_rollout_corr.py"
HELPER = "verl.trainer.ppo.rollout_corr_helper"
CONFTEST = textwrap.dedent(f"""
    import sys

    import verl  # verl's package (and its plugins) as in any verl process
    import rollout_correction.compat.verl as drop_in

    sys.modules["{HELPER}"] = drop_in  # in this test process only
""")


def _suite() -> Path:
    files = importlib.metadata.files("verl") or []
    found = [f for f in files if str(f).replace(os.sep, "/") == SUITE]
    assert found, f"verl's wheel ships no {SUITE}"
    return Path(found[0].locate())


def test_verls_own_rollout_corr_tests_pass_on_the_drop_in(tmp_path):
    shutil.copy(_suite(), tmp_path / "test_rollout_corr.py")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repository's settings
    check = "import sys; import conftest; m = sys.modules['" + HELPER + "']; print(m.__name__)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    seen = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert seen.stdout.strip() == "rollout_correction.compat.verl", seen.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                           "test_rollout_corr.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) == 19 and "failed" not in summary and "skipped" not in summary, summary


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
