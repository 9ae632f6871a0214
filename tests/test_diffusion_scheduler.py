"""FlowMatchSDEScheduler against hand-derived formulas: log-prob, mean and std of the three SDE types
at every step of a shifted schedule, with and without the normaliser; any latent rank; the σ = 1
edge; per-row timesteps and noise levels; verl-omni's call conventions."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")

from rollout_correction.diffusion import FlowMatchSDEScheduler  # noqa: E402

torch.set_num_threads(1)
STEPS, SHIFT = 10, 3.0


def _sched() -> FlowMatchSDEScheduler:
    s = FlowMatchSDEScheduler(shift=SHIFT)
    s.set_timesteps(STEPS)
    return s


def _expected(x, v, prev, sig, sig_next, sig_max, eta, sde_type, normalizer):
    """Float64 mean, s_t and per-sample log-prob, written out from the published update rules."""
    x, v, prev = x.double(), v.double(), prev.double()
    dt = sig_next - sig
    if sde_type == "sde":
        std = eta * math.sqrt(sig / (1 - (sig_max if sig == 1 else sig)))
        mean = x * (1 + std**2 / (2 * sig) * dt) + v * (1 + std**2 * (1 - sig) / (2 * sig)) * dt
        scale = std * math.sqrt(-dt)
    elif sde_type == "cps":
        std = sig_next * math.sin(eta * math.pi / 2)
        x0 = x - sig * v
        eps = x + v * (1 - sig)
        mean = x0 * (1 - sig_next) + eps * math.sqrt(sig_next**2 - std**2)
        scale = std
    else:  # dance_sde
        x0 = x - sig * v
        score = -(x - x0 * (1 - sig)) / sig**2
        mean = x + dt * v + (-0.5 * eta**2 * score) * dt
        std = eta * math.sqrt(sig - sig_next)
        scale = std
    if sde_type == "cps":
        per = -((prev - mean) ** 2)
    else:
        per = -((prev - mean) ** 2) / (2 * scale**2)
        if normalizer:
            per = per - math.log(scale) - 0.5 * math.log(2 * math.pi)
    return mean, std, per.flatten(1).mean(1)


def test_the_schedule_is_shifted():
    s = _sched()
    sig = s.sigmas.double()
    assert sig[0] == 1 and sig[-1] == 0 and len(sig) == STEPS + 1
    u = sig[:-1] / (SHIFT - (SHIFT - 1) * sig[:-1])  # inverse of σ = k·u / (1 + (k − 1)·u)
    steps = u[:-1] - u[1:]
    torch.testing.assert_close(steps, steps.mean().expand_as(steps), rtol=1e-5, atol=0)


@pytest.mark.parametrize("normalizer", [True, False])
@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_every_step_matches_the_formulas(sde_type, normalizer):
    s = _sched()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 4, 4, generator=g)
    sig = [float(v) for v in s.sigmas]
    for k, t in enumerate(s.timesteps):
        v = torch.randn(x.shape, generator=g)
        prev = x + 0.1 * torch.randn(x.shape, generator=g)
        exp_mean, exp_std, exp_lp = _expected(x, v, prev, sig[k], sig[k + 1], sig[1], 0.7, sde_type, normalizer)
        out = s.step(v, t, x, noise_level=0.7, prev_sample=prev, sde_type=sde_type,
                     include_logprob_normalizer=normalizer)
        assert out.prev_sample.dtype == torch.float32 and out.log_prob.shape == (3,)
        torch.testing.assert_close(out.prev_sample_mean.double(), exp_mean, rtol=1e-5, atol=1e-5)
        assert float(out.std_dev_t) == pytest.approx(exp_std, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(out.log_prob.double(), exp_lp, rtol=1e-5, atol=1e-4)
        x = prev
    assert s.step_index == STEPS


def test_sigma_one_uses_the_second_sigma_and_is_finite():
    s = _sched()
    x, v = torch.randn(2, 8), torch.randn(2, 8)
    out = s.step(v, s.timesteps[0], x, noise_level=1.2, generator=torch.Generator().manual_seed(0))
    assert float(s.sigmas[0]) == 1.0
    assert float(out.std_dev_t) == pytest.approx(1.2 * math.sqrt(1 / (1 - float(s.sigmas[1]))), rel=1e-6)
    assert torch.isfinite(out.log_prob).all() and torch.isfinite(out.prev_sample).all()


def test_sampled_step_is_mean_plus_scale_times_the_generator_noise():
    s = _sched()
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    s.step(v, s.timesteps[0], x, generator=torch.Generator().manual_seed(0))  # move to step 1
    prev, lp, mean, std = s.step(v, s.timesteps[1], x, generator=torch.Generator().manual_seed(5), return_dict=False)
    dt = float(s.sigmas[2] - s.sigmas[1])
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(prev, mean + std * math.sqrt(-dt) * noise, rtol=0, atol=1e-6)
    # and its log-prob is the Gaussian one of that noise: −½ mean(z²) − log scale − ½ log 2π
    scale = float(std) * math.sqrt(-dt)
    expect = -0.5 * noise.double().pow(2).flatten(1).mean(1) - math.log(scale) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(lp.double(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 64), (3, 4, 4, 4), (3, 2, 2, 4, 4), (3, 16, 4)])
def test_any_rank_gives_the_flattened_result(shape):
    g = torch.Generator().manual_seed(1)
    x, v, prev = (torch.randn(shape, generator=g) for _ in range(3))
    a, b = _sched(), _sched()
    t = a.timesteps[3]
    out = a.step(v, t, x, prev_sample=prev)
    flat = b.step(v.reshape(3, -1), t, x.reshape(3, -1), prev_sample=prev.reshape(3, -1))
    torch.testing.assert_close(out.log_prob, flat.log_prob, rtol=1e-6, atol=1e-6)
    assert out.prev_sample_mean.shape == shape


def test_low_precision_inputs_are_stepped_in_fp32():
    s = _sched()
    x, v = torch.randn(2, 8), torch.randn(2, 8)
    out = s.step(v.bfloat16(), s.timesteps[2], x.bfloat16(), generator=torch.Generator().manual_seed(0))
    assert out.prev_sample.dtype == out.prev_sample_mean.dtype == out.log_prob.dtype == torch.float32


def test_per_row_timesteps_and_noise_levels():
    s = _sched()
    g = torch.Generator().manual_seed(2)
    x, v, prev = (torch.randn(4, 2, 4, 4, generator=g) for _ in range(3))
    ts = s.timesteps[torch.tensor([0, 3, 5, 9])]
    _, lp, mean, std, sqrt_dt = s.sample_previous_step(x, v, timestep=ts, noise_level=0.7, prev_sample=prev,
                                                       return_sqrt_dt=True)
    for i, k in enumerate([0, 3, 5, 9]):
        one = _sched()
        one._step_index = k
        _, lp_k, mean_k, std_k = one.sample_previous_step(x[i:i + 1], v[i:i + 1], noise_level=0.7,
                                                          prev_sample=prev[i:i + 1])
        torch.testing.assert_close(lp[i:i + 1], lp_k)
        torch.testing.assert_close(mean[i:i + 1], mean_k)
        assert float(sqrt_dt[i]) == pytest.approx(math.sqrt(float(s.sigmas[k] - s.sigmas[k + 1])), rel=1e-6)
    # a row with η = 0 takes the deterministic Euler step and reports log-prob 0
    eta = torch.tensor([0.7, 0.0, 0.7, 0.0]).view(4, 1, 1, 1)
    s2 = _sched()
    s2._step_index = 4
    out = s2.step(v, s2.timesteps[4], x, noise_level=eta, generator=torch.Generator().manual_seed(0))
    euler = x + (s2.sigmas[5] - s2.sigmas[4]) * v
    torch.testing.assert_close(out.prev_sample[1], euler[1], rtol=0, atol=1e-6)
    assert out.log_prob[1] == 0 and out.log_prob[3] == 0 and (out.log_prob[[0, 2]] != 0).all()


def test_bad_calls_say_what_is_wrong():
    s = _sched()
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="not an integer index"):
        s.step(x, 3, x)
    with pytest.raises(ValueError, match="sde_type"):
        s.step(x, s.timesteps[0], x, sde_type="ode")
    with pytest.raises(ValueError, match="same"):
        s.step(x, s.timesteps[0], torch.randn(2, 5))


VERL_OMNI_SRC = os.environ.get("ROLLOUT_CORRECTION_VERL_OMNI_SRC")
_PEER = r'''
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("peer_sched", sys.argv[1])
peer = importlib.util.module_from_spec(spec); spec.loader.exec_module(peer)
from rollout_correction.diffusion import FlowMatchSDEScheduler
worst = 0.0
for sde_type in ("sde", "cps", "dance_sde"):
    for norm in (True, False):
        a, b = peer.FlowMatchSDEDiscreteScheduler(shift=3.0), FlowMatchSDEScheduler(shift=3.0)
        a.set_timesteps(10); b.set_timesteps(10)
        x = torch.randn(3, 4, 5, 6, generator=torch.Generator().manual_seed(0))
        for k, t in enumerate(a.timesteps):
            v = torch.randn(x.shape, generator=torch.Generator().manual_seed(k))
            kw = dict(noise_level=0.7, sde_type=sde_type, include_logprob_normalizer=norm, return_dict=False)
            ra = a.step(v, t, x, generator=torch.Generator().manual_seed(k), **kw)
            rb = b.step(v, t, x, generator=torch.Generator().manual_seed(k), **kw)
            for u, w in zip(ra, rb):
                worst = max(worst, float(((u - w).abs() / (1 + u.abs())).max()))
            x = ra[0]
print(worst)
'''


@pytest.mark.nightly
@pytest.mark.skipif(VERL_OMNI_SRC is None, reason="set ROLLOUT_CORRECTION_VERL_OMNI_SRC to a verl-omni checkout")
def test_matches_verl_omni_scheduler_in_a_child_process():
    path = os.path.join(VERL_OMNI_SRC, "verl_omni", "pipelines", "schedulers", "flow_match_sde.py")
    out = subprocess.run([sys.executable, "-c", _PEER, path], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 2e-6
