"""verl-omni's own diffusion rollout-correction tests, run against ``rollout_correction.compat.verl``.

verl-omni (github verl-project/verl-omni, not on PyPI) tests its diffusion port in
``tests/trainer/diffusion/test_rollout_correction_on_cpu.py``; its modules call verl's
``verl.trainer.ppo.rollout_corr_helper``. Here that file, unmodified and in its own checkout, is
collected by pytest in a child process with a plugin that puts this library's drop-in in
``sys.modules`` under verl's module name. verl-omni's package ``__init__`` files import every
pipeline (vllm, vllm-omni), so the plugin registers the packages on the path of the modules under
test without running those files; the modules themselves load unchanged from the checkout.

Needs a checkout: ``ROLLOUT_CORRECTION_VERL_OMNI_SRC=/path/to/verl-omni``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

SRC = os.environ.get("ROLLOUT_CORRECTION_VERL_OMNI_SRC")
SUITE = "tests/trainer/diffusion/test_rollout_correction_on_cpu.py"
PLUGIN = textwrap.dedent('''
    import os, sys, types

    ROOT = os.environ["ROLLOUT_CORRECTION_VERL_OMNI_SRC"]
    for pkg in ("verl_omni", "verl_omni.trainer", "verl_omni.trainer.diffusion", "verl_omni.trainer.omni",
                "verl_omni.workers", "verl_omni.workers.utils"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [os.path.join(ROOT, *pkg.split("."))]
        sys.modules[pkg] = mod
    import verl
    import rollout_correction.compat.verl as drop_in

    sys.modules["verl.trainer.ppo.rollout_corr_helper"] = drop_in  # in this test process only


    def pytest_sessionfinish(session):
        from verl_omni.trainer.diffusion import rollout_correction
        used = rollout_correction.compute_rollout_correction_and_rejection_mask.__module__
        print("\\nhelper used:", used)
''')


@pytest.mark.nightly
@pytest.mark.skipif(SRC is None, reason="set ROLLOUT_CORRECTION_VERL_OMNI_SRC to a verl-omni checkout")
def test_verl_omnis_own_rollout_correction_tests_pass_on_the_drop_in(tmp_path):
    (tmp_path / "rc_drop_in_plugin.py").write_text(PLUGIN)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},  # verl-omni's options, not ours
           "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC, *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "rc_drop_in_plugin",
         "--noconftest", "-c", str(tmp_path / "pytest.ini"), "--rootdir", SRC, SUITE],
        cwd=SRC, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "helper used: rollout_correction.compat.verl" in done.stdout
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 20, done.stdout[-2000:]
