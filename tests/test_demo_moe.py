"""The demo's mixture-of-experts scenario: the engine's 3-bit experts flip routing for real, R3
replays the engine's routing in the trainer, and a short ``--scenario moe`` run reports it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from rollout_correction import METRIC_PREFIX  # noqa: E402
from rollout_correction.cli import main  # noqa: E402
from rollout_correction.demo.config import METHODS, SCENARIOS, DemoConfig  # noqa: E402
from rollout_correction.demo.engine import RolloutEngine, fake_quantize  # noqa: E402
from rollout_correction.demo.model import build_model, response_log_probs  # noqa: E402
from rollout_correction.demo.task import Task  # noqa: E402
from rollout_correction.moe import record_routing, replay_routing, routing_agreement  # noqa: E402

torch.set_num_threads(1)


def test_engine_quantises_every_expert_and_leaves_the_routers():
    model = build_model("moe", max_len=16, seed=0)
    engine = RolloutEngine(model, "fp32", "int3", 0, "tensor")
    engine.sync(model)
    trainer, quant = dict(model.named_parameters()), dict(engine.model.named_parameters())
    experts = trainer["model.layers.0.mlp.experts.gate_up_proj"]
    for e in range(experts.shape[0]):
        assert torch.equal(quant["model.layers.0.mlp.experts.gate_up_proj"][e], fake_quantize(experts[e], "int3", "tensor"))
    assert torch.equal(quant["model.layers.1.mlp.gate.weight"], trainer["model.layers.1.mlp.gate.weight"])


def test_r3_makes_the_trainer_route_like_the_engine():
    """The quantised engine routes some tokens differently; under replay of its record the
    trainer's experts are the engine's, and its log-probs move towards the engine's."""
    task = Task("sort", 6)
    model = build_model("moe", max_len=task.seq_len + 1, seed=0)
    engine = RolloutEngine(model, "fp32", "int3", 0, "tensor")
    engine.sync(model)
    prompts = task.prompts(task.sample_digits(64, torch.Generator().manual_seed(0)))
    with record_routing(engine.model) as eng:
        responses, rollout_lp = engine.generate(prompts, task.response_len, generator=torch.Generator().manual_seed(1))
    tokens = torch.cat([prompts, responses], dim=1)
    with torch.no_grad(), record_routing(model) as own:
        plain = response_log_probs(model, tokens, task.prompt_len)
    agree = routing_agreement(eng.record, own.record)
    assert agree[METRIC_PREFIX + "routing_token_differs"] > 0.01     # routing really flips
    with torch.no_grad(), replay_routing(model, eng.record), record_routing(model) as replayed_own:
        replayed = response_log_probs(model, tokens, task.prompt_len)
    # layer 0's router sees the same input with or without replay: its own choice is unchanged
    assert torch.equal(replayed_own.record.experts[:, :, 0], own.record.experts[:, :, 0])
    gap_plain = (plain - rollout_lp).abs().mean()
    gap_replayed = (replayed - rollout_lp).abs().mean()
    assert gap_replayed < gap_plain


def test_replay_methods_need_an_moe_model():
    assert SCENARIOS["moe"]["model"] == "moe"
    assert {m for m in METHODS if METHODS[m].replay} == {"r3", "r3_token_tis", "bypass_r3"}
    with pytest.raises(ValueError, match="mixture-of-experts model"):
        DemoConfig(methods=("naive", "r3"))


def test_short_moe_scenario_run_reports_routing(tmp_path):
    out = tmp_path / "report"
    code = main(["demo", "--scenario", "moe", "--methods", "naive,r3,r3_token_tis", "--out", str(out),
                 "--workers", "1", "--no-progress", "--seeds", "0", "--steps", "4", "--eval-every", "2",
                 "--eval-prompts", "32", "--prompts", "4", "--samples", "4", "--sft-steps", "5"])
    assert code == 0
    runs = {r["method"]: r for r in (json.loads(p.read_text()) for p in (out / "runs").glob("*.json"))}
    for name, r in runs.items():
        h = r["history"]
        assert len(h["routing_match"]) == 4
        assert all(0.0 <= x <= 1.0 for x in h["routing_match"] + h["routing_token_differs"])
        assert h["routing_match"] == h[METRIC_PREFIX + "routing_match"]
        for key in ("other_token_is_clipped", "other_seq_is_rs_rejected", "other_token_is_ess"):
            assert len(h[key]) == 4
    assert (out / "routing_agreement.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "Routing agreement" in report


def test_quick_moe_scenario_includes_routing_replay():
    """``--scenario moe --quick`` (the first look) compares R3 with naive and token TIS; a dense
    scenario's ``--quick`` runs on-policy, naive and the correction the scenario recommends."""
    import argparse

    from rollout_correction.demo.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    moe = config_from_args(parser.parse_args(["--scenario", "moe", "--quick"]))
    assert moe.model == "moe" and moe.methods == ("naive", "token_tis", "r3")
    dense = config_from_args(parser.parse_args(["--quick"]))
    assert dense.methods == ("on_policy", "naive", "bypass_ppo") and dense.recommended == "bypass_ppo"
    quantized = config_from_args(parser.parse_args(["--scenario", "quantized", "--quick"]))
    assert quantized.methods == ("on_policy", "naive", "token_tis") and quantized.recommended == "token_tis"
