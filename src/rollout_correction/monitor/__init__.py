"""Training health monitor: seed 001's alerting and six-panel plot, plus trend rules that warn
before a collapse.

    from rollout_correction.monitor import HealthMonitor
    mon = HealthMonitor()
    alerts = mon.update(step, metrics)      # in the training loop, after each step

See docs/monitoring.md for every rule's formula. ``HealthMonitorCallback`` (in
``rollout_correction.monitor.callback``) needs ``transformers``; the plot needs ``matplotlib``;
reading TensorBoard event files needs ``tensorboard``.
"""

from __future__ import annotations

from typing import Any, Optional

from .monitor import HEALTH_PREFIX, METRIC_PREFIX, HealthMonitor, canonical_metrics
from .readers import read_history
from .rules import STATIC_THRESHOLDS, Alert, NonFiniteRule, ThresholdRule, TrendRule, static_rules, trend_rules

__all__ = [
    "HealthMonitor", "Alert", "ThresholdRule", "TrendRule", "NonFiniteRule", "STATIC_THRESHOLDS",
    "static_rules", "trend_rules", "read_history", "plot_metrics", "canonical_metrics", "HEALTH_PREFIX",
    "METRIC_PREFIX", "set_active_monitor", "active_monitor", "observe",
]


def plot_metrics(*args, **kwargs):
    """See :func:`rollout_correction.monitor.plots.plot_metrics` (imports matplotlib on use)."""
    from .plots import plot_metrics as _plot

    return _plot(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# The process's active monitor: adapters whose engine owns the training loop (verl's driver, slime)
# call ``observe`` with each step's metrics; it is a no-op until a monitor is set.

_ACTIVE: Optional[HealthMonitor] = None


def set_active_monitor(monitor: Optional[HealthMonitor]) -> Optional[HealthMonitor]:
    """Make ``monitor`` the one :func:`observe` feeds (None: stop); returns it."""
    global _ACTIVE
    _ACTIVE = monitor
    return monitor


def active_monitor() -> Optional[HealthMonitor]:
    return _ACTIVE


def observe(metrics: dict[str, Any], step: Optional[int] = None) -> dict[str, float]:
    """Feed one step's metrics to the active monitor and return its ``rollout_corr/health/*``
    numbers to log with them ({} when no monitor is active). ``step`` defaults to one after the
    monitor's last step."""
    mon = _ACTIVE
    if mon is None:
        return {}
    if step is None:
        step = mon.history[-1]["step"] + 1 if mon.history else 0
    mon.update(step, metrics)
    return mon.health_metrics()
