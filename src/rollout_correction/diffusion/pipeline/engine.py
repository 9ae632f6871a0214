"""The rollout engine of the pipeline demo, the way vllm-omni serves a FlowGRPO rollout.

The engine holds its own copy of the trainer's weights in a serving precision:

* ``fp32`` — an exact copy (the gap-free reference);
* ``bf16`` — weights and transformer compute in bfloat16;
* ``fp8``  — weights stored as ``torch.float8_e4m3fn`` with a per-tensor scale (matrices and
  convolutions; the rest in bf16), upcast to bf16 when they are loaded into the compute copy,
  compute in bf16.

By default only the transformer runs in that precision: its output is upcast and the scheduler
step, the stored latents and the log-probabilities are fp32, as in verl-omni's rollout adapters
(``noise_pred.to(torch.float32)`` before ``scheduler.step``). ``all_low_precision=True`` also runs
the step, the latents and the log-probabilities in bf16 — the setting of the toy, which makes the
gap much larger.

``sample`` draws one SDE window per sample (``sde_window_size`` steps starting uniformly in
``sde_window_range``, from a generator seeded by ``sde_window_seed``): inside its window a row
takes stochastic steps with noise level η and the engine records the step's log-probability;
outside, η = 0 (deterministic Euler steps).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rollout_correction.diffusion.scheduler import FlowMatchSDEScheduler
from rollout_correction.diffusion.sde import flow_sde_log_prob, flow_sde_step

from .model import PromptBank, velocity

__all__ = ["PRECISIONS", "Trajectory", "RolloutEngine", "make_scheduler", "sample_windows"]

PRECISIONS = ("fp32", "bf16", "fp8")
_FP8_MAX = 448.0


def make_scheduler(num_steps: int, shift: float) -> FlowMatchSDEScheduler:
    sched = FlowMatchSDEScheduler(shift=shift)
    sched.set_timesteps(num_steps)
    return sched


def sample_windows(batch: int, size: int, window_range: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """(B,) window starts, uniform in [lo, hi − size] (verl-omni's ``sde_window_range`` = (lo, hi))."""
    lo, hi = window_range
    if size < 1 or hi - size < lo:
        raise ValueError(f"sde_window_size={size} does not fit in sde_window_range={window_range}")
    return torch.randint(lo, hi - size + 1, (batch,), generator=generator)


@dataclass
class Trajectory:
    """What the engine hands the trainer (verl-omni's batch keys in brackets).

    prompt (B,); latents (B, S + 1, C, H, W) fp32 window states [all_latents];
    timesteps (B, S) [all_timesteps]; rollout_log_probs (B, S) fp32; final (B, C, H, W) x₀;
    starts (B,) window starts.
    """

    prompt: torch.Tensor
    latents: torch.Tensor
    timesteps: torch.Tensor
    rollout_log_probs: torch.Tensor
    final: torch.Tensor
    starts: torch.Tensor


class RolloutEngine:
    """Samples trajectories with a serving-precision copy of the policy."""

    def __init__(self, precision: str = "bf16", *, all_low_precision: bool = False):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        self.step_dtype = self.dtype if all_low_precision else torch.float32
        self.model: Optional[nn.Module] = None
        self.fp8_store: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def load_weights(self, model: nn.Module) -> None:
        """Sync with the trainer (a LoRA model is merged first)."""
        src = model
        if hasattr(model, "merge_and_unload"):  # peft: serve the merged weights, as vllm-omni does
            src = copy.deepcopy(model).merge_and_unload()
        m = copy.deepcopy(src).to(self.dtype).eval()
        if self.precision == "fp8":
            self.fp8_store = {}
            for name, p in m.named_parameters():
                if p.dim() >= 2:
                    w = src.get_parameter(name).detach().float()
                    scale = w.abs().max().clamp(min=1e-12) / _FP8_MAX
                    q = (w / scale).to(torch.float8_e4m3fn)  # the stored fp8 weight
                    self.fp8_store[name] = (q, scale)
                    p.copy_((q.float() * scale).to(self.dtype))  # upcast for bf16 compute
        for p in m.parameters():
            p.requires_grad_(False)
        self.model = m

    @torch.no_grad()
    def sample(
        self,
        prompt: torch.Tensor,
        bank: PromptBank,
        *,
        num_steps: int,
        shift: float,
        noise_level: float,
        sde_type: str,
        window_size: int,
        window_range: tuple[int, int],
        cfg_scale: float,
        generator: torch.Generator,
        window_generator: torch.Generator,
    ) -> Trajectory:
        if self.model is None:
            raise RuntimeError("call load_weights(model) before sample()")
        b = prompt.shape[0]
        sched = make_scheduler(num_steps, shift)
        starts = sample_windows(b, window_size, window_range, window_generator)
        x = torch.randn(b, *bank.cfg.latent_shape, generator=generator).to(self.step_dtype)
        lat, lps, tss = [], [], []
        for i, t in enumerate(sched.timesteps):
            in_window = (starts <= i) & (i < starts + window_size)
            eta = torch.where(in_window, noise_level, 0.0).view(b, 1, 1, 1)
            v = velocity(self.model, x, t.expand(b), prompt, bank, cfg_scale, self.dtype)
            if self.step_dtype == torch.float32:
                x_next, lp, _, _ = sched.step(v, t, x, generator=generator, noise_level=eta,
                                              sde_type=sde_type, return_dict=False)
            else:  # the toy's setting: step, state and log-prob in the engine's dtype
                sig = sched.sigmas.to(self.step_dtype)
                idx = sched.step_index if sched.step_index is not None else sched.index_for_timestep(t)
                mean, _, scale = flow_sde_step(x, v.to(self.step_dtype), sig[idx], sig[idx + 1],
                                               eta.to(self.step_dtype), sde_type, sigma_max=sig[1])
                noise = torch.randn(x.shape, generator=generator).to(self.step_dtype)
                x_next = mean + scale * noise
                lp = flow_sde_log_prob(x_next, mean, scale, sde_type)
                sched._step_index = idx + 1
            lat.append(x.float())
            lps.append(lp.float())
            tss.append(t.float().expand(b))
            x = x_next
        lat.append(x.float())
        all_lat = torch.stack(lat, 1)  # (B, N + 1, ...)
        rows = torch.arange(b)
        cols = starts.view(-1, 1) + torch.arange(window_size).view(1, -1)  # (B, S)
        latents = all_lat[rows.view(-1, 1), torch.cat([cols, cols[:, -1:] + 1], 1)]
        lp_all = torch.stack(lps, 1)
        ts_all = torch.stack(tss, 1)
        return Trajectory(prompt, latents, ts_all[rows.view(-1, 1), cols], lp_all[rows.view(-1, 1), cols],
                          x.float(), starts)
