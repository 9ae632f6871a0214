"""Seed 001's six-panel plot of the correction metrics over steps, with its reference lines and
the monitor's alerts marked on the time axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional, Union

from .monitor import HealthMonitor, canonical_metrics
from .rules import Alert

__all__ = ["plot_metrics", "PANELS"]

# (title, [(metric, label)], [(y, colour, label)], symlog)
PANELS = (
    ("Mean IS weight", [("rollout_is_mean", "mean IS weight")],
     [(1.0, "r", "ideal"), (0.5, "0.5", "warning (0.5, 2)"), (2.0, "0.5", None)], False),
    ("Effective sample size", [("rollout_is_eff_sample_size", "ESS / N")],
     [(0.5, "g", "good"), (0.3, "r", "warning")], False),
    ("Veto / rejected fraction", [("rollout_is_veto_fraction", "veto"), ("rollout_rs_masked_fraction", "rejected"),
                                  ("rollout_rs_rejected_positive_fraction", "rejected with A > 0")],
     [(0.1, "r", "warning")], False),
    ("KL divergence", [("kl", "KL (k1)"), ("k3_kl", "K3 KL")],
     [(0.0, "g", None), (0.1, "r", "|kl| warning")], True),
    ("PPL ratio (training / rollout)", [("ppl_ratio", "PPL ratio")], [(1.0, "r", "ideal")], False),
    ("Chi-squared divergence", [("chi2_token", "token"), ("chi2_seq", "sequence")],
     [(1.0, "r", "warning")], True),
    ("Token probabilities, trainer vs rollout", [("prob_abs_diff_mean", "mean |Δp|"),
                                                 ("js_divergence", "JS divergence"),
                                                 ("log_prob_abs_diff_gt1", "share |Δ log p| > 1")],
     [(0.0, "g", None)], True),
)
_PANEL_OF_METRIC = {m: i for i, (_, series, _, _) in enumerate(PANELS) for m, _ in series}


def _rows(history: Any) -> list[tuple[int, dict[str, float]]]:
    """(step, canonical metrics) from a monitor, a list of step dicts, a reader's output, or a
    seed-style dict of lists."""
    if isinstance(history, HealthMonitor):
        history = history.history
    if isinstance(history, dict):  # {"rollout_corr/kl": [...], ...}, optional "step": [...]
        n = max((len(v) for v in history.values()), default=0)
        steps = history.get("step") or list(range(n))
        return [(int(steps[i]), canonical_metrics({k: v[i] for k, v in history.items()
                                                   if k != "step" and i < len(v)})) for i in range(n)]
    rows = []
    for item in history:
        if isinstance(item, tuple):
            rows.append((int(item[0]), canonical_metrics(item[1])))
        else:
            rows.append((int(item["step"]), canonical_metrics(item)))
    return rows


def plot_metrics(history: Any, path: Union[str, Path], alerts: Optional[Iterable[Alert]] = None,
                 title: Optional[str] = None, dpi: int = 120) -> Path:
    """Draw the 2×3 panel to ``path`` (the suffix picks PNG or SVG) and return the path.

    ``history``: a :class:`HealthMonitor` (its alerts are drawn unless ``alerts`` is given), a list
    of ``{"step": s, "rollout_corr/...": v}`` dicts, a list of ``(step, metrics)`` pairs, or a dict
    of lists as in seed 001's ``metrics_history``. Alerts are drawn as vertical lines on every
    panel at each rule's first alert (orange: warning, red: critical), labelled on the panel of the
    rule's metric.
    """
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "svg", "pdf", "cairo"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if alerts is None and isinstance(history, HealthMonitor):
        alerts = history.alerts
    alerts = list(alerts or [])
    rows = _rows(history)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (ptitle, series, refs, symlog) in zip(axes.flat, PANELS):
        drawn = False
        for metric, label in series:
            pts = [(s, m[metric]) for s, m in rows if metric in m]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, label=label)
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not logged in this history", ha="center", va="center", transform=ax.transAxes,
                    color="0.45")
        for y, colour, label in refs:
            ax.axhline(y, color=colour, ls="--", lw=1.0, alpha=0.7, label=label)
        if symlog:
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_title(ptitle)
        ax.set_xlabel("Step")
        ax.grid(alpha=0.3)
    labels: dict[tuple[int, int], list[Alert]] = {}
    seen: set[str] = set()
    for a in alerts:  # each rule's first alert: a line on every panel, labelled on its metric's panel
        if a.name in seen:
            continue
        seen.add(a.name)
        colour = "red" if a.severity == "critical" else "darkorange"
        for ax in axes.flat:
            ax.axvline(a.step, color=colour, lw=0.9, alpha=0.5)
        panel = _PANEL_OF_METRIC.get(_alert_metric(a.name))
        if panel is not None:
            labels.setdefault((panel, a.step), []).append(a)
    for (panel, step), group in labels.items():
        colour = "red" if any(a.severity == "critical" for a in group) else "darkorange"
        axes.flat[panel].annotate(", ".join(a.name for a in group), xy=(step, 0.98), xycoords=("data", "axes fraction"),
                                  rotation=90, va="top", ha="right", fontsize=7, color=colour)
    steps = [s for s, _ in rows] + [a.step for a in alerts]
    if steps and min(steps) < max(steps):
        for ax in axes.flat:
            ax.set_xlim(min(steps), max(steps))
    for ax, (_, series, _, symlog) in zip(axes.flat, PANELS):
        values = [m[k] for _, m in rows for k, _ in series if k in m]
        if symlog and values and min(values) >= 0:
            ax.set_ylim(bottom=0)
    for ax in axes.flat:
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=8, loc="best")
    if alerts:
        first = alerts[0]
        note = f"first alert: {first.name} at step {first.step}; {len(alerts)} alert(s)"
    else:
        note = "no alerts"
    fig.suptitle((title + " — " if title else "") + note, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _alert_metric(rule_name: str) -> Optional[str]:
    from .rules import TREND_SPEC, static_rules

    for r in static_rules():
        if r.name == rule_name:
            return r.metric
    for name, metric, *_ in TREND_SPEC:
        if name == rule_name:
            return metric
    return None

