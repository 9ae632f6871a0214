"""verl's correction step routed to this library by config lines alone (the plugin's dispatcher).

The config is composed by Hydra from verl 0.9.1's own ``ppo_trainer.yaml`` with the documented
override lines; the function is looked up where verl's legacy trainer looks it up at each step
(``from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch``).
A fresh Python process that only imports verl (as verl's TaskRunner does) gets the dispatcher from
the ``verl.plugins`` entry point, with no import of this library. verl's default V1 trainer (its
import-time binding, its correction step through TransferQueue, and verl's TaskRunnerV1 Ray actor)
is run for real in tests/test_integration_verl_v1.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_reference import load_verl_rollout_corr_helper, require_verl

require_verl()

import rollout_correction.compat.verl as compat  # noqa: E402
import rollout_correction.integrations.verl as rc_verl  # noqa: E402
from test_verl_parity import make_batch  # noqa: E402

HELPER = load_verl_rollout_corr_helper()
ON = "+algorithm.rollout_correction.backend=rollout_correction"
SETTINGS = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.01"]


def _compose(overrides):
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _legacy_call_site(batch, rollout_corr_config):
    # what RayPPOTrainer.fit does at each step (the import runs at call time)
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    return compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config)


def _proto(old, rollout, mask):
    from verl.protocol import DataProto

    return DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                        "response_mask": mask.clone()})


def test_config_line_routes_the_legacy_call_site_to_this_library():
    config = _compose(SETTINGS + [ON])
    block = config.algorithm.rollout_correction
    assert block.backend == "rollout_correction" and block.rollout_rs == "seq_mean_k3"
    old, rollout, mask = make_batch(8, 10, 0.3, 5)
    out, metrics = _legacy_call_site(_proto(old, rollout, mask), block)
    assert metrics[rc_verl.BACKEND_METRIC] == 1.0
    settings = {k: v for k, v in dict(block).items() if k != "backend"}
    expected, expected_metrics = compat.compute_rollout_correction_and_add_to_batch(_proto(old, rollout, mask), settings)
    assert torch.equal(out.batch["response_mask"], expected.batch["response_mask"])
    torch.testing.assert_close(out.batch["rollout_is_weights"], expected.batch["rollout_is_weights"])
    assert {k: v for k, v in metrics.items() if k != rc_verl.BACKEND_METRIC} == expected_metrics


def test_without_the_line_verls_own_function_runs_unchanged():
    config = _compose(SETTINGS)
    assert "backend" not in config.algorithm.rollout_correction
    old, rollout, mask = make_batch(8, 10, 0.3, 6)
    original = HELPER.compute_rollout_correction_and_add_to_batch.verl_original
    out, metrics = _legacy_call_site(_proto(old, rollout, mask), config.algorithm.rollout_correction)
    ref, ref_metrics = original(_proto(old, rollout, mask), config.algorithm.rollout_correction)
    assert rc_verl.BACKEND_METRIC not in metrics
    assert torch.equal(out.batch["response_mask"], ref.batch["response_mask"])
    assert torch.equal(out.batch["rollout_is_weights"], ref.batch["rollout_is_weights"])
    assert metrics.keys() == ref_metrics.keys()


def test_a_misspelt_backend_fails_naming_it():
    config = _compose(SETTINGS + ["+algorithm.rollout_correction.backend=rollout_corection"])
    old, rollout, mask = make_batch(4, 6, 0.3, 7)
    with pytest.raises(ValueError, match="rollout_corection"):
        _legacy_call_site(_proto(old, rollout, mask), config.algorithm.rollout_correction)


def test_the_line_is_rejected_without_the_plus():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose(SETTINGS + [ON[1:]])


def test_a_fresh_process_that_only_imports_verl_gets_the_dispatcher():
    script = textwrap.dedent(f"""
        import sys
        from verl_reference import ray_or_stand_in
        ray_or_stand_in()
        import verl  # loads the verl.plugins entry points, as in every verl process
        assert "rollout_correction.integrations.verl" in sys.modules
        helper = sys.modules["verl.trainer.ppo.rollout_corr_helper"]
        assert hasattr(helper.compute_rollout_correction_and_add_to_batch, "verl_original")
        from test_integration_verl_plugin import _compose, _legacy_call_site, _proto, SETTINGS, ON
        from test_verl_parity import make_batch
        block = _compose(SETTINGS + [ON]).algorithm.rollout_correction
        for step in range(3):  # three training steps
            old, rollout, mask = make_batch(6, 8, 0.3, 3 + step)
            _, metrics = _legacy_call_site(_proto(old, rollout, mask), block)
            print(metrics["{rc_verl.BACKEND_METRIC}"])
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    done = subprocess.run([sys.executable, "-c", script], cwd=here, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-3:] == ["1.0"] * 3  # the backend metric at every step
    assert done.stderr.count("runs this library") == 1  # the log line once, not once per step


def test_the_documented_loss_and_estimator_lines_resolve_to_this_library():
    from verl.trainer.ppo import core_algos

    config = _compose(SETTINGS + [ON, "actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction",
                                  "algorithm.adv_estimator=grpo_accepted"])
    assert core_algos.get_policy_loss_fn(config.actor_rollout_ref.actor.policy_loss.loss_mode) is rc_verl.policy_loss
    assert core_algos.get_adv_estimator_fn(config.algorithm.adv_estimator) is rc_verl.grpo_accepted_advantage


@pytest.mark.parametrize("plugins, code, says", [("auto", 0, "active in verl"), ("none", 1, "NOT active")])
def test_verl_check_reports_whether_the_plugin_loaded(plugins, code, says):
    script = ("import sys\nfrom verl_reference import ray_or_stand_in\nray_or_stand_in()\n"
              "from rollout_correction.cli import main\nsys.exit(main(['verl-check']))\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path]), "VERL_USE_EXTERNAL_PLUGINS": plugins}
    done = subprocess.run([sys.executable, "-c", script], cwd=here, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == code, done.stderr[-2000:]
    assert says in done.stdout + done.stderr
