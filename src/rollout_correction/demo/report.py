"""The report: ``summary.json``, plots (PNG) and ``report.md`` from the raw run results.

Per method and seed the summary keeps the trainer's final and best greedy exact match, the
rollout engine's, the mismatch KL(π_rollout‖π_old) at the start and the end, whether the run
collapsed and its wall time; ``methods.png`` compares the methods side by side. A run *collapsed* when its final exact match is below half of its best.
Every per-method figure has its 95 % interval over seeds (``demo/results.py``). Comparisons are
paired: the runs of one seed start from the same SFT checkpoint and see the same prompts, so each
method is judged against naive PPO, on-policy and the best method on its per-seed differences
(95 % t-interval of the mean difference and the sign count; *tied* = that interval covers 0).
``summary.json`` carries the provenance: commit, torch, CPU, workers × threads, date and command.

The *claims* are declared before running: each scenario's config names the correction it
``recommended``s, and the demonstration claims, each on its paired interval,

* on-policy − naive > 0 (the mismatch costs naive PPO something), and
* recommended − naive > 0 (the recommended correction wins some of it back).

The naive run's mismatch KL growth (first to last tenth of training) is reported beside them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rollout_correction.demo.config import METHODS, DemoConfig, declared_claims
from rollout_correction.demo.results import interval, paired_difference, provenance, tied_with_best

COLLAPSE_FRACTION = 0.5

PLOTS = {  # file stem -> (history key or eval key, title, y label, log scale)
    "trainer_reward": ("evals:trainer", "fp32 trainer policy: greedy exact match", "exact match", False),
    "engine_reward": ("evals:engine", "rollout engine: greedy exact match", "exact match", False),
    "train_reward": ("reward", "training reward (rollout-engine samples)", "mean reward", False),
    "mismatch_kl": ("kl", "mismatch KL(π_rollout ‖ π_old) per token", "KL (k1)", True),
    "chi2": ("chi2_token", "χ² divergence per token", "χ²", True),
    "ess": ("ess", "effective sample size of the IS weights", "ESS / N", False),
    "rejected": ("rejected", "fraction rejected by RS", "fraction", False),
    "grad_norm": ("grad_norm", "gradient norm (before clipping)", "‖g‖", True),
}
OVERVIEW = ("trainer_reward", "engine_reward", "mismatch_kl", "grad_norm")
# Mixture-of-experts runs (``--model moe``): the engine's and the trainer's routing, per step.
PLOTS["routing_agreement"] = ("routing_match", "MoE routing agreement, engine vs trainer (response tokens)",
                              "share of (token, layer) top-k sets that match", False)


def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _tenth(xs, last: bool) -> float:
    k = max(1, len(xs) // 10)
    return _mean(xs[-k:] if last else xs[:k])


FALL = 0.1  # a run "falls" when the trainer's exact match drops this far below its best


def fall_step(evals: dict) -> int | None:
    """First evaluation step after the best at which the trainer's exact match is ≤ best − FALL."""
    trainer, steps = evals["trainer"], evals["step"]
    best = max(trainer)
    i_best = trainer.index(best)
    return next((int(steps[i]) for i in range(i_best, len(trainer)) if trainer[i] <= best - FALL), None)


def run_health(r: dict, **monitor_options) -> dict:
    """The health monitor replayed on a run's per-step ``rollout_corr/*`` metrics (step i = the
    GRPO step after i updates, the same numbering as the evaluations): first warning, first static
    and trend alerts, the fall step and the lead time (fall − first warning)."""
    from rollout_correction import METRIC_PREFIX
    from rollout_correction.monitor import HealthMonitor

    hist = r["history"]
    keys = [k for k in hist if k.startswith(METRIC_PREFIX)]
    mon = HealthMonitor(log_alerts=False, **monitor_options)
    for i in range(len(hist.get("reward", []))):
        mon.update(i, {k: hist[k][i] for k in keys if i < len(hist[k])})
    first, static, trend = mon.first_alert(), mon.first_alert("static"), mon.first_alert("trend")
    fall = fall_step(r["evals"])
    by_rule: dict[str, int] = {}
    for a in mon.alerts:
        by_rule.setdefault(a.name, a.step)
    return {
        "monitored": bool(keys),
        "first_warning": first.step if first else None,
        "first_warning_rule": first.name if first else None,
        "first_static": static.step if static else None,
        "first_trend": trend.step if trend else None,
        "first_alert_by_rule": by_rule,
        "fall_step": fall,
        "lead": fall - first.step if first and fall is not None else None,
        "alerts": len(mon.alerts),
    }


def _lengths(hist: dict, prefix: str = "ess_seq") -> list[int]:
    """The response lengths L of a run's ``<prefix>@L`` history keys, in order."""
    return sorted(int(k.split("@")[1]) for k in hist if k.startswith(prefix + "@"))


def _by_length(hist: dict, prefix: str) -> list[float] | None:
    """The last tenth's mean of ``<prefix>@L`` for every recorded L (None for runs without them)."""
    return [_tenth(hist[f"{prefix}@{L}"], last=True) for L in _lengths(hist, prefix)] or None


def summarize_run(r: dict, sft_reward: float) -> dict:
    trainer, engine, kl = r["evals"]["trainer"], r["evals"]["engine"], r["history"].get("kl", [])
    best = max(trainer)
    return {
        "health": run_health(r),
        "method": r["method"],
        "seed": r["seed"],
        "sft_reward": sft_reward,
        "final_reward": trainer[-1],
        "best_reward": best,
        "final_engine_reward": engine[-1],
        "best_engine_reward": max(engine),
        "initial_mismatch_kl": _tenth(kl, last=False),
        "final_mismatch_kl": _tenth(kl, last=True),
        "initial_grad_norm": _tenth(r["history"]["grad_norm"], last=False),
        "final_grad_norm": _tenth(r["history"]["grad_norm"], last=True),
        "collapsed": bool(trainer[-1] < COLLAPSE_FRACTION * best),
        # against response length L: the final prefix exact match and the last tenth's ESS / N of the
        # untruncated sequence weight ∏_{t≤L} ρₜ and of its geometric mean (trainer.weight_ess_by_length)
        "final_by_length": r["evals"].get("trainer_by_length"),
        "answer_lengths": r["evals"].get("lengths") or (list(range(1, len(r["evals"]["trainer_by_length"]) + 1))
                                                        if r["evals"].get("trainer_by_length") else None),
        "ess_lengths": _lengths(r["history"]) or None,
        "ess_seq_by_length": _by_length(r["history"], "ess_seq"),
        "ess_geo_by_length": _by_length(r["history"], "ess_geo"),
        "seconds": r["seconds"],
        "cpu_seconds": r.get("cpu_seconds", float("nan")),
    }


def _stats(xs):
    """Mean, sample standard deviation (n − 1 denominator; 0 for a single seed), n and the 95 %
    interval over seeds (None for a single seed) of the finite values."""
    return interval(xs)


def run_provenance(raw: dict) -> list[dict]:
    """The distinct (commit, dirty, torch, Python, CPU, threads) the runs were measured with, each
    with its run count (a run resumed from an earlier invocation keeps that invocation's)."""
    keys = ("commit", "dirty", "torch", "python", "cpu", "threads")
    groups: dict[tuple, dict] = {}
    for r in raw["results"]:
        p = r.get("provenance") or {}
        k = tuple(p.get(x) for x in keys)
        groups.setdefault(k, {**dict(zip(keys, k)), "runs": 0})["runs"] += 1
    return list(groups.values())


def summarize(cfg: DemoConfig, raw: dict, command: str = "", prov: dict | None = None) -> dict:
    runs = [summarize_run(r, raw["sft_reward"][r["seed"]]) for r in raw["results"]]
    per_method = {}
    for m in cfg.methods:
        rs = [r for r in runs if r["method"] == m]
        kl0, kl1 = _mean([r["initial_mismatch_kl"] for r in rs]), _mean([r["final_mismatch_kl"] for r in rs])
        per_method[m] = {
            "label": METHODS[m].label,
            "preset": METHODS[m].setting,
            "final_reward": _stats([r["final_reward"] for r in rs]),
            "best_reward": _stats([r["best_reward"] for r in rs]),
            "final_engine_reward": _stats([r["final_engine_reward"] for r in rs]),
            "initial_mismatch_kl": kl0,
            "final_mismatch_kl": kl1,
            "kl_growth": kl1 / kl0 if kl0 > 0 else float("nan"),
            "collapsed": sum(r["collapsed"] for r in rs),
            "runs": len(rs),
            # response length × per-token KL over the first and the last tenth (the long scenario's ≥ 20 rule)
            "initial_length_x_kl": cfg.make_task().response_len * kl0,
            "length_x_kl": cfg.make_task().response_len * kl1,
            "seconds": _stats([r["seconds"] for r in rs]),
        }
    measured = run_provenance(raw)
    summary = {
        "provenance": prov if prov is not None else provenance(command, cfg.workers, cfg.threads),
        "run_provenance": measured,
        "mixed_provenance": len(measured) > 1,
        "config": cfg.to_dict(),
        "tied_with_best": tied_with_best({m: finals(runs, m) for m in per_method}),
        "sft_reward": {str(k): v for k, v in raw["sft_reward"].items()},
        "seconds": {**raw["seconds"], "run_cpu_total": sum(r["cpu_seconds"] for r in runs)},
        "resumed": raw.get("resumed", 0),
        "runs": runs,
        "methods": per_method,
    }
    summary["paired"] = paired(summary)
    summary["claims"] = claims(summary)
    return summary


def finals(runs: list[dict], method: str, key: str = "final_reward") -> dict[int, float]:
    """{seed: figure} of one method's runs."""
    return {r["seed"]: r[key] for r in runs if r["method"] == method}


#: The references every method is compared with, seed by seed.
REFERENCES = ("naive", "on_policy")


def paired(summary: dict) -> dict:
    """``{"vs_naive": {method: d}, "vs_on_policy": {...}}``: each method's final exact match minus
    the reference's, seed by seed (:func:`rollout_correction.demo.results.paired_difference`).
    Computed from ``summary["runs"]``, so it applies to any results file."""
    out = {}
    for ref in REFERENCES:
        if ref in summary["methods"]:
            base = finals(summary["runs"], ref)
            out[f"vs_{ref}"] = {m: paired_difference(finals(summary["runs"], m), base)
                                for m in summary["methods"] if m != ref}
    return out


def claims(summary: dict) -> dict:
    """The pre-declared claims (``config.declared_claims``: by default on-policy − naive and
    recommended − naive), each judged on its paired interval: it *holds* when the interval of
    (method − minus) lies above 0. A claim whose methods did not both run, or that has one seed, is
    not evaluated (``evaluated`` False, ``holds`` None) and never counts as holding."""
    cfg = summary["config"]
    recommended = cfg.get("recommended")
    methods = summary["methods"]
    rows = []
    for a, b in declared_claims(cfg):
        name = ("recommended" if a == recommended and a != "on_policy" else a) + "_beats_" + b
        row = {"claim": name, "method": a, "minus": b}
        if a is None:
            row.update(evaluated=False, holds=None, reason="the scenario recommends no correction")
        elif a not in methods or b not in methods:
            row.update(evaluated=False, holds=None, reason=f"needs the {a} and {b} methods in the run")
        else:
            d = paired_difference(finals(summary["runs"], a), finals(summary["runs"], b))
            row.update(evaluated=d["verdict"] is not None, difference=d,
                       holds=None if d["verdict"] is None else d["verdict"] == "above",
                       reason=None if d["verdict"] is not None else "one seed: no paired interval")
        rows.append(row)
    nv = methods.get("naive")
    return {
        "recommended": recommended,
        "claims": rows,
        "all_hold": all(r.get("holds") is True for r in rows),
        "naive_kl_growth": nv["kl_growth"] if nv else None,
    }


# ---------------------------------------------------------------------------------------------
# Plots


def _series(raw: dict, method: str, key: str):
    """(x, per-seed y lists) for a history key or an ``evals:<key>``."""
    rows = [r for r in raw["results"] if r["method"] == method]
    if key.startswith("evals:"):
        k = key.split(":", 1)[1]
        return rows[0]["evals"]["step"], [r["evals"][k] for r in rows]
    ys = [r["history"][key] for r in rows if key in r["history"]]
    return list(range(1, len(ys[0]) + 1)) if ys else [], ys


def _smooth(ys, window: int):
    if window <= 1:
        return ys
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _line_style(i: int) -> tuple[str, str]:
    """Colour and dash of the i-th method: the ten default colours solid, then again dashed, so
    up to 30 methods stay distinguishable."""
    return f"C{i % 10}", ("-", "--", ":")[(i // 10) % 3]


def _draw(ax, cfg: DemoConfig, raw: dict, stem: str) -> None:
    key, title, ylabel, log = PLOTS[stem]
    window = 1 if key.startswith("evals:") else max(1, cfg.steps // 30)
    for i, m in enumerate(cfg.methods):
        x, ys = _series(raw, m, key)
        if not ys:
            continue
        ys = [_smooth(y, window) for y in ys]
        mean = [_mean(col) for col in zip(*ys)]
        color, style = _line_style(i)
        ax.plot(x, mean, color=color, ls=style, label=METHODS[m].label, lw=1.6)
        if len(ys) > 1:
            cis = [interval(c)["ci"] or (float("nan"),) * 2 for c in zip(*ys)]  # the table's 95 % interval
            ax.fill_between(x, [c[0] for c in cis], [c[1] for c in cis], color=color, alpha=0.15, lw=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(ylabel)
    if log:  # symlog: the on-policy gap is ~0 (and may be slightly negative)
        ax.set_yscale("symlog", linthresh=1e-3 if key != "grad_norm" else 1e-2)
        if key == "grad_norm":  # a norm: no negative ticks where an interval's lower end dips below 0
            ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def plot_all(cfg: DemoConfig, raw: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for stem in PLOTS:  # a metric no method of this run reports (MoE routing without MoE) gets no plot
        if not any(_series(raw, m, PLOTS[stem][0])[1] for m in cfg.methods):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        _draw(ax, cfg, raw, stem)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=110)
        plt.close(fig)
        files.append(f"{stem}.png")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, stem in zip(axes.flat, OVERVIEW):
        _draw(ax, cfg, raw, stem)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    ncol = min(4, len(labels))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    fig.suptitle(_scenario_line(cfg), fontsize=10)
    legend_rows = -(-len(labels) // ncol) if labels else 0
    fig.tight_layout(rect=(0, 0.02 + 0.028 * legend_rows, 1, 0.96))
    fig.savefig(out_dir / "overview.png", dpi=110)
    plt.close(fig)
    files.append("overview.png")
    return files


def plot_by_length(cfg: DemoConfig, summary: dict, path: Path) -> bool:
    """Two panels against response length L (the first L answer tokens): the ESS / N of the
    untruncated sequence weight ∏ρₜ (solid) and of its geometric mean (dashed), last tenth of
    training; and the final prefix exact match with the table's 95 % interval over seeds. False
    (nothing drawn) when the runs carry no per-length figures."""
    import matplotlib.pyplot as plt

    if not any(r.get("ess_seq_by_length") for r in summary["runs"]):
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, m in enumerate(summary["methods"]):
        rs = [r for r in summary["runs"] if r["method"] == m]
        color, style = _line_style(i)
        for key, ls, tag in (("ess_seq_by_length", "-", "∏ρ"), ("ess_geo_by_length", "--", "geo")):
            ys = [r[key] for r in rs if r.get(key)]
            if ys:
                x = rs[0].get("ess_lengths") or range(1, len(ys[0]) + 1)
                a1.plot(x, [_mean(c) for c in zip(*ys)], color=color, ls=ls, label=f"{METHODS[m].label} ({tag})",
                        lw=1.4)
        ys = [r["final_by_length"] for r in rs if r.get("final_by_length")]
        if ys:
            x = rs[0].get("answer_lengths") or range(1, len(ys[0]) + 1)
            stats = [interval(c) for c in zip(*ys)]
            a2.plot(x, [st["mean"] for st in stats], color=color, ls=style, label=METHODS[m].label, lw=1.6)
            if all(st["ci"] for st in stats):
                a2.fill_between(x, [st["ci"][0] for st in stats], [st["ci"][1] for st in stats], color=color,
                                alpha=0.15, lw=0)
    a1.set(title="ESS / N of the sequence weight, last tenth of training", xlabel="response length L (tokens)",
           ylabel="ESS / N", yscale="log")
    a2.set(title="final exact match of the first L answer tokens (95 % interval)", xlabel="answer tokens L",
           ylabel="exact match", ylim=(0, 1))
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(_scenario_line(cfg), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_comparison(cfg: DemoConfig, summary: dict, path: Path) -> None:
    """One row per method: trainer final (bar, with the table's 95 % interval over seeds) and best
    (marker) exact match,
    with the collapse count, the last-tenth mismatch KL and the wall time per run written beside it."""
    import matplotlib.pyplot as plt

    names = list(summary["methods"])
    fig, ax = plt.subplots(figsize=(9.5, 0.45 * len(names) + 1.6))
    for i, m in enumerate(names):
        s = summary["methods"][m]
        final, best = s["final_reward"], s["best_reward"]
        err = None if final.get("ci") is None else [[final["mean"] - final["ci"][0]], [final["ci"][1] - final["mean"]]]
        ax.barh(i, final["mean"], xerr=err, color="C3" if s["collapsed"] else "C0", alpha=0.8, error_kw={"lw": 1})
        ax.plot(best["mean"], i, "k|", ms=12, mew=2)
        ax.text(1.02, i, f"collapsed {s['collapsed']}/{s['runs']}   KL {_kl(s['final_mismatch_kl'])}   "
                f"{_secs(s['seconds']['mean'])} s", va="center", fontsize=8, transform=ax.get_yaxis_transform())
    ax.set_yticks(range(len(names)), [summary["methods"][m]["label"] for m in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("greedy exact match of the trainer: final (bar, 95 % interval over seeds), best (|)")
    ax.set_title(_scenario_line(cfg), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0, 0.72, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Markdown and terminal table


def _scenario_line(cfg: DemoConfig) -> str:
    tail = f" + {cfg.tail} unscored tokens" if cfg.tail else ""
    return (f"scenario {cfg.scenario}: {cfg.task} {cfg.digits} digits{tail}, model {cfg.model}, engine "
            f"{cfg.precision}/{cfg.quant}/lag {cfg.lag}; {cfg.steps} steps × {cfg.prompts}×{cfg.samples}; "
            f"seeds {list(cfg.seeds)}")


def fixed(x: float, digits: int = 2, signed: bool = False) -> str:
    """``x`` to ``digits`` decimals, without a minus sign on a value that rounds to zero ("-0.00")."""
    x = round(x, digits) + 0.0
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _pm(s: dict) -> str:
    return f"{fixed(s['mean'])} ± {fixed(s['std'])}"


def _ci(s: dict) -> str:
    """Mean and 95 % interval over seeds, "0.87 [0.82, 0.92]" (the mean alone from one seed)."""
    if s.get("ci") is None:
        return fixed(s["mean"])
    return f"{fixed(s['mean'])} [{fixed(s['ci'][0])}, {fixed(s['ci'][1])}]"


def _tie(summary: dict, method: str) -> str:
    """"yes" when the method's paired interval against the best method covers 0 (recomputed from the
    runs, so any results file reads the same), "n/a" with one seed."""
    tied = tied_with_best({m: finals(summary["runs"], m) for m in summary["methods"]})
    if tied is None:
        return "n/a"
    return "yes" if method in tied else "—"


def diff_text(d: dict | None) -> str:
    """A paired difference as "+0.12 [+0.05, +0.19]" (the mean alone from one seed)."""
    if d is None or d["n"] == 0:
        return "—"
    if d.get("ci") is None:
        return fixed(d["mean"], signed=True)
    low, high = (fixed(x, signed=True) for x in d["ci"])
    return f"{fixed(d['mean'], signed=True)} [{low}, {high}]"


def signs_text(d: dict | None) -> str:
    """The sign count of a paired difference: seeds above / below (/ equal, when any)."""
    if d is None or d["n"] == 0:
        return "—"
    return f"{d['above']}/{d['below']}" + (f" ({d['equal']} equal)" if d["equal"] else "")


def _secs(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def _kl(x: float) -> str:
    return f"{0.0 if abs(x) < 5e-5 else x:.4f}"  # the on-policy gap is rounding noise of either sign


def table_rows(summary: dict) -> list[list[str]]:
    pairs = paired(summary).get("vs_naive", {})
    rows = []
    for m, s in summary["methods"].items():
        d = pairs.get(m)
        rows.append([
            s["label"], s["preset"] or "—", _ci(s["final_reward"]), diff_text(d), signs_text(d), _tie(summary, m),
            _pm(s["best_reward"]), _pm(s["final_engine_reward"]),
            f"{_kl(s['initial_mismatch_kl'])} → {_kl(s['final_mismatch_kl'])}", f"{s['collapsed']}/{s['runs']}",
            _secs(s["seconds"]["mean"]),
        ])
    return rows


TABLE_HEADER = ["method", "preset", "trainer final [95 % CI]", "− naive, paired [95 % CI]", "seeds above / below naive",
                "tied with best (paired)", "trainer best", "engine final", "mismatch KL first → last", "collapsed",
                "wall s / run"]
_TERMINAL_COLUMNS = (0, 2, 3, 4, 5, 6, 7, 8, 9, 10)


def kl_trend(growth: float) -> str:
    """A change of the mismatch KL by the factor ``growth`` (last over first), in words: a rise
    "grows ×4.8", a fall "falls by 29 %" (never "grows ×0.7"), and within 5 % "stays level (×1.02)"."""
    if growth >= 1.05:
        return f"grows ×{growth:.1f}"
    if growth <= 0.95:
        return f"falls by {100 * (1 - growth):.0f} %"
    return f"stays level (×{growth:.2f})"


def claims_text(summary: dict) -> list[str]:
    """The pre-declared claims in words, with their paired intervals and sign counts."""
    c = claims(summary)
    label = {m: x["label"] for m, x in summary["methods"].items()}
    lines = [f"Recommended before running: {label.get(c['recommended'], c['recommended']) or 'nothing'}"
             + (f" (`{c['recommended']}`)." if c["recommended"] else ".")]
    for r in c["claims"]:
        name = label.get(r["method"]) or (METHODS[r["method"]].label if r["method"] in METHODS else "recommended")
        minus = label.get(r["minus"]) or METHODS[r["minus"]].label
        if not r["evaluated"]:  # a claim is judged only on two runs of the same seeds, never taken as holding
            d = r.get("difference")
            lines.append(f"- {name} − {minus} > 0: not evaluated ({r['reason']})"
                         + (f"; per-seed difference {diff_text(d)}." if d else "."))
            continue
        d = r["difference"]
        word = "holds" if r["holds"] else "**does not hold**"
        short = "naive" if r["minus"] == "naive" else minus
        lines.append(f"- {name} − {minus} > 0: {word} — paired difference {diff_text(d)} over {d['n']} seeds, "
                     f"{d['above']} of {d['n']} seeds above {short} ({d['verdict']}).")
    if c["naive_kl_growth"] is not None and c["naive_kl_growth"] == c["naive_kl_growth"]:
        lines.append(f"Naive PPO's mismatch KL {kl_trend(c['naive_kl_growth'])} from the first to the last tenth "
                     "of training.")
    judged = [r for r in c["claims"] if r["evaluated"]]
    lines.append(("Both claims hold." if len(c["claims"]) == 2 else "Every claim holds.") if c["all_hold"] else
                 "**Not every claim holds in this run; see above.**" if judged else
                 "The claims need two or more seeds and both methods in the run.")
    return lines


def write_markdown(cfg: DemoConfig, summary: dict, files: list[str], out_dir: Path, command: str) -> None:
    lines = [
        "# Rollout-correction demo report", "",
        _scenario_line(cfg) + ".", "",
        f"Command: `{command}`", "",
        f"Wall time {summary['seconds']['total']:.0f} s (SFT {summary['seconds']['sft']:.0f} s), "
        f"{cfg.workers} worker(s) × {cfg.threads} thread(s); CPU time per GRPO run "
        f"{_mean([r['cpu_seconds'] for r in summary['runs']]):.0f} s on average (wall time depends on what else "
        "runs on the machine). SFT exact match per seed: "
        + ", ".join(f"{k}: {v:.2f}" for k, v in summary["sft_reward"].items()) + ".", "",
    ]
    if summary["resumed"]:
        lines += [f"{summary['resumed']} of {len(summary['runs'])} runs were reused from `runs/` (`--resume`); "
                  "the wall time covers only this invocation.", ""]
    lines += [
        provenance_line(summary["provenance"]), "",
        *([f"**Mixed provenance:** the runs come from {len(summary['run_provenance'])} different commits, "
           "machines or settings (`run_provenance` in summary.json); do not compare their rows as one "
           "measurement.", ""] if summary["mixed_provenance"] else []),
        "Rewards are greedy exact match on a fixed set of "
        f"{cfg.eval_prompts} held-out prompts. *Trainer final* is the mean over seeds with its 95 % Student-t "
        "interval (one seed: no interval). Comparisons are paired: the runs of one seed start from the same SFT "
        "weights and see the same prompts, so *− naive* is the mean of the per-seed differences with its 95 % "
        "t-interval, beside the count of seeds above / below naive; *tied with best*: the paired interval against "
        "the highest mean covers 0 (methods inside a tie are not ranked); the other columns are mean ± sample "
        "standard deviation "
"(n − 1) over seeds. *Trainer* is the fp32 policy being "
        "trained, *engine* its rollout copy. Mismatch KL is the k1 estimate of KL(π_rollout ‖ π_old) per "
        "token over the first and last tenth of training. A run collapsed if its final exact match is below "
        "half of its best.", "",
        "| " + " | ".join(TABLE_HEADER) + " |",
        "|" + "---|" * len(TABLE_HEADER),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(summary)]
    lines += ["", "Per seed — trainer final / engine final exact match, final mismatch KL:", ""]
    lines += _per_seed_table(cfg, summary, "seed {}", lambda r: (
        f"{r['final_reward']:.2f} / {r['final_engine_reward']:.2f}, KL {_kl(r['final_mismatch_kl'])}"))
    lines += routing_lines(summary.get("routing", {}))
    lines += ["", "## Claims (declared before running)", ""] + claims_text(summary)
    lines += ["", "## Health monitor", ""] + health_lines(cfg, summary)
    if cfg.steps < 300:
        lines += ["", f"This run has only {cfg.steps} GRPO steps: the mismatch builds up over hundreds of steps, "
                  "so a short run (such as `--quick`) shows the machinery, not the effect."]
    lines += ["", "## Plots", ""]
    lines += [f"![{f[:-4]}]({f})" for f in files]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    (out_dir / "report.html").write_text(report_html(lines, out_dir, "Rollout-correction demo report"))


_HTML_STYLE = """body{font:15px/1.45 system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:.85em;display:block;overflow-x:auto}
td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right}td:first-child,th:first-child{text-align:left}
th{background:#eef2f6}code{background:#f2f2f2;padding:0 .2em}img{max-width:100%}"""


def _html_inline(text: str) -> str:
    """Escaped text with the marks report.md uses: `code`, **bold**, *italic*."""
    import html
    import re

    t = html.escape(text, quote=False)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", t)
    return re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"<i>\1</i>", t)


def report_html(lines: list[str], out_dir: Path, title: str) -> str:
    """The lines of report.md as one self-contained page: headings, paragraphs, lists and tables,
    with the plots embedded (base64 data URIs), so the file can be mailed or archived alone."""
    import base64
    import html
    import re

    body, table, items = [], [], []

    def flush() -> None:
        if table:
            head, *rows = table
            body.append("<table><tr>" + "".join(f"<th>{_html_inline(c)}</th>" for c in head) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{_html_inline(c)}</td>" for c in r) + "</tr>" for r in rows)
                        + "</table>")
            table.clear()
        if items:
            body.append("<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in items) + "</ul>")
            items.clear()

    for line in lines:
        image = re.fullmatch(r"!\[(.*)\]\((.+)\)", line)
        if line.startswith("|"):
            if not re.fullmatch(r"\|(-+\|)+", line.replace(" ", "")):
                table.append([c.strip() for c in line.strip().strip("|").split(" | ")])
            continue
        if line.startswith("- "):
            items.append(line[2:])
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{_html_inline(line[level:].strip())}</h{level}>")
        elif image:
            data = base64.b64encode((out_dir / image[2]).read_bytes()).decode("ascii")
            body.append(f"<figure><img alt='{html.escape(image[1])}' src='data:image/png;base64,{data}'>"
                        f"<figcaption>{html.escape(image[1])}</figcaption></figure>")
        elif line.strip():
            body.append(f"<p>{_html_inline(line)}</p>")
    flush()
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_HTML_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def provenance_line(p: dict) -> str:
    """One sentence: the commit, machine, threads, date and command of a result."""
    commit = (p["commit"] or "no git checkout")[:12] + (" with uncommitted changes" if p.get("dirty") else "")
    return (f"Commit {commit}; torch {p['torch']}, Python {p['python']}; {p['cpu']} ({p['logical_cpus']} logical "
            f"CPUs), {p['workers']} worker(s) × {p['threads']} thread(s); {p['date']}; `{p['command']}`.")


def health_lines(cfg: DemoConfig, summary: dict) -> list[str]:
    """Per method and seed: the monitor's first warning and the step the trainer's exact match fell
    0.1 below its best (docs/monitoring.md)."""
    lines = ["`rollout_correction.monitor.HealthMonitor` (default rules) replayed on each run's "
             f"`rollout_corr/*` metrics. *Fall*: the first evaluation at which the trainer's exact match is "
             f"{FALL} or more below its best; *lead*: fall − first warning, in GRPO steps.", ""]

    def cell(r: dict) -> str:
        h = r.get("health")
        if not h or not h["monitored"]:
            return "—"
        warn = f"{h['first_warning']} ({h['first_warning_rule']})" if h["first_warning"] is not None else "none"
        fall = h["fall_step"] if h["fall_step"] is not None else "no fall"
        lead = f"{h['lead']:+d}" if h["lead"] is not None else "—"
        return f"{warn} · {fall} · {lead}"

    return lines + _per_seed_table(cfg, summary, "seed {}: first warning · fall · lead", cell)


def _per_seed_table(cfg: DemoConfig, summary: dict, header: str, cell) -> list[str]:
    """A markdown table, one row per method and one column per seed (``header`` formatted with
    the seed); ``cell(run)`` writes a run's cell, "—" where the run is missing."""
    lines = ["| method | " + " | ".join(header.format(s) for s in cfg.seeds) + " |",
             "|---|" + "---|" * len(cfg.seeds)]
    for m in cfg.methods:
        runs = [next((r for r in summary["runs"] if r["method"] == m and r["seed"] == s), None) for s in cfg.seeds]
        lines.append(f"| {METHODS[m].label} | " + " | ".join("—" if r is None else cell(r) for r in runs) + " |")
    return lines


def print_table(summary: dict, console=None) -> None:
    """The summary table and the checks. The table is whole where it fits (a terminal's width; in a
    log, a pipe, ``tee`` or CI, :data:`~rollout_correction.console.LOG_WIDTH` columns), one block per
    method otherwise; the claims are one line each."""
    from rich.console import Console

    console = console or Console()
    print_fitted(console, "greedy exact match: final mean [95 % interval] over seeds; other columns mean ± sample "
                          "std (n − 1)", [TABLE_HEADER[i] for i in _TERMINAL_COLUMNS],
                 [[r[i] for i in _TERMINAL_COLUMNS] for r in table_rows(summary)])
    for line in claims_text(summary):
        print_unwrapped(console, line.replace("**", ""))


def print_fitted(console, title: str, header: list[str], rows: list[list[str]]) -> None:
    """A table that is never cut: whole when it fits the width it may take (a terminal's own, or
    :data:`~rollout_correction.console.LOG_WIDTH` columns without a terminal, where rich would assume
    80 and wrap the cells), otherwise one block per row (its first cell, then ``header: value``
    lines)."""
    from rich.markup import escape
    from rich.table import Table

    from rollout_correction.console import LOG_WIDTH

    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        table.add_row(*r)
    need = console.measure(table, options=console.options.update_width(1000)).maximum
    if need <= (console.width if console.is_terminal else LOG_WIDTH):
        print_unwrapped(console, table)
        return
    console.print(title, markup=False, soft_wrap=not console.is_terminal)
    for r in rows:
        console.print(f"[bold]{escape(r[0])}[/bold]", soft_wrap=True)
        for h, cell in zip(header[1:], r[1:]):
            console.print(f"  {h}: {cell}", soft_wrap=True, markup=False)


def print_unwrapped(console, renderable) -> None:
    """Print in full width when the console is not a terminal (rich assumes 80 columns there): a
    line of text stays one line, a table takes the width it needs (:func:`print_fitted` keeps it
    within :data:`~rollout_correction.console.LOG_WIDTH`)."""
    if console.is_terminal:
        console.print(renderable)
    elif isinstance(renderable, str):
        console.print(renderable, soft_wrap=True)
    else:
        need = console.measure(renderable, options=console.options.update_width(1000)).maximum
        width = console.width
        console.width = max(width, need)
        try:
            console.print(renderable)
        finally:
            console.width = width


def _finite_or_null(x):
    """Strict JSON: undefined numbers (e.g. a KL growth from a zero gap) become null."""
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_null(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_report(cfg: DemoConfig, raw: dict, out_dir: Path, command: str, prov: dict | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(cfg, raw, command, prov)
    summary["routing"] = routing_summary(cfg, raw)
    (out_dir / "summary.json").write_text(json.dumps(_finite_or_null(summary), indent=2, allow_nan=False))
    files = plot_all(cfg, raw, out_dir)
    plot_comparison(cfg, summary, out_dir / "methods.png")
    files.insert(0, "methods.png")
    if plot_by_length(cfg, summary, out_dir / "by_length.png"):
        files.insert(1, "by_length.png")
    write_markdown(cfg, summary, files, out_dir, command)
    return summary


# ---------------------------------------------------------------------------------------------
# Mixture of experts: routing agreement and what routing replay does to the other corrections.

ROUTING_COLUMNS = {  # history key -> (header, format)
    "routing_match": ("top-k sets matching", "{:.3f}"),
    "routing_token_differs": ("tokens routed differently", "{:.3f}"),
    "kl": ("mismatch KL", "{:.4f}"),
    "other_token_is_clipped": ("token TIS: ρ > 2", "{:.4f}"),
    "other_token_is_std": ("token IS weight std", "{:.3f}"),
    "other_token_is_ess": ("token IS ESS", "{:.3f}"),
    "other_seq_is_rs_rejected": ("seq IS + RS rejected", "{:.3f}"),
    "other_geo_rs_rejected": ("geometric RS rejected", "{:.3f}"),
}


def routing_summary(cfg: DemoConfig, raw: dict) -> dict:
    """Per method, the mean over all GRPO steps and seeds of each routing column (empty for dense
    models)."""
    out = {}
    for m in cfg.methods:
        rows = [r for r in raw["results"] if r["method"] == m and "routing_match" in r["history"]]
        if rows:
            out[m] = {k: _mean([_mean(r["history"][k]) for r in rows if k in r["history"]]) for k in ROUTING_COLUMNS}
    return out


def routing_lines(routing: dict) -> list[str]:
    if not routing:
        return []
    header = ["method"] + [h for h, _ in ROUTING_COLUMNS.values()]
    lines = ["", "## Routing agreement and the other corrections", "",
             "Means over every GRPO step and seed. Routing agreement compares the experts the engine routed each "
             "response token's input to during sampling with the trainer's routers' own choice in its π_old "
             "forward (for R3 methods: given the replayed routing of the layers below). The last five columns "
             "are what the other corrections would do with the step's gap π_old vs π_rollout (π_old replayed "
             "for R3 methods): the share of tokens token TIS truncates, the token IS weights' spread and "
             "effective sample size, and the share of sequences the seq IS + RS and geometric RS presets reject.",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m, values in routing.items():
        cells = [fmt.format(values[k]) if values[k] == values[k] else "—" for k, (_, fmt) in ROUTING_COLUMNS.items()]
        lines.append("| " + " | ".join([METHODS[m].label] + cells) + " |")
    return lines
