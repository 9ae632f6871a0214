"""The stochastic sampler of FlowGRPO-style training and its per-step Gaussian log-probabilities.

A rectified-flow model interpolates data x₀ and noise ε as x_t = (1 − t)·x₀ + t·ε and predicts the
velocity v_θ(x_t, t) ≈ ε − x₀. Sampling integrates from t = 1 (noise) to t = 0 (data). The
deterministic (ODE) step of size h is

    x_{t−h} = x_t − h·v_θ(x_t, t).

To make each step a stochastic policy with a tractable likelihood, FlowGRPO (Liu et al., 2025)
replaces a few steps — the *SDE window* — by the reverse-time SDE that has the same marginals.
With the score of the interpolation written through the velocity, ∇log p_t(x) = −(x + (1 − t)·v)/t,
one Euler–Maruyama step of size h with noise level σ_t is Gaussian:

    μ = x_t − h·[v + σ_t²/(2t)·(x_t + (1 − t)·v)],     s = σ_t·√h,
    x_{t−h} = μ + s·z,  z ~ N(0, I),
    σ_t = η·√(t / (1 − t))                              (t capped below 1, see ``sde_sigma``)

and its log-probability, as FlowGRPO reports it, is the *per-dimension mean* of the Gaussian
log-density (the "mean-pooled over latent dimensions" log-prob):

    log π(x_{t−h} | x_t) = mean_d [ −(x_{t−h,d} − μ_d)² / (2s²) − log s − ½·log 2π ].

Everything here is a small pure function on tensors; the dtype of the inputs is the dtype of the
arithmetic, which is how the reduced-precision "rollout engine" of the example is obtained.
"""

from __future__ import annotations

import math

import torch

__all__ = ["time_grid", "sde_sigma", "sde_step_mean_std", "ode_step", "gaussian_step_log_prob"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def time_grid(num_steps: int) -> list[float]:
    """Times t_k = 1 − k/N, k = 0 … N (from noise to data)."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
    return [1.0 - k / num_steps for k in range(num_steps + 1)]


def sde_sigma(t: float, h: float, eta: float) -> float:
    """Noise level σ_t = η·√(t′ / (1 − t′)) with t′ = min(t, 1 − h).

    FlowGRPO's schedule diverges at t = 1; capping t at the next grid point (1 − h) keeps the
    first step finite, as FlowGRPO does by using the second sigma of its schedule there.
    """
    if not 0.0 < h <= 1.0:
        raise ValueError(f"step size h must lie in (0, 1], got {h!r}")
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta!r}")
    tc = min(t, 1.0 - h) if h < 1.0 else min(t, 0.5)
    return eta * math.sqrt(tc / (1.0 - tc))


def sde_step_mean_std(
    x: torch.Tensor, v: torch.Tensor, t: float, h: float, eta: float
) -> tuple[torch.Tensor, float]:
    """Mean μ and standard deviation s of one SDE step from t to t − h.

    μ = x − h·[v + σ_t²/(2t)·(x + (1 − t)·v)],  s = σ_t·√h.

    Args:
        x: state x_t, shape (B, D).
        v: velocity v_θ(x_t, t), shape (B, D), same dtype as ``x``.
        t: current time in (0, 1].
        h: step size in (0, t].
        eta: noise scale η ≥ 0 (η = 0 gives the ODE step and s = 0).
    Returns:
        (μ with the shape and dtype of ``x``, s as a Python float).
    """
    if x.shape != v.shape:
        raise ValueError(f"x and v must have the same shape, got {tuple(x.shape)} and {tuple(v.shape)}")
    if not 0.0 < t <= 1.0:
        raise ValueError(f"t must lie in (0, 1], got {t!r}")
    if not 0.0 < h <= t + 1e-12:
        raise ValueError(f"step size h must lie in (0, t={t}], got {h!r}")
    sigma = sde_sigma(t, h, eta)
    drift = v + (sigma * sigma / (2.0 * t)) * (x + (1.0 - t) * v)
    return x - h * drift, sigma * math.sqrt(h)


def ode_step(x: torch.Tensor, v: torch.Tensor, h: float) -> torch.Tensor:
    """Deterministic Euler step x_{t−h} = x_t − h·v."""
    return x - h * v


def gaussian_step_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Per-dimension mean Gaussian log-density of one SDE step.

    log π = mean_d [ −(x_next,d − μ_d)² / (2·std²) − log std − ½·log 2π ].

    Args:
        x_next: sampled next state, shape (B, D).
        mean: step mean μ, shape (B, D).
        std: step standard deviation s > 0.
    Returns:
        (B,) log-probabilities in the dtype of the inputs.
    """
    if x_next.shape != mean.shape:
        raise ValueError(
            f"x_next and mean must have the same shape, got {tuple(x_next.shape)} and {tuple(mean.shape)}"
        )
    if x_next.dim() != 2:
        raise ValueError(f"expected (B, D) states, got shape {tuple(x_next.shape)}")
    if not std > 0:
        raise ValueError(f"std must be > 0 for a log-probability, got {std!r}")
    z = (x_next - mean) / std
    return (-0.5 * z * z).mean(dim=-1) - (math.log(std) + _HALF_LOG_2PI)
