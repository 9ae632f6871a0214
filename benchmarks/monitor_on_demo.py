"""The health monitor measured on a demo output folder.

    python benchmarks/monitor_on_demo.py DEMO_OUT [DEMO_OUT ...] [--plot docs/img/monitor.png]

For every saved run (``DEMO_OUT/runs/*.json``) the default ``HealthMonitor`` is replayed on the
per-step ``rollout_corr/*`` metrics. Printed:

1. per run: best and final trainer exact match, the fall step (first evaluation ≥ 0.1 below the
   best), the first warning (rule) and the lead time (fall − first warning);
2. the targets: a warning ahead of the fall on every degrading naive run (final ≤ best − 0.1);
   no warning on ≥ 2 of 3 on-policy runs; warnings on the healthy bypass PPO-clip runs;
3. on degrading runs, the first step each seed-001 static threshold and each trend rule fires;
4. the trend rules against the seed's thresholds checked at every step (``static_window=1``, the
   seed's own per-step check): which fires first on each degrading run, and how many healthy runs
   (on-policy and bypass PPO-clip runs that do not degrade) each raises an alert on.

``--plot PATH`` draws the six-panel plot of the degrading naive run with the longest history
(the docs' figure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollout_correction.demo.report import FALL, run_health
from rollout_correction.monitor.rules import STATIC_THRESHOLDS, TREND_SPEC


def load_runs(folder: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted((folder / "runs").glob("*.json"))]
    if not runs:
        sys.exit(f"{folder}/runs/ has no run files: pass a `rollout-correction demo --out` folder")
    return runs


def degrading(r: dict) -> bool:
    t = r["evals"]["trainer"]
    return t[-1] <= max(t) - FALL


def fmt(x) -> str:
    return "—" if x is None else str(x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--trend-factor", type=float, default=None)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--min-duration", type=int, default=None)
    ap.add_argument("--baseline-steps", type=int, default=None)
    ap.add_argument("--static-window", type=int, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    opts = {k: v for k, v in (("trend_factor", args.trend_factor), ("window", args.window),
                              ("min_duration", args.min_duration), ("baseline_steps", args.baseline_steps),
                              ("static_window", args.static_window))
            if v is not None}

    rows = []
    for folder in args.folders:
        for r in load_runs(folder):
            h = run_health(r, **opts)
            rows.append({"folder": folder.name, "run": r, "h": h})

    print(f"monitor options: {opts or 'defaults'}\n")
    print("| demo | method | seed | best | final | degrades | fall step | first warning (rule) | lead |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        r, h = x["run"], x["h"]
        t = r["evals"]["trainer"]
        warn = f"{h['first_warning']} ({h['first_warning_rule']})" if h["first_warning"] is not None else "none"
        print(f"| {x['folder']} | {r['method']} | {r['seed']} | {max(t):.2f} | {t[-1]:.2f} | "
              f"{'yes' if degrading(r) else 'no'} | {fmt(h['fall_step'])} | {warn} | {fmt(h['lead'])} |")

    naive_deg = [x for x in rows if x["run"]["method"] == "naive" and degrading(x["run"])]
    ahead = [x for x in naive_deg if x["h"]["lead"] is not None and x["h"]["lead"] > 0]
    print(f"\nTarget 1 — warning ahead of the fall on every degrading naive run: "
          f"{len(ahead)}/{len(naive_deg)} ({'met' if naive_deg and len(ahead) == len(naive_deg) else 'NOT met'})")
    for x in naive_deg:
        print(f"  {x['folder']} naive seed {x['run']['seed']}: first warning {fmt(x['h']['first_warning'])}, "
              f"fall {fmt(x['h']['fall_step'])}, lead {fmt(x['h']['lead'])}")
    for folder in args.folders:
        on = [x for x in rows if x["folder"] == folder.name and x["run"]["method"] == "on_policy"]
        quiet = [x for x in on if x["h"]["first_warning"] is None]
        print(f"Target 2 — {folder.name}: on-policy runs without a warning: {len(quiet)}/{len(on)} "
              f"({'met' if len(on) and len(quiet) >= min(2, len(on)) else 'NOT met'})")
    for x in rows:
        if x["run"]["method"] in ("on_policy", "bypass_ppo") and x["h"]["alerts"]:
            print(f"  false alarms: {x['folder']} {x['run']['method']} seed {x['run']['seed']}: "
                  f"{x['h']['first_alert_by_rule']}")

    statics = list(STATIC_THRESHOLDS)
    trends = [s[0] for s in TREND_SPEC]
    deg = [x for x in rows if degrading(x["run"]) and x["h"]["monitored"]]
    print("\nDegrading runs: first step each rule fires (— never); fall step last")
    print("| demo | method | seed | " + " | ".join(trends) + " | " + " | ".join(statics)
          + " | first trend | first static | fall |")
    print("|---|---|---|" + "---|" * (len(trends) + len(statics) + 3))
    earlier = 0
    for x in deg:
        b = x["h"]["first_alert_by_rule"]
        ft, fs = x["h"]["first_trend"], x["h"]["first_static"]
        earlier += ft is not None and (fs is None or ft < fs)
        print(f"| {x['folder']} | {x['run']['method']} | {x['run']['seed']} | "
              + " | ".join(fmt(b.get(n)) for n in trends) + " | " + " | ".join(fmt(b.get(n)) for n in statics)
              + f" | {fmt(ft)} | {fmt(fs)} | {fmt(x['h']['fall_step'])} |")
    print(f"trend rules fire before every static threshold on {earlier}/{len(deg)} degrading runs")

    per_step = {**opts, "static_window": 1}
    print("\nTrend rules vs the seed's thresholds checked at every step (static_window = 1)")
    print("| demo | method | seed | first trend | first static, per step (rule) | fall | first |")
    print("|---|---|---|---|---|---|---|")
    trend_first = 0
    for x in deg:
        h1 = run_health(x["run"], **per_step)
        ft, fs = x["h"]["first_trend"], h1["first_static"]
        rule = next((n for n, s in sorted(h1["first_alert_by_rule"].items(), key=lambda kv: kv[1])
                     if n in STATIC_THRESHOLDS), None)
        first = "trend" if ft is not None and (fs is None or ft < fs) else ("static" if fs is not None else "—")
        trend_first += first == "trend"
        print(f"| {x['folder']} | {x['run']['method']} | {x['run']['seed']} | {fmt(ft)} | {fmt(fs)}"
              f"{f' ({rule})' if rule else ''} | {fmt(x['h']['fall_step'])} | {first} |")
    print(f"trend rules first on {trend_first}/{len(deg)} degrading runs")
    healthy = [x for x in rows if x["run"]["method"] in ("on_policy", "bypass_ppo") and not degrading(x["run"])]
    alarm_default = sum(x["h"]["first_warning"] is not None for x in healthy)
    alarm_static1 = sum(run_health(x["run"], **per_step)["first_static"] is not None for x in healthy)
    print(f"healthy runs with an alert: default monitor {alarm_default}/{len(healthy)}; "
          f"seed's thresholds per step {alarm_static1}/{len(healthy)}")

    if args.plot and naive_deg:
        from rollout_correction.monitor import HealthMonitor, plot_metrics

        x = naive_deg[0]
        hist = x["run"]["history"]
        keys = [k for k in hist if k.startswith("rollout_corr/")]
        mon = HealthMonitor(log_alerts=False, **opts)
        for i in range(len(hist["reward"])):
            mon.update(i, {k: hist[k][i] for k in keys})
        plot_metrics(mon, args.plot, title=f"demo {x['folder']}: naive PPO, seed {x['run']['seed']} "
                                           f"(exact match falls at step {x['h']['fall_step']})")
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
