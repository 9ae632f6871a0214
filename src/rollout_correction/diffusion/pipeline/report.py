"""Summary, results file, markdown report and plots of the pipeline demo.

Intervals are 95 % t-intervals over seeds. Two variants *tie* when the interval of their paired
difference (same seeds) contains 0.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from typing import Any

import torch

__all__ = ["provenance", "summarise", "merge_results", "write_report"]

# two-sided 95 % Student t quantiles by degrees of freedom (1 … 30); normal beyond
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % t-interval); half-width 0 for one value."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
    return m, t * sd / math.sqrt(n)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(command: str) -> dict[str, Any]:
    """commit, torch / diffusers versions, CPU model, threads, date, command."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    try:
        import diffusers

        dv = diffusers.__version__
    except ImportError:  # pragma: no cover
        dv = None
    return {"commit": commit, "torch": torch.__version__, "diffusers": dv, "python": sys.version.split()[0],
            "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command}


def _tail_mean(xs: list[float], k: int = 5) -> float:
    tail = xs[-k:]
    return sum(tail) / len(tail)


def summarise(logs: list[dict[str, Any]], clip_range: float) -> dict[str, Any]:
    """Per-variant figures over seeds (see the module doc for intervals and ties)."""
    out = {name: _variant_summary(runs) for name, runs in _by_variant(logs).items()}
    add_paired_differences(out, logs)
    return out


def _by_variant(logs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for log in logs:
        by.setdefault(log["variant"], []).append(log)
    return by


def add_paired_differences(out: dict[str, Any], logs: list[dict[str, Any]]) -> None:
    """``vs_naive``: final and eval reward minus naive's on the same seeds, with the tie verdict."""
    by = _by_variant(logs)
    if "naive" not in by:
        return
    base = {r["seed"]: r for r in by["naive"]}
    for name, runs in by.items():
        if name == "naive":
            continue
        d_final = [_tail_mean(r["reward"]) - _tail_mean(base[r["seed"]]["reward"]) for r in runs if r["seed"] in base]
        d_eval = [r["eval_reward"] - base[r["seed"]]["eval_reward"] for r in runs if r["seed"] in base]
        if d_final:
            m, h = mean_ci(d_final)
            me, he = mean_ci(d_eval)
            out[name]["vs_naive"] = {"final_reward_diff": [m, h], "eval_reward_diff": [me, he],
                                     "tie": bool(abs(m) <= h and abs(me) <= he) if len(d_final) > 1 else None}


def _variant_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    iters = len(runs[0]["reward"])
    curve = [mean_ci([r["reward"][i] for r in runs]) for i in range(iters)]
    times = {k: mean_ci([sum(t[k] for t in r["times"]) / iters for r in runs])[0]
             for k in ("rollout", "recompute", "update")}
    gap_all = [g["mean"] for r in runs for g in r["gap"]]
    clip_first = [m.get("actor/pg_clipfrac@first_mini_step", 0.0) for r in runs for m in r["metrics"]]
    rej_keys = ("rollout_corr/rejected_fraction", "actor/rollout_corr/rejected_fraction")
    ess_keys = ("rollout_corr/rollout_is_eff_sample_size", "actor/rollout_corr/rollout_is_eff_sample_size")
    rej = [m[k] for r in runs for m in r["metrics"] for k in rej_keys if k in m]
    ess = [m[k] for r in runs for m in r["metrics"] for k in ess_keys if k in m]
    by_ts: dict[str, list[float]] = {}
    for r in runs:
        for g in r["gap"]:
            for t, v in g["by_timestep"].items():
                by_ts.setdefault(t, []).append(v["mean"])
    return {
        "seeds": [r["seed"] for r in runs],
        "final_reward": mean_ci([_tail_mean(r["reward"]) for r in runs]),
        "eval_reward": mean_ci([r["eval_reward"] for r in runs]),
        "reward_curve": curve,
        "time_per_iter_s": times,
        "wall_s_per_run": mean_ci([r["wall_s"] for r in runs])[0],
        "wall_s_max": max(r["wall_s"] for r in runs),
        "cpu_s_per_run": (sum(r["cpu_s"] for r in runs) / len(runs)) if all("cpu_s" in r for r in runs) else None,
        "gap_mean": sum(gap_all) / len(gap_all),
        "gap_frac_above_clip": sum(g["frac_above_clip"] for r in runs for g in r["gap"]) / len(gap_all),
        "gap_by_timestep": {t: sum(v) / len(v) for t, v in sorted(by_ts.items(), key=lambda kv: float(kv[0]))},
        "clipfrac_first_mini_step": sum(clip_first) / max(len(clip_first), 1),
        "rejected_fraction": (sum(rej) / len(rej)) if rej else None,
        "ess": (sum(ess) / len(ess)) if ess else None,
    }


def _fmt_ci(mc: tuple[float, float] | list[float]) -> str:
    return f"{mc[0]:.4f} ± {mc[1]:.4f}"


def _table(summary: dict[str, Any], scan: list[dict[str, Any]], clip_range: float) -> str:
    lines = ["| variant | final reward (last 5 iters) | eval reward (fp32, η = 0) | Δ vs naive (final / eval) | "
             "mean \\|Δ log π\\| | steps > clip | clipped @ 1st mini-step | rejected | ESS | "
             "rollout / recompute / update s per iter |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = ["fp32_reference", "naive", "decoupled_is_rs", "bypass", "bypass_rs"]
    for name in [n for n in order if n in summary] + [n for n in summary if n not in order]:
        s = summary[name]
        vs = s.get("vs_naive")
        vs_txt = "—" if vs is None else (
            f"{vs['final_reward_diff'][0]:+.4f} ± {vs['final_reward_diff'][1]:.4f} / "
            f"{vs['eval_reward_diff'][0]:+.4f} ± {vs['eval_reward_diff'][1]:.4f}" + (" (tie)" if vs["tie"] else ""))
        t = s["time_per_iter_s"]
        rej = "—" if s["rejected_fraction"] is None else f"{100 * s['rejected_fraction']:.2f} %"
        ess = "—" if s["ess"] is None else f"{s['ess']:.5f}"
        lines.append(
            f"| `{name}` | {_fmt_ci(s['final_reward'])} | {_fmt_ci(s['eval_reward'])} | {vs_txt} | "
            f"{s['gap_mean']:.2e} | {100 * s['gap_frac_above_clip']:.1f} % | {100 * s['clipfrac_first_mini_step']:.1f} % | "
            f"{rej} | {ess} | "
            f"{t['rollout']:.2f} / {t['recompute']:.3f} / {t['update']:.2f} |")
    if scan:
        lines += ["", "| precision | η | CFG | mean \\|Δ log π\\| | max | steps > clip (1e-4) | steps > RS band (ln 2) | "
                  "rejected (quickstart) | ESS | IS min / max |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in scan:
            g = r["gap"]
            lines.append(
                f"| {r['precision']} | {r['noise_level']} | {'off' if r['cfg_scale'] <= 1 else r['cfg_scale']} | "
                f"{g['mean']:.2e} | {g['max']:.2e} | {100 * g['frac_above_clip']:.1f} % | "
                f"{100 * g['frac_outside_rs_band']:.1f} % | {100 * r['rejected_fraction']:.2f} % | {r['ess']:.6f} | "
                f"{r['is_min']:.5f} / {r['is_max']:.5f} |")
    return "\n".join(lines)


def write_report(out_dir: str, result: dict[str, Any]) -> list[str]:
    """summary.json, report.md and the plots (when matplotlib is installed); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "summary.json"), os.path.join(out_dir, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    clip = result["config"]["train"]["clip_range"]
    md = ["# FlowGRPO on a diffusers transformer: rollout correction", "",
          f"`{result['provenance']['command']}` — commit {result['provenance']['commit'][:12]}, torch "
          f"{result['provenance']['torch']}, diffusers {result['provenance']['diffusers']}, "
          f"{result['provenance']['cpu_model']}, {result['provenance']['threads']} thread(s), "
          f"{result['provenance']['date']}.", "",
          _table(result["summary"], result.get("scan", []), clip), ""]
    with open(paths[1], "w") as f:
        f.write("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return paths
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in result["summary"].items():
        m = [c[0] for c in s["reward_curve"]]
        h = [c[1] for c in s["reward_curve"]]
        xs = range(1, len(m) + 1)
        ax.plot(xs, m, label=name)
        ax.fill_between(xs, [a - b for a, b in zip(m, h)], [a + b for a, b in zip(m, h)], alpha=0.15)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean rollout reward (95 % CI over seeds)")
    paths.append(_save(fig, ax, out_dir, "reward.png"))
    scan = result.get("scan", [])
    if scan:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in scan:
            ts = sorted(r["gap"]["by_timestep"], key=float)
            ax.plot([float(t) for t in ts], [r["gap"]["by_timestep"][t]["mean"] for t in ts], marker="o",
                    label=f"{r['precision']} η={r['noise_level']} cfg={'off' if r['cfg_scale'] <= 1 else r['cfg_scale']}")
        ax.axhline(clip, color="k", ls="--", lw=1, label=f"clip range {clip:g}")
        ax.axhline(math.log(2.0), color="r", ls=":", lw=1, label="RS band |log ρ| = ln 2")
        ax.set_yscale("log")
        ax.set_xlabel("timestep (diffusers scale, 1000 = noise)")
        ax.set_ylabel("mean |log π_old − log π_rollout| (nats)")
        paths.append(_save(fig, ax, out_dir, "gap_by_timestep.png", fontsize=6))
    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(result["summary"])
    bottom = [0.0] * len(names)
    for part in ("rollout", "recompute", "update"):
        vals = [result["summary"][n]["time_per_iter_s"][part] for n in names]
        ax.barh(names, vals, left=bottom, label=part)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set_xlabel("seconds per iteration (measured)")
    paths.append(_save(fig, ax, out_dir, "timing.png"))
    return paths


def _save(fig: Any, ax: Any, out_dir: str, name: str, fontsize: int = 7) -> str:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=fontsize)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_table(result: dict[str, Any]) -> str:
    """The markdown tables of a results file (what docs/diffusion.md shows)."""
    return _table(result["summary"], result.get("scan", []), result["config"]["train"]["clip_range"])


def merge_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs made in separate processes (e.g. variants split across processes).

    Variant summaries and scan rows are concatenated, the paired differences against ``naive`` are
    recomputed from the per-run logs, and the provenance keeps each part's command.
    """
    if not results:
        raise ValueError("nothing to merge")
    merged = {**results[0], "summary": {}, "scan": [], "runs": []}
    for r in results:
        merged["summary"].update(r["summary"])
        merged["scan"] += r.get("scan", [])
        # per-iteration metric dicts stay in the parts; the merged file keeps rewards, times, gaps
        merged["runs"] += [{k: v for k, v in run.items() if k != "metrics"} for run in r.get("runs", [])]
    for s in merged["summary"].values():
        s.pop("vs_naive", None)
    add_paired_differences(merged["summary"], merged["runs"])
    merged["provenance"] = {**results[0]["provenance"],
                            "command": " && ".join(r["provenance"]["command"] for r in results),
                            "parts": [r["provenance"] for r in results]}
    return merged


if __name__ == "__main__":  # python -m rollout_correction.diffusion.pipeline.report RESULTS.json
    with open(sys.argv[1]) as f:
        print(render_table(json.load(f)))
