"""Every route docs/integrations.md shows for verl says that this library runs: once in the log, and
with ``rollout_corr/backend/rollout_correction`` (BACKEND_METRIC, emitted by nothing in verl) in
the logged metrics, so a silent fallback to verl's own code is visible.

Routes, each through verl 0.9.1's own machinery (Hydra-composed ``ppo_trainer.yaml``, verl's worker
config conversion, verl's ``ppo_loss`` worker call; the correction step of the V1 trainer subclass
the entry point runs; the helpers of tests/test_integration_verl_worker.py):

* "your own entry point" (``wire_trainer_config`` + ``task_runner_class`` handed to verl's
  ``run_ppo``), read from the docs and executed, in decoupled and in bypass mode (where verl runs
  no correction step: the loss says it);
* the loss lines of the "Policy loss and GRPO estimator" sub-section (decoupled block through the
  entry point, bypass block on verl's own entry point, read from the docs);
* the headline command (the entry point) is run on the V1 trainer through TransferQueue and in its
  TaskRunner actor in tests/test_integration_verl_v1.py.

Also: ``examples/integration_verl.py`` runs (subprocess) and prints what the docs say it prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from verl_reference import require_verl

require_verl()

from omegaconf import OmegaConf  # noqa: E402

import rollout_correction.integrations.verl as rc_verl  # noqa: E402
from rollout_correction.integrations.verl import main_ppo  # noqa: E402
from test_integration_verl_worker import (CORE, DOCS, SIZES, Rollout, _aggregate, _compose,  # noqa: E402
                                          _compose_verl, _correction_step, _doc_lines, _k3_seq_mean,
                                          _worker_actor_config, _worker_update)

HERE = os.path.dirname(os.path.abspath(__file__))
STEP_SAYS = "rollout-correction step runs this library"
LOSS_SAYS = "policy loss runs this library"


def _verl_section() -> str:
    text = open(DOCS, encoding="utf-8").read()
    start = text.index("## verl")
    return text[start:text.index("\n## ", start + 4)]


def _wire_blocks() -> tuple[dict, str]:
    """The YAML block and the python block of the docs' "your own entry point" route."""
    section = _verl_section()
    start = section.index("**Your own entry point**")
    code = re.search(r"```python\n(.*?)```", section[start:], flags=re.S).group(1)
    yaml = re.search(r"```yaml\n(.*?)```", section[start:], flags=re.S).group(1)
    assert "wire_trainer_config(config)" in code and "run_ppo(config, task_runner_class=" in code
    return OmegaConf.to_container(OmegaConf.create(yaml)), code


def _user_config(**block):
    """verl's Hydra-composed config (the user's own entry point) with the docs' YAML block merged in."""
    yaml, _ = _wire_blocks()
    yaml["algorithm"]["rollout_correction"].update(block)
    config = _compose_verl(SIZES)
    OmegaConf.set_struct(config, False)  # a key of the user's own YAML (e.g. backend) is not in verl's schema
    merged = OmegaConf.merge(config, yaml)
    OmegaConf.set_struct(merged, True)
    return merged


def _said(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.fixture
def fresh(monkeypatch, caplog):
    """A process where nothing has been said yet."""
    monkeypatch.setattr(rc_verl, "_said", set())
    caplog.set_level("WARNING", logger=rc_verl.__name__)
    return caplog


def _run_own_entry_point(code, config, monkeypatch):
    """The docs' python block, as written; verl's ``run_ppo`` (which starts the Ray actors that build
    models) records what it is handed."""
    import verl.trainer.main_ppo as verl_main

    handed = {}
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: handed.update(runner=task_runner_class))
    exec(code, {"config": config})
    return handed["runner"]


def _logged_actor_metrics(results) -> dict:
    """The actor metrics as verl's trainer logs them: Metric-aggregated, then prefixed "actor/"."""
    from verl.utils.py_functional import rename_dict

    return rename_dict({k: _aggregate(results, k) for k in results[0][1]}, "actor/")


def test_own_entry_point_route_decoupled_says_so_once_and_logs_the_backend_metric(fresh, monkeypatch):
    yaml, code = _wire_blocks()
    config = _user_config()
    assert _run_own_entry_point(code, config, monkeypatch) is main_ppo.RolloutCorrectionTaskRunner
    assert "backend" not in config.algorithm.rollout_correction
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == rc_verl.LOSS_NAME
    assert config.algorithm.adv_estimator == rc_verl.ADV_ESTIMATOR_NAME
    OmegaConf.resolve(config)
    actor = _worker_actor_config(config)
    block = config.algorithm.rollout_correction
    for seed in (3, 4, 5):  # three training steps: the trainer subclass's step, then the worker update
        r = Rollout(seed=seed)
        batch, metrics = _correction_step(r.proto(), config)
        assert metrics[rc_verl.BACKEND_METRIC] == 1.0
        results, data = _worker_update(batch, config, actor, r)
        logged = _logged_actor_metrics(results)
        assert logged["actor/" + rc_verl.BACKEND_METRIC] == 1.0
        # batch_num_tokens counts the corrected mask (loss_mask): accepted tokens only
        accepted = _k3_seq_mean(r.old - r.rollout, r.mask) <= float(block.rollout_rs_threshold)
        keep = r.mask.bool() & accepted[:, None]
        assert data["batch_num_tokens"] == int(keep.sum()) < int(r.mask.sum())
    assert len(_said(fresh, STEP_SAYS)) == 1 and len(_said(fresh, LOSS_SAYS)) == 1


def test_own_entry_point_route_bypass_the_loss_says_so(fresh, monkeypatch):
    """In bypass mode verl runs no correction step; the registered loss carries the signal."""
    _, code = _wire_blocks()
    config = _user_config(bypass_mode=True)
    _run_own_entry_point(code, config, monkeypatch)
    assert config.actor_rollout_ref.rollout.calculate_log_probs is True
    OmegaConf.resolve(config)
    actor = _worker_actor_config(config)
    assert actor.policy_loss.rollout_correction["bypass_mode"] is True
    for seed in (5, 6):
        r = Rollout(seed=seed)
        batch = r.proto()
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]  # verl's bypass step
        results, _ = _worker_update(batch, config, actor, r)
        logged = _logged_actor_metrics(results)
        assert logged["actor/" + rc_verl.BACKEND_METRIC] == 1.0
        assert "actor/rollout_corr/rollout_rs_masked_fraction" in logged
    said = _said(fresh, LOSS_SAYS)
    assert len(said) == 1 and "bypass" in said[0] and not _said(fresh, STEP_SAYS)


@pytest.mark.parametrize("must", ["algorithm.adv_estimator=grpo_accepted", "bypass_mode=true"])
def test_the_loss_lines_log_the_backend_metric_and_verls_own_loss_does_not(fresh, must):
    lines = _doc_lines(must)
    bypass = "bypass" in must  # the bypass block runs on verl's own entry point, the decoupled one on ours
    config = (_compose_verl if bypass else _compose)(lines + SIZES)
    actor = _worker_actor_config(config)
    for seed in (7, 8, 9):
        r = Rollout(seed=seed)
        if bypass:
            batch = r.proto()
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        else:
            batch, _ = _correction_step(r.proto(), config)
        ours, _ = _worker_update(batch, config, actor, r)
        assert _logged_actor_metrics(ours)["actor/" + rc_verl.BACKEND_METRIC] == 1.0
    assert len(_said(fresh, LOSS_SAYS)) == 1
    # verl's own loss for the same mode (bypass_mode / vanilla) emits rollout_corr/* names too, never this one
    theirs_lines = [x for x in lines if "loss_mode" not in x and "policy_loss.rollout_correction" not in x]
    theirs_config = _compose_verl(theirs_lines + SIZES + (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
                                                      "+actor_rollout_ref.actor.policy_loss.rollout_correction="
                                                      "${algorithm.rollout_correction}"] if bypass else []))
    theirs_actor = _worker_actor_config(theirs_config)
    assert CORE.get_policy_loss_fn(theirs_actor.policy_loss.loss_mode).__module__.startswith("verl.")
    theirs, _ = _worker_update(batch, theirs_config, theirs_actor, r)
    logged = _logged_actor_metrics(theirs)
    assert "actor/" + rc_verl.BACKEND_METRIC not in logged
    if bypass:
        assert any(k.startswith("actor/rollout_corr/") for k in logged)  # same prefix, no backend key


def test_own_entry_point_keeps_an_explicit_backend_verl_and_refuses_a_misspelt_one(fresh, monkeypatch):
    from verl.trainer.main_ppo import TaskRunnerV1

    _, code = _wire_blocks()
    config = _user_config(backend="verl")
    assert _run_own_entry_point(code, config, monkeypatch) is TaskRunnerV1  # the user's explicit choice
    assert "backend" not in config.algorithm.rollout_correction and not _said(fresh, STEP_SAYS)
    with pytest.raises(ValueError, match="rollout_corection"):
        rc_verl.wire_trainer_config(_user_config(backend="rollout_corection"))


def test_the_example_runs_and_shows_the_backend_metric():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, *sys.path])}
    done = subprocess.run([sys.executable, os.path.join(HERE, os.pardir, "examples", "integration_verl.py")],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"{rc_verl.BACKEND_METRIC} = 1.0" in out
    assert "actor.policy_loss.loss_mode: rollout_correction" in out
    assert "algorithm.adv_estimator:     grpo_accepted" in out
    rejected = re.search(r"rejected rows: \[(.*?)\]", out).group(1)
    assert rejected.strip() != ""  # the far off-policy row was rejected
    ours, theirs = map(float, re.search(r"policy loss: ours ([-\d.e]+), verl vanilla ([-\d.e]+)", out).groups())
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert f"loss metric actor/{rc_verl.BACKEND_METRIC}: ours 1.0, verl vanilla None" in out
    assert done.stderr.count(STEP_SAYS) == 1 and done.stderr.count(LOSS_SAYS) == 1
