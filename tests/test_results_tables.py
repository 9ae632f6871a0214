"""The README's and docs' demo tables are rendered from the results files under docs/results/
(``python tools/render_results.py``), and every results file carries its provenance and the
intervals it is judged by."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rollout_correction.demo.results import PROVENANCE_FIELDS, interval, tied_with_best

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
    assert read == {p.name for p in FILES}


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
    stats = {}
    for m, x in s["methods"].items():
        stats[m] = interval(finals[m])
        assert x["final_reward"]["n"] == len(finals[m]) == len(s["config"]["seeds"])
        assert x["final_reward"]["ci"] == pytest.approx(stats[m]["ci"])
    assert s["tied_with_best"] == tied_with_best(stats)


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
