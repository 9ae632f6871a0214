"""Render the result tables of docs/*.md from the results files under docs/results/.

    python tools/render_results.py           # rewrites every rendered block
    python tools/render_results.py --check   # exit 1 (and name the block) where a page differs

A rendered block sits between two comments in a page:

    <!-- results: demo-stale -->
    ...generated lines...
    <!-- /results -->

``BLOCKS`` maps each block name to its renderer and the results files it reads. A demo results file
is a demo ``summary.json`` (``rollout_correction/demo/report.py``): per-method means, 95 %
intervals over seeds, the methods tied with the best, and the provenance of the invocation and of
every run (commit, torch, Python, CPU, workers × threads, date, command). A block says under its
table where and how the figures were measured, and says so when they come from more than one
commit or machine. tests/test_results_tables.py checks that the pages equal this rendering.

Every comparison is recomputed from the per-seed runs of the file (``demo/report.py``): each
method's paired difference with naive PPO (95 % t-interval and sign count), the ties with the best
(a paired interval covering 0) and the pre-declared claims. Methods whose runs are identical seed by
seed (aliases at one update per batch) are shown once, their other names beside it. A block that
reads several results files refuses files from different commits (``ONE_COMMIT``); a file not yet
measured renders as one line saying so.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "core" / "src")]  # the toolkit and the core, from this checkout

from rollout_correction.demo.report import (  # noqa: E402
    TABLE_HEADER, _ci, _kl, _tie, claims, claims_text, diff_text, finals, fixed, paired, provenance_line, signs_text,
    table_rows)

BEGIN = re.compile(r"^<!-- results: ([\w.-]+) -->$")
END = "<!-- /results -->"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def measured(name: str) -> bool:
    return (RESULTS / name).is_file()


def not_measured(name: str) -> list[str]:
    return [f"`docs/results/{name}` has not been measured yet: `tools/run_demo_results.sh` writes it."]


def commits_of(s: dict) -> set[tuple[str | None, bool | None]]:
    """The (commit, dirty) pairs of a results file: its invocation's and every run's."""
    runs = {(g.get("commit"), g.get("dirty")) for g in s.get("run_provenance") or []}
    return {(s["provenance"]["commit"], s["provenance"].get("dirty"))} | runs


def one_commit(files: list[tuple[str, dict]]) -> None:
    """Refuse a results file whose runs come from different commits (runs resumed from another
    invocation) and results files of different commits (or with uncommitted changes) in one block."""
    for n, s in files:
        if len(commits_of(s)) > 1 or s.get("mixed_provenance"):
            seen = ", ".join(f"{(c or '?')[:12]}{' (dirty)' if d else ''}" for c, d in sorted(commits_of(s), key=str))
            raise SystemExit(f"{n} holds runs of different commits or machines ({seen}) — re-run it in one "
                             "invocation (tools/run_demo_results.sh)")
    commits = {(s["provenance"]["commit"], s["provenance"].get("dirty")) for _, s in files}
    if len(commits) > 1:
        raise SystemExit("results files from different commits in one block: " + "; ".join(
            f"{n} at {(s['provenance']['commit'] or '?')[:12]}{' (dirty)' if s['provenance'].get('dirty') else ''}"
            for n, s in files) + " — re-run them together (tools/run_demo_results.sh)")


def load_one(name: str) -> dict:
    """A results file, refused when its runs come from different commits (:func:`one_commit`)."""
    s = load(name)
    one_commit([(name, s)])
    return s


#: The headline results files, measured together at one commit by ``tools/run_demo_results.sh``.
HEADLINE = ("demo-default.json", "demo-stale.json", "demo-stale-seeds5-9.json", "demo-quantized.json",
            "demo-long.json")


def headline_commit() -> str | None:
    """The commit of the headline results files (None before they are measured)."""
    return load(HEADLINE[1])["provenance"]["commit"] if measured(HEADLINE[1]) else None


#: The settings that decide a run's result, compared by :func:`design_mark`.
_DESIGN = ("task", "digits", "tail", "reward", "model", "precision", "quant", "granularity", "lag", "sft_steps",
           "sft_batch", "sft_lr", "steps", "prompts", "samples", "lr", "minibatches", "clip_eps", "max_grad_norm",
           "eval_every", "eval_prompts", "methods", "seeds", "recommended", "claims")


def design_mark(name: str, s: dict) -> str | None:
    """For a headline file measured with other settings than ``tools/run_demo_results.sh`` runs at
    this commit (a scenario changed since): the words that say so and which settings differ."""
    diff = design_diffs(name, s)
    if not diff:
        return None
    return ("measured with other settings than `tools/run_demo_results.sh` runs at this commit ("
            + "; ".join(diff) + "): re-run it to measure this scenario as it stands")


def design_diffs(name: str, s: dict) -> list[str]:
    """The settings of a headline file that differ from those the script runs at this commit, as
    "name then (now value)"; empty when none does or the file is no headline file."""
    import argparse

    from rollout_correction.demo.cli import add_arguments, config_from_args
    from rollout_correction.demo.config import declared_claims
    from rollout_correction.demo.headline import HEADLINES

    h = HEADLINES.get(name)
    if h is None:
        return []
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    now = config_from_args(parser.parse_args(["--scenario", h.scenario, "--methods", ",".join(h.methods), "--seeds",
                                              ",".join(map(str, h.seeds))])).to_dict()
    then = s["config"]
    defaults = {"tail": 0, "claims": None}

    def value(cfg: dict, key: str):
        if key == "claims":
            return [list(pair) for pair in declared_claims(cfg)]
        return list(cfg[key]) if isinstance(cfg.get(key), (list, tuple)) else cfg.get(key, defaults.get(key))

    return [f"{k} {value(then, k)} (now {value(now, k)})" for k in _DESIGN if value(then, k) != value(now, k)]


def older_mark(s: dict) -> str | None:
    """For a file measured at another commit than the headline files: the words that say so."""
    head, own = headline_commit(), s["provenance"]["commit"]
    if head is None or own == head:
        return None
    return f"measured at an older commit, `{(own or '?')[:7]}`, not at the headline files' `{head[:7]}`"


def aliases(s: dict) -> dict[str, list[str]]:
    """{method shown: [methods identical to it, seed by seed]} — a declared alias
    (``demo.config.ALIASES``: equal at one update per batch) is folded into the method it aliases
    when their runs are identical: the same final, best and engine exact match and the same
    mismatch KL on every seed, two or more seeds."""
    from rollout_correction.demo.config import ALIASES

    keys = ("final_reward", "best_reward", "final_engine_reward", "final_mismatch_kl")
    sig = {}
    for m in s["methods"]:
        rs = sorted((r for r in s["runs"] if r["method"] == m), key=lambda r: r["seed"])
        sig[m] = tuple((r["seed"],) + tuple(r.get(k) for k in keys) for r in rs) if len(rs) > 1 else (m,)
    out: dict[str, list[str]] = {m: [] for m in s["methods"] if not (ALIASES.get(m) in sig and sig[ALIASES[m]] == sig[m])}
    for m in s["methods"]:
        if m not in out:
            out[ALIASES[m]].append(m)
    return out


def _label(s: dict, m: str, folded: dict[str, list[str]]) -> str:
    same = folded.get(m) or []
    return s["methods"][m]["label"] + (f" (= {', '.join(s['methods'][a]['label'] for a in same)})" if same else "")


def _cpu_seconds(summary: dict, method: str) -> str:
    xs = [r["cpu_seconds"] for r in summary["runs"] if r["method"] == method and r.get("cpu_seconds") is not None]
    return f"{statistics.fmean(xs):.0f}" if xs else "—"


_MACHINE = ("commit", "dirty", "torch", "python", "cpu", "threads")


def measured_with(summaries: list[tuple[str, dict]]) -> list[str]:
    """Lines under a table: one provenance sentence per results file (the invocation that wrote it),
    and a warning where the runs behind the table differ in commit, machine or threads."""
    lines = []
    for name, s in summaries:
        marks = [m for m in (older_mark(s), design_mark(name, s)) if m]
        lines.append("".join(f"**{m[0].upper() + m[1:]}.** " for m in marks)
                     + f"`docs/results/{name}`: " + provenance_line(s["provenance"]))
    kinds = {tuple(p.get(k) for k in _MACHINE) for _, s in summaries for p in s["run_provenance"]}
    if len(kinds) > 1:
        lines.append("**These rows come from more than one commit, machine or thread count** (see `run_provenance` "
                     "in the results files); compare them only through their intervals.")
    else:
        lines.append("Every run of this table: one commit, one machine, one thread count.")
    return lines


def per_seed(s: dict, group: str, key: str, title: str) -> list[str]:
    """The final exact match of each run, one row per method (or mode), one column per seed."""
    seeds = s["config"]["seeds"]
    lines = ["| " + title + " | " + " | ".join(f"seed {x}" for x in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for m, ms in s[group].items():
        finals = {r["seed"]: r["final_reward"] for r in s["runs"] if r[key] == m}
        lines.append(f"| {ms['label']} | " + " | ".join(f"{finals[x]:.2f}" if x in finals else "—" for x in seeds) + " |")
    return lines


def demo_table(name: str) -> list[str]:
    """One scenario: the demo report's table (paired differences with naive included; identical
    methods folded into one row), the trainer's final exact match per seed, provenance."""
    if not measured(name):
        return not_measured(name)
    s = load_one(name)
    folded = aliases(s)
    header = TABLE_HEADER[:-1] + ["CPU s / run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m, row in zip(s["methods"], table_rows(s)):
        if m in folded:
            lines.append("| " + " | ".join([_label(s, m, folded)] + row[1:-1] + [_cpu_seconds(s, m)]) + " |")
    lines += [""] + per_seed(s, "methods", "method", "trainer final per seed")
    return lines + [""] + measured_with([(name, s)])


def demo_headline(*names: str) -> list[str]:
    """docs/demo.md: the scenarios side by side (one results file each), one row per method."""
    files = [(n, load(n)) for n in names]
    one_commit(files)
    per = ["final [95 % CI]", "− naive, paired", "seeds > / < naive", "tied with best", "KL last", "collapsed"]
    header = ["method", "preset"]
    for _, s in files:
        header += [f"{s['config']['scenario']}: {h}" if i == 0 else h for i, h in enumerate(per)]
    header.append("CPU s / run" + (f" ({' / '.join(s['config']['scenario'] for _, s in files)})" if len(files) > 1 else ""))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    methods = list(dict.fromkeys(m for _, s in files for m in s["methods"]))

    def cells(s: dict, m: str) -> list[str]:
        if m not in s["methods"]:
            return ["not run"] + ["—"] * (len(per) - 1)
        x = s["methods"][m]
        d = paired(s).get("vs_naive", {}).get(m)
        return [_ci(x["final_reward"]), diff_text(d), signs_text(d), _tie(s, m), f"{_kl(x['final_mismatch_kl'])}",
                f"{x['collapsed']}/{x['runs']}"]

    per_file = [aliases(s) for _, s in files]
    hidden = {m for m in methods if all(m not in a for a, (_, s) in zip(per_file, files) if m in s["methods"])}
    labels = {m: x["label"] for _, s in files for m, x in s["methods"].items()}
    folded = {m: [a for a in methods if a in hidden and any(a in f.get(m, []) for f in per_file)] for m in methods}
    for m in [m for m in methods if m not in hidden]:
        x = next(s["methods"][m] for _, s in files if m in s["methods"])
        preset = f"`{x['preset']}`" if x["preset"] else "—"
        row = [x["label"] + (f" (= {', '.join(labels[a] for a in folded[m])})" if folded[m] else ""), preset]
        for _, s in files:
            row += cells(s, m)
        row.append(" / ".join(_cpu_seconds(s, m) for _, s in files))
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""] + measured_with(files)


def demo_claims(*names: str) -> list[str]:
    """The claims each scenario declared before running (its ``recommended`` correction), judged on
    paired per-seed intervals, from the scenarios' results files (one commit)."""
    files = [(n, load(n)) for n in names if measured(n)]
    one_commit(files)
    lines = []
    for n, s in files:
        c = s["config"]
        seeds = c["seeds"]
        span = (f"seeds {seeds[0]}–{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2
                else "seeds " + ", ".join(map(str, seeds)))
        mark = design_mark(n, s)
        tail = f" + {c['tail']} unscored tokens" if c.get("tail") else ""
        lines.append(f"- **{c['scenario']}** ({c['task']} {c['digits']} digits{tail}, engine {c['precision']}/"
                     f"{c['quant']}/lag {c['lag']}, " + (f"{c['steps']} GRPO steps, " if c.get("steps") else "")
                     + f"{span}, `docs/results/{n}`)"
                     + (f" — **{mark}**:" if mark else ":"))
        lines += ["  " + x for x in claims_text(s)]
    for n in names:
        if not measured(n):
            lines += ["- " + x for x in not_measured(n)]
    if files:
        p = files[0][1]["provenance"]
        lines += ["", f"Judged seed by seed: a claim holds when the 95 % t-interval of the mean per-seed difference lies "
                      f"above 0 (a tie when it covers 0). Commit {(p['commit'] or '?')[:12]}, {p['cpu']}."]
    return lines


def _names(s: dict, methods: list[str]) -> str:
    labels = [s["methods"][m]["label"] for m in methods]
    return ", ".join(labels[:-1]) + " and " + labels[-1] if len(labels) > 1 else (labels[0] if labels else "none")


def findings(name: str) -> list[str]:
    """What one scenario's results file shows, in words, every statement recomputed from its runs:
    the claims, naive's mismatch growth, the highest mean and the methods tied with it, each method
    against naive on its paired interval, and the collapses."""
    if not measured(name):
        return not_measured(name)
    s = load_one(name)
    c, pairs, folded = claims(s), paired(s).get("vs_naive", {}), aliases(s)
    shown = [m for m in s["methods"] if m in folded]
    n = len(s["config"]["seeds"])
    out = []
    for r in c["claims"]:
        a, b = s["methods"].get(r["method"], {}).get("label", r["method"]), s["methods"].get(r["minus"], {}).get(
            "label", r["minus"])
        if not r["evaluated"]:
            out.append(f"{a} − {b}: not evaluated ({r['reason']}).")
            continue
        d = r["difference"]
        out.append(f"{a} − {b} {'holds' if r['holds'] else 'does not hold'}: {diff_text(d)}, "
                   f"{d['above']} of {d['n']} seeds above, {d['below']} below.")
    nv = s["methods"].get("naive")
    if nv and nv.get("kl_growth") is not None:
        word = "rises" if nv["kl_growth"] > 1 else "falls"
        out.append(f"Naive PPO's mismatch KL {word} from {_kl(nv['initial_mismatch_kl'])} to "
                   f"{_kl(nv['final_mismatch_kl'])} per token (×{nv['kl_growth']:.1f}, first to last tenth).")
    means = {m: s["methods"][m]["final_reward"]["mean"] for m in shown}
    best = max(means, key=means.get)
    tied = [m for m in shown if m != best and _tie(s, m) == "yes"]
    out.append(f"Highest mean: {s['methods'][best]['label']} ({fixed(means[best])}); "
               + (f"tied with it on the paired intervals: {_names(s, tied)}." if tied
                  else "no other method ties with it."))
    for verdict, words in (("above", "Above naive on the paired interval"), ("tied", "Tied with naive"),
                           ("below", "Below naive")):
        ms = [m for m in shown if m in pairs and pairs[m]["verdict"] == verdict]
        if ms:
            out.append(f"{words}: " + ", ".join(f"{s['methods'][m]['label']} {diff_text(pairs[m])}" for m in ms) + ".")
    every = [m for m in shown if s["methods"][m]["collapsed"] == n]
    some = [m for m in shown if 0 < s["methods"][m]["collapsed"] < n]
    out.append("Collapsed on every seed: " + (_names(s, every) if every else "none") + "; on some seeds: "
               + (", ".join(f"{s['methods'][m]['label']} ({s['methods'][m]['collapsed']} of {n})" for m in some)
                  if some else "none") + ".")
    mark = design_mark(name, s)
    commit = (s["provenance"]["commit"] or "?")[:7]
    return [f"- {x}" for x in out] + ["", (f"**{mark[0].upper() + mark[1:]}.** " if mark else "")
                                      + f"From `docs/results/{name}` (commit {commit}), recomputed from its runs."]


def long_table(name: str) -> list[str]:
    """Scenario ``long``: the demo table, the per-token KL and length × per-token KL per method, the
    ESS of the sequence weight over the whole response, and the plot against response length
    (``docs/img/demo-long-by-length.png``, written with the results file)."""
    if not measured(name):
        return not_measured(name)
    s = load_one(name)
    lines = demo_table(name)
    c = s["config"]
    n = c["digits"] + (c.get("tail") or 0)  # on-policy's KL is 0 up to rounding: ``fixed`` prints no "-0.0"
    shown = [x for x in s["methods"].values() if x.get("initial_mismatch_kl") is not None]
    if shown:
        kls = [f"{x['label']} {_kl(x['initial_mismatch_kl'])} → {_kl(x['final_mismatch_kl'])} (× {n}: "
               f"{fixed(n * x['initial_mismatch_kl'], 1)} → {fixed(n * x['final_mismatch_kl'], 1)})" for x in shown]
        lines += ["", "Per-token mismatch KL, first → last tenth of training, and response length × per-token KL "
                      f"({n} tokens): " + ", ".join(kls) + "."]
    ess = []
    for m, x in s["methods"].items():
        rs = [r for r in s["runs"] if r["method"] == m and r.get("ess_seq_by_length")]
        if rs:
            seq = statistics.fmean(r["ess_seq_by_length"][-1] for r in rs)
            geo = statistics.fmean(r["ess_geo_by_length"][-1] for r in rs)
            ess.append(f"{x['label']} {seq:.3f} / {geo:.3f}")
    if ess:
        lines += ["", "ESS / N of the untruncated sequence weight ∏ρₜ / of its geometric mean over the whole "
                      f"response ({n} tokens), last tenth of training, mean over seeds: " + ", ".join(ess) + "."]
    if (ROOT / "docs" / "img" / "demo-long-by-length.png").is_file():
        lines += ["", "![ESS of the sequence weight against response length, and final exact match against answer "
                      "length](img/demo-long-by-length.png)"]
    return lines


def moe_table(name: str) -> list[str]:
    """Scenario ``moe``: the demo table, then the routing table of its report (means over every GRPO
    step and seed)."""
    from rollout_correction.demo.report import routing_lines

    routing = routing_lines(load_one(name).get("routing", {}))
    header = next(i for i, line in enumerate(routing) if line.startswith("| method"))
    return demo_table(name) + ["", "Routing agreement and what the other corrections would do with each step's "
                                   "gap (means over every GRPO step and seed):", ""] + routing[header:]


def time_table(*names: str) -> list[str]:
    """Wall and CPU time of each demo invocation behind the tables (from its results file)."""
    lines = ["| invocation | scenario | commit | runs | wall time (whole invocation) | CPU s per run: mean (min–max) "
             "| workers × threads |", "|---|---|---|---|---|---|---|"]
    for name in names:
        if not measured(name):
            continue
        s, total = load_one(name), None
        p = s["provenance"]
        if "modes" in s:  # --async: one run at a time
            total = s["seconds"] if isinstance(s["seconds"], (int, float)) else s["seconds"].get("total")
            shape = "1 × 1 (two processes)"
        else:
            total = s["seconds"]["total"]
            shape = f"{p['workers']} × {p['threads']}"
        cpu = [r["cpu_seconds"] for r in s["runs"]]
        commit = (f"`{(p['commit'] or '?')[:7]}`" + (" (older: not the headline files' commit)" if older_mark(s) else "")
                  + (" (measured with settings the script no longer runs)" if design_diffs(name, s) else ""))
        lines.append(f"| `{p['command']}` | {s['config'].get('scenario', '?')} | {commit} | {len(cpu)} | "
                     f"{int(total // 60)} min {int(total % 60):02d} s | "
                     f"{statistics.fmean(cpu):.1f} ({min(cpu):.0f}–{max(cpu):.0f}) | {shape} |")
    return lines + ["", "Measured on " + f"{load(names[0])['provenance']['cpu']} ({load(names[0])['provenance']['logical_cpus']} "
                        "logical CPUs), the figures' own runs (see each results file's provenance)."]


def default_time(name: str) -> list[str]:
    """The README's time bullet: the wall time of the default ``rollout-correction demo`` (its results file)."""
    s = load_one(name)
    p, c, total = s["provenance"], s["config"], s["seconds"]["total"]
    diffs = design_diffs(name, s)
    return [f"- **Time.** The default run ({len(c['methods'])} methods × {len(c['seeds'])} seeds × {c['steps']} GRPO steps) "
            f"took {int(total // 60)} min {int(total % 60):02d} s",
            f"  on two free CPU cores ({p['cpu']}, commit `{p['commit'][:7]}`, `docs/results/{name}`); longer on a busy",
            "  machine. `rollout-correction demo --quick` takes under a minute."
            + (f" **Not re-timed since the default changed ({'; '.join(diffs)}).**" if diffs else "")]


def step_cost_table(name: str) -> list[str]:
    """docs/demo.md's cost table: per scenario, the CPU time of a GRPO step, of an evaluation and of
    a run under each setting of ``benchmarks/demo_step_cost.py`` (medians), against the former one."""
    if not measured(name):
        return [f"`docs/results/{name}` has not been measured yet: `benchmarks/demo_step_cost.py --json` writes it."]
    s = load(name)
    lines = ["| scenario | settings | ms per GRPO step | ms per evaluation | CPU s per run | "
             "former ÷ this, paired: median (min–max) |", "|---|---|---|---|---|---|"]
    for scenario, r in s["scenarios"].items():
        for setting, f in r["settings"].items():
            ratios = f["former_over_this"]
            lines.append(f"| {scenario} ({r['steps']} steps) | {setting} | "
                         f"{statistics.median(f['step_s']) * 1000:.1f} | {statistics.median(f['eval_s']) * 1000:.0f} | "
                         f"{f['run_cpu_s']:.1f} ({r['steps']} steps + {f['evaluations']} × 2 evaluations) | "
                         f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}) |")
    phases = list(next(iter(s["scenarios"].values()))["settings"]["current"]["phase_s_per_step"])
    lines += ["", "Where a step's CPU time goes (ms per GRPO step, means; *other*: rewards, batching, metrics):", "",
              "| scenario | settings | " + " | ".join(phases) + " |", "|---|---|" + "---|" * len(phases)]
    for scenario, r in s["scenarios"].items():
        for setting, f in r["settings"].items():
            lines.append(f"| {scenario} | {setting} | "
                         + " | ".join(f"{f['phase_s_per_step'][p] * 1000:.1f}" for p in phases) + " |")
    before, after = s["load_average"]["before"], s["load_average"]["after"]
    return lines + ["", f"Medians of {s['reps']} repetitions (10 steps and one evaluation of each setting, "
                        "the order rotated); load average (1 / 5 / 15 min) "
                        f"{' / '.join(f'{x:.2f}' for x in before)} before, {' / '.join(f'{x:.2f}' for x in after)} "
                        f"after. `docs/results/{name}`: " + provenance_line(s["provenance"])]


def async_table(name: str) -> list[str]:
    """docs/demo.md's ``--async`` table: the report's columns, per-seed finals, the load around the
    run (the timings depend on it) and the invocation's provenance."""
    from rollout_correction.demo.async_report import COLUMNS
    from rollout_correction.demo.async_report import table_rows as async_rows

    s = load(name)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in async_rows(s)]
    lines += [""] + per_seed(s, "modes", "mode", "final exact match per seed")
    load_avg = s["load_average"]
    return lines + ["", f"Target {s['target']:.2f} exact match; load average (1 / 5 / 15 min) "
                        f"{' / '.join(f'{x:.2f}' for x in load_avg['before'])} before, "
                        f"{' / '.join(f'{x:.2f}' for x in load_avg['after'])} after, on {s['cpu_count']} cores.",
                    (f"**{older_mark(s)[0].upper() + older_mark(s)[1:]}.** " if older_mark(s) else "")
                    + f"`docs/results/{name}`: " + provenance_line(s["provenance"]).replace(
                        "1 worker(s) × 1 thread(s)", "one run at a time, one torch thread per process "
                                                     "(synchronous on-policy: 2)")]


def diffusion_table(name: str) -> list[str]:
    """docs/diffusion.md's tables of a ``diffusion-demo`` results file (variants, when it has runs,
    then the precision × noise × CFG scan), with the file's provenance."""
    from rollout_correction.diffusion.pipeline.report import render_table

    s = load(name)
    lines = render_table(s).split("\n")
    if not s["summary"]:  # a scan-only file: no variant table
        lines = lines[3:]
    p = s["provenance"]
    return lines + ["", f"`docs/results/{name}`: commit `{p['commit'][:7]}`, torch {p['torch']}, diffusers "
                        f"{p['diffusers']}, {p['cpu_model']} ({p['cpu_count']} CPUs, {p['threads']} thread), "
                        f"{p['date'][:10]}."]


def gpu_tables(name: str) -> list[str]:
    """docs/performance.md's GPU tables: the rows of a ``benchmarks/bench_gpu.py --json`` run, as that
    script renders them, with the device, versions and command of the run, and its cuda-test count."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_gpu import markdown

    s = load(name)
    p = s["provenance"]
    tests = "; ".join(f"at commit `{t['commit'][:7]}` {t['passed']} passed, {t['failed']} failed ({t['seconds']:.0f} s, "
                      f"{t['device']})" for t in s["cuda_tests"])
    return markdown(s["rows"]).rstrip("\n").split("\n") + [
        "", f"`docs/results/{name}`: {p['device']}, {p['cpus']} CPUs; torch {p['torch']}, CUDA {p['cuda']}, Python "
            f"{p['python']}; verl {p['verl']}; commit `{p['commit'][:7]}` (library core of `{p['core_commit'][:7]}`), "
            f"{p['date']}; `{p['command']}`.",
        f"`{s['cuda_tests'][0]['command']}`: {tests}."]


def cpu_tables(*names: str) -> list[str]:
    """docs/performance.md's CPU tables: the rows of ``benchmarks/bench_vs_verl.py --json`` runs, as that
    script renders them, each with the machine, versions, load and command of its run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_vs_verl import markdown_tables

    lines: list[str] = []
    for name in names:
        s = load(name)
        p = s["provenance"]
        (start, end) = p["load_average"]
        lines += ([""] if lines else []) + markdown_tables(s["rows"]).rstrip("\n").split("\n") + [
            "", f"`docs/results/{name}`: {p['cpu']} ({p['logical_cpus']} logical CPUs, one thread); torch {p['torch']}, "
                f"Python {p['python']}; verl {p['verl']}; {commit_date(p)}; load average {start[0]:.1f} at the start "
                f"(the benchmark itself holds one core), {end[0]:.1f} at the end; `{p['command']}`."]
    return lines


def commit_date(p: dict) -> str:
    """A benchmark provenance's commit (marked when the tree had local changes) and date."""
    return f"commit `{p['commit'][:7]}`{' (with local changes)' if p['dirty'] else ''}, {p['date']}"


def kernel_tables(name: str) -> list[str]:
    """docs/performance.md's kernel and operation counts: a ``benchmarks/bench_kernels.py --json`` run, as that
    script renders it beside 0.2.0's figures, with the machine, versions, load and command of the run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_kernels import markdown

    s = load(name)
    p = s["provenance"]
    return markdown(s).split("\n") + [
        "", f"`docs/results/{name}`: {s['shape']} float32; {p['cpu']} ({p['logical_cpus']} logical CPUs, one thread); "
            f"torch {p['torch']}, Python {p['python']}; {commit_date(p)}; `{p['command']}`."]


def agreement_table(name: str) -> list[str]:
    """docs/context-parallel.md's cost of the agreement: a ``benchmarks/bench_agreement.py --json`` run,
    per group kind, verify setting and path, with the machine, versions and command of the run."""
    s = load(name)
    p = s["provenance"]
    lines = ["| group | verify | path | host reads / call | collectives / call | ms / call (median) | "
             "paired ratio to `once` |", "|---|---|---|---|---|---|---|"]
    for key, r in s["rows"].items():
        group, verify, path = key.split(" ")
        lines.append(f"| {group} | {verify.removeprefix('verify=')} | {path} | {r['reads']} | {r['collectives']} | "
                     f"{r['ms']:.1f} | {r['ratio_to_once']:.2f}× |")
    return lines + ["", f"`docs/results/{name}`: {s['shape']} float32, 2 gloo ranks; {p['cpu']} "
                        f"({p['logical_cpus']} logical CPUs, one thread per rank); torch {p['torch']}, Python "
                        f"{p['python']}; {commit_date(p)}; `{p['command']}`."]


#: block name -> (renderer, its results files)
BLOCKS = {
    "demo-headline": (demo_headline, ("demo-stale.json", "demo-quantized.json")),
    "demo-claims": (demo_claims, ("demo-stale.json", "demo-stale-seeds5-9.json", "demo-quantized.json",
                                  "demo-long.json")),
    "demo-findings-stale": (findings, ("demo-stale.json",)),
    "demo-findings-quantized": (findings, ("demo-quantized.json",)),
    "demo-findings-long": (findings, ("demo-long.json",)),
    "demo-stale": (demo_table, ("demo-stale.json",)),
    "demo-long": (long_table, ("demo-long.json",)),
    "demo-quantized": (demo_table, ("demo-quantized.json",)),
    "demo-minibatches": (demo_table, ("demo-minibatches.json",)),
    "demo-time": (time_table, ("demo-default.json", "demo-stale.json", "demo-stale-seeds5-9.json",
                               "demo-quantized.json", "demo-long.json", "demo-minibatches.json", "demo-moe.json",
                               "demo-async.json")),
    "demo-async": (async_table, ("demo-async.json",)),
    "demo-default-time": (default_time, ("demo-default.json",)),
    "demo-step-cost": (step_cost_table, ("cpu-demo-step-cost.json",)),
    "demo-moe": (moe_table, ("demo-moe.json",)),
    "demo-bf16-long": (demo_table, ("demo-bf16-long.json",)),
    "diffusion-pipeline": (diffusion_table, ("diffusion_pipeline.json",)),
    "diffusion-all-low-precision": (diffusion_table, ("diffusion_pipeline_all_low_precision.json",)),
    "gpu-h200": (gpu_tables, ("gpu-h200.json",)),
    "gpu-h200-0.3.0": (gpu_tables, ("gpu-h200-0.3.0.json",)),
    "cpu-0.3.0": (cpu_tables, ("cpu-0.3.0.json", "cpu-0.3.0-bf16.json")),
    "cpu-kernels": (kernel_tables, ("cpu-kernels.json",)),
    "cpu-agreement": (agreement_table, ("cpu-agreement.json",)),
    "cpu-fused-loaded": (cpu_tables, ("cpu-fused-loaded.json",)),
    "cpu-fused-idle": (cpu_tables, ("cpu-fused-idle.json",)),
}

PAGES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))


def render_block(name: str) -> list[str]:
    fn, files = BLOCKS[name]
    return fn(*files)


def render_page(text: str) -> tuple[str, list[str]]:
    """The page with every block re-rendered, and the names of its blocks."""
    out, names, lines = [], [], text.split("\n")
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        name = m.group(1)
        if name not in BLOCKS:
            raise SystemExit(f"unknown results block {name!r}; known: {sorted(BLOCKS)}")
        try:
            j = lines.index(END, i + 1)
        except ValueError:
            raise SystemExit(f"results block {name!r} has no closing {END}") from None
        out += [lines[i], *render_block(name), END]
        names.append(name)
        i = j + 1
    return "\n".join(out), names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report pages that differ; change nothing")
    args = parser.parse_args(argv)
    stale = []
    for page in PAGES:
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        new, names = render_page(text)
        if new != text:
            stale.append(f"{page} ({', '.join(names)})")
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print("not rendered from docs/results/: " + "; ".join(stale) + " — run: python tools/render_results.py")
        return 1
    print(("rewrote: " + "; ".join(stale)) if stale else "every results block is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
