"""Reading metric histories in each format (JSONL, wandb and MLflow CSV exports, TensorBoard
event files written by torch's SummaryWriter) and the ``rollout-correction monitor`` command."""

import csv
import json

import pytest

from rollout_correction.cli import main
from rollout_correction.monitor import HealthMonitor, read_history

P = "rollout_corr/"


def _steps(n=60):
    """A run whose KL triples at step 30 and whose ESS crosses seed 001's 0.3 line at step 45
    (ess_low fires at 47, when 3 of the last 5 steps are below the line).

    KL: the window median is (b + 3b)/2 = 2b (not above the limit 2b) at step 34, 3b from step 35:
    kl_rising fires at 35 + D − 1 = 39. ESS deficit 0.1 → 0.75: the median (0.1 + 0.75)/2 exceeds
    2 × 0.1 from step 49: ess_falling fires at 53."""
    out = []
    for s in range(n):
        kl = 0.01 if s < 30 else 0.03
        out.append((s, {P + "kl": kl, P + "k3_kl": kl, P + "rollout_is_eff_sample_size": 0.9 if s < 45 else 0.25}))
    return out


OPTS = dict(trend_factor=2.0, window=10)  # the step computations below are for F = 2, W = 10


def _expected():
    mon = HealthMonitor(log_alerts=False, **OPTS)
    mon.replay(_steps())
    assert [(a.name, a.step) for a in mon.alerts] == [("kl_rising", 39), ("k3_kl_rising", 39), ("ess_low", 47),
                                                        ("ess_falling", 53)]
    return mon


def _alerts(history):
    mon = HealthMonitor(log_alerts=False, **OPTS)
    mon.replay(history)
    return [(a.name, a.step, a.value) for a in mon.alerts]


def test_jsonl_flat_and_monitor_file(tmp_path):
    ref = _expected()
    p = tmp_path / "h.jsonl"
    p.write_text("\n".join(json.dumps({"_step": s, **m, "lr": 1e-6, "tag": "x"}) for s, m in _steps()) + "\n")
    h = read_history(p)
    assert h[3] == (3, {**_steps()[3][1], "lr": 1e-6})
    assert _alerts(h) == [(a.name, a.step, a.value) for a in ref.alerts]
    ref.save(tmp_path / "saved.jsonl")
    assert _alerts(read_history(tmp_path / "saved.jsonl")) == [(a.name, a.step, a.value) for a in ref.alerts]


def test_jsonl_bad_line_names_the_line(tmp_path):
    p = tmp_path / "h.jsonl"
    p.write_text('{"step": 0, "rollout_corr/kl": 0.1}\nnot json\n')
    with pytest.raises(ValueError, match=r"h.jsonl:2"):
        read_history(p)


def test_wandb_panel_csv(tmp_path):
    """wandb's panel export: ``Step``, ``<run> - <metric>`` and its ``__MIN`` / ``__MAX`` columns;
    the train/ prefix wandb's HF callback adds; empty cells for steps a metric was not logged."""
    p = tmp_path / "wandb.csv"
    names = [f"train/{P}kl", f"train/{P}k3_kl", f"train/{P}rollout_is_eff_sample_size"]
    cols = ["Step"] + [f"grpo-run-7 - {n}{suf}" for n in names for suf in ("", "__MIN", "__MAX")]
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for s, m in _steps():
            vals = [m[P + n.split(P)[1]] for n in names]
            w.writerow([s] + [x for v in vals for x in (v, -99.0, 99.0)])
        w.writerow([60, "", "", ""] + [""] * 6)  # a step without values
    h = read_history(p)
    assert h[0][1] == {n: _steps()[0][1][P + n.split(P)[1]] for n in names}
    assert _alerts(h) == [(a.name, a.step, a.value) for a in _expected().alerts]


def test_wandb_history_csv_and_mlflow_long_csv(tmp_path):
    p = tmp_path / "run_history.csv"
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["_step", "_runtime", *_steps()[0][1]])
        w.writeheader()
        for s, m in _steps():
            w.writerow({"_step": s, "_runtime": 3.0 * s, **m})
    assert _alerts(read_history(p)) == [(a.name, a.step, a.value) for a in _expected().alerts]
    q = tmp_path / "mlflow.csv"  # MLflow metric history: one row per (key, step)
    with open(q, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "value", "timestamp", "step"])
        for s, m in _steps():
            for k, v in m.items():
                w.writerow([k, v, 1700000000000 + s, s])
    assert _alerts(read_history(q)) == [(a.name, a.step, a.value) for a in _expected().alerts]


def test_csv_without_step_column(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="no step column"):
        read_history(p)


def test_tensorboard_event_directory(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path / "tb"
    w = SummaryWriter(str(logdir / "run1"))
    for s, m in _steps():
        for k, v in m.items():
            w.add_scalar(k, v, global_step=s)
        w.add_scalar("train/loss", 1.0 / (s + 1), global_step=s)
    w.close()
    h = read_history(logdir)
    assert len(h) == 60 and h[10][1][P + "kl"] == pytest.approx(0.01) and "train/loss" in h[10][1]
    # TensorBoard stores float32: compare steps and rules; values to float32 precision
    got = _alerts(h)
    ref = [(a.name, a.step, a.value) for a in _expected().alerts]
    assert [g[:2] for g in got] == [r[:2] for r in ref]
    assert [g[2] for g in got] == pytest.approx([r[2] for r in ref], rel=1e-6)


def test_format_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_history(tmp_path / "missing.jsonl")
    (tmp_path / "h.txt").write_text("")
    with pytest.raises(ValueError, match="--format"):
        read_history(tmp_path / "h.txt")
    with pytest.raises(ValueError, match="no events"):
        read_history(tmp_path, "tensorboard")


def test_monitor_command(tmp_path, capsys):
    p = tmp_path / "h.jsonl"
    p.write_text("\n".join(json.dumps({"step": s, **m}) for s, m in _steps()) + "\n")
    out = tmp_path / "report"
    assert main(["monitor", str(p), "--out", str(out), "--trend-factor", "2", "--window", "10"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_alert"]["name"] == "kl_rising" and summary["first_alert"]["step"] == 39
    assert summary["first_alert_step_by_rule"] == {"kl_rising": 39, "k3_kl_rising": 39, "ess_low": 47,
                                                  "ess_falling": 53}
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG" and (out / "metrics.svg").stat().st_size > 0
    timeline = (out / "alerts.md").read_text()
    assert "| 39 | kl_rising | warn |" in timeline and "| 47 | ess_low | warn |" in timeline
    assert HealthMonitor.load(out / "history.jsonl").alerts == _expected().alerts
    assert "first: kl_rising at step 39" in capsys.readouterr().out
    # options reach the monitor: static rules only, a changed threshold
    assert main(["monitor", str(p), "--out", str(out), "--no-trends", "--threshold", "ess_low=0.2"]) == 2
    assert "already holds a report" in capsys.readouterr().err  # another run's report is kept...
    assert main(["monitor", str(p), "--out", str(out), "--no-trends", "--threshold", "ess_low=0.2", "--force"]) == 0
    assert json.loads((out / "summary.json").read_text())["alerts"] == 0  # 0.25 > 0.2
    # no rollout_corr metric: a clear error
    q = tmp_path / "other.jsonl"
    q.write_text('{"step": 1, "loss": 2.0}\n')
    assert main(["monitor", str(q), "--out", str(out)]) == 2
    assert "no rollout_corr/* metric" in capsys.readouterr().err
