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
arithmetic, which is how the reduced-precision "rollout engine" of the toy is obtained.

The same step written on a diffusers sigma schedule (σ_k from 1 to 0, step σ → σ′ = σ_{k+1},
dt = σ′ − σ < 0, noise level η) is :func:`flow_sde_step`, the one implementation behind both the
toy and :class:`rollout_correction.diffusion.FlowMatchSDEScheduler`. Three step types
(FlowGRPO's ``sde``, FlowGRPO-CPS's ``cps``, DanceGRPO's ``dance_sde``):

    sde:       s_t = η·√(σ / (1 − σ̃)),  σ̃ = σ_max where σ = 1 (σ_max = σ_1, the second sigma)
               μ = x·(1 + s_t²·dt / (2σ)) + v·(1 + s_t²·(1 − σ) / (2σ))·dt,   scale = s_t·√(−dt)
    cps:       s_t = σ′·sin(η·π/2),  x̂₀ = x − σ·v,  ε̂ = x + (1 − σ)·v
               μ = x̂₀·(1 − σ′) + ε̂·√(σ′² − s_t²),                           scale = s_t
    dance_sde: s_t = η·√(σ − σ′),  x̂₀ = x − σ·v,  score = −(x − (1 − σ)·x̂₀) / σ²
               μ = x + dt·v − ½·η²·score·dt,                                 scale = s_t

and the per-sample log-probability is the mean over every non-batch dimension of

    sde, dance_sde:  −(x′ − μ)² / (2·scale²)  [− log scale − ½·log 2π  with the normaliser]
    cps:             −(x′ − μ)²                 (FlowGRPO-CPS's unnormalised score)
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

__all__ = [
    "time_grid",
    "sde_sigma",
    "sde_step_mean_std",
    "ode_step",
    "gaussian_step_log_prob",
    "SDE_TYPES",
    "flow_sde_step",
    "flow_sde_log_prob",
]

SDE_TYPES = ("sde", "cps", "dance_sde")

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
    return _sde_mean(x, v, t, h, sigma), sigma * math.sqrt(h)


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
    return flow_sde_log_prob(x_next, mean, std, "sde")


# ------------------------------------------------------------------ the step on a sigma schedule
Number = Union[float, torch.Tensor]


def _sde_mean(x: torch.Tensor, v: torch.Tensor, sigma: Number, h: Number, std_dev_t: Number) -> torch.Tensor:
    """μ = x − h·[v + s_t²/(2σ)·(x + (1 − σ)·v)], h = σ − σ′ > 0 (FlowGRPO's reverse SDE)."""
    return x - h * (v + (std_dev_t * std_dev_t / (2.0 * sigma)) * (x + (1.0 - sigma) * v))


def flow_sde_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: Number,
    sigma_next: Number,
    noise_level: Number,
    sde_type: str = "sde",
    *,
    sigma_max: Optional[Number] = None,
) -> tuple[torch.Tensor, Number, Number]:
    """Mean, s_t and step scale of one stochastic step σ → σ′ (formulas in the module doc).

    Args:
        sample: x at σ, any shape (B, ...).
        model_output: the velocity v_θ(x, σ), same shape.
        sigma, sigma_next: σ > σ′ ≥ 0, floats or tensors broadcastable to ``sample``
            (per-row values as (B, 1, ..., 1)).
        noise_level: η ≥ 0, float or broadcastable tensor (0 gives a deterministic step).
        sde_type: ``"sde"``, ``"cps"`` or ``"dance_sde"``.
        sigma_max: σ̃ used in place of σ in 1 − σ where σ = 1 (``"sde"`` only; required there when
            a σ equals 1, since s_t diverges).
    Returns:
        (μ with the shape of ``sample``, s_t, scale) with scale the standard deviation of x′.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    if sample.shape != model_output.shape:
        raise ValueError(
            f"sample {tuple(sample.shape)} and model_output {tuple(model_output.shape)} must have the same shape"
        )
    h = sigma - sigma_next
    if sde_type == "sde":
        at_one = (sigma == 1) if isinstance(sigma, torch.Tensor) else torch.tensor(sigma == 1)
        if bool(at_one.any()):
            if sigma_max is None:
                raise ValueError("sigma = 1 makes the 'sde' noise level diverge; pass sigma_max (the second sigma)")
            denom = 1.0 - torch.where(at_one, torch.as_tensor(sigma_max), torch.as_tensor(sigma))
        else:
            denom = 1.0 - sigma
        std_dev_t = (sigma / denom) ** 0.5 * noise_level
        return _sde_mean(sample, model_output, sigma, h, std_dev_t), std_dev_t, std_dev_t * h**0.5
    if sde_type == "cps":
        std_dev_t = sigma_next * (
            torch.sin(noise_level * (math.pi / 2))
            if isinstance(noise_level, torch.Tensor)
            else math.sin(noise_level * math.pi / 2)
        )
        x0 = sample - sigma * model_output
        eps = sample + (1.0 - sigma) * model_output
        mean = x0 * (1.0 - sigma_next) + eps * (sigma_next * sigma_next - std_dev_t * std_dev_t) ** 0.5
        return mean, std_dev_t, std_dev_t
    x0 = sample - sigma * model_output
    score = -(sample - (1.0 - sigma) * x0) / (sigma * sigma)
    mean = sample - h * model_output + (0.5 * noise_level * noise_level) * score * h
    std_dev_t = noise_level * h**0.5
    return mean, std_dev_t, std_dev_t


def flow_sde_log_prob(
    prev_sample: torch.Tensor,
    mean: torch.Tensor,
    scale: Number,
    sde_type: str = "sde",
    *,
    include_normalizer: bool = True,
) -> torch.Tensor:
    """Per-sample log-probability of x′ = ``prev_sample``: the mean over all non-batch dimensions.

    ``sde``/``dance_sde``: −(x′ − μ)²/(2·scale²) [− log scale − ½·log 2π]; ``cps``: −(x′ − μ)².
    Where the scale is 0 (a deterministic step, η = 0) the step is not an action and its
    log-probability is returned as 0 instead of NaN.

    Returns:
        (B,) tensor in the dtype of the inputs.
    """
    if prev_sample.shape != mean.shape:
        raise ValueError(
            f"prev_sample {tuple(prev_sample.shape)} and mean {tuple(mean.shape)} must have the same shape"
        )
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    dims = tuple(range(1, mean.dim()))
    diff = prev_sample.detach() - mean
    if sde_type == "cps":
        return (-(diff * diff)).mean(dim=dims) if dims else -(diff * diff)
    # (x′ − μ)²/(2·scale²) as ½·z², z = (x′ − μ)/scale; the normaliser is constant within a row.
    if not isinstance(scale, torch.Tensor):
        if not scale > 0:
            return torch.zeros(mean.shape[:1], dtype=mean.dtype, device=mean.device)
        z = diff / scale
        quad = (-0.5 * z * z).mean(dim=dims) if dims else -0.5 * z * z
        return quad - (math.log(scale) + _HALF_LOG_2PI) if include_normalizer else quad
    b = mean.shape[0]
    scale_t = scale.to(mean.dtype)
    # one scale per row: a 0-d tensor, or (B, 1, …, 1) / (1, 1, …, 1) broadcastable to the sample
    row = scale_t.expand(b) if scale_t.dim() == 0 else scale_t.reshape(scale_t.shape[0], -1)[:, 0].expand(b)
    stochastic = row > 0
    safe = torch.where(stochastic, row, torch.ones_like(row))
    z = diff / safe.view(b, *([1] * len(dims)))
    quad = (-0.5 * z * z).mean(dim=dims) if dims else -0.5 * z * z
    if include_normalizer:
        quad = quad - (torch.log(safe) + _HALF_LOG_2PI)
    return torch.where(stochastic, quad, torch.zeros_like(quad))
