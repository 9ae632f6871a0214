"""The report of ``rollout-correction demo --async``: ``async-summary.json``, ``async-wallclock.png``
and ``async-report.md`` from the raw results of :func:`~rollout_correction.demo.async_runner.run_comparison`.

The *reference* is ``sync_on_policy`` (two threads), or ``sync_on_policy_1t`` when only that one
ran. The *target* is 0.8 greedy exact match, or the reference's final (mean over seeds) minus 0.05
when that is lower. A run's *time to target* is the clock time of its first evaluation
snapshot at or above the target (None: never reached). Per mode, over seeds:

    speedup = mean time to target of the reference / mean time to target of the mode
    throughput speedup = (steps/s of the mode) / (steps/s of the reference)

The *checks* are the comparison's claims: every asynchronous mode that reaches the target does so
≥ 1.5× faster than synchronous on-policy; the best corrected asynchronous mode ends within 0.05 of
synchronous on-policy; naive asynchronous PPO's cost is reported as the gap in final accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollout_correction.demo.async_runner import ASYNC_MODES, AsyncConfig
from rollout_correction.demo.config import DemoConfig
from rollout_correction.demo.report import _mean, _stats, _tenth

TARGET = 0.8
TARGET_MARGIN = 0.05
SPEEDUP_GOAL = 1.5
SYNC = "sync_on_policy"


def time_to_target(evals: dict, target: float) -> tuple[float | None, int | None]:
    """(seconds, step) of the first evaluation with exact match ≥ ``target``, or (None, None)."""
    for step, seconds, acc in zip(evals["step"], evals["seconds"], evals["trainer"]):
        if acc >= target:
            return seconds, int(step)
    return None, None


def lag_counts(history: dict, max_staleness: int) -> list[int]:
    """Number of steps whose batch was ℓ = 0, 1, …, η versions old."""
    counts = [0] * (max_staleness + 1)
    for lag in history["lag"]:
        counts[int(lag)] += 1
    return counts


def kl_by_lag(history: dict) -> dict[str, float]:
    """Mean over the steps that have tokens of that staleness of the per-bucket mismatch KL
    (``rollout_corr/staleness/lag_<ℓ>/kl``), per bucket."""
    prefix, out = "rollout_corr/staleness/", {}
    for key in history:
        if key.startswith(prefix) and key.endswith("/kl"):
            bucket = key[len(prefix):-len("/kl")]
            counts = history[f"{prefix}{bucket}/token_count"]
            out[bucket] = _mean([kl for kl, n in zip(history[key], counts) if n > 0])
    return out


def summarize(cfg: DemoConfig, acfg: AsyncConfig, raw: dict) -> dict:
    results = raw["results"]
    ref = reference_mode(acfg.modes)
    sync_final = _mean([r["evals"]["trainer"][-1] for r in results if r["mode"] == ref])
    target = min(TARGET, sync_final - TARGET_MARGIN) if sync_final == sync_final else TARGET
    runs = []
    for r in results:
        seconds, step = time_to_target(r["evals"], target)
        kl = r["history"].get("kl", [])
        first = r["alerts"][0] if r["alerts"] else None
        runs.append({
            "mode": r["mode"], "seed": r["seed"],
            "final_reward": r["evals"]["trainer"][-1], "best_reward": max(r["evals"]["trainer"]),
            "time_to_target": seconds, "steps_to_target": step,
            "seconds": r["seconds"], "startup_seconds": r["startup_seconds"], "cpu_seconds": r["cpu_seconds"],
            "steps_per_second": len(r["history"]["lag"]) / r["seconds"],
            "lag_counts": lag_counts(r["history"], acfg.max_staleness),
            "lag_mean": _mean(r["history"]["lag"]),
            "initial_mismatch_kl": _tenth(kl, last=False), "final_mismatch_kl": _tenth(kl, last=True),
            "mean_mismatch_kl": _mean(kl),
            "first_alert": first, "alerts": len(r["alerts"]),
            "alert_rules": sorted({a["rule"] for a in r["alerts"]}),
            "kl_by_lag": kl_by_lag(r["history"]),
        })
    modes = {}
    for m in acfg.modes:
        rs = [r for r in runs if r["mode"] == m]
        reached = [r["time_to_target"] for r in rs if r["time_to_target"] is not None]
        counts = [sum(c) for c in zip(*(r["lag_counts"] for r in rs))]
        modes[m] = {
            "label": ASYNC_MODES[m].label,
            "asynchronous": ASYNC_MODES[m].asynchronous,
            "final_reward": _stats([r["final_reward"] for r in rs]),
            "best_reward": _stats([r["best_reward"] for r in rs]),
            "reached_target": len(reached), "runs": len(rs),
            "time_to_target": _stats(reached) if len(reached) == len(rs) else None,
            "steps_to_target": _stats([r["steps_to_target"] for r in rs]) if len(reached) == len(rs) else None,
            "steps_per_second": _stats([r["steps_per_second"] for r in rs]),
            "seconds": _stats([r["seconds"] for r in rs]),
            "startup_seconds": _stats([r["startup_seconds"] for r in rs]),
            "lag_fraction": [c / max(1, sum(counts)) for c in counts],
            "lag_mean": _mean([r["lag_mean"] for r in rs]),
            "initial_mismatch_kl": _mean([r["initial_mismatch_kl"] for r in rs]),
            "final_mismatch_kl": _mean([r["final_mismatch_kl"] for r in rs]),
            "mean_mismatch_kl": _mean([r["mean_mismatch_kl"] for r in rs]),
            "first_alerts": [r["first_alert"] for r in rs],
            "alert_rules": {rule: sum(rule in r["alert_rules"] for r in rs)
                            for rule in sorted({x for r in rs for x in r["alert_rules"]})},
            "kl_by_lag": {b: _mean([r["kl_by_lag"].get(b, float("nan")) for r in rs])
                          for b in sorted({b for r in rs for b in r["kl_by_lag"]})},
        }
    if ref is not None:
        syncs = [m for m in modes.values() if not m["asynchronous"] and m["time_to_target"]]
        fastest = min((m["time_to_target"]["mean"] for m in syncs), default=None)
        base = modes[ref]
        for m in modes.values():
            ttt, ref = m["time_to_target"], base["time_to_target"]
            ok = ttt is not None and ttt["mean"] > 0
            m["speedup"] = ref["mean"] / ttt["mean"] if ok and ref else None
            m["speedup_vs_fastest_sync"] = fastest / ttt["mean"] if ok and fastest else None
            m["throughput_speedup"] = m["steps_per_second"]["mean"] / base["steps_per_second"]["mean"]
    return {
        "config": cfg.to_dict(), "async": acfg.to_dict(), "target": target,
        "sft_reward": {str(k): v for k, v in raw["sft_reward"].items()},
        "seconds": raw["seconds"], "load_average": raw["load_average"], "cpu_count": raw["cpu_count"],
        "reference": ref, "runs": runs, "modes": modes, "checks": checks(modes),
    }


def reference_mode(modes) -> str | None:
    """The synchronous reference: ``sync_on_policy`` (2 threads), else its one-thread variant."""
    return next((m for m in (SYNC, SYNC + "_1t") if m in modes), None)


def checks(modes: dict) -> dict:
    """The comparison's claims on the means over seeds (module docstring)."""
    ref = reference_mode(modes)
    if ref is None:
        return {"available": False, "reason": f"needs the {SYNC} or {SYNC}_1t mode"}
    sync = modes[ref]["final_reward"]["mean"]
    out: dict = {"available": True, "reference": ref, "sync_final": sync}
    asyncs = [m for m in modes if modes[m]["asynchronous"]]
    speedups = {m: modes[m]["speedup"] for m in asyncs}
    out["speedup"] = speedups
    reached = [m for m in asyncs if speedups[m] is not None]
    out["async_reaching_target"] = reached
    out["async_1.5x_faster"] = bool(reached) and all(speedups[m] >= SPEEDUP_GOAL for m in reached)
    fastest = {m: modes[m]["speedup_vs_fastest_sync"] for m in reached}
    out["speedup_vs_fastest_sync"] = fastest
    out["async_1.5x_faster_than_fastest_sync"] = bool(reached) and all(
        x is not None and x >= SPEEDUP_GOAL for x in fastest.values())
    corrected = [m for m in asyncs if m != "async_naive"]
    if corrected:
        best = max(corrected, key=lambda m: modes[m]["final_reward"]["mean"])
        out["best_corrected"] = best
        out["best_corrected_final"] = modes[best]["final_reward"]["mean"]
        out["corrected_within_0.05"] = bool(sync - modes[best]["final_reward"]["mean"] <= TARGET_MARGIN)
    if "async_naive" in modes:
        out["naive_final"] = modes["async_naive"]["final_reward"]["mean"]
        out["naive_cost"] = sync - out["naive_final"]
    return out


# ---------------------------------------------------------------------------------------------


def plot(cfg: DemoConfig, acfg: AsyncConfig, raw: dict, summary: dict, path: Path) -> None:
    """Exact match against wall-clock seconds and against steps (thin: seeds; thick: mean), and
    the staleness distribution of every mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [1.4, 1.0, 0.8]})
    for i, m in enumerate(acfg.modes):
        rs = [r for r in raw["results"] if r["mode"] == m]
        color = f"C{i % 10}"
        for r in rs:
            axes[0].plot(r["evals"]["seconds"], r["evals"]["trainer"], color=color, lw=0.6, alpha=0.35)
        t = [_mean(c) for c in zip(*(r["evals"]["seconds"] for r in rs))]
        acc = [_mean(c) for c in zip(*(r["evals"]["trainer"] for r in rs))]
        axes[0].plot(t, acc, color=color, lw=2, label=ASYNC_MODES[m].label)
        axes[1].plot(rs[0]["evals"]["step"], acc, color=color, lw=2)
        fr = summary["modes"][m]["lag_fraction"]
        width = 0.8 / len(acfg.modes)
        axes[2].bar([k + (i - (len(acfg.modes) - 1) / 2) * width for k in range(len(fr))], fr, width=width,
                    color=color)
    for ax in axes[:2]:
        ax.axhline(summary["target"], color="0.3", ls="--", lw=1)
        ax.set_ylabel("greedy exact match (trainer)")
        ax.grid(alpha=0.3)
    axes[0].text(0.99, summary["target"], f"target {summary['target']:.2f}", ha="right", va="bottom",
                 fontsize=8, transform=axes[0].get_yaxis_transform())
    axes[0].set_xlabel("wall-clock seconds (evaluation off the clock)")
    axes[0].set_title("accuracy against wall-clock time", fontsize=10)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("GRPO step")
    axes[1].set_title("accuracy against steps (mean over seeds)", fontsize=10)
    axes[2].set_xlabel("staleness ℓ = trainer version − sampling version")
    axes[2].set_ylabel("fraction of steps")
    axes[2].set_xticks(range(acfg.max_staleness + 1))
    axes[2].set_title(f"staleness distribution (η = {acfg.max_staleness})", fontsize=10)
    axes[2].grid(axis="y", alpha=0.3)
    fig.suptitle(f"{cfg.task} {cfg.digits} digits, {cfg.steps} steps × {cfg.prompts}×{cfg.samples} samples, "
                 f"seeds {','.join(map(str, cfg.seeds))}; {raw['cpu_count']} CPU cores", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pm(s: dict | None, fmt: str = "{:.2f}") -> str:
    if not s:
        return "—"
    return (fmt + " ± " + fmt).format(s["mean"], s["std"])


def table_rows(summary: dict) -> list[list[str]]:
    """One row per mode: the columns of :data:`COLUMNS`."""
    rows = []
    for m, s in summary["modes"].items():
        reached = f"{s['reached_target']}/{s['runs']}"
        ttt = _pm(s["time_to_target"], "{:.1f}") if s["time_to_target"] else f"not reached ({reached})"
        first = [a for a in s["first_alerts"] if a]
        rows.append([
            s["label"], _pm(s["final_reward"]), ttt,
            (f"{s['speedup']:.2f}×" if s.get("speedup") else "—")
            + (f" ({s['speedup_vs_fastest_sync']:.2f}×)" if s.get("speedup_vs_fastest_sync") else ""),
            _pm(s["steps_per_second"], "{:.1f}"),
            " / ".join(f"{f:.2f}" for f in s["lag_fraction"]),
            f"{s['initial_mismatch_kl']:.4f} → {s['final_mismatch_kl']:.4f}",
            f"{len(first)}/{s['runs']}" + (f" ({first[0]['rule']} @ {first[0]['step']})" if first else ""),
        ])
    return rows


COLUMNS = ["mode", "final exact match", "time to target (s)", "speedup (vs faster sync)", "steps/s", "lag 0/1/…/η (fraction)",
           "mismatch KL first → last", "monitor: runs warned (first)"]


def markdown(summary: dict, command: str) -> str:
    c, lines = summary["checks"], []
    lines += ["# rollout-correction demo --async", "", f"`{command}`", "",
              f"Target: {summary['target']:.3f} exact match. Load average (1/5/15 min) before "
              f"{', '.join(f'{x:.2f}' for x in summary['load_average']['before'])}, after "
              f"{', '.join(f'{x:.2f}' for x in summary['load_average']['after'])}; "
              f"{summary['cpu_count']} CPU cores.", "",
              "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summary)]
    if c.get("available"):
        lines += ["", "## Checks", ""]
        for m, x in c["speedup"].items():
            lines.append(f"- {ASYNC_MODES[m].label}: " + (f"{x:.2f}× faster to the target" if x is not None
                                                          else "did not reach the target on every seed"))
        lines.append(f"- every async mode that reaches the target is ≥ {SPEEDUP_GOAL}× faster than the reference "
                     f"({c['reference']}): {'yes' if c['async_1.5x_faster'] else 'no'}; than the faster "
                     f"synchronous run: {'yes' if c['async_1.5x_faster_than_fastest_sync'] else 'no'}")
        if "best_corrected" in c:
            lines.append(f"- best corrected async ({ASYNC_MODES[c['best_corrected']].label}) ends at "
                         f"{c['best_corrected_final']:.3f} vs synchronous {c['sync_final']:.3f}: within 0.05 "
                         f"{'yes' if c['corrected_within_0.05'] else 'no'}")
        if "naive_cost" in c:
            lines.append(f"- naive async ends {c['naive_cost']:+.3f} below the reference")
    return "\n".join(lines) + "\n"


def write_report(cfg: DemoConfig, acfg: AsyncConfig, raw: dict, out: Path, command: str,
                 prov: dict | None = None) -> dict:
    """Write the report; ``prov`` is the invocation's :func:`~rollout_correction.demo.results.provenance`
    (taken now when not given)."""
    from rollout_correction.demo.results import provenance

    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(cfg, acfg, raw)
    summary["command"] = command
    summary["provenance"] = prov if prov is not None else provenance(command, 1, 1)
    (out / "async-runs.json").write_text(json.dumps(raw["results"]))
    (out / "async-summary.json").write_text(json.dumps(summary, indent=1))
    plot(cfg, acfg, raw, summary, out / "async-wallclock.png")
    (out / "async-report.md").write_text(markdown(summary, command))
    return summary


def print_table(summary: dict, console) -> None:
    from rollout_correction.demo.report import print_fitted

    print_fitted(console, f"demo --async: target {summary['target']:.2f} exact match", list(COLUMNS),
                 table_rows(summary))
