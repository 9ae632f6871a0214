"""The README's and docs' demo tables are rendered from the results files under docs/results/
(``python tools/render_results.py``), and every results file carries its provenance and the
intervals it is judged by."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from rollout_correction.demo.config import SCENARIOS
from rollout_correction.demo.headline import HEADLINES
from rollout_correction.demo.results import PROVENANCE_FIELDS, interval, paired_difference, tied_with_best

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_results", ROOT / "tools" / "render_results.py")
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)
FILES = sorted((ROOT / "docs" / "results").glob("*.json"))


def test_pages_equal_the_rendering():
    assert R.main(["--check"]) == 0, "run: python tools/render_results.py"


def test_every_block_and_every_results_file_is_used():
    used = set()
    for page in R.PAGES:
        _, names = R.render_page((ROOT / page).read_text(encoding="utf-8"))
        used.update(names)
    assert used == set(R.BLOCKS)
    read = {f for _, files in R.BLOCKS.values() for f in files}
    assert read >= {p.name for p in FILES}
    # a file a block names but nobody has measured yet renders as one line saying so
    for f in read - {p.name for p in FILES}:
        assert R.not_measured(f)[0].startswith(f"`docs/results/{f}` has not been measured yet")


def test_a_hand_edit_of_a_rendered_figure_is_caught():
    page = (ROOT / "docs" / "demo.md").read_text(encoding="utf-8")
    start = page.index("<!-- results: demo-headline -->")
    row = page.index("| on-policy reference |", start)
    edited = page[:row] + page[row:].replace("0.88", "0.91", 1)
    assert R.render_page(edited)[0] == page


def test_no_demo_or_gpu_table_outside_a_rendered_block():
    """A table of demo or GPU figures in the README or docs is a rendered block, never typed by hand:
    a header naming a final exact match, a trainer's figure or verl's milliseconds sits inside one."""
    markers = ("final exact match", "trainer final", "| final [", "verl ms")
    for page in R.PAGES:
        inside = False
        for n, line in enumerate((ROOT / page).read_text(encoding="utf-8").split("\n"), 1):
            if R.BEGIN.match(line):
                inside = True
            elif line == R.END:
                inside = False
            elif line.startswith("|") and any(m in line for m in markers):
                assert inside, f"{page}:{n}: a table of measured figures outside a results block: {line[:80]}"


@pytest.mark.parametrize("path", [p for p in FILES if p.name.startswith("demo") and "async" not in p.name],
                         ids=lambda p: p.name)
def test_results_file_has_provenance_and_recomputable_intervals(path):
    s = json.loads(path.read_text(encoding="utf-8"))
    assert set(s["provenance"]) == set(PROVENANCE_FIELDS) and all(s["provenance"][k] is not None
                                                                  for k in ("commit", "torch", "cpu", "date"))
    assert s["provenance"]["dirty"] is False  # measured from a clean checkout of the commit it names
    assert sum(g["runs"] for g in s["run_provenance"]) == len(s["runs"])
    assert s["mixed_provenance"] == (len(s["run_provenance"]) > 1)
    finals = {}
    for r in s["runs"]:
        finals.setdefault(r["method"], []).append(r["final_reward"])
    for m, x in s["methods"].items():
        assert x["final_reward"]["n"] == len(finals[m]) == len(s["config"]["seeds"])
        assert x["final_reward"]["ci"] == pytest.approx(interval(finals[m])["ci"])
    if "paired" in s:  # written since the comparisons became paired: the stored figures recompute
        per_seed = {m: {r["seed"]: r["final_reward"] for r in s["runs"] if r["method"] == m} for m in s["methods"]}
        assert s["tied_with_best"] == tied_with_best(per_seed)
        for m, d in s["paired"]["vs_naive"].items():
            assert d["ci"] == pytest.approx(paired_difference(per_seed[m], per_seed["naive"])["ci"])


def _summary_file(tmp_path, name, commit, finals, recommended="token_tis"):
    """A minimal demo results file with the given {method: [final per seed]}."""
    from rollout_correction.demo.config import METHODS

    runs = [{"method": m, "seed": k, "final_reward": v, "best_reward": v, "final_engine_reward": v,
             "final_mismatch_kl": 0.01 * (m != "on_policy"), "cpu_seconds": 30.0}
            for m, xs in finals.items() for k, v in enumerate(xs)]
    methods = {m: {"label": METHODS[m].label, "preset": METHODS[m].setting, "final_reward": interval(xs),
                   "best_reward": interval(xs), "final_engine_reward": interval(xs), "initial_mismatch_kl": 0.01,
                   "final_mismatch_kl": 0.05, "kl_growth": 5.0, "collapsed": 0, "runs": len(xs),
                   "seconds": interval([30.0] * len(xs))} for m, xs in finals.items()}
    prov = {"commit": commit, "dirty": False, "torch": "2.13", "python": "3.11", "cpu": "CPU", "logical_cpus": 16,
            "workers": 16, "threads": 1, "date": "2026-01-01T00:00:00Z", "command": "demo"}
    s = {"provenance": prov, "run_provenance": [{**{k: prov[k] for k in R._MACHINE}, "runs": len(runs)}],
         "config": {"scenario": name, "task": "sort", "digits": 6, "precision": "fp32", "quant": "none", "lag": 4,
                    "seeds": list(range(len(next(iter(finals.values()))))), "recommended": recommended},
         "methods": methods, "runs": runs}
    (tmp_path / f"{name}.json").write_text(json.dumps(s))


def test_renderer_refuses_results_files_of_different_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    finals = {"on_policy": [0.9, 0.8, 0.85], "naive": [0.5, 0.6, 0.4], "token_tis": [0.7, 0.7, 0.6]}
    _summary_file(tmp_path, "a", "1" * 40, finals)
    _summary_file(tmp_path, "b", "2" * 40, finals)
    with pytest.raises(SystemExit, match="different commits.*a.json at 111111111111.*b.json at 222222222222"):
        R.demo_claims("a.json", "b.json")
    with pytest.raises(SystemExit, match="different commits"):
        R.demo_headline("a.json", "b.json")
    _summary_file(tmp_path, "b", "1" * 40, finals)
    lines = R.demo_claims("a.json", "b.json", "missing.json")
    # on-policy − naive = 0.4, 0.2, 0.45: mean 0.35, s_d 0.13229, half 4.3027 · 0.13229 / √3 = 0.32863
    assert any("on-policy reference − naive PPO > 0: holds — paired difference +0.35 [+0.02, +0.68]" in x
               for x in lines)
    assert lines[-3] == "- `docs/results/missing.json` has not been measured yet: `tools/run_demo_results.sh` writes it."


def test_identical_methods_are_shown_once_with_their_aliases(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    _summary_file(tmp_path, "s", "1" * 40, {"naive": [0.5, 0.6, 0.4], "token_tis": [0.7, 0.7, 0.6],
                                            "cispo": [0.7, 0.7, 0.6], "dppo_tv": [0.7, 0.7, 0.61],
                                            "icepop": [0.7, 0.7, 0.6]})
    lines = R.demo_table("s.json")
    table = lines[2:lines.index("")]   # the main table, without its header and separator
    labels = [x.split(" | ")[0][2:] for x in table]
    # CISPO is a declared alias of token TIS and identical on every seed: folded; DPPO-TV differs on
    # seed 2; IcePop is identical by chance but no alias: both keep their rows
    assert labels == ["naive PPO", "decoupled token TIS (= CISPO × token TIS)", "DPPO-TV × token TIS",
                      "decoupled token IcePop"]


@pytest.mark.parametrize("path", [p for p in FILES if p.name.startswith("diffusion")], ids=lambda p: p.name)
def test_diffusion_results_file_has_provenance_and_recomputable_intervals(path):
    """A ``diffusion-demo`` results file names its commit, versions, machine, date and command, and
    its per-variant intervals are those of its per-run figures."""
    from rollout_correction.diffusion.pipeline.report import mean_ci

    def tail_mean(xs, k=5):  # "final reward": the mean over the last 5 iterations
        return sum(xs[-k:]) / len(xs[-k:])

    s = json.loads(path.read_text(encoding="utf-8"))
    p = s["provenance"]
    assert all(p.get(k) for k in ("commit", "torch", "diffusers", "cpu_model", "date", "command"))
    for variant, summary in s["summary"].items():
        finals = [tail_mean(r["reward"]) for r in s["runs"] if r["variant"] == variant]
        assert len(finals) == len(s["config"]["seeds"])
        assert list(summary["final_reward"]) == pytest.approx(list(mean_ci(finals)))


@pytest.mark.parametrize("path", [p for p in FILES if "async" in p.name], ids=lambda p: p.name)
def test_async_results_file_has_provenance(path):
    s = json.loads(path.read_text(encoding="utf-8"))
    assert set(s["provenance"]) == set(PROVENANCE_FIELDS) and s["provenance"]["dirty"] is False
    assert {r["mode"] for r in s["runs"]} == set(s["modes"])
    for m, x in s["modes"].items():
        finals = [r["final_reward"] for r in s["runs"] if r["mode"] == m]
        assert x["final_reward"]["mean"] == pytest.approx(sum(finals) / len(finals))


def test_gpu_results_file_names_its_device_commit_and_command():
    s = json.loads((ROOT / "docs" / "results" / "gpu-h200.json").read_text(encoding="utf-8"))
    p = s["provenance"]
    assert all(p.get(k) for k in ("commit", "core_commit", "device", "torch", "cuda", "date", "command"))
    assert len(s["rows"]) == 30 and {r["agreement"].split(",")[0] for r in s["rows"]} == {"mask equal"}
    assert s["cuda_tests"] and all(t["failed"] == 0 and t["passed"] > 0 and t["commit"] for t in s["cuda_tests"])


@pytest.mark.parametrize("args,message", [
    (["OUT"], "usage: tools/run_demo_results.sh OUT WORKERS"),
    (["OUT", "0"], "WORKERS must be a positive integer, got '0'"),
    (["OUT", "1", "--only", "stale,foo"],
     "--only: unknown results file 'foo' (default, stale, stale-seeds5-9, quantized, long)"),
    (["OUT", "1", "--only"], "--only needs a comma-separated list of results files"),
    (["OUT", "1", "--fast"], "unknown option '--fast'"),
])
def test_run_demo_results_refuses_bad_arguments_in_one_line(tmp_path, args, message):
    import subprocess

    args = [str(tmp_path / a) if a == "OUT" else a for a in args]
    done = subprocess.run(["bash", str(ROOT / "tools" / "run_demo_results.sh"), *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_a_value_that_rounds_to_zero_prints_without_a_minus_sign():
    from rollout_correction.demo.report import _ci, diff_text, fixed

    assert diff_text({"n": 5, "mean": -0.001, "ci": (-0.004, 0.003)}) == "+0.00 [+0.00, +0.00]"
    assert diff_text({"n": 5, "mean": -0.012, "ci": (-0.0449, 0.02)}) == "-0.01 [-0.04, +0.02]"
    assert diff_text({"n": 1, "mean": -0.004, "ci": None}) == "+0.00"
    assert _ci({"mean": 0.0, "ci": (-0.0001, 0.0001)}) == "0.00 [0.00, 0.00]"
    assert _ci({"mean": 0.5, "ci": (-0.25, 1.25)}) == "0.50 [-0.25, 1.25]"
    assert fixed(-0.04, 1) == "0.0" and fixed(-0.06, 1) == "-0.1" and fixed(0.0, 1, signed=True) == "+0.0"


def test_demo_step_cost_file_names_its_commit_and_recomputes():
    s = json.loads((ROOT / "docs" / "results" / "cpu-demo-step-cost.json").read_text(encoding="utf-8"))
    assert set(s["provenance"]) == set(PROVENANCE_FIELDS) and s["provenance"]["dirty"] is False
    assert s["provenance"]["command"].startswith("OMP_NUM_THREADS=1 python benchmarks/demo_step_cost.py")
    for r in s["scenarios"].values():
        assert set(r["settings"]) == {"former", "direct", "current"}
        for f in r["settings"].values():
            assert len(f["step_s"]) == len(f["eval_s"]) == s["reps"]
            median = statistics.median
            expected = r["steps"] * median(f["step_s"]) + 2 * f["evaluations"] * median(f["eval_s"])
            assert f["run_cpu_s"] == pytest.approx(expected)
            def run(g, i):
                return r["steps"] * g["step_s"][i] + 2 * g["evaluations"] * g["eval_s"][i]
            assert f["former_over_this"] == pytest.approx(
                [run(r["settings"]["former"], i) / run(f, i) for i in range(s["reps"])])
            phases = f["phase_s_per_step"]
            assert min(v for k, v in phases.items() if k != "other") > 0
            assert sum(phases.values()) == pytest.approx(statistics.fmean(f["step_s"]))


# ---------------------------------------------------------------------------------------------
# The headline files: measured together at one commit, each as demo/headline.py says, and their
# claims are what their runs give.


def _headline(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", list(HEADLINES))
def test_headline_file_claims_recompute_from_its_runs_and_its_tables_say_what_it_was_measured_with(name):
    """Each headline file's claims section is the recomputation from its own per-seed runs, and the
    words say "holds" exactly there. A file measured with other settings than the script runs at
    this commit (a scenario changed since) is marked so in the page; a file not yet measured is named
    as such."""
    from rollout_correction.demo.report import _finite_or_null, claims, claims_text

    page = (ROOT / "docs" / "demo.md").read_text(encoding="utf-8")
    if not (ROOT / "docs" / "results" / name).is_file():
        assert R.not_measured(name)[0] in page
        return
    s, h = _headline(name), HEADLINES[name]
    assert s["config"]["scenario"] == h.scenario
    recomputed = _finite_or_null(claims(s))
    assert s["claims"] == recomputed
    for row in recomputed["claims"]:
        d = row["difference"]
        a = {r["seed"]: r["final_reward"] for r in s["runs"] if r["method"] == row["method"]}
        b = {r["seed"]: r["final_reward"] for r in s["runs"] if r["method"] == row["minus"]}
        assert d["mean"] == pytest.approx(statistics.fmean(a[k] - b[k] for k in s["config"]["seeds"]))
        assert row["evaluated"] and row["holds"] == (d["ci"][0] > 0)
    said = [line for line in claims_text(s) if line.startswith("- ")]
    assert [(": holds —" in line) for line in said] == [r["holds"] for r in recomputed["claims"]]
    # measured as the script measures it now, or marked in the page
    c = s["config"]
    if R.design_diffs(name, s):
        assert R.design_mark(name, s) in page
    else:
        assert (tuple(c["methods"]), tuple(c["seeds"])) == (h.methods, h.seeds)
        assert sorted((r["method"], r["seed"]) for r in s["runs"]) == sorted((m, x) for m in h.methods
                                                                             for x in h.seeds)


def test_headline_files_come_from_one_commit_and_one_invocation_of_the_script():
    files = [(n, _headline(n)) for n in HEADLINES if (ROOT / "docs" / "results" / n).is_file()]
    R.one_commit(files)   # refuses files of different commits, and a file of mixed runs
    commands = {s["provenance"]["command"] for n, s in files if not HEADLINES[n].default_command}
    assert len(commands) == 1 and next(iter(commands)).startswith("tools/run_demo_results.sh ")
    # the default command's runs are the stale file's, bit for bit (same commit, machine and seeds)
    default, stale = _headline("demo-default.json"), _headline("demo-stale.json")
    for r in default["runs"]:
        twin = next(x for x in stale["runs"] if (x["method"], x["seed"]) == (r["method"], r["seed"]))
        assert (r["final_reward"], r["best_reward"], r["final_mismatch_kl"]) == \
            (twin["final_reward"], twin["best_reward"], twin["final_mismatch_kl"])


def test_a_headline_file_measured_with_other_settings_is_named_with_the_settings_that_differ():
    s = _headline("demo-stale.json")
    same = {**s, "config": {**s["config"], "steps": SCENARIOS["stale"]["steps"]}}
    assert R.design_diffs("demo-stale.json", same) == []
    older = {**s, "config": {**s["config"], "steps": 123, "lag": 2}}
    assert R.design_diffs("demo-stale.json", older) == ["lag 2 (now 4)", "steps 123 (now 750)"]
    assert R.design_mark("demo-stale.json", older).startswith(
        "measured with other settings than `tools/run_demo_results.sh` runs at this commit (lag 2 (now 4); ")
    assert R.design_diffs("not-a-headline.json", older) == []


def test_a_claim_whose_method_did_not_run_is_not_evaluated_and_never_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    # the recommended token TIS did not run: its claim is "not evaluated", the other one is judged
    _summary_file(tmp_path, "a", "1" * 40, {"on_policy": [0.9, 0.8, 0.85], "naive": [0.5, 0.6, 0.4]})
    lines = R.demo_claims("a.json")
    (judged,) = [x for x in lines if "on-policy reference − naive PPO" in x]
    (unjudged,) = [x for x in lines if "decoupled token TIS − naive PPO" in x]
    assert ": holds —" in judged
    assert "not evaluated (needs the token_tis and naive methods in the run)" in unjudged and "holds" not in unjudged
    assert "Both claims hold." not in "\n".join(lines)


def test_renderer_refuses_a_results_file_whose_runs_come_from_different_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    _summary_file(tmp_path, "a", "1" * 40, {"naive": [0.5, 0.6, 0.4], "token_tis": [0.7, 0.7, 0.6]})
    s = json.loads((tmp_path / "a.json").read_text())
    s["run_provenance"] = [{**s["run_provenance"][0], "runs": 3},
                           {**s["run_provenance"][0], "commit": "2" * 40, "runs": 3}]
    s["mixed_provenance"] = True
    (tmp_path / "a.json").write_text(json.dumps(s))
    for render in (R.demo_table, R.demo_claims, R.demo_headline, R.time_table):
        with pytest.raises(SystemExit, match="a.json holds runs of different commits.*111111111111.*222222222222"):
            render("a.json")


def test_a_file_measured_at_another_commit_than_the_headline_files_says_so_in_every_table(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "RESULTS", tmp_path)
    finals = {"naive": [0.5, 0.6, 0.4], "token_tis": [0.7, 0.7, 0.6]}
    _summary_file(tmp_path, "demo-stale", "1" * 40, finals)
    _summary_file(tmp_path, "old", "2" * 40, finals)
    for name in ("demo-stale.json", "old.json"):   # the time table reads the invocation's seconds
        s = json.loads((tmp_path / name).read_text())
        s["seconds"] = {"total": 125.0}
        (tmp_path / name).write_text(json.dumps(s))
    table = R.demo_table("old.json")
    assert any(x.startswith("**Measured at an older commit, `2222222`, not at the headline files' `1111111`.**")
               for x in table)
    assert not any("older commit" in x for x in R.demo_table("demo-stale.json"))
    rows = [x for x in R.time_table("demo-stale.json", "old.json") if x.startswith("| `demo`")]
    assert [("(older: not the headline files' commit)" in x) for x in rows] == [False, True]


def test_run_demo_results_writes_the_headline_files_and_plots_at_one_commit(tmp_path):
    """``--quick`` end to end (tiny runs, not results) for the default command and one pooled file:
    the files the renderer reads, the plots docs/demo.md shows, one commit, the script's methods."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(["bash", str(ROOT / "tools" / "run_demo_results.sh"), str(tmp_path), "1", "--quick", "--only",
                           "default,long"], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "default -> " in done.stdout and "long: " in done.stdout
    default, long = (json.loads((tmp_path / n).read_text()) for n in ("demo-default.json", "demo-long.json"))
    assert default["provenance"]["command"].startswith("rollout-correction demo --quick --no-progress")
    assert long["provenance"]["command"] == f"tools/run_demo_results.sh {tmp_path} 1 --quick --only default,long"
    assert default["provenance"]["commit"] == long["provenance"]["commit"]
    assert long["config"]["methods"] == list(HEADLINES["demo-long.json"].methods) and long["config"]["tail"] == 24
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == ["demo-long-by-length.png"]
    assert not (tmp_path / "demo-stale.json").exists()
