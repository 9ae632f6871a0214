"""Tests of the demo trainer: its pieces against hand-computed values, and ``--quick`` end to end."""

from __future__ import annotations

import json
import math

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


def test_a_long_response_is_the_answer_then_an_unscored_bigram_continuation():
    from rollout_correction.demo.task import BIGRAM

    task = Task("sort", 4, "partial", tail=5)
    digits = torch.tensor([[3, 1, 2, 0], [9, 9, 0, 5]])
    assert (task.answer_len, task.response_len, task.seq_len) == (4, 9, 15)
    # the reward reads the answer only: the same answers with other continuations score the same
    a = torch.tensor([[0, 1, 3, 3, 7, 7, 7, 7, 7], [0, 5, 9, 9, 1, 2, 3, 4, 5]])
    b = torch.cat([a[:, :4], torch.zeros(2, 5, dtype=torch.long)], dim=1)
    assert task.reward(a, digits).tolist() == task.reward(b, digits).tolist() == [0.75, 1.0]
    with pytest.raises(ValueError, match=r"responses must have shape \(2, 9\)"):
        task.reward(a[:, :6], digits)
    demo = task.demonstrations(digits, torch.Generator().manual_seed(0))
    assert demo.shape == (2, 9) and demo[:, :4].tolist() == task.answers(digits).tolist()
    # the continuation follows the bigram: each row a distribution, transition frequencies close to it
    assert torch.allclose(BIGRAM.sum(dim=1), torch.ones(10)) and (BIGRAM > 0).all()
    long = Task("sort", 2, tail=4000).continuation(torch.arange(10).repeat(10), torch.Generator().manual_seed(1))
    pairs = torch.stack([long[:, :-1].reshape(-1), long[:, 1:].reshape(-1)])
    counts = torch.zeros(10, 10).index_put_((pairs[0], pairs[1]), torch.ones(pairs.shape[1]), accumulate=True)
    assert torch.allclose(counts / counts.sum(dim=1, keepdim=True), BIGRAM, atol=0.02)
    # entropy of the rows: about 2.2 nats per token (Dirichlet(3)), not deterministic, not uniform
    entropy = -(BIGRAM * BIGRAM.log()).sum(dim=1).mean().item()
    assert 1.9 < entropy < 2.25 and Task("sort", 4).demonstrations(digits, torch.Generator()).shape == (2, 4)
    with pytest.raises(ValueError, match="tail must be in"):
        Task("sort", 4, tail=-1)


def test_by_length_figures_are_kept_on_a_grid_of_lengths():
    from rollout_correction.demo.trainer import length_grid, weight_ess_by_length

    assert length_grid(6) == [1, 2, 3, 4, 5, 6]
    grid = length_grid(600)   # every length to 16, then every 18th, and 600
    assert grid[:16] == list(range(1, 17)) and grid[-1] == 600 and 18 * 33 in grid and len(grid) <= 50
    assert all(b > a for a, b in zip(grid, grid[1:]))
    ess = weight_ess_by_length(torch.zeros(4, 600), torch.full((4, 600), -0.01))
    assert sorted(ess) == sorted([f"ess_seq@{L}" for L in grid] + [f"ess_geo@{L}" for L in grid])
    assert ess["ess_seq@600"] == pytest.approx(1.0)   # equal weights: ESS / N = 1


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


@pytest.mark.parametrize("quant,bits", [("int2", 2), ("int3", 3), ("int4", 4), ("int8", 8)])
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
        fake_quantize(w, "int1")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_sampling_path_equals_the_models_own_forward_bit_for_bit(dtype, monkeypatch):
    """The sampler's direct layer calls for a dense Llama give the tokens and log-probs of the
    model's own KV-cache forward exactly (at temperature 1, greedy and top-k)."""
    import rollout_correction.demo.engine as engine

    task, model, prompts = _model_and_prompts(32)
    model = model.to(dtype).eval()
    assert engine.is_dense_llama(model)
    for kw in ({}, {"greedy": True}, {"top_k": 5}):
        fast = sample(model, prompts, task.response_len, generator=torch.Generator().manual_seed(3), **kw)
        with monkeypatch.context() as m:
            m.setattr(engine, "is_dense_llama", lambda model: False)
            own = sample(model, prompts, task.response_len, generator=torch.Generator().manual_seed(3), **kw)
        assert torch.equal(fast[0], own[0]) and torch.equal(fast[1], own[1]), kw


def test_growing_cache_holds_the_concatenated_caches_values_and_gives_the_same_logits():
    """The sampler's in-place cache: after every step the same keys and values as concatenating,
    and the same logits bit for bit; a full buffer refuses more positions."""
    from rollout_correction.demo.model import GrowingCache, dense_forward

    task, model, prompts = _model_and_prompts(8)
    model.eval()
    ids = torch.randint(0, 10, (8, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, cat_cache = dense_forward(model, prompts)
        grow = GrowingCache(cat_cache, prompts.shape[1] + ids.shape[1])
        for t in range(ids.shape[1]):
            a, cat_cache = dense_forward(model, ids[:, t:t + 1], cat_cache)
            b, grow = dense_forward(model, ids[:, t:t + 1], grow)
            assert torch.equal(a, b), t
            assert grow.length == cat_cache[0][0].shape[2] == prompts.shape[1] + t + 1
            for (k, v), (kb, vb) in zip(cat_cache, grow):
                assert torch.equal(k, kb[:, :, :grow.length]) and torch.equal(v, vb[:, :, :grow.length])
        with pytest.raises(ValueError, match="the cache holds 18 positions, 19 requested"):
            dense_forward(model, ids[:, :1], grow)
    with pytest.raises(ValueError, match="capacity \\(3\\) must hold the cache's 6 positions"):
        GrowingCache(dense_forward(model, prompts)[1], 3)


def _grouped_batch(prompts_n=4, group=3, seed=0):
    """``prompts_n`` prompts, each repeated ``group`` times, with random responses."""
    task = Task("sort", 5)
    model = build_model("tiny", max_len=task.seq_len + 1, seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = task.prompts(task.sample_digits(prompts_n, g)).repeat_interleave(group, dim=0)
    responses = torch.randint(0, 10, (prompts.shape[0], task.response_len), generator=g)
    return task, model, prompts, responses


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_shared_forward_gives_the_full_forwards_log_probs_and_gradient(seed):
    """Reading each group's prompt once and its rows on top of the prompt's KV cache gives the
    log-probs and the parameter gradient of the model's own forward over every row."""
    task, model, prompts, responses = _grouped_batch(seed=seed)
    tokens = torch.cat([prompts, responses], 1)
    coeff = torch.randn(tokens.shape[0], task.response_len, generator=torch.Generator().manual_seed(seed))
    grads = []
    for group in (1, 3):
        model.zero_grad()
        lp = response_log_probs(model, tokens, task.prompt_len, group_size=group)
        (lp * coeff).sum().backward()
        grads.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    (full, full_grad), (shared, shared_grad) = grads
    # The full forward itself (teacher forcing through model(...).logits), computed independently.
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits[:, task.prompt_len - 1:]
        expected = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(full, expected)
    assert torch.allclose(shared, full, atol=1e-5, rtol=0), (shared - full).abs().max()
    for a, b in zip(shared_grad, full_grad):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("kw", [{}, {"greedy": True}, {"top_k": 4}])
def test_prefix_shared_sampling_gives_the_tokens_of_reading_every_row(kw):
    task, model, prompts, _ = _grouped_batch(prompts_n=6, group=4)
    model.eval()
    every = sample(model, prompts, task.response_len, generator=torch.Generator().manual_seed(5), **kw)
    shared = sample(model, prompts, task.response_len, generator=torch.Generator().manual_seed(5),
                    group_size=4, **kw)
    assert torch.equal(shared[0], every[0])
    assert torch.allclose(shared[1], every[1], atol=1e-5, rtol=0)


def test_prefix_sharing_refuses_rows_that_do_not_share_their_prompt():
    task, model, prompts, responses = _grouped_batch(prompts_n=2, group=3)
    tokens = torch.cat([prompts, responses], 1)
    mixed = tokens.clone()
    mixed[1, 1] = (mixed[1, 1] + 1) % 10
    with pytest.raises(ValueError, match="every group of 3 consecutive rows must share one prompt"):
        response_log_probs(model, mixed, task.prompt_len, group_size=3)
    with pytest.raises(ValueError, match="group_size \\(4\\) must divide the 6 rows"):
        response_log_probs(model, tokens, task.prompt_len, group_size=4)
    with pytest.raises(ValueError, match="must share one prompt"):
        sample(model, mixed[:, :task.prompt_len], task.response_len, greedy=True, group_size=3)


def test_greedy_sampling_is_argmax_of_teacher_forced_logits():
    task, model, prompts = _model_and_prompts(8)
    responses, lp = sample(model, prompts, task.response_len, greedy=True)
    with torch.no_grad():
        logits = model(torch.cat([prompts, responses], 1)[:, :-1]).logits[:, task.prompt_len - 1:]
    assert torch.equal(logits.argmax(-1), responses)


def test_demo_units_are_weighed_by_their_expected_cost():
    """The default demo (5 seeds × 5 methods): an SFT warm start costs 60 steps × 64 sequences plus
    one evaluation of 512 prompts at 0.4; a GRPO run 500 steps × 16 × 8 sequences plus 11 evaluations
    (steps 0, 50, …, 500) with the trainer and the engine. With the warm starts done after 5.5 s, the
    ETA is 5.5 s × (25 runs) / (5 warm starts) in cost, about 7.8 minutes, not 27.5 s (5.5 s per 5
    units × 25 units left, as when every unit counted alike)."""
    import io

    from rollout_correction.console import ProgressLines
    from rollout_correction.demo.runner import unit_costs

    sft, run = unit_costs(DemoConfig())
    assert sft == pytest.approx(60 * 64 + 0.4 * 512)                 # 4044.8
    assert run == pytest.approx(500 * 16 * 8 + 0.4 * 2 * 11 * 512)   # 68505.6
    assert unit_costs(DemoConfig(steps=40, eval_every=20))[1] == pytest.approx(40 * 128 + 0.4 * 2 * 3 * 512)
    assert unit_costs(DemoConfig(steps=45, eval_every=20))[1] == pytest.approx(45 * 128 + 0.4 * 2 * 4 * 512)
    t = iter([0.0, 1.1, 2.2, 3.3, 4.4, 5.5])
    p = ProgressLines(30, stream=io.StringIO(), now=lambda: next(t), total_cost=5 * sft + 25 * run)
    lines = [p.finished(f"SFT warm start · seed {s}", cost=sft) for s in range(5)]
    # 5.5 × (25 · 68505.6) / (5 · 4044.8) = 465.8 s
    assert lines[-1] == "[ 5/30] SFT warm start · seed 4  elapsed 6s  ETA 7m46s"


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="unknown method"):
        DemoConfig(methods=("naive", "magic"))
    with pytest.raises(ValueError, match="quant must be one of"):
        DemoConfig(quant="int1")
    with pytest.raises(ValueError, match="samples per prompt"):
        DemoConfig(samples=1)
    with pytest.raises(ValueError, match="seeds must be distinct"):
        DemoConfig(seeds=(0, 0))
    with pytest.raises(ValueError, match="at least one seed"):
        DemoConfig(seeds=())
    with pytest.raises(ValueError, match="recommended must name a corrected method"):
        DemoConfig(recommended="naive")


def test_bad_demo_input_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    """A seed list, a method or a recommendation the demo cannot run stops before any run, with one
    line naming the problem (on stderr, exit 2, nothing written)."""
    import argparse

    from rollout_correction.cli import main
    from rollout_correction.demo.cli import add_arguments

    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, words in ((["--seeds", "1,1"], "seeds must be distinct"), (["--seeds", ","], "at least one seed"),
                        (["--samples", "1"], "samples per prompt")):
        assert main(["demo", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    assert not list(tmp_path.iterdir())
    for bad in (["--scenario", "nope"], ["--methods", "naive,magic"], ["--seeds", "one"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(bad)
        assert exc.value.code == 2


def test_new_criteria_and_long_scenario_methods_build_their_library_configs():
    """KPop, Δp band, log-prob error, MinPRO and the rollout-IS loss run as presets plus config keys;
    the aliases at one update per batch name methods that exist."""
    from rollout_correction.demo.config import ALIASES, SCENARIOS
    from rollout_correction.demo.trainer import correction_config

    cfgs = {m: correction_config(METHODS[m]) for m in ("kpop_rs", "dp_rs", "lp_err_rs", "minpro", "rollout_is",
                                                         "geo_rs_long")}
    assert cfgs["kpop_rs"].rollout_rs == "seq_mean_kpop" and cfgs["kpop_rs"].rollout_is == "token"
    assert cfgs["dp_rs"].rollout_rs == "seq_mean_dp" and tuple(cfgs["dp_rs"].rollout_rs_threshold) == (-0.05, 0.05)
    assert cfgs["lp_err_rs"].rollout_rs == "seq_logprob_error"
    assert cfgs["minpro"].rollout_is == "prefix_min"
    assert cfgs["rollout_is"].loss_type == "rollout_is" and cfgs["rollout_is"].bypass_mode
    assert METHODS["kpop_rs"].setting == "decoupled_token_is, rollout_rs=seq_mean_kpop, rollout_rs_threshold=0.02"
    assert all(a in METHODS and b in METHODS and a != b for a, b in ALIASES.items())
    for name, sc in SCENARIOS.items():
        DemoConfig(scenario=name, **sc)  # every scenario's declared recommendation is a corrected method


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
                 "engine_reward.png", "mismatch_kl.png", "chi2.png", "grad_norm.png"):
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
    assert summary["claims"]["recommended"] == summary["config"]["recommended"] == "bypass_ppo" in methods
    assert [c["evaluated"] for c in summary["claims"]["claims"]] == [False, False]  # one seed
    assert summary["paired"]["vs_naive"]["on_policy"]["n"] == 1
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


def test_quick_long_scenario_reports_weights_and_results_against_length(tmp_path):
    """``--quick --scenario long``: a tiny long-response run with the ESS of the sequence weight
    against response length, the final prefix exact match against answer length, and the plot of both."""
    from rollout_correction.cli import main
    from rollout_correction.demo.trainer import ess_fraction, length_grid

    out = tmp_path / "long"
    assert main(["demo", "--quick", "--scenario", "long", "--out", str(out), "--workers", "1", "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    c = summary["config"]
    assert (c["quant"], c["recommended"], c["tail"]) == ("int2", "token_tis", 40)
    assert (out / "by_length.png").stat().st_size > 0
    n, T = c["digits"], c["digits"] + c["tail"]
    for r in summary["runs"]:
        prefix = r["final_by_length"]
        assert r["answer_lengths"] == list(range(1, n + 1)) and len(prefix) == n
        assert all(a >= b for a, b in zip(prefix, prefix[1:]))  # a longer prefix is harder
        assert prefix[-1] == r["final_reward"]
        assert r["ess_lengths"] == length_grid(T) and len(r["ess_seq_by_length"]) == len(r["ess_geo_by_length"]) == \
            len(length_grid(T))
        assert all(0 < x <= 1 + 1e-9 for x in r["ess_seq_by_length"] + r["ess_geo_by_length"])
    m = summary["methods"]["naive"]
    assert m["initial_length_x_kl"] == pytest.approx(T * m["initial_mismatch_kl"])
    # the scenario's own claims: one seed judges nothing, and seq IS did not run in --quick
    rows = summary["claims"]["claims"]
    assert [(r["method"], r["minus"], r["evaluated"]) for r in rows] == [("token_tis", "naive", False),
                                                                         ("token_tis", "seq_is", False)]
    assert rows[1]["reason"] == "needs the token_tis and seq_is methods in the run"
    # ESS / N by hand: weights 1, 1, 2 → (4)² / (3 · 6) = 0.8889; equal weights → 1
    assert ess_fraction(torch.tensor([0.0, 0.0, math.log(2.0)])).item() == pytest.approx(16 / 18)
    assert ess_fraction(torch.full((5,), 700.0, dtype=torch.float64)).item() == pytest.approx(1.0)  # no overflow


def test_saved_runs_are_reused_only_with_identical_settings(tmp_path):
    from rollout_correction.demo.runner import _load_run, _save_run

    cfg = DemoConfig(out=str(tmp_path), seeds=(0,), methods=("naive",))
    result = {"method": "naive", "seed": 0, "history": {}, "evals": {}, "seconds": 1.0, "cpu_seconds": 1.0}
    _save_run(cfg, result)
    assert _load_run(cfg, "naive", 0)["seconds"] == 1.0
    assert _load_run(cfg.replace(workers=1, seeds=(0, 1)), "naive", 0) is not None  # not result-relevant
    assert _load_run(cfg.replace(lr=1e-4), "naive", 0) is None                      # different result
    assert _load_run(cfg, "naive", 1) is None


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


def test_paired_interval_by_hand():
    from rollout_correction.demo.results import interval, paired_difference

    a, b = {0: 0.80, 1: 0.50, 2: 0.65}, {0: 0.75, 1: 0.44, 2: 0.61}
    d = paired_difference(a, b)
    # dₛ = 0.05, 0.06, 0.04: mean 0.05, s_d = 0.01, half-width 4.3027 · 0.01 / √3 = 0.024842
    assert d["mean"] == pytest.approx(0.05) and d["std"] == pytest.approx(0.01) and d["n"] == 3
    assert d["ci"] == pytest.approx([0.05 - 0.024842, 0.05 + 0.024842], abs=1e-5)
    assert (d["above"], d["below"], d["equal"], d["verdict"]) == (3, 0, 0, "above")
    # the same figures unpaired: the two intervals overlap (the seed-to-seed spread hides the gain)
    ia, ib = interval(a.values()), interval(b.values())
    assert ia["ci"][0] < ib["ci"][1]
    # dₛ = 0.20, 0.05, 0.25: mean 0.16667, s_d = 0.104083, half-width 4.3027 · 0.104083 / √3 = 0.25856
    d = paired_difference({0: 0.80, 1: 0.70, 2: 0.75}, {0: 0.60, 1: 0.65, 2: 0.50})
    assert d["ci"] == pytest.approx([0.16667 - 0.25856, 0.16667 + 0.25856], abs=1e-4) and d["verdict"] == "tied"
    # b ahead on two seeds of three, one equal; only the shared finite seeds count
    d = paired_difference({0: 0.5, 1: 0.4, 2: 0.3, 3: 0.9}, {0: 0.6, 1: 0.5, 2: 0.3, 4: 0.1})
    assert (d["n"], d["above"], d["below"], d["equal"], d["seeds"]) == (3, 0, 2, 1, [0, 1, 2])
    one = paired_difference({0: 0.9}, {0: 0.1, 1: 0.2})
    assert one["n"] == 1 and one["ci"] is None and one["verdict"] is None and one["mean"] == pytest.approx(0.8)


def test_ties_are_paired_intervals_against_the_best_that_cover_0():
    from rollout_correction.demo.results import tied_with_best

    finals = {"a": {0: 0.89, 1: 0.87, 2: 0.85},   # best
              "b": {0: 0.78, 1: 0.71, 2: 0.72},   # a − b = 0.11, 0.16, 0.13: apart (below)
              "c": {0: 0.95, 1: 0.60, 2: 0.90},   # a − c = −0.06, 0.27, −0.05: covers 0, tied
              "d": {0: 0.88, 1: 0.86, 2: 0.84}}   # a − d = 0.01 on every seed: s_d = 0, below
    assert tied_with_best(finals) == ["a", "c"]
    assert tied_with_best({"a": {0: 0.9}, "b": {0: 0.1}}) is None


def test_provenance_names_commit_machine_threads_date_and_command():
    import torch

    from rollout_correction.demo.results import PROVENANCE_FIELDS, provenance

    p = provenance("rollout-correction demo --quick", workers=2, threads=1)
    assert tuple(p) == PROVENANCE_FIELDS
    assert p["torch"] == torch.__version__ and p["workers"] == 2 and p["threads"] == 1
    assert p["command"] == "rollout-correction demo --quick" and p["cpu"] and p["date"].endswith("Z")
    assert p["commit"] is None or len(p["commit"]) == 40


def _summary(finals: dict, recommended: str | None) -> dict:
    """A summary with the given {method: {seed: final}} (the other figures fixed)."""
    from rollout_correction.demo.results import interval

    runs = [{"method": m, "seed": k, "final_reward": v} for m, f in finals.items() for k, v in f.items()]
    methods = {m: {"label": METHODS[m].label, "preset": METHODS[m].preset, "final_reward": interval(f.values()),
                   "best_reward": interval(f.values()), "final_engine_reward": interval([0.7] * len(f)),
                   "initial_mismatch_kl": 0.01, "final_mismatch_kl": 0.06, "kl_growth": 6.0, "collapsed": 0,
                   "runs": len(f), "seconds": interval([45.0] * len(f))} for m, f in finals.items()}
    return {"methods": methods, "runs": runs, "config": {"recommended": recommended}}


def test_a_scenario_declares_its_own_claims_and_each_is_judged_on_its_pair():
    """``claims`` in a scenario's config: (method, minus) pairs, judged like the default two."""
    from rollout_correction.demo.config import SCENARIOS
    from rollout_correction.demo.report import claims, claims_text

    s = _summary({"naive": {0: 0.50, 1: 0.40, 2: 0.45}, "token_tis": {0: 0.60, 1: 0.55, 2: 0.50},
                  "seq_is": {0: 0.30, 1: 0.31, 2: 0.32}}, "token_tis")
    s["config"]["claims"] = [["token_tis", "naive"], ["token_tis", "seq_is"]]
    first, second = claims(s)["claims"]
    # token TIS − naive = 0.10, 0.15, 0.05: mean 0.10, s_d 0.05, half 4.3027 · 0.05 / √3 = 0.12421: tied
    assert (first["claim"], first["holds"]) == ("recommended_beats_naive", False)
    assert first["difference"]["ci"] == pytest.approx([0.10 - 0.12421, 0.10 + 0.12421], abs=1e-4)
    # token TIS − seq TIS = 0.30, 0.24, 0.18: mean 0.24, s_d 0.06, half 0.14905: above 0
    assert (second["claim"], second["minus"], second["holds"]) == ("recommended_beats_seq_is", "seq_is", True)
    assert second["difference"]["ci"] == pytest.approx([0.24 - 0.14905, 0.24 + 0.14905], abs=1e-4)
    text = claims_text(s)
    assert "decoupled token TIS − decoupled seq TIS > 0: holds — paired difference +0.24 [+0.09, +0.39]" in text[2]
    assert "3 of 3 seeds above decoupled seq TIS (above)" in text[2]
    # the long scenario declares its two; a claim names two different known methods
    assert DemoConfig(scenario="long", **SCENARIOS["long"]).declared_claims() == (
        ("token_tis", "naive"), ("token_tis", "seq_is"))
    assert DemoConfig(recommended="bypass_ppo").declared_claims() == (("on_policy", "naive"), ("bypass_ppo", "naive"))
    for bad in ((("naive", "naive"),), (("magic", "naive"),), (("naive",),)):
        with pytest.raises(ValueError, match="a claim is a pair of two different method names"):
            DemoConfig(claims=bad)


def test_claims_are_declared_and_judged_on_paired_intervals():
    from rollout_correction.demo.report import claims, claims_text

    on, naive = {0: 0.89, 1: 0.87, 2: 0.85}, {0: 0.60, 1: 0.20, 2: 0.55}
    s = _summary({"on_policy": on, "naive": naive, "token_tis": {0: 0.70, 1: 0.30, 2: 0.62}}, "token_tis")
    c = claims(s)
    # on-policy − naive = 0.29, 0.67, 0.30: mean 0.42, s_d 0.21656, half 4.3027 · 0.21656 / √3 = 0.53798
    first, second = c["claims"]
    assert first["difference"]["ci"] == pytest.approx([0.42 - 0.53798, 0.42 + 0.53798], abs=1e-4)
    assert first["holds"] is False and first["difference"]["above"] == 3   # every seed above, not resolved
    # token TIS − naive = 0.10, 0.10, 0.07: mean 0.09, s_d 0.017321, half 0.043027: above 0
    assert second["method"] == "token_tis" and second["holds"] is True
    assert second["difference"]["ci"] == pytest.approx([0.09 - 0.043027, 0.09 + 0.043027], abs=1e-4)
    assert c["all_hold"] is False
    text = claims_text(s)
    assert text[0] == "Recommended before running: decoupled token TIS (`token_tis`)."
    assert "does not hold" in text[1] and "+0.42 [-0.12, +0.96]" in text[1] and "3 of 3 seeds" in text[1]
    assert "holds — paired difference +0.09 [+0.05, +0.13]" in text[2]
    # a recommendation that is not in the run, and one seed: nothing is judged
    assert claims(_summary({"on_policy": on, "naive": naive}, "geo_is"))["claims"][1]["evaluated"] is False
    one = claims(_summary({"on_policy": {0: 0.9}, "naive": {0: 0.1}}, None))
    assert [r["evaluated"] for r in one["claims"]] == [False, False] and one["all_hold"] is False


def _methods_summary(names, rewards=(0.8, 0.7, 0.75)) -> dict:
    from rollout_correction.demo.results import interval

    methods = {m: {"label": METHODS[m].label, "preset": METHODS[m].preset, "final_reward": interval(list(rewards)),
                   "best_reward": interval([0.8, 0.8, 0.8]), "final_engine_reward": interval([0.7, 0.7, 0.7]),
                   "initial_mismatch_kl": 0.01, "final_mismatch_kl": 0.02, "kl_growth": 2.0, "collapsed": 0, "runs": 3,
                   "seconds": interval([45.0, 46.0, 47.0])} for m in names}
    runs = [{"method": m, "seed": k, "final_reward": v} for m in methods for k, v in enumerate(rewards)]
    return {"methods": methods, "runs": runs, "config": {"recommended": None}}


def test_summary_table_in_a_log_is_at_most_100_columns():
    """Without a terminal (output captured, as through a pipe) the 10-column table, about 215
    columns whole, is one block per method: no line wider than 100, nothing wrapped or cut, every
    header and value whole."""
    import io

    from rich.console import Console

    from rollout_correction.demo.report import TABLE_HEADER, _TERMINAL_COLUMNS, print_table

    summary = _methods_summary(("on_policy", "cispo", "binary_kl_rs"))
    out = io.StringIO()
    console = Console(file=out)
    assert not console.is_terminal
    print_table(summary, console)
    text = out.getvalue()
    table = text.split("Recommended before running")[0].splitlines()
    assert max(len(line) for line in table) <= 100 and "…" not in text and "│" not in text
    for m in summary["methods"].values():
        assert table.count(m["label"]) == 1, m["label"]
    for i in _TERMINAL_COLUMNS[1:]:
        assert text.count(f"  {TABLE_HEADER[i]}: ") == 3, TABLE_HEADER[i]
    block = text.split("binary-KL RS + token TIS\n", 1)[1]
    assert block.startswith("  trainer final [95 % CI]: 0.75 [0.63, 0.87]\n") and "  tied with best (paired): yes" in block


@pytest.mark.parametrize("growth, words", [
    (4.756671289155859, "grows ×4.8"),            # docs/results/demo-stale.json: 0.0xx → 4.8 × that
    (0.7054473032318747, "falls by 29 %"),        # docs/results/demo-long.json: a fall, 1 − 0.705 = 29 %
    (1.02, "stays level (×1.02)"), (0.97, "stays level (×0.97)"), (0.0, "falls by 100 %"),
])
def test_naive_kl_change_is_called_a_rise_or_a_fall(growth, words):
    from rollout_correction.demo.report import claims_text

    summary = _methods_summary(("on_policy", "naive"))
    summary["methods"]["naive"]["kl_growth"] = growth
    (line,) = [x for x in claims_text(summary) if x.startswith("Naive PPO's mismatch KL")]
    assert line == f"Naive PPO's mismatch KL {words} from the first to the last tenth of training."


def test_a_table_that_fits_100_columns_prints_whole_in_a_log():
    """Rich assumes 80 columns without a terminal and would wrap a 90-column table; up to 100 it
    prints whole, one line per row."""
    import io

    from rich.console import Console

    from rollout_correction.demo.report import print_fitted

    header = ["method", "a rather long first column header", "another long column header here"]
    rows = [["naive PPO", "0.123456789 [0.1, 0.2]", "0.987654321 [0.9, 1.0]"], ["token TIS", "0.5", "0.6"]]
    out = io.StringIO()
    console = Console(file=out)
    print_fitted(console, "title", header, rows)
    lines = out.getvalue().splitlines()
    assert 80 < max(len(line) for line in lines) <= 100
    assert sum("naive PPO" in line and "0.123456789 [0.1, 0.2]" in line and "0.987654321" in line
               for line in lines) == 1


def test_summary_table_stacks_in_a_narrow_terminal():
    """An 80-column terminal: one block per method, every header whole, no line wider than 80."""
    import io

    from rich.console import Console

    from rollout_correction.demo.report import TABLE_HEADER, _TERMINAL_COLUMNS, print_table
    from rollout_correction.demo.results import interval

    methods = {m: {"label": METHODS[m].label, "preset": METHODS[m].preset, "final_reward": interval([0.8, 0.7, 0.75]),
                   "best_reward": interval([0.8, 0.8, 0.8]), "final_engine_reward": interval([0.7, 0.7, 0.7]),
                   "initial_mismatch_kl": 0.01, "final_mismatch_kl": 0.02, "kl_growth": 2.0, "collapsed": 0, "runs": 3,
                   "seconds": interval([45.0, 46.0, 47.0])} for m in ("on_policy", "naive")}
    runs = [{"method": m, "seed": seed, "final_reward": r} for m in methods
            for seed, r in enumerate((0.8, 0.7, 0.75) if m == "on_policy" else (0.5, 0.6, 0.4))]
    summary = {"methods": methods, "runs": runs, "config": {"recommended": None},
               "checks": {"available": False, "reason": "x"}}
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    print_table(summary, console)
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for i in _TERMINAL_COLUMNS[1:]:
        assert text.count(f"  {TABLE_HEADER[i]}: ") == 2, TABLE_HEADER[i]
    assert "  trainer final [95 % CI]: 0.75 [0.63, 0.87]" in text
