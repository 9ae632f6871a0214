"""The diffusion demo's pipeline on a real diffusers transformer, and the verl-omni-named pieces:
rollout vs recompute log-probs (fp32 engine: equal; bf16 / fp8: the measured gap), per-sample SDE
windows, verl-omni's entry points and metric keys, GRPO-Guard / KL / global-std advantages against
hand formulas, LoRA, and ``diffusion-demo --quick`` end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("diffusers")

from rollout_correction.diffusion import (  # noqa: E402
    apply_bypass_mode_to_diffusion_batch,
    apply_rollout_correction_to_diffusion_batch,
    step_correction,
)
from rollout_correction.diffusion.correction import BYPASS_METRIC_PREFIX  # noqa: E402
from rollout_correction.diffusion.loss import flow_grpo_advantages, grpo_guard_loss, sde_kl_loss  # noqa: E402
from rollout_correction.diffusion.pipeline.engine import RolloutEngine, sample_windows  # noqa: E402
from rollout_correction.diffusion.pipeline.model import ModelConfig, PromptBank, build_transformer  # noqa: E402
from rollout_correction.diffusion.pipeline.trainer import TrainConfig, Trainer  # noqa: E402

torch.set_num_threads(1)
MODEL = ModelConfig(channels=4, size=4, layers=1, heads=2, head_dim=8, text_dim=16, text_len=2, num_prompts=2)


@pytest.fixture(scope="module")
def setup():
    return build_transformer(MODEL, 0), PromptBank(MODEL)


def _sample(engine, bank, cfg: TrainConfig, seed=0, b=8):
    prompt = torch.arange(b) % MODEL.num_prompts
    return engine.sample(prompt, bank, num_steps=cfg.num_steps, shift=cfg.shift, noise_level=cfg.noise_level,
                         sde_type=cfg.sde_type, window_size=cfg.window_size, window_range=cfg.window_range,
                         cfg_scale=cfg.cfg_scale, generator=torch.Generator().manual_seed(seed),
                         window_generator=torch.Generator().manual_seed(seed + 1))


@pytest.mark.parametrize("sde_type, cfg_scale", [("sde", 1.0), ("sde", 4.5), ("cps", 1.0), ("dance_sde", 1.0)])
def test_fp32_engine_rollout_and_recompute_log_probs_agree(setup, sde_type, cfg_scale):
    model, bank = setup
    cfg = TrainConfig(num_steps=6, window_range=(0, 4), sde_type=sde_type, cfg_scale=cfg_scale)
    engine = RolloutEngine("fp32")
    engine.load_weights(model)
    traj = _sample(engine, bank, cfg)
    assert traj.latents.shape == (8, 3, *MODEL.latent_shape) and traj.rollout_log_probs.shape == (8, 2)
    assert len(set(traj.starts.tolist())) > 1  # per-sample windows
    old = Trainer(model, bank, cfg, bypass=False, correction=None).recompute(traj)
    assert (old - traj.rollout_log_probs).abs().max() <= 1e-6


def test_windows_are_drawn_per_sample_within_the_range():
    starts = sample_windows(1000, 2, (0, 5), torch.Generator().manual_seed(0))
    assert set(starts.tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="does not fit"):
        sample_windows(4, 6, (0, 5), torch.Generator())


def test_low_precision_engines_store_fp32_latents_and_have_a_small_gap(setup):
    model, bank = setup
    cfg = TrainConfig(num_steps=6, window_range=(0, 4))
    trainer = Trainer(model, bank, cfg, bypass=False, correction=None)
    gaps = {}
    for precision, low in (("bf16", False), ("fp8", False), ("bf16", True)):
        engine = RolloutEngine(precision, all_low_precision=low)
        engine.load_weights(model)
        traj = _sample(engine, bank, cfg)
        assert traj.latents.dtype == torch.float32
        gaps[(precision, low)] = float((trainer.recompute(traj) - traj.rollout_log_probs).abs().mean())
        if precision == "fp8":
            q, scale = next(iter(engine.fp8_store.values()))
            assert q.dtype == torch.float8_e4m3fn
    assert all(0 < g < 0.05 for g in gaps.values()), gaps
    # the step in bf16 (the toy's setting) makes the gap much larger than a bf16 transformer alone
    assert gaps[("bf16", True)] > 5 * gaps[("bf16", False)], gaps


def test_fp8_engine_computes_with_the_dequantised_weights(setup):
    model, _ = setup
    engine = RolloutEngine("fp8")
    engine.load_weights(model)
    name, (q, scale) = next(iter(engine.fp8_store.items()))
    expect = (q.float() * scale).bfloat16()
    assert torch.equal(engine.model.get_parameter(name), expect)
    assert not torch.equal(expect.float(), model.get_parameter(name).detach())


def test_verl_omni_entry_points_write_rollout_is_weights_and_timestep_metrics():
    old = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    ro = torch.tensor([[-1.0, -2.0], [-1.5, -2.0], [-1.0, 1.0]])  # row 2: mean log ρ = −1.5 → rejected
    ts = torch.tensor([[1000.0, 900.0], [900.0, 800.0], [1000.0, 900.0]])
    batch = {"old_log_probs": old, "rollout_log_probs": ro, "all_timesteps": ts}
    cfg = {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
           "rollout_rs_threshold": "0.5_2.0"}
    out, metrics = apply_rollout_correction_to_diffusion_batch(batch, cfg)
    w = out["rollout_is_weights"]
    assert w.shape == (3, 2) and torch.equal(w[2], torch.zeros(2)) and torch.equal(w[0], torch.ones(2))
    assert w[1, 0] == pytest.approx(min(math.exp(0.5), 2.0), rel=1e-5)  # sequence IS = exp(Σ log ρ)
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["rollout_corr/logprob_abs_diff/ts_1000"] == pytest.approx(0.0)
    assert metrics["rollout_corr/logprob_abs_diff/ts_900"] == pytest.approx((0.5 + 0 + 3.0) / 3)
    assert metrics["rollout_corr/logprob_abs_diff/ts_800"] == pytest.approx(0.0)
    plain = {"old_log_probs": old, "rollout_log_probs": ro}
    apply_rollout_correction_to_diffusion_batch(plain, {})
    assert "rollout_is_weights" not in plain  # nothing configured: nothing written
    by = {"rollout_log_probs": ro}
    assert apply_bypass_mode_to_diffusion_batch(by)["old_log_probs"] is ro


def test_bypass_step_metrics_use_the_actor_prefix():
    lp, ro = torch.tensor([[-1.0], [-1.0]]), torch.tensor([[-1.0], [0.0]])
    keep, m = step_correction(lp, ro, {"bypass_mode": True, "rollout_rs": "seq_mean_k1",
                                       "rollout_rs_threshold": "0.5_2.0"}, prefix=BYPASS_METRIC_PREFIX)
    assert keep.flatten().tolist() == [1.0, 0.0]
    assert m and all(k.startswith("actor/rollout_corr/") for k in m)


def test_grpo_guard_and_kl_against_hand_formulas():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(4, generator=g) * 1e-3 - 1).requires_grad_()
    old = lp.detach() + torch.randn(4, generator=g) * 1e-3
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    mean = torch.randn(4, 3, 2, generator=g).requires_grad_()
    old_mean = mean.detach() + 0.01 * torch.randn(4, 3, 2, generator=g)
    std, sqrt_dt = torch.tensor(0.6), torch.full((4,), 0.3)
    loss, _ = grpo_guard_loss(lp, old, adv, mean, old_mean, std, sqrt_dt, clip_range=0.2)
    c = 0.3 * 0.6
    bias = ((mean.detach() - old_mean) ** 2).flatten(1).mean(1) / (2 * c * c)
    r = torch.exp((lp.detach() - old + bias) * c)
    per = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    assert float(loss.detach()) == pytest.approx(float(per.mean() / 0.3**2), rel=1e-5)
    loss.backward()
    assert lp.grad is not None and mean.grad is not None
    ref = mean.detach() + 0.1
    kl = sde_kl_loss(mean, ref, std)
    assert float(kl.detach()) == pytest.approx(0.01 / (2 * 0.36), rel=1e-5)


def test_advantages_global_std_and_per_group():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 7.0])
    glob = flow_grpo_advantages(r, 3)
    centred = torch.tensor([-1.0, 0.0, 1.0, -4 / 3, -1 / 3, 5 / 3])
    torch.testing.assert_close(glob, centred / (r.std() + 1e-4))
    grp = flow_grpo_advantages(r, 3, std="group")
    torch.testing.assert_close(grp[:3], centred[:3] / (1.0 + 1e-4), rtol=1e-5, atol=1e-6)


def test_lora_trains_only_adapters_and_the_engine_serves_the_merged_weights(setup):
    pytest.importorskip("peft")
    model, bank = setup
    cfg = TrainConfig(num_steps=4, window_range=(0, 3), lora_rank=4, prompts_per_batch=2, group_size=4, lr=1e-2,
                      kl_coef=0.1, clip_range=0.2)
    trainer = Trainer(build_transformer(MODEL, 0), bank, cfg, bypass=False, correction=None)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    engine = RolloutEngine("fp32")
    engine.load_weights(trainer.model)
    traj = _sample(engine, bank, cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.update(traj, torch.linspace(-1, 1, 8), 0.0)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert changed and all("lora_" in n for n in changed)
    engine.load_weights(trainer.model)  # merged: the fp32 engine and the trainer still agree
    traj = _sample(engine, bank, cfg, seed=3)
    assert (trainer.recompute(traj) - traj.rollout_log_probs).abs().max() <= 1e-5


def test_quick_demo_end_to_end(tmp_path, capsys):
    from rollout_correction.cli import main

    out = tmp_path / "demo"
    assert main(["diffusion-demo", "--quick", "--out", str(out)]) == 0
    # stderr is not a terminal here: no tqdm bars, one plain line per finished unit (scan, 5 runs)
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    units = [line for line in err.splitlines() if line.startswith("[")]
    assert [u.split("]")[0] for u in units] == [f"[{k}/6" for k in range(1, 7)]
    assert units[0].startswith("[1/6] mismatch scan") and "ETA" in units[0] and units[-1].endswith("done")
    result = json.loads((out / "summary.json").read_text())
    for key in ("commit", "torch", "cpu_model", "threads", "date", "command"):
        assert result["provenance"][key]
    s = result["summary"]
    assert set(s) == {"fp32_reference", "naive", "decoupled_is_rs", "bypass", "bypass_rs"}
    assert s["fp32_reference"]["gap_mean"] == 0.0
    assert 0 < s["naive"]["gap_mean"] < 1e-2
    assert s["naive"]["clipfrac_first_mini_step"] == 0.0  # recompute: the first ratio is exactly 1
    assert s["bypass"]["time_per_iter_s"]["recompute"] < s["naive"]["time_per_iter_s"]["recompute"]
    assert s["decoupled_is_rs"]["rejected_fraction"] is not None and s["bypass_rs"]["ess"] is not None
    assert (out / "report.md").exists() and (out / "reward.png").exists() and (out / "gap_by_timestep.png").exists()
