"""``rollout-correction monitor HISTORY --out DIR``: replay a logged metrics history through the
health monitor and write the six-panel plot, the alert timeline and ``summary.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollout_correction.console import report_folder

DEFAULT_OUT = "monitor-report"
# What makes a folder another run's report (an explicit --out holding one is refused without --force).
REPORT_MARKERS = ("summary.json", "alerts.md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("history", help="metrics history: a .jsonl file, a .csv export (wandb or MLflow) or a "
                                        "TensorBoard event directory")
    parser.add_argument("--out", default=None,
                        help=f"output folder (default: a new {DEFAULT_OUT}/<date>-<time>/, with {DEFAULT_OUT}/latest "
                             "pointing at the newest); refused when it holds another report, unless --force")
    parser.add_argument("--force", action="store_true", help="write into an --out that holds another report")
    parser.add_argument("--format", dest="fmt", choices=("auto", "jsonl", "csv", "tensorboard"), default="auto",
                        help="history format (default: from the file name)")
    parser.add_argument("--trend-factor", type=float, default=None, help="trend rules: rise factor F (default 3)")
    parser.add_argument("--baseline-steps", type=int, default=None, help="trend rules: baseline steps B (default 20)")
    parser.add_argument("--window", type=int, default=None, help="trend rules: median window W (default 20)")
    parser.add_argument("--min-duration", type=int, default=None, help="trend rules: consecutive steps D (default 5)")
    parser.add_argument("--static-window", type=int, default=None,
                        help="static rules: median over this many steps (default 5; 1 = every step on its own)")
    parser.add_argument("--no-trends", action="store_true", help="only seed 001's static thresholds")
    parser.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                        help="override a static threshold, e.g. --threshold ess_low=0.2 (repeatable; "
                             "VALUE 'off' drops the rule)")


def _thresholds(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--threshold expects NAME=VALUE, got {item!r}")
        out[name.strip()] = None if value.strip().lower() in ("off", "none") else float(value)
    return out


def run(args: argparse.Namespace) -> int:
    import sys

    from .monitor import HealthMonitor
    from .plots import plot_metrics
    from .readers import read_history

    try:
        history = read_history(args.history, args.fmt)
        options = {k: v for k, v in (("trend_factor", args.trend_factor), ("baseline_steps", args.baseline_steps),
                                     ("window", args.window), ("min_duration", args.min_duration),
                                     ("static_window", args.static_window)) if v is not None}
        mon = HealthMonitor(_thresholds(args.threshold), trends=not args.no_trends, log_alerts=False, **options)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"rollout-correction monitor: {exc}", file=sys.stderr)
        return 2
    mon.replay(history)
    if not any(len(h) > 1 for h in mon.history):
        print(f"rollout-correction monitor: {args.history} has no rollout_corr/* metric "
              f"({len(history)} steps read)", file=sys.stderr)
        return 2
    out = report_folder(args.out, DEFAULT_OUT, REPORT_MARKERS, force=args.force)
    title = Path(args.history).name
    plot_metrics(mon, out / "metrics.png", title=title)
    plot_metrics(mon, out / "metrics.svg", title=title)
    mon.save(out / "history.jsonl")
    (out / "summary.json").write_text(json.dumps(mon.summary(), indent=2))
    lines = ["# Alert timeline", "", f"History: `{args.history}` ({len(mon.history)} steps).", ""]
    if mon.alerts:
        lines += ["| step | rule | severity | value | what to do |", "|---|---|---|---|---|"]
        lines += [f"| {a.step} | {a.name} | {a.severity} | {a.value:.4g} | {a.message} |" for a in mon.alerts]
    else:
        lines.append("No alerts.")
    (out / "alerts.md").write_text("\n".join(lines) + "\n")
    first = mon.first_alert()
    print(f"{len(mon.history)} steps, {len(mon.alerts)} alert(s)"
          + (f"; first: {first.name} at step {first.step}" if first else "") + f"; report in {out}/")
    for a in mon.alerts[:20]:
        print(f"  step {a.step}: {a.name} [{a.severity}]")
    return 0
