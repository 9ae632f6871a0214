"""HealthMonitor: feed it each step's metrics; it keeps the history and raises alerts.

    mon = HealthMonitor()
    for step, batch in enumerate(loader):
        ...
        alerts = mon.update(step, metrics)     # any dict with rollout_corr/* keys
        tracker.log(mon.health_metrics(), step=step)

Alerts are edge-triggered: a rule raises one :class:`Alert` when it starts to fire, and a firing
rule counts as clear again only after ``clear_steps`` consecutive clear steps (default 5), so a
value hovering at a limit does not raise an alert every few steps. ``health_metrics()`` gives the level view for a tracker:
``rollout_corr/health/<rule>`` is 1 while the rule fires and 0 otherwise, plus
``rollout_corr/health/status`` (0 healthy, 1 warning, 2 critical) and
``rollout_corr/health/alerts`` (alerts raised so far).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from rollout_correction import ENGINE_METRIC_NAMES, METRIC_PREFIX

from .rules import Alert, NonFiniteRule, static_rules, trend_rules

__all__ = ["HealthMonitor", "HEALTH_PREFIX", "METRIC_PREFIX", "canonical_metrics"]

HEALTH_PREFIX = METRIC_PREFIX + "health/"
logger = logging.getLogger("rollout_correction.monitor")


def _to_float(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if hasattr(v, "numel") and hasattr(v, "item"):  # a tensor / numpy scalar with one element
        try:
            if v.numel() == 1:
                return float(v.item())
        except TypeError:
            pass
        return None
    if hasattr(v, "item") and getattr(v, "size", None) == 1:
        return float(v.item())
    return None


def canonical_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """``{name: float}`` for every ``rollout_corr/<name>`` key in ``metrics`` (numbers or
    one-element tensors), whatever a tracker put before the prefix (``train/rollout_corr/kl`` →
    ``kl``), and the mismatch metrics other engines log under their own names. Health metrics and
    non-numeric values are left out."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        key = str(key)
        i = key.find(METRIC_PREFIX)
        if i < 0 or key.startswith(HEALTH_PREFIX, i):
            continue
        x = _to_float(value)
        if x is not None:
            out[key[i + len(METRIC_PREFIX):]] = x
    out.update((k, v) for k, v in _engine_named(metrics).items() if k not in out)
    return out


#: Other engines' names of the mismatch metrics (verl's ``training/rollout_probs_diff_*``, slime's
#: ``train_rollout_logprob_abs_diff``, NeMo-RL's ``js_divergence_error``…) → ours.
_ENGINE_NAMES = {theirs: ours for names in ENGINE_METRIC_NAMES.values() for theirs, ours in names.items()}


def _engine_named(metrics: dict[str, Any]) -> dict[str, float]:
    """The mismatch metrics an engine logged under its own names (after any tracker prefix, e.g.
    ``train/js_divergence_error``), under ours; a run logged by verl, slime or NeMo-RL alone is read."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        key = str(key)
        if METRIC_PREFIX in key:
            continue
        for theirs, ours in _ENGINE_NAMES.items():
            if (key == theirs or key.endswith("/" + theirs)) and (x := _to_float(value)) is not None:
                out[ours] = x
    return out


class HealthMonitor:
    """Watches the rollout-correction metrics of a training run.

    Args:
        thresholds: overrides of seed 001's static thresholds by rule name (see
            :data:`~rollout_correction.monitor.rules.STATIC_THRESHOLDS`); None drops a rule.
        trend_factor: F, how far the smoothed badness must rise above its early baseline
            (F for divergences, √F for first-order quantities).
        baseline_steps: B, the first B reported steps form each trend rule's baseline.
        window: W, trend rules compare the median of the last W reported steps.
        min_duration: D, a trend rule fires after D consecutive steps over its limit.
        trends: False disables the trend rules.
        static_window: S, static rules judge the median of the last S reported steps (1: every
            step on its own, as seed 001's example does; the default 5 ignores 1–2-step spikes).
        clear_steps: a firing rule is clear again after this many consecutive clear steps.
        log_alerts: send each alert to the ``rollout_correction.monitor`` logger
            (warning, or error when critical).
    """

    def __init__(self, thresholds: Optional[dict[str, Optional[float]]] = None, *, trend_factor: float = 3.0,
                 baseline_steps: int = 20, window: int = 20, min_duration: int = 5, trends: bool = True,
                 static_window: int = 5, clear_steps: int = 5, log_alerts: bool = True) -> None:
        self.config = {"thresholds": dict(thresholds or {}), "trend_factor": trend_factor,
                       "baseline_steps": baseline_steps, "window": window, "min_duration": min_duration,
                       "trends": trends, "static_window": static_window, "clear_steps": clear_steps}
        if clear_steps < 1:
            raise ValueError(f"clear_steps must be >= 1, got {clear_steps}")
        self.clear_steps = clear_steps
        self.rules = [NonFiniteRule(), *static_rules(thresholds, static_window)]
        if trends:
            self.rules += trend_rules(trend_factor, baseline_steps, window, min_duration)
        self.log_alerts = log_alerts
        self.history: list[dict[str, float]] = []
        self.alerts: list[Alert] = []
        self._firing: dict[str, bool] = {r.name: False for r in self.rules}
        self._clear_run: dict[str, int] = {r.name: 0 for r in self.rules}

    # -----------------------------------------------------------------------------------------

    def update(self, step: int, metrics: dict[str, Any]) -> list[Alert]:
        """Record one step's metrics (keys ``rollout_corr/<name>``, floats or 0-d tensors; other
        keys and missing metrics are skipped) and return the alerts raised at this step."""
        step = int(step)
        values = canonical_metrics(metrics)
        self.history.append({"step": step, **{METRIC_PREFIX + k: v for k, v in values.items()}})
        new: list[Alert] = []
        for rule in self.rules:
            firing, value = rule.evaluate(values)
            if firing is None:
                continue
            if firing and not self._firing[rule.name]:
                alert = Alert(step, rule.name, rule.severity, value, rule.describe(value), rule.kind)
                new.append(alert)
                if self.log_alerts:
                    level = logging.ERROR if rule.severity == "critical" else logging.WARNING
                    logger.log(level, "step %d: %s [%s] %s", step, rule.name, rule.severity, alert.message)
            self._clear_run[rule.name] = 0 if firing else self._clear_run[rule.name] + 1
            if firing:
                self._firing[rule.name] = True
            elif self._clear_run[rule.name] >= self.clear_steps:
                self._firing[rule.name] = False
        self.alerts.extend(new)
        return new

    def observe(self, metrics: dict[str, Any], step: Optional[int] = None) -> dict[str, float]:
        """:meth:`update` for a loop that does not count steps (an adapter's per-step hook): the step
        defaults to one after the last recorded; returns :meth:`health_metrics` to log with the
        metrics."""
        if step is None:
            step = self.history[-1]["step"] + 1 if self.history else 0
        self.update(step, metrics)
        return self.health_metrics()

    def health_metrics(self) -> dict[str, float]:
        """Numbers for a tracker: ``rollout_corr/health/<rule>`` (1 firing, 0 clear),
        ``…/status`` (0 healthy, 1 warning, 2 critical), ``…/alerts`` (raised so far)."""
        out = {HEALTH_PREFIX + name: float(f) for name, f in self._firing.items()}
        sev = {r.name: r.severity for r in self.rules}
        status = max((2.0 if sev[n] == "critical" else 1.0 for n, f in self._firing.items() if f), default=0.0)
        out[HEALTH_PREFIX + "status"] = status
        out[HEALTH_PREFIX + "alerts"] = float(len(self.alerts))
        return out

    @property
    def firing(self) -> list[str]:
        """Names of the rules firing at the last step."""
        return [n for n, f in self._firing.items() if f]

    def first_alert(self, kind: Optional[str] = None, severity: Optional[str] = None) -> Optional[Alert]:
        """The earliest alert (of ``kind`` "static" / "trend" / "nonfinite", and ``severity``)."""
        return next((a for a in self.alerts if (kind is None or a.kind == kind)
                     and (severity is None or a.severity == severity)), None)

    def summary(self) -> dict:
        steps = [h["step"] for h in self.history]
        first: dict[str, int] = {}
        for a in self.alerts:
            first.setdefault(a.name, a.step)
        fw = self.first_alert()
        return {
            "steps": len(steps),
            "first_step": steps[0] if steps else None,
            "last_step": steps[-1] if steps else None,
            "alerts": len(self.alerts),
            "first_alert": fw.to_dict() if fw else None,
            "first_alert_step_by_rule": first,
            "firing_at_end": self.firing,
            "status_at_end": self.health_metrics()[HEALTH_PREFIX + "status"],
            "config": self.config,
        }

    # -----------------------------------------------------------------------------------------
    # Persistence: JSONL, one config line then one line per step. Loading replays the steps, so
    # the loaded monitor is in exactly the state the saved one was (and can keep watching).

    def save(self, path: Union[str, Path]) -> None:
        by_step: dict[int, list[dict]] = {}
        for a in self.alerts:
            by_step.setdefault(a.step, []).append(a.to_dict())
        with open(path, "w") as f:
            f.write(json.dumps({"rollout_correction_monitor": 1, "config": self.config}) + "\n")
            for i, h in enumerate(self.history):
                line = {"step": h["step"], "metrics": {k: v for k, v in h.items() if k != "step"}}
                # alerts of a step are written on its last history line
                last = i + 1 == len(self.history) or self.history[i + 1]["step"] != h["step"]
                if last and h["step"] in by_step:
                    line["alerts"] = by_step.pop(h["step"])
                f.write(json.dumps(line) + "\n")  # NaN/inf as JSON's NaN/Infinity literals

    @classmethod
    def load(cls, path: Union[str, Path], **overrides) -> "HealthMonitor":
        """A monitor rebuilt from :meth:`save`'s file (its config, then every step replayed);
        ``overrides`` replace config entries (e.g. ``trend_factor=3``)."""
        lines = [json.loads(s) for s in Path(path).read_text().splitlines() if s.strip()]
        if not lines or "rollout_correction_monitor" not in lines[0]:
            raise ValueError(f"{path} is not a file written by HealthMonitor.save (no header line); "
                             "read a plain metrics history with rollout_correction.monitor.read_history")
        config = {**lines[0]["config"], **overrides}
        config.setdefault("log_alerts", False)
        mon = cls(**config)
        mon.replay((ln["step"], ln["metrics"]) for ln in lines[1:])
        return mon

    def replay(self, steps: Iterable[tuple[int, dict[str, Any]]]) -> list[Alert]:
        """``update`` for every ``(step, metrics)``; returns all alerts raised."""
        out: list[Alert] = []
        for step, metrics in steps:
            out += self.update(step, metrics)
        return out

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric (``kl`` or ``rollout_corr/kl``) over the history."""
        key = name if name.startswith(METRIC_PREFIX) else METRIC_PREFIX + name
        pts = [(h["step"], h[key]) for h in self.history if key in h]
        return [p[0] for p in pts], [p[1] for p in pts]
