"""What every command does around its work (``rollout_correction/console.py``, ``cli.py``): one line
on stderr and exit 2 for bad arguments, bad files and a missing extra (a traceback only with
``--debug``); plain progress lines without a terminal; a new report folder per invocation that
never overwrites another report; the demo's self-contained HTML report."""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout_correction.cli import install_hint, main
from rollout_correction.console import CommandError, ProgressLines, clock, report_folder

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """The command as a user runs it: a fresh process, stdout and stderr pipes (no terminal)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "rollout_correction.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def _main(args: list[str], capsys, cwd: Path, monkeypatch) -> subprocess.CompletedProcess:
    """``main(args)`` in this process (argparse's exit included), as a CompletedProcess."""
    monkeypatch.chdir(cwd)
    try:
        rc = main(args)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def _one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------ bad inputs

@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "x.pt").write_text("this is a text file, not torch.save output\n")
    buf = d / "whole.pt"
    torch.save({"rollout_log_probs": torch.zeros(4, 3), "old_log_probs": torch.zeros(4, 3)}, buf)
    data = buf.read_bytes()
    (d / "truncated.pt").write_bytes(data[: len(data) // 2])
    with open(d / "object.pt", "wb") as fh:  # a pickle of a class: refused, nothing from it runs
        pickle.dump(datetime.date(2024, 1, 1), fh)
    with open(d / "wrong.pkl", "wb") as fh:  # a pickle, but not a SkyRL batch
        pickle.dump({"old_log_probs": [1.0]}, fh)
    (d / "x.npz").write_text("not a zip archive\n")
    return d


@pytest.mark.parametrize("name, words", [
    ("x.pt", ["x.pt", "not a readable torch.save file"]),
    ("truncated.pt", ["truncated.pt", "not a readable torch.save file"]),
    ("object.pt", ["object.pt", "refused"]),
    ("wrong.pkl", ["wrong.pkl", "not a SkyRL TrainingInputBatch"]),
    ("x.npz", ["x.npz", "not a readable .npz file"]),
    ("missing.parquet", ["missing.parquet"]),
])
def test_diagnose_bad_files_are_one_line_and_exit_2(bad_files, tmp_path, capsys, monkeypatch, name, words):
    proc = _main(["diagnose", str(bad_files / name), "--out", str(tmp_path / "rep")], capsys, tmp_path, monkeypatch)
    _one_line_error(proc, *words)


@pytest.mark.parametrize("certify", [False, True], ids=["diagnose", "certify"])
@pytest.mark.parametrize("name", ["missing.parquet", "x.pt", "truncated.pt", "empty-folder"])
def test_diagnose_makes_no_report_folder_for_a_file_it_cannot_read(bad_files, tmp_path, capsys, monkeypatch,
                                                                   name, certify):
    """A missing or unreadable dump: exit 2 and nothing on disk, neither a ``diagnose_report/<time>/``
    folder (nor ``latest`` pointing at one) nor an explicit ``--out``."""
    (bad_files / "empty-folder").mkdir(exist_ok=True)
    args = ["diagnose", str(bad_files / name)] + (["--certify"] if certify else [])
    _one_line_error(_main(args, capsys, tmp_path, monkeypatch), name)
    _one_line_error(_main(args + ["--out", "rep"], capsys, tmp_path, monkeypatch), name)
    assert not list(tmp_path.iterdir())


def test_debug_shows_the_traceback(bad_files, tmp_path):
    proc = _cli("diagnose", str(bad_files / "x.pt"), "--out", str(tmp_path / "rep"), "--debug", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "not a readable torch.save file" in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["demo", "--steps", "x"], ["rollout-correction demo", "--steps", "invalid int value"]),
    (["demo", "--methods", "nope"], ["unknown method", "nope"]),
    (["demo", "--bogus"], ["rollout-correction demo: unrecognized arguments: --bogus"]),
    (["demo", "--steps", "0"], ["rollout-correction demo", "steps"]),
    (["demo", "--async", "--max-staleness", "-1"], ["rollout-correction demo"]),
    (["diagnose"], ["give a FILE"]),
    (["diagnose", "f.pt", "--example"], ["either FILE or --example"]),
    (["diagnose", "f.pt", "--chunk-rows", "many"], ["--chunk-rows", "invalid int value"]),
    (["diffusion-demo", "--iters", "x"], ["rollout-correction diffusion-demo", "--iters"]),
    (["diffusion-demo", "--precision", "fp4"], ["--precision", "invalid choice: 'fp4'"]),
    (["diffusion-demo", "--toy", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["monitor", "no-such-history.jsonl"], ["rollout-correction monitor", "no-such-history.jsonl"]),
    (["diagnose", "--atol", "1e-6", "f.pt"], ["--atol applies to --certify only"]),
    (["nocommand"], ["invalid choice: 'nocommand'"]),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, words):
    _one_line_error(_main(args, capsys, tmp_path, monkeypatch), *words)
    assert not list(tmp_path.iterdir())  # nothing written for a refused command


def test_missing_extra_names_the_install_command(tmp_path):
    """diffusers made unimportable (a meta-path finder that refuses it, as in an environment
    without it): ``diffusion-demo --help`` is one line naming the module and the pip command."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoDiffusers:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'diffusers' or name.startswith('diffusers.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoDiffusers())\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'src'}"}
    line = _one_line_error(_cli("diffusion-demo", "--help", cwd=tmp_path, env=env), "'diffusers'", "pip install")
    # running from this checkout (editable install or src/ on the path): the editable command, here
    assert f"pip install -e '{ROOT}[diffusion]'" in line


def test_install_hint_fits_the_way_the_package_is_installed(monkeypatch, tmp_path):
    import rollout_correction.cli as cli

    monkeypatch.chdir(tmp_path)
    assert install_hint("diffusion-demo") == f"pip install -e '{ROOT}[diffusion]'"
    monkeypatch.chdir(ROOT)
    assert install_hint("demo") == "pip install -e '.[demo]'"
    # a wheel in site-packages: no pyproject.toml beside the package
    fake = tmp_path / "site-packages" / "rollout_correction" / "cli.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(cli, "__file__", str(fake))
    assert install_hint("verl-check") == "pip install 'rollout-correction[verl]'"


# ------------------------------------------------------------------------------------ progress lines

def test_progress_lines_count_elapsed_and_eta():
    import io

    t = iter([100.0, 110.0, 130.0, 160.0])  # start, then three units finish after 10, 30, 60 s
    out = io.StringIO()
    p = ProgressLines(4, done=1, stream=out, now=lambda: next(t))   # one unit resumed: done, not in the rate
    assert p.finished("naive PPO · seed 0", "final 0.50") == "[2/4] naive PPO · seed 0 final 0.50  elapsed 10s  ETA 20s"
    assert p.finished("token TIS · seed 0") == "[3/4] token TIS · seed 0  elapsed 30s  ETA 15s"
    assert p.finished("on-policy · seed 0") == "[4/4] on-policy · seed 0  elapsed 1m00s  done"
    assert out.getvalue().count("\n") == 3 and "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert [clock(x) for x in (0, 59.4, 61, 3599, 3600 * 2 + 61)] == ["0s", "59s", "1m01s", "59m59s", "2h01m"]


def test_progress_lines_weigh_units_by_their_expected_cost():
    """Two cheap units (cost 1) then two expensive ones (cost 9): after the cheap ones the ETA is
    the time per cost unit times the cost left, not the time per unit times the units left."""
    import io

    t = iter([0.0, 2.0, 4.0, 22.0, 40.0])   # start; the cheap units end at 2 and 4 s, the others at 22 and 40 s
    out = io.StringIO()
    p = ProgressLines(4, stream=out, now=lambda: next(t), total_cost=20.0)
    assert p.finished("warm start 0", cost=1.0).endswith("elapsed 2s  ETA 38s")   # 2 s / 1 × 19 left
    assert p.finished("warm start 1", cost=1.0).endswith("elapsed 4s  ETA 36s")   # 4 s / 2 × 18 left
    assert p.finished("run 0", cost=9.0).endswith("elapsed 22s  ETA 18s")         # 22 s / 11 × 9 left
    assert p.finished("run 1", cost=9.0).endswith("elapsed 40s  done")
    # resumed: one expensive unit was done before this invocation; it is done but not in the rate
    t = iter([0.0, 3.0])
    p = ProgressLines(3, done=1, total_cost=19.0, done_cost=9.0, stream=out, now=lambda: next(t))
    assert p.finished("warm start", cost=1.0) == "[2/3] warm start  elapsed 3s  ETA 27s"  # 3 s / 1 × 9 left
    # worker processes took 5 s to start before any unit: elapsed counts them, the rate does not
    t = iter([0.0, 5.0, 6.0, 7.0])
    p = ProgressLines(3, stream=out, now=lambda: next(t), total_cost=12.0)
    p.units_start()
    assert p.finished("warm start 0", cost=1.0).endswith("elapsed 6s  ETA 11s")   # 1 s / 1 × 11 left
    assert p.finished("warm start 1", cost=1.0).endswith("elapsed 7s  ETA 10s")   # 2 s / 2 × 10 left


def test_quick_demo_prints_a_line_per_finished_unit_through_a_pipe(tmp_path):
    """The tiniest demo in a subprocess with a pipe for stdout: the lines arrive one per unit,
    plain text, with elapsed time and ETA; then the report lands in demo-report/<date>-<time>/."""
    proc = _cli("demo", "--quick", "--steps", "2", "--eval-every", "1", "--eval-prompts", "8", "--sft-steps", "2",
                "--workers", "1", "--methods", "naive,token_tis", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] + "]" for line in lines] == ["[1/3]", "[2/3]", "[3/3]"]
    assert "SFT warm start · seed 0" in lines[0] and "naive PPO · seed 0" in lines[1]
    assert all("elapsed " in line for line in lines) and "ETA " in lines[0] and lines[2].endswith("done")
    assert "\r" not in proc.stdout + proc.stderr and "\x1b" not in proc.stdout + proc.stderr
    latest = tmp_path / "demo-report" / "latest"
    assert latest.is_symlink() and (latest / "report.md").is_file() and (latest / "report.html").is_file()
    assert f"report: demo-report/{os.readlink(latest)}/report.md" in proc.stdout

    # a second run gets its own folder; the first report is untouched
    first = (latest / "summary.json").read_bytes()
    before = os.readlink(latest)
    proc = _cli("demo", "--quick", "--steps", "2", "--eval-every", "1", "--eval-prompts", "8", "--sft-steps", "2",
                "--workers", "1", "--methods", "naive", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not any(line.startswith("[") for line in proc.stdout.splitlines())  # --no-progress: no lines either
    assert os.readlink(latest) != before and (tmp_path / "demo-report" / before / "summary.json").read_bytes() == first
    html = (latest / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "data:image/png;base64," in html and "<table>" in html
    assert "src='methods.png'" not in html and "http" not in html.split("<body>")[1].split("data:image")[0]


@pytest.mark.skipif(not shutil.which("chromium"), reason="headless Chromium not installed (.ci/run installs it)")
def test_demo_html_report_renders_in_headless_chromium(tmp_path):
    from rollout_correction.demo.report import report_html

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, 1])
    fig.savefig(tmp_path / "methods.png")
    plt.close(fig)
    lines = ["# Rollout-correction demo report", "", "Command: `rollout-correction demo --quick`", "",
             "| method | trainer final [95 % CI] |", "|---|---|", "| naive PPO | 0.51 [-0.20, 1.21] |", "",
             "## Checks", "", "- Naive PPO ends **below** on-policy: *yes*", "", "![methods](methods.png)"]
    page = report_html(lines, tmp_path, "demo")
    assert "<b>below</b>" in page and "<i>yes</i>" in page and "<code>rollout-correction demo --quick</code>" in page
    assert page.count("<tr>") == 2 and "<th>trainer final [95 % CI]</th>" in page and "|---" not in page
    (tmp_path / "report.html").write_text(page)
    shot = tmp_path / "shot.png"
    subprocess.run([shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,700",
                    f"--screenshot={shot}", (tmp_path / "report.html").as_uri()],
                   check=True, capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000


# ------------------------------------------------------------------------------------ report folders

def test_default_folder_is_new_per_invocation_with_latest(tmp_path):
    base = tmp_path / "demo-report"
    now = datetime.datetime(2025, 3, 4, 5, 6, 7)
    a = report_folder(None, str(base), ("report.md",), now=now)
    b = report_folder(None, str(base), ("report.md",), now=now)  # the same second: a suffix
    assert a.name == "20250304-050607" and b.name == "20250304-050607-2"
    assert os.readlink(base / "latest") == b.name
    assert report_folder(None, str(base), ("report.md",), reuse=True) == b.resolve()  # --resume: latest


def test_explicit_out_holding_a_report_is_refused_unless_force(tmp_path):
    out = tmp_path / "mine"
    assert report_folder(str(out), "unused", ("report.md",)) == out and out.is_dir()  # empty: fine
    (out / "report.md").write_text("an earlier run\n")
    with pytest.raises(CommandError, match="already holds a report.*--force"):
        report_folder(str(out), "unused", ("report.md",))
    assert report_folder(str(out), "unused", ("report.md",), force=True) == out
    assert (out / "report.md").read_text() == "an earlier run\n"  # refusing or not, nothing is deleted here


def test_demo_refuses_an_out_with_another_report(tmp_path, capsys, monkeypatch):
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "summary.json").write_text("{}")
    line = _one_line_error(_main(["demo", "--quick", "--out", "rep"], capsys, tmp_path, monkeypatch),
                           "rep already holds a report", "--force")
    assert line.startswith("rollout-correction demo: ")
    assert (tmp_path / "rep" / "summary.json").read_text() == "{}"


@pytest.mark.parametrize("command, marker", [("diagnose", "summary.json"), ("diffusion-demo", "report.md")])
def test_other_commands_refuse_an_out_with_another_report(tmp_path, capsys, monkeypatch, command, marker):
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / marker).write_text("an earlier report\n")
    args = [command, "x.pt", "--out", "rep"] if command == "diagnose" else [command, "--quick", "--out", "rep"]
    _one_line_error(_main(args, capsys, tmp_path, monkeypatch), "rep already holds a report", "--force")
    assert (tmp_path / "rep" / marker).read_text() == "an earlier report\n"


def test_diagnose_prints_a_line_per_file_and_writes_a_new_folder(tmp_path, capsys, monkeypatch):
    dump = tmp_path / "dump"
    dump.mkdir()
    g = torch.Generator().manual_seed(0)
    for i, rows in enumerate((5, 7)):
        roll = -torch.rand(rows, 4, generator=g)
        torch.save({"rollout_log_probs": roll, "old_log_probs": roll + 0.01, "response_mask": torch.ones(rows, 4)},
                   dump / f"step_{i}.pt")
    proc = _main(["diagnose", "dump"], capsys, tmp_path, monkeypatch)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert lines[0].startswith("[1/2] step_0.pt 5 rows, 20 tokens  elapsed ") and "ETA" in lines[0]
    assert lines[1].startswith("[2/2] step_1.pt 7 rows, 28 tokens  elapsed ") and lines[1].endswith("done")
    latest = tmp_path / "diagnose_report" / "latest"
    assert (latest / "summary.json").is_file()
    assert _main(["diagnose", "dump", "--quiet"], capsys, tmp_path, monkeypatch).returncode == 0
    assert len([p for p in (tmp_path / "diagnose_report").iterdir() if p.name != "latest"]) == 2
