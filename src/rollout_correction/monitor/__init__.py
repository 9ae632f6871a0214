"""Training health monitor: seed 001's alerting and six-panel plot, plus trend rules that warn
before a collapse.

    from rollout_correction.monitor import HealthMonitor
    mon = HealthMonitor()
    alerts = mon.update(step, metrics)      # in the training loop, after each step

Adapters whose engine owns the loop take the monitor explicitly (docs/monitoring.md); there is no
process-wide monitor they feed on their own.

See docs/monitoring.md for every rule's formula. ``HealthMonitorCallback`` (in
``rollout_correction.monitor.callback``) needs ``transformers``; the plot needs ``matplotlib``;
reading TensorBoard event files needs ``tensorboard``.
"""

from __future__ import annotations

import warnings
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
# Deprecated since 0.2.0 (removed in 0.3.0): the process-wide "active" monitor. Adapters take their
# monitor explicitly now (``monitor=`` of verl's batch step, ``health_monitor`` of the verl trainer,
# ``make_tis_function(monitor)`` for slime); during the deprecation they still feed an active
# monitor set here when none was given explicitly.

_ACTIVE: Optional[HealthMonitor] = None
_DEPRECATED = ("is deprecated since rollout-correction 0.2.0 and will be removed in 0.3.0: give the adapter "
               "its monitor explicitly (docs/monitoring.md)")


def set_active_monitor(monitor: Optional[HealthMonitor]) -> Optional[HealthMonitor]:
    """Deprecated: make ``monitor`` the process-wide one the adapters feed when they were given none
    (None: stop); returns it."""
    global _ACTIVE
    warnings.warn(f"set_active_monitor {_DEPRECATED}", DeprecationWarning, stacklevel=2)
    _ACTIVE = monitor
    return monitor


def active_monitor() -> Optional[HealthMonitor]:
    """Deprecated: the monitor :func:`set_active_monitor` set, or None (no warning: adapters read it
    during the deprecation; setting it warns)."""
    return _ACTIVE


def observe(metrics: dict[str, Any], step: Optional[int] = None) -> dict[str, float]:
    """Deprecated: :meth:`HealthMonitor.observe` of the active monitor ({} when none is set)."""
    warnings.warn(f"observe {_DEPRECATED}", DeprecationWarning, stacklevel=2)
    return {} if _ACTIVE is None else _ACTIVE.observe(metrics, step)
