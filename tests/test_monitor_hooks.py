"""The adapters feed the health monitor they are given, explicitly: verl's correction step (the
method of the V1 trainer subclass that ``rollout_correction.integrations.verl.main_ppo`` runs, which
its ``_compute_advantage`` calls once per training step; the monitor is the trainer's
``health_monitor``) and slime's custom TIS function (``make_tis_function(monitor)``, loaded by dotted
path as slime's ``--custom-tis-function-path`` does). Without one they feed nothing (the deprecated
process-wide monitor aside). The gap is a known shift δ of every log-prob, so
|k1| = δ exactly: 0.01 for 20 steps, then 0.05."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from rollout_correction.monitor import HealthMonitor, set_active_monitor

P = "rollout_corr/"


def _delta(step):
    return 0.01 if step < 20 else 0.05


def _log_probs(step, B=4, T=6):
    g = torch.Generator().manual_seed(step)
    old = -torch.rand(B, T, generator=g) - 0.1
    return old, old - _delta(step)   # rollout = old − δ: k1 = mean(rollout − old) = −δ


@pytest.fixture
def monitor():
    return HealthMonitor(log_alerts=False, trend_factor=2.0, window=10)


def _check(mon, returned):
    # F = 2, W = 10: baseline steps 0–19 at 0.01; from step 20 at 0.05: the window median passes 2 × 0.01 at
    # step 24 (5 of 10 high: 0.03), D = 5 -> kl_rising at step 28
    assert [h["step"] for h in mon.history] == list(range(30))
    assert [h[P + "kl"] for h in mon.history] == pytest.approx([-_delta(s) for s in range(30)], rel=1e-5)
    first = {}
    for a in mon.alerts:
        first.setdefault(a.name, a.step)
    assert first["kl_rising"] == 28
    assert returned[27][P + "health/kl_rising"] == 0.0 and returned[28][P + "health/kl_rising"] == 1.0


def test_verl_driver_step_feeds_the_monitor(monitor):
    from omegaconf import OmegaConf
    from verl_reference import _import

    from rollout_correction.integrations.verl.trainer import trainer_class

    protocol = _import("verl.protocol")
    trainer = object.__new__(trainer_class("sync"))  # its __init__ builds workers; the step needs the config
    trainer.health_monitor = monitor  # what RolloutCorrectionTaskRunnerV1.run sets from its health_monitor()
    trainer.config = OmegaConf.create({"algorithm": {"rollout_correction": {"rollout_is": "token",
                                                                            "rollout_is_threshold": 2.0}}})
    returned = []
    for step in range(30):
        old, rollout = _log_probs(step)
        batch = protocol.DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                                      "response_mask": torch.ones_like(old)})
        _, metrics = trainer.rollout_correction_step(batch)
        returned.append(metrics)  # what verl's trainer merges into its tracker's metrics
    _check(monitor, returned)
    assert returned[0][P + "kl"] == pytest.approx(-0.01, rel=1e-5)


def test_verl_driver_step_without_a_monitor_returns_only_the_metrics():
    from verl_reference import _import

    from rollout_correction.integrations import verl as rc_verl

    protocol = _import("verl.protocol")
    old, rollout = _log_probs(0)
    batch = protocol.DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                                  "response_mask": torch.ones_like(old)})
    _, metrics = rc_verl.compute_rollout_correction_and_add_to_batch(batch, {"rollout_is": "token"})
    assert not any(k.startswith(P + "health/") for k in metrics)


def test_slime_tis_function_feeds_the_monitor(monitor, tmp_path, monkeypatch):
    # the user's module, as docs/monitoring.md writes it, loaded by dotted path as slime does
    (tmp_path / "my_slime_hooks.py").write_text(
        "from rollout_correction.integrations.slime import make_tis_function\n"
        "MONITOR = None\n"
        "def tis(args, **kwargs):\n"
        "    return make_tis_function(MONITOR)(args, **kwargs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module, attr = "my_slime_hooks.tis".rsplit(".", 1)
    hooks = importlib.import_module(module)
    hooks.MONITOR = monitor
    fn = getattr(hooks, attr)
    args = SimpleNamespace(use_tis=True, tis_mode="truncate", tis_level="token", tis_lower_bound=None,
                           tis_upper_bound=2.0, tis_batch_normalize=False, use_rs=False, rs_level="token",
                           rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None)
    returned = []
    for step in range(30):
        old, rollout = _log_probs(step)
        lengths = [6, 4, 5, 6]
        train = [old[i, :n] for i, n in enumerate(lengths)]
        roll = [rollout[i, :n] for i, n in enumerate(lengths)]
        masks = [torch.ones(n) for n in lengths]
        pg_loss = torch.ones(sum(lengths))
        _, _, metrics = fn(args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=roll, loss_masks=masks)
        # slime averages each per-token metric over the loss masks: a repeated value stays itself
        returned.append({k: float(v.mean()) for k, v in metrics.items()})
        assert all(v.shape == pg_loss.shape for v in metrics.values())
    _check(monitor, returned)


def test_without_a_monitor_the_adapters_feed_nothing(monitor):
    """No process-wide monitor is fed implicitly: a monitor that was not handed over sees nothing."""
    from rollout_correction.integrations.slime import tis_function

    args = SimpleNamespace(use_tis=True, tis_mode="truncate", tis_level="token", tis_lower_bound=None,
                           tis_upper_bound=2.0, tis_batch_normalize=False, use_rs=False, rs_level="token",
                           rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None)
    old, rollout = _log_probs(0)
    _, _, metrics = tis_function(args, pg_loss=torch.ones(old.numel()), train_log_probs=list(old),
                                 rollout_log_probs=list(rollout), loss_masks=[torch.ones(6)] * 4)
    assert monitor.history == [] and not any(k.startswith(P + "health/") for k in metrics)


def test_the_deprecated_process_wide_monitor_is_still_fed(monitor):
    from verl_reference import _import

    from rollout_correction.integrations import verl as rc_verl

    protocol = _import("verl.protocol")
    old, rollout = _log_probs(0)
    batch = protocol.DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                                  "response_mask": torch.ones_like(old)})
    with pytest.warns(DeprecationWarning):
        set_active_monitor(monitor)
    try:
        _, metrics = rc_verl.compute_rollout_correction_and_add_to_batch(batch, {"rollout_is": "token"})
    finally:
        with pytest.warns(DeprecationWarning):
            set_active_monitor(None)
    assert len(monitor.history) == 1 and P + "health/status" in metrics
