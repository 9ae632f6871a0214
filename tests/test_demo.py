"""Tests of the demo trainer: its pieces against hand-computed values, and ``--quick`` end to end."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from rollout_correction.demo.config import METHODS, DemoConfig  # noqa: E402
from rollout_correction.demo.engine import RolloutEngine, fake_quantize, sample  # noqa: E402
from rollout_correction.demo.model import build_model, response_log_probs  # noqa: E402
from rollout_correction.demo.task import BOS, SEP, Task  # noqa: E402
from rollout_correction.demo.trainer import group_advantages  # noqa: E402

torch.set_num_threads(1)


def test_task_prompts_answers_and_reward():
    task = Task("sort", 4)
    digits = torch.tensor([[3, 1, 2, 0], [9, 9, 0, 5]])
    assert task.prompts(digits).tolist() == [[BOS, 3, 1, 2, 0, SEP], [BOS, 9, 9, 0, 5, SEP]]
    assert task.answers(digits).tolist() == [[0, 1, 2, 3], [0, 5, 9, 9]]
    responses = torch.tensor([[0, 1, 2, 3], [0, 5, 9, 8]])
    assert task.reward(responses, digits).tolist() == [1.0, 0.0]
    assert Task("reverse", 4).answers(digits).tolist() == [[0, 2, 1, 3], [5, 0, 9, 9]]
    with pytest.raises(ValueError, match="responses must have shape"):
        task.reward(responses[:, :3], digits)
    with pytest.raises(ValueError, match="task must be one of"):
        Task("add", 4)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    # group 1: mean 0.25, std sqrt(0.1875) = 0.4330; group 2: constant -> 0
    s = 0.1875 ** 0.5
    expected = [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError):
        group_advantages(rewards, 3)


def test_group_baselines_leave_out_rejected_rows():
    # Row 0 (reward 1) is rejected: group 1's baseline is over rows 1-3 (rewards 0, 0, 1:
    # mean 1/3, population std sqrt(2)/3), row 0 gets 0; group 2 keeps all rows.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    mask = torch.ones(8, 3)
    mask[0] = 0.0
    adv = group_advantages(rewards, 4, response_mask=mask)
    s = 2**0.5 / 3
    expected = [0.0, -(1 / 3) / (s + 1e-6), -(1 / 3) / (s + 1e-6), (2 / 3) / (s + 1e-6), 0.5 / 0.5, -0.5 / 0.5,
                0.5 / 0.5, -0.5 / 0.5]
    assert adv.tolist() == pytest.approx(expected, abs=1e-4)
    # Without the mask the rejected reward would have moved group 1's baseline to 0.5.
    assert group_advantages(rewards, 4)[1].item() == pytest.approx(-1.0, abs=1e-4)


@pytest.mark.parametrize("quant,bits", [("int3", 3), ("int4", 4), ("int8", 8)])
def test_fake_quantize_integer_grid(quant, bits):
    w = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    q = fake_quantize(w, quant)
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=1, keepdim=True) / qmax
    levels = q / scale
    assert torch.allclose(levels, levels.round(), atol=1e-4)          # on the grid
    assert levels.abs().max() <= qmax + 1e-4                           # within range
    assert (q - w).abs().max() <= scale.max() / 2 + 1e-6               # round to nearest
    assert torch.allclose(q.abs().amax(dim=1), w.abs().amax(dim=1))    # the row max is exact


def test_fake_quantize_fp8_and_none():
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fake_quantize(w, "none"), w)
    q = fake_quantize(w, "fp8")
    rel = ((q - w).abs() / w.abs().clamp_min(1e-3)).max()
    assert 0 < rel <= 2 ** -4 + 1e-6  # e4m3 has 3 mantissa bits: relative error ≤ 2^-4
    with pytest.raises(ValueError, match="quant must be one of"):
        fake_quantize(w, "int2")


def _model_and_prompts(n=16):
    task = Task("sort", 4)
    model = build_model("tiny", max_len=task.seq_len + 1, seed=0)
    digits = task.sample_digits(n, torch.Generator().manual_seed(0))
    return task, model, task.prompts(digits)


def test_exact_engine_matches_trainer_log_probs():
    task, model, prompts = _model_and_prompts()
    engine = RolloutEngine(model, "fp32", "none", 0)
    engine.sync(model)
    responses, rollout_lp = engine.generate(prompts, task.response_len, torch.Generator().manual_seed(1))
    trainer_lp = response_log_probs(model, torch.cat([prompts, responses], 1), task.prompt_len)
    assert torch.allclose(rollout_lp, trainer_lp.detach(), atol=1e-5)


def test_mismatched_engine_differs_for_real():
    task, model, prompts = _model_and_prompts()
    for precision, quant in [("bf16", "none"), ("fp32", "int3")]:
        engine = RolloutEngine(model, precision, quant, 0)
        engine.sync(model)
        responses, rollout_lp = engine.generate(prompts, task.response_len, torch.Generator().manual_seed(1))
        trainer_lp = response_log_probs(model, torch.cat([prompts, responses], 1), task.prompt_len).detach()
        gap = (rollout_lp - trainer_lp).abs().max().item()
        assert 1e-4 < gap < 1.0, (precision, quant, gap)
        assert rollout_lp.dtype == torch.float32


def test_engine_lag_uses_weights_from_k_syncs_ago():
    task, model, prompts = _model_and_prompts(4)
    engine = RolloutEngine(model, "fp32", "none", lag=2)
    snapshots = []
    for k in range(4):
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.1)
        snapshots.append(model.model.embed_tokens.weight.detach().clone())
        engine.sync(model)
        expected = snapshots[max(0, k - 2)]
        assert torch.equal(engine.model.model.embed_tokens.weight, expected)


def test_greedy_sampling_is_argmax_of_teacher_forced_logits():
    task, model, prompts = _model_and_prompts(8)
    responses, lp = sample(model, prompts, task.response_len, greedy=True)
    with torch.no_grad():
        logits = model(torch.cat([prompts, responses], 1)[:, :-1]).logits[:, task.prompt_len - 1:]
    assert torch.equal(logits.argmax(-1), responses)


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="unknown method"):
        DemoConfig(methods=("naive", "magic"))
    with pytest.raises(ValueError, match="quant must be one of"):
        DemoConfig(quant="int2")
    with pytest.raises(ValueError, match="samples per prompt"):
        DemoConfig(samples=1)


def test_every_corrected_method_names_a_library_preset():
    from rollout_correction import RolloutCorrectionConfig

    for m in METHODS.values():
        if m.preset:
            RolloutCorrectionConfig.from_preset(m.preset)


def test_quick_end_to_end(tmp_path):
    from rollout_correction.cli import main

    out = tmp_path / "report"
    code = main(["demo", "--quick", "--out", str(out), "--workers", "1", "--no-progress"])
    assert code == 0
    for name in ("summary.json", "report.md", "report.html", "overview.png", "trainer_reward.png",
                 "engine_reward.png", "mismatch_kl.png", "chi2.png", "ess.png", "grad_norm.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    # no placeholder plots: no method of --quick rejects, and the model has no routers
    assert not (out / "rejected.png").exists() and not (out / "routing_agreement.png").exists()
    assert "rejected.png" not in (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    methods = summary["config"]["methods"]
    seeds = summary["config"]["seeds"]
    runs = summary["runs"]
    assert sorted((r["method"], r["seed"]) for r in runs) == sorted((m, s) for m in methods for s in seeds)
    for r in runs:
        assert 0.0 <= r["final_reward"] <= r["best_reward"] <= 1.0
        assert isinstance(r["collapsed"], bool)
        assert r["collapsed"] == (r["final_reward"] < 0.5 * r["best_reward"])
        assert r["final_mismatch_kl"] == r["final_mismatch_kl"]  # not NaN
        if r["method"] == "on_policy":
            assert abs(r["final_mismatch_kl"]) < 1e-4   # engine = trainer
        else:
            assert r["final_mismatch_kl"] > 1e-3        # a real gap
    assert "| method |" in (out / "report.md").read_text()
    assert set(summary["checks"]) >= {"naive_gap", "naive_kl_growth", "all_hold"}
    # provenance of the invocation and of every run; one seed: means without intervals, no ties judged
    from rollout_correction.demo.results import PROVENANCE_FIELDS

    assert set(summary["provenance"]) == set(PROVENANCE_FIELDS)
    assert summary["provenance"]["command"].startswith("rollout-correction demo") or "Python" in \
        summary["provenance"]["command"]
    assert summary["run_provenance"] == [{**{k: summary["provenance"][k] for k in
                                             ("commit", "dirty", "torch", "python", "cpu", "threads")},
                                          "runs": len(runs)}] and summary["mixed_provenance"] is False
    for m in methods:
        final = summary["methods"][m]["final_reward"]
        assert final["n"] == 1 and final["ci"] is None
        assert final["mean"] == pytest.approx(next(r["final_reward"] for r in runs if r["method"] == m))
    assert summary["tied_with_best"] is None


def test_saved_runs_are_reused_only_with_identical_settings(tmp_path):
    from rollout_correction.demo.runner import _load_run, _save_run

    cfg = DemoConfig(out=str(tmp_path), seeds=(0,), methods=("naive",))
    result = {"method": "naive", "seed": 0, "history": {}, "evals": {}, "seconds": 1.0, "cpu_seconds": 1.0}
    _save_run(cfg, result)
    assert _load_run(cfg, "naive", 0)["seconds"] == 1.0
    assert _load_run(cfg.replace(workers=1, seeds=(0, 1)), "naive", 0) is not None  # not result-relevant
    assert _load_run(cfg.replace(lr=1e-4), "naive", 0) is None                      # different result
    assert _load_run(cfg, "naive", 1) is None


def test_checks_text_says_above_or_below_and_keeps_the_deciding_digit():
    from rollout_correction.demo.report import checks_text

    checks = {"available": True, "on_policy_final": 0.868, "naive_final": 0.591, "naive_gap": 0.277,
              "naive_degrades": False, "naive_kl_growth": 6.9, "naive_kl_rises_5x": True,
              "best_correction": "token_tis", "best_correction_final": 0.787, "best_minus_naive": 0.196,
              "best_beats_naive_by_0.2": False, "best_within_0.1_of_on_policy": True, "all_hold": False}
    lines = checks_text(checks)
    # 0.196 must not print as "0.20" next to "no": three decimals show why the check failed
    assert "beats naive by ≥ 0.2: **no** — by 0.196." in lines[2]
    assert lines[3].endswith("yes — 0.081 below on-policy.")
    assert lines[-1].startswith("**Not every claim holds")
    above = dict(checks, best_correction_final=0.898, best_minus_naive=0.416,
                 **{"best_beats_naive_by_0.2": True})
    assert checks_text(above)[3].endswith("yes — 0.030 above on-policy.")


# ---------------------------------------------------------------------------------------------
# Intervals, ties and provenance (demo/results.py)


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042),
                                          (120, 1.980)])
def test_t_quantile_matches_the_printed_table(df, expected):
    from rollout_correction.demo.results import t_quantile

    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_interval_of_three_seeds_by_hand():
    from rollout_correction.demo.results import interval

    s = interval([0.89, 0.87, 0.85])
    # mean 0.87, s = 0.02, half-width t(0.975, 2) · s / √3 = 4.3027 · 0.02 / 1.7321 = 0.04968
    assert s["mean"] == pytest.approx(0.87) and s["std"] == pytest.approx(0.02) and s["n"] == 3
    assert s["ci"] == pytest.approx([0.87 - 0.04968, 0.87 + 0.04968], abs=1e-4)
    one = interval([0.5, float("nan")])
    assert one["n"] == 1 and one["ci"] is None and one["mean"] == 0.5


def test_ties_are_overlapping_intervals_with_the_best():
    from rollout_correction.demo.results import interval, tied_with_best

    stats = {"a": interval([0.89, 0.87, 0.85]),   # best: [0.820, 0.920]
             "b": interval([0.78, 0.71, 0.72]),   # [0.643, 0.831]: overlaps
             "c": interval([0.72, 0.44, 0.50]),   # [0.187, 0.920]: overlaps (a wide interval is a tie)
             "d": interval([0.50, 0.51, 0.52])}   # [0.485, 0.535]: below
    assert tied_with_best(stats) == ["a", "b", "c"]
    assert tied_with_best({"a": interval([0.9]), "b": interval([0.1, 0.2])}) is None


def test_provenance_names_commit_machine_threads_date_and_command():
    import torch

    from rollout_correction.demo.results import PROVENANCE_FIELDS, provenance

    p = provenance("rollout-correction demo --quick", workers=2, threads=1)
    assert tuple(p) == PROVENANCE_FIELDS
    assert p["torch"] == torch.__version__ and p["workers"] == 2 and p["threads"] == 1
    assert p["command"] == "rollout-correction demo --quick" and p["cpu"] and p["date"].endswith("Z")
    assert p["commit"] is None or len(p["commit"]) == 40


def test_checks_are_judged_on_intervals():
    from rollout_correction.demo.report import checks
    from rollout_correction.demo.results import interval

    def method(values):
        return {"final_reward": interval(values), "collapsed": 0, "runs": len(values), "kl_growth": 6.0}

    apart = {"on_policy": method([0.89, 0.87, 0.85]), "naive": method([0.52, 0.55, 0.50]),
             "token_tis": method([0.80, 0.78, 0.82])}
    c = checks(apart)
    assert c["naive_degrades"] and c["best_beats_naive_by_0.2"] and c["best_within_0.1_of_on_policy"]
    assert c["judged_on"] == "means and 95 % intervals"
    # a 0.33 gap of the means whose intervals overlap is not a resolved drop
    wide = dict(apart, naive=method([0.95, 0.40, 0.30]))
    c = checks(wide)
    assert c["naive_gap"] >= 0.3 and c["naive_below_on_policy_interval"] is False and not c["naive_degrades"]
    one_seed = {k: method([v["final_reward"]["mean"]]) for k, v in apart.items()}
    assert checks(one_seed)["judged_on"].startswith("means (one seed")


def test_summary_table_reads_whole_in_a_log():
    """Through a pipe rich assumes 80 columns; the table must not wrap or cut method names."""
    import io

    from rich.console import Console

    from rollout_correction.demo.report import print_table
    from rollout_correction.demo.results import interval

    methods = {m: {"label": METHODS[m].label, "preset": METHODS[m].preset, "final_reward": interval([0.8, 0.7, 0.75]),
                   "best_reward": interval([0.8, 0.8, 0.8]), "final_engine_reward": interval([0.7, 0.7, 0.7]),
                   "initial_mismatch_kl": 0.01, "final_mismatch_kl": 0.02, "collapsed": 0, "runs": 3,
                   "seconds": interval([45.0, 46.0, 47.0])} for m in ("on_policy", "cispo", "binary_kl_rs")}
    summary = {"methods": methods, "tied_with_best": list(methods), "checks": {"available": False, "reason": "x"}}
    out = io.StringIO()
    console = Console(file=out, width=80)
    assert not console.is_terminal
    print_table(summary, console)
    text = out.getvalue()
    assert "…" not in text
    for m in methods.values():
        assert sum(m["label"] in line for line in text.splitlines()) == 1, m["label"]
    row = next(line for line in text.splitlines() if "binary-KL RS + token TIS" in line)
    assert "0.75 [0.63, 0.87]" in row and "yes" in row


def test_summary_table_stacks_in_a_narrow_terminal():
    """An 80-column terminal: one block per method, every header whole, no line wider than 80."""
    import io

    from rich.console import Console

    from rollout_correction.demo.report import TABLE_HEADER, _TERMINAL_COLUMNS, print_table
    from rollout_correction.demo.results import interval

    methods = {m: {"label": METHODS[m].label, "preset": METHODS[m].preset, "final_reward": interval([0.8, 0.7, 0.75]),
                   "best_reward": interval([0.8, 0.8, 0.8]), "final_engine_reward": interval([0.7, 0.7, 0.7]),
                   "initial_mismatch_kl": 0.01, "final_mismatch_kl": 0.02, "collapsed": 0, "runs": 3,
                   "seconds": interval([45.0, 46.0, 47.0])} for m in ("on_policy", "naive")}
    summary = {"methods": methods, "tied_with_best": list(methods), "checks": {"available": False, "reason": "x"}}
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    print_table(summary, console)
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for i in _TERMINAL_COLUMNS[1:]:
        assert text.count(f"  {TABLE_HEADER[i]}: ") == 2, TABLE_HEADER[i]
    assert "  trainer final [95 % CI]: 0.75 [0.63, 0.87]" in text
