"""benchmarks/demo_step_cost.py: its three settings run the code paths they name, leave the demo's
code as they found it, and ``--json`` writes figures with their provenance."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import rollout_correction.demo.engine as engine  # noqa: E402
import rollout_correction.demo.model as model_module  # noqa: E402
import rollout_correction.demo.trainer as trainer  # noqa: E402
from rollout_correction.demo.task import Task  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("demo_step_cost", ROOT / "benchmarks" / "demo_step_cost.py")
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)


def test_each_setting_takes_its_own_path_and_restores_the_code(monkeypatch):
    shared_calls = []
    real = model_module.group_prompts
    monkeypatch.setattr(model_module, "group_prompts", lambda p, g: shared_calls.append(g) or real(p, g))
    monkeypatch.setattr(engine, "group_prompts", model_module.group_prompts)
    originals = (engine.is_dense_llama, trainer.response_log_probs, engine.RolloutEngine.generate)
    seen = {}
    for name, (_, _, direct, shared, _) in B.SETTINGS.items():
        shared_calls.clear()
        with B._Applied(B._patched(direct, shared)):
            m = model_module.build_model("tiny", max_len=14, seed=0)
            task = Task("sort", 6)
            eng = engine.RolloutEngine(m, "fp32", "none", 0)
            digits = task.sample_digits(2, torch.Generator().manual_seed(0)).repeat_interleave(4, 0)
            responses, _ = eng.generate(task.prompts(digits), 6, greedy=True, group_size=4)
            trainer.response_log_probs(m, torch.cat([task.prompts(digits), responses], 1), 8, 4)
            seen[name] = (engine.is_dense_llama(m), list(shared_calls))
        assert (engine.is_dense_llama, trainer.response_log_probs, engine.RolloutEngine.generate) == originals
    assert seen["former"] == (False, [])
    assert seen["direct"] == (True, [])
    assert seen["current"] == (True, [4, 4])   # the sampler's prefill and the trainer's forward


def test_json_holds_every_setting_with_its_provenance(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cost.json"
    monkeypatch.setattr(sys, "argv", ["demo_step_cost.py", "1", "--scenarios", "long", "--json", str(out)])
    tiny = {**B.SCENARIOS["long"], "tail": 8, "steps": 20, "eval_prompts": 16}
    monkeypatch.setitem(B.SCENARIOS, "long", tiny)
    monkeypatch.setattr(B.trainer, "setup_torch", lambda threads: None)  # keep this process's torch settings
    timed = [getattr(owner, name) for pairs in B.PHASES.values() for owner, name in pairs]
    B.main()
    assert [getattr(owner, name) for pairs in B.PHASES.values() for owner, name in pairs] == timed
    doc = json.loads(out.read_text())
    assert doc["provenance"]["command"].endswith("1 --scenarios long --json " + str(out))
    r = doc["scenarios"]["long"]
    assert r["steps"] == 20 and set(r["settings"]) == {"former", "direct", "current"}
    for name, f in r["settings"].items():
        n_eval = 20 // (B.SETTINGS[name][1] or tiny["eval_every"]) + 1
        assert f["evaluations"] == n_eval
        assert f["run_cpu_s"] == pytest.approx(20 * f["step_s"][0] + 2 * n_eval * f["eval_s"][0])
        phases = f["phase_s_per_step"]
        assert set(phases) == set(B.PHASES) | {"other"}
        assert sum(phases.values()) == pytest.approx(f["step_s"][0])
        assert phases["sampling"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    assert r["settings"]["former"]["former_over_this"] == [1.0]
    assert r["settings"]["current"]["former_over_this"] == pytest.approx(
        [r["settings"]["former"]["run_cpu_s"] / r["settings"]["current"]["run_cpu_s"]])
    assert "former / current" in capsys.readouterr().out


def test_bad_scenario_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["demo_step_cost.py", "--scenarios", "stale,foo"])
    with pytest.raises(SystemExit) as e:
        B.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "demo_step_cost.py: unknown scenario(s) ['foo']; choose from stale, quantized, long\n"
