"""The verl plugin's failure modes, each in a fresh process that imports the plugin the way verl's
``verl.plugins`` loader does (``import verl`` loads every entry point of the group):

* verl not installed: importing the module is silent and leaves nothing to register;
* verl installed but a module on the registration path fails to import: the failure is logged at
  error level with its cause, and a config selecting ``loss_mode=rollout_correction`` (or the
  ``grpo_accepted`` estimator) raises a clear error from ``require_registration`` — which this
  library's entry point (``main_ppo.task_runner_class``) calls before verl starts its workers —
  instead of verl's "Unsupported loss mode" later, in the workers. (With the module of this test
  broken, importing the entry point itself fails inside verl's own ``main_ppo``.)

A failed import is produced for real: ``sys.modules[name] = None`` is what Python itself uses to
make ``import name`` raise ``ImportError`` (and what it reports for an absent package)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from verl_reference import require_verl

require_verl()

_PROLOGUE = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
""")


def _run(body: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", _PROLOGUE + textwrap.dedent(body)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_verl_absent_is_silent():
    out = _run("""
        for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
            del sys.modules[name]
        sys.modules["verl"] = None          # not installed, as Python reports it
        import rollout_correction.integrations.verl as rc
        assert rc.REGISTRATION_ERROR is None
        from omegaconf import OmegaConf
        rc.require_registration(OmegaConf.create(
            {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "rollout_correction"}}}}))
        print("OK")
    """)
    assert out.stdout.strip().endswith("OK")
    assert "rollout_correction" not in out.stderr, out.stderr  # not a line logged


def test_broken_verl_import_is_logged_and_raised_where_the_loss_is_selected():
    out = _run("""
        sys.modules["verl.trainer.ppo.core_algos"] = None   # verl installed, one of its modules fails to import
        import verl                                          # verl's plugin loader imports our entry point
        import rollout_correction.integrations.verl as rc
        assert isinstance(rc.REGISTRATION_ERROR, ImportError), rc.REGISTRATION_ERROR
        from omegaconf import OmegaConf
        rc.require_registration(OmegaConf.create({"algorithm": {"adv_estimator": "grpo"}}))  # not selected: fine
        selected = OmegaConf.create({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "rollout_correction"}}},
                                     "algorithm": {"adv_estimator": "grpo"}})
        try:
            rc.require_registration(selected)
        except RuntimeError as exc:
            print("RAISED:", exc)
            print("CAUSE:", type(exc.__cause__).__name__)
    """)
    logged = [line for line in out.stderr.splitlines() if line.startswith("ERROR rollout_correction.integrations.verl")]
    assert len(logged) == 1, out.stderr[-3000:]
    assert "registering loss_mode='rollout_correction'" in logged[0] and "verl.trainer.ppo.core_algos" in logged[0]
    assert "Traceback" in out.stderr  # the cause, with its traceback
    raised = next(line for line in out.stdout.splitlines() if line.startswith("RAISED:"))
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction" in raised
    assert "verl.trainer.ppo.core_algos" in raised
    assert "CAUSE: ModuleNotFoundError" in out.stdout
