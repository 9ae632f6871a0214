"""A toy FlowGRPO setting small enough for a laptop CPU.

* Target: a ring of K Gaussian modes in 2-D. The verifiable reward is 1 when the final sample
  lands within ``reward_radius`` of one of the *rewarded* modes (by default 3 of the 8), else 0.
* Policy: :class:`VelocityMLP`, a rectified-flow velocity field v_θ(x, t), pretrained by flow
  matching on the whole mixture, so before RL about 3/8 of the samples are rewarded; RL has to
  move the mass onto the rewarded modes.
* Rollout engine: :class:`RolloutEngine` holds a copy of the weights in a reduced precision
  (bf16, fp16, or fp8-e4m3 weights with bf16 compute) and runs the whole sampler — network, SDE
  update, state, log-probabilities — in the compute dtype, like a serving stack with
  low-precision kernels. It records the per-step log-probabilities of the SDE window.
* Trainer: :func:`window_log_probs` recomputes the same per-step log-probabilities in fp32 with
  gradients, from the states the engine recorded.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from rollout_correction.advantages import group_advantages as library_group_advantages
from rollout_correction.diffusion.sde import gaussian_step_log_prob, ode_step, sde_step_mean_std, time_grid

__all__ = [
    "RingTarget",
    "VelocityMLP",
    "pretrain_flow_matching",
    "RolloutEngine",
    "Trajectory",
    "PRECISIONS",
    "fp8_round_trip",
    "window_log_probs",
    "group_advantages",
]


@dataclass(frozen=True)
class RingTarget:
    """K Gaussian modes of standard deviation ``mode_std`` on a circle of radius ``ring_radius``."""

    num_modes: int = 8
    ring_radius: float = 2.0
    mode_std: float = 0.15
    reward_radius: float = 0.5
    rewarded_modes: tuple[int, ...] = (0, 1, 2)

    def centers(self) -> torch.Tensor:
        """(K, 2) mode centres."""
        angle = torch.arange(self.num_modes, dtype=torch.float64) * (2.0 * math.pi / self.num_modes)
        return (self.ring_radius * torch.stack([angle.cos(), angle.sin()], dim=-1)).float()

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n, 2) samples of the mixture (uniform over modes)."""
        idx = torch.randint(self.num_modes, (n,), generator=generator)
        return self.centers()[idx] + self.mode_std * torch.randn(n, 2, generator=generator)

    def reward(self, x: torch.Tensor) -> torch.Tensor:
        """r = 1[min_{k rewarded} ‖x − c_k‖ < reward_radius], shape (B,), float32."""
        centers = self.centers()[list(self.rewarded_modes)]
        dist = torch.cdist(x.float(), centers).min(dim=-1).values
        return (dist < self.reward_radius).float()

    def in_any_mode(self, x: torch.Tensor) -> torch.Tensor:
        """1[x lies within reward_radius of any mode] — sample quality, shape (B,)."""
        dist = torch.cdist(x.float(), self.centers()).min(dim=-1).values
        return (dist < self.reward_radius).float()


class VelocityMLP(nn.Module):
    """v_θ(x, t): an MLP on [x, Fourier features of t]."""

    def __init__(self, hidden: int = 128, depth: int = 3, time_freqs: int = 6):
        super().__init__()
        self.register_buffer("freqs", torch.arange(1, time_freqs + 1, dtype=torch.float32) * math.pi)
        layers: list[nn.Module] = []
        width = 2 + 2 * time_freqs
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, 2))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        dtype = self.net[0].weight.dtype
        x = x.to(dtype)
        t = torch.as_tensor(t, dtype=dtype).expand(x.shape[0]).unsqueeze(-1)  # float or (B,) -> (B, 1)
        ft = t * self.freqs.to(dtype)
        return self.net(torch.cat([x, ft.sin(), ft.cos()], dim=-1))


def pretrain_flow_matching(
    model: VelocityMLP, target: RingTarget, steps: int, batch_size: int = 512, lr: float = 2e-3, seed: int = 0
) -> list[float]:
    """Flow matching on the mixture: min E‖v_θ(x_t, t) − (ε − x₀)‖², x_t = (1 − t)·x₀ + t·ε.

    Returns the loss curve.
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    losses = []
    for _ in range(steps):
        x0 = target.sample(batch_size, g)
        eps = torch.randn(batch_size, 2, generator=g)
        t = torch.rand(batch_size, generator=g)
        xt = (1.0 - t[:, None]) * x0 + t[:, None] * eps
        v = model(xt, t)
        loss = ((v - (eps - x0)) ** 2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


@dataclass
class Trajectory:
    """What the rollout engine hands to the trainer (all float32; reduced-precision values are exact).

    states: (B, S+1, 2) — the state before each window step and after the last.
    times: the S window times t (each step goes from t to t − h). rollout_log_probs: (B, S).
    final: (B, 2) final samples.
    """

    states: torch.Tensor
    times: list[float]
    step_size: float
    rollout_log_probs: torch.Tensor
    final: torch.Tensor


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}

_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor-scaled float8-e4m3 quantisation: s = max|w| / 448, w ← s·fp8(w / s)."""
    scale = w.detach().abs().max().clamp(min=1e-12) / _FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


class RolloutEngine:
    """Samples trajectories with a reduced-precision copy of the policy.

    ``precision``: ``"bf16"`` / ``"fp16"`` (weights and compute in that dtype), ``"fp8"`` (weights
    quantised to float8-e4m3 with a per-tensor scale, compute in bf16) or ``"fp32"`` (no gap).
    Every operation of the sampler (network, SDE mean, noise, state update, log-probability) runs in
    the compute dtype: the sampled states are representable in it and the recorded log-probabilities
    carry its rounding.
    """

    def __init__(self, precision: str = "bf16"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self.dtype = PRECISIONS[precision]
        self.model: VelocityMLP | None = None

    @torch.no_grad()
    def load_weights(self, model: VelocityMLP) -> None:
        """Sync the engine with the trainer's weights (a quantised / cast copy)."""
        engine_model = copy.deepcopy(model).float()
        if self.precision == "fp8":
            for p in engine_model.parameters():
                p.copy_(fp8_round_trip(p))
        self.model = engine_model.to(self.dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def sample(
        self,
        batch_size: int,
        num_steps: int,
        window_start: int,
        window_size: int,
        eta: float,
        generator: torch.Generator,
    ) -> Trajectory:
        """Run N denoising steps; steps window_start … window_start+S−1 are SDE steps, the rest ODE."""
        if self.model is None:
            raise RuntimeError("RolloutEngine.load_weights(model) must be called before sample()")
        if not 0 <= window_start <= num_steps - window_size or window_size < 1:
            raise ValueError(
                f"SDE window [{window_start}, {window_start + window_size}) does not fit in {num_steps} steps"
            )
        grid = time_grid(num_steps)
        h = 1.0 / num_steps
        b = batch_size
        x = torch.randn(b, 2, generator=generator).to(self.dtype)
        states, log_probs, times = [], [], []
        for k in range(num_steps):
            t = grid[k]
            v = self.model(x, t)
            if window_start <= k < window_start + window_size:
                mean, std = sde_step_mean_std(x, v, t, h, eta)
                z = torch.randn(b, 2, generator=generator).to(self.dtype)
                x_next = mean + std * z
                log_probs.append(gaussian_step_log_prob(x_next, mean, std))
                states.append(x)
                times.append(t)
                x = x_next
                if k == window_start + window_size - 1:
                    states.append(x)
            else:
                x = ode_step(x, v, h)
        return Trajectory(
            states=torch.stack(states, 1).float(),
            times=times,
            step_size=h,
            rollout_log_probs=torch.stack(log_probs, 1).float(),
            final=x.float(),
        )


def window_log_probs(
    model: VelocityMLP, traj: Trajectory, eta: float, steps: list[int] | None = None
) -> torch.Tensor:
    """Trainer-side log π_θ of the recorded window steps, in the model's dtype (fp32), with grad.

    Returns (B, S), or (B, len(steps)) for a subset of window steps.
    """
    idx = range(len(traj.times)) if steps is None else steps
    cols = []
    for s in idx:
        x, x_next, t = traj.states[:, s], traj.states[:, s + 1], traj.times[s]
        v = model(x, t)
        mean, std = sde_step_mean_std(x, v, t, traj.step_size, eta)
        cols.append(gaussian_step_log_prob(x_next, mean, std))
    return torch.stack(cols, dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO advantages: Â_i = (r_i − mean_g r) / (std_g r + eps) within consecutive groups
    (population std), from the library's :func:`rollout_correction.advantages.group_advantages`.

    Args:
        rewards: (B,) with B a multiple of ``group_size``; rows of a group are consecutive.
        keep: (B,) bool, the trajectories rejection sampling left something of; the baselines
            use those only and the others get 0 (None: every trajectory).
    Returns:
        (B,) float32.
    """
    if rewards.dim() != 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"rewards must be (B,) with B a multiple of group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    return library_group_advantages(rewards.float(), group_size, keep=keep, unbiased_std=False,
                                    epsilon=eps).advantages
