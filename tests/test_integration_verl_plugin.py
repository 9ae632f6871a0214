"""Installing the package changes nothing in verl: its ``verl.plugins`` entry point registers two names.

verl imports every ``verl.plugins`` entry point on ``import verl``, in every process it starts. A
fresh Python process that only imports verl (as verl's TaskRunner and workers do) is checked here:
verl's correction step is still the function defined in verl's ``rollout_corr_helper`` source, in
that module and where the V1 trainer bound it (``trainer_base``), while this library's loss and
estimator are in verl's registries. Also: what happens to the entry point's ``backend`` key when it
is given to verl's own entry point (Hydra refuses it; forced in with ``+``, the loss and the
estimator refuse it), the legacy trainer under the entry point, and ``rollout-correction verl-check``.
The entry point itself runs verl's V1 trainer in tests/test_integration_verl_v1.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_reference import require_verl

require_verl()

import rollout_correction.integrations.verl as rc_verl  # noqa: E402
from rollout_correction.integrations.verl import main_ppo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "compute_rollout_correction_and_add_to_batch"
SETTINGS = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.01"]
SIZES = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]

_IMPORT_VERL_ONLY = textwrap.dedent(f"""
    import inspect, json, sys
    import verl  # loads the verl.plugins entry points, as every verl process does
    import verl.trainer.ppo.rollout_corr_helper as helper
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from verl.trainer.ppo import core_algos

    def where(fn):
        return {{"module": fn.__module__, "qualname": fn.__qualname__, "file": inspect.getsourcefile(fn)}}

    print(json.dumps({{
        "helper_file": helper.__file__,
        "helper": where(helper.{NAME}),
        "trainer_base": where(trainer_base.{NAME}),
        "same_object": trainer_base.{NAME} is helper.{NAME},
        "rollout_correction_modules": sorted(m for m in sys.modules if m.startswith("rollout_correction")),
        "loss": where(core_algos.get_policy_loss_fn("{rc_verl.LOSS_NAME}")),
        "estimator": where(core_algos.get_adv_estimator_fn("{rc_verl.ADV_ESTIMATOR_NAME}")),
        "vanilla": where(core_algos.get_policy_loss_fn("vanilla")),
    }}))
""")


def _fresh_process(script: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")}
    environ.update(env, PYTHONPATH=os.pathsep.join([HERE, *sys.path]))
    return subprocess.run([sys.executable, "-c", script], cwd=HERE, env=environ, capture_output=True, text=True,
                          timeout=600)


def test_import_verl_leaves_verls_correction_step_and_registers_two_names():
    done = _fresh_process(_IMPORT_VERL_ONLY)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # the entry point was loaded by verl (nothing else imported this library) ...
    assert seen["rollout_correction_modules"][0] == "rollout_correction"
    assert rc_verl.__name__ in seen["rollout_correction_modules"]
    assert not any(m.endswith((".main_ppo", ".trainer")) for m in seen["rollout_correction_modules"])
    # ... verl's step is the function defined in verl's own source, in both places verl's trainers use
    for place in ("helper", "trainer_base"):
        assert seen[place] == {"module": "verl.trainer.ppo.rollout_corr_helper", "qualname": NAME,
                               "file": seen["helper_file"]}, place
    assert seen["same_object"] is True
    # ... and the two names resolve to this library; verl's own names to verl's functions
    assert seen["loss"]["module"] == seen["estimator"]["module"] == rc_verl.__name__
    assert (seen["loss"]["qualname"], seen["estimator"]["qualname"]) == ("policy_loss", "grpo_accepted_advantage")
    assert seen["vanilla"]["module"] == "verl.trainer.ppo.core_algos"


def test_this_process_too_has_verls_own_step():
    import verl.trainer.ppo.rollout_corr_helper as helper
    import verl.trainer.ppo.v1.trainer_base as trainer_base

    for module in (helper, trainer_base):
        assert getattr(module, NAME).__module__ == helper.__name__
        assert getattr(module, NAME).__code__.co_filename == helper.__file__


def _compose_verl(overrides):
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_the_backend_key_is_not_a_key_of_verls_own_entry_point():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="backend"):
        _compose_verl(SETTINGS + ["algorithm.rollout_correction.backend=rollout_correction"])
    # the entry point's config has it (without '+'), and a '+' there fails too: the key exists
    assert main_ppo.compose(SETTINGS).algorithm.rollout_correction.backend == rc_verl.BACKEND_NAME
    with pytest.raises(ConfigCompositionException):
        main_ppo.compose(SETTINGS + ["+algorithm.rollout_correction.backend=rollout_correction"])


def test_forced_into_verls_own_entry_point_the_key_is_refused_by_the_loss_and_the_estimator():
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    config = _compose_verl(SETTINGS + SIZES + [
        "+algorithm.rollout_correction.backend=rollout_correction", "algorithm.adv_estimator=grpo_accepted",
        "actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction",
        "+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}"])
    OmegaConf.resolve(config)
    scores = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction.backend='rollout_correction'.*main_ppo"):
        rc_verl.grpo_accepted_advantage(scores, torch.ones(4, 3), index=[0, 0, 1, 1], config=config.algorithm)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # what verl's worker holds
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"policy_loss.rollout_correction.backend.*main_ppo"):
        rc_verl.policy_loss(x, x, x, torch.ones(2, 3), config=actor)


def test_the_entry_point_removes_the_key_and_refuses_a_misspelt_value():
    config = main_ppo.compose(SETTINGS)
    assert main_ppo.task_runner_class(config) is main_ppo.RolloutCorrectionTaskRunner
    assert rc_verl.BACKEND_KEY not in config.algorithm.rollout_correction  # verl never sees it
    config = main_ppo.compose(SETTINGS + ["algorithm.rollout_correction.backend=verl"])
    from verl.trainer.main_ppo import TaskRunnerV1

    assert main_ppo.task_runner_class(config) is TaskRunnerV1
    with pytest.raises(ValueError, match="rollout_corection"):
        main_ppo.task_runner_class(main_ppo.compose(SETTINGS + ["algorithm.rollout_correction.backend=rollout_corection"]))


def test_the_legacy_trainer_is_refused_for_this_librarys_step_and_says_what_to_do():
    with pytest.raises(ValueError, match=r"trainer.use_v1=false.*fit\(\).*V1 trainer.*backend=verl"):
        main_ppo.task_runner_class(main_ppo.compose(SETTINGS + ["trainer.use_v1=false"]))
    from verl.trainer.main_ppo_v0 import TaskRunner

    for extra in (["algorithm.rollout_correction.backend=verl"], ["algorithm.rollout_correction.bypass_mode=true"]):
        assert main_ppo.task_runner_class(main_ppo.compose(SETTINGS + ["trainer.use_v1=false", *extra])) is TaskRunner


@pytest.mark.parametrize("plugins, code, says", [("auto", 0, "verl's correction step is verl's own"),
                                                  ("none", 1, "NOT active")])
def test_verl_check_reports_what_is_true(plugins, code, says):
    script = "import sys\nfrom rollout_correction.cli import main\nsys.exit(main(['verl-check']))\n"
    done = _fresh_process(script, VERL_USE_EXTERNAL_PLUGINS=plugins)
    assert done.returncode == code, done.stderr[-2000:]
    assert says in done.stdout + done.stderr
    if code == 0:
        assert "loss_mode=rollout_correction" in done.stdout and "main_ppo" in done.stdout
