"""A diffusers scheduler whose ``step`` is a stochastic FlowGRPO step with its log-probability.

:class:`FlowMatchSDEScheduler` subclasses diffusers' ``FlowMatchEulerDiscreteScheduler`` (same
config, ``set_timesteps``, shift and timestep bookkeeping) and replaces ``step`` with one
stochastic step σ → σ′ of type ``sde``, ``cps`` or ``dance_sde`` (formulas in
:mod:`rollout_correction.diffusion.sde`). The call signature and the four return values follow
verl-omni's ``FlowMatchSDEDiscreteScheduler``, so a denoising loop written against it runs
unchanged::

    scheduler = FlowMatchSDEScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    for t in scheduler.timesteps:
        v = transformer(latents.to(torch.bfloat16), t, ...).sample       # engine precision
        latents, log_prob, mean, std_dev_t = scheduler.step(
            v, t, latents, noise_level=0.7, sde_type="sde", return_dict=False)  # fp32 step

The step always runs in float32 (``sample``, ``model_output`` and ``prev_sample`` are upcast), as
the rollout engine of verl-omni does; latents may have any rank ≥ 1 (batch first) and the
log-probability is the mean over every non-batch dimension, shape (B,). ``noise_level`` is a
float or a per-row tensor (B, 1, …, 1); a row with η = 0 takes a deterministic step whose
log-probability is reported as 0 (it is not an action).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

try:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.utils import BaseOutput
    from diffusers.utils.torch_utils import randn_tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rollout_correction.diffusion.FlowMatchSDEScheduler needs diffusers: pip install 'rollout-correction[diffusion]'"
    ) from exc

from .sde import SDE_TYPES, flow_sde_log_prob, flow_sde_step

__all__ = ["FlowMatchSDEScheduler", "FlowMatchSDESchedulerOutput"]

SDEType = Literal["sde", "cps", "dance_sde"]


@dataclass
class FlowMatchSDESchedulerOutput(BaseOutput):
    """``prev_sample`` x′ (B, …) fp32; ``log_prob`` (B,) or None; ``prev_sample_mean`` μ (B, …);
    ``std_dev_t`` s_t (0-d, or (B, 1, …) for per-row timesteps or noise levels)."""

    prev_sample: torch.Tensor
    log_prob: Optional[torch.Tensor]
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor


class FlowMatchSDEScheduler(FlowMatchEulerDiscreteScheduler):
    """``FlowMatchEulerDiscreteScheduler`` with a stochastic, log-prob-returning ``step``."""

    def step(  # type: ignore[override]
        self,
        model_output: torch.Tensor,
        timestep: Union[float, torch.Tensor],
        sample: torch.Tensor,
        s_churn: float = 0.0,
        s_tmin: float = 0.0,
        s_tmax: float = float("inf"),
        s_noise: float = 1.0,
        generator: Optional[torch.Generator] = None,
        per_token_timesteps: Optional[torch.Tensor] = None,
        return_dict: bool = True,
        noise_level: Union[float, torch.Tensor] = 0.7,
        prev_sample: Optional[torch.Tensor] = None,
        sde_type: SDEType = "sde",
        return_logprobs: bool = True,
        include_logprob_normalizer: bool = True,
    ) -> Union[FlowMatchSDESchedulerOutput, tuple]:
        """One stochastic step from ``timestep`` to the next timestep of the schedule.

        Args:
            model_output: velocity prediction v (B, …), any float dtype (upcast to fp32).
            timestep: the current entry of ``self.timesteps`` (a float, not an index).
            sample: x at this timestep, (B, …).
            s_churn, s_tmin, s_tmax, s_noise: accepted for signature compatibility; unused.
            generator: RNG of the step noise (drawn with diffusers' ``randn_tensor`` in fp32).
            per_token_timesteps: not supported (raises ``NotImplementedError``).
            return_dict: return a :class:`FlowMatchSDESchedulerOutput` (True) or a 4-tuple.
            noise_level: η, float or per-row tensor.
            prev_sample: x′ to score instead of sampling one (the trainer's recompute).
            sde_type: ``"sde"`` (FlowGRPO), ``"cps"`` (FlowGRPO-CPS) or ``"dance_sde"`` (DanceGRPO).
            return_logprobs: compute the log-probability (else ``log_prob`` is None).
            include_logprob_normalizer: add −log scale − ½·log 2π (``sde``/``dance_sde``).
        Returns:
            (prev_sample, log_prob, prev_sample_mean, std_dev_t).
        """
        if isinstance(timestep, int) or (
            isinstance(timestep, torch.Tensor) and not torch.is_floating_point(timestep)
        ):
            raise ValueError(
                "step() takes a timestep value from scheduler.timesteps, not an integer index "
                "(e.g. from enumerate(timesteps))"
            )
        if self.step_index is None:
            self._init_step_index(timestep)
        out = self.sample_previous_step(
            sample=sample,
            model_output=model_output,
            generator=generator,
            per_token_timesteps=per_token_timesteps,
            noise_level=noise_level,
            prev_sample=prev_sample,
            sde_type=sde_type,
            return_logprobs=return_logprobs,
            include_logprob_normalizer=include_logprob_normalizer,
        )
        self._step_index += 1
        if not return_dict:
            return out
        return FlowMatchSDESchedulerOutput(*out)

    def sample_previous_step(
        self,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        timestep: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        per_token_timesteps: Optional[torch.Tensor] = None,
        noise_level: Union[float, torch.Tensor] = 0.7,
        prev_sample: Optional[torch.Tensor] = None,
        sde_type: SDEType = "sde",
        return_logprobs: bool = True,
        return_sqrt_dt: bool = False,
        include_logprob_normalizer: bool = True,
    ) -> tuple:
        """The step without the step-index bookkeeping.

        ``timestep=None`` uses the scheduler's current step index (the denoising loop);
        a (B,) tensor of timestep values scores each row at its own step (the trainer's
        recompute over per-sample SDE windows). ``return_sqrt_dt=True`` appends √(σ − σ′) per
        row (GRPO-Guard's scale), shape (B,).
        """
        if sde_type not in SDE_TYPES:
            raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
        if per_token_timesteps is not None:
            raise NotImplementedError("per_token_timesteps is not supported by FlowMatchSDEScheduler")
        if sample.dim() < 1 or sample.shape != model_output.shape:
            raise ValueError(
                f"sample {tuple(sample.shape)} and model_output {tuple(model_output.shape)} must have the "
                "same (B, …) shape"
            )
        sample = sample.to(torch.float32)
        model_output = model_output.to(torch.float32)
        if prev_sample is not None:
            if prev_sample.shape != sample.shape:
                raise ValueError(f"prev_sample {tuple(prev_sample.shape)} must have the shape of sample")
            prev_sample = prev_sample.to(torch.float32)
        sigmas = self.sigmas.to(device=sample.device, dtype=torch.float32)
        if timestep is None:
            if self.step_index is None:
                raise ValueError("no step index: call step() in a denoising loop or pass timestep=")
            idx = self.step_index
            sigma, sigma_next = sigmas[idx], sigmas[idx + 1]
        else:
            ts = torch.as_tensor(timestep).reshape(-1)
            idx = torch.tensor([self.index_for_timestep(t) for t in ts], device=sample.device)
            view = (-1,) + (1,) * (sample.dim() - 1)
            sigma, sigma_next = sigmas[idx].view(view), sigmas[idx + 1].view(view)
        if isinstance(noise_level, torch.Tensor):
            noise_level = noise_level.to(device=sample.device, dtype=torch.float32)
        mean, std_dev_t, scale = flow_sde_step(
            sample, model_output, sigma, sigma_next, noise_level, sde_type, sigma_max=sigmas[1]
        )
        std_dev_t = torch.as_tensor(std_dev_t, dtype=torch.float32, device=sample.device)
        if prev_sample is None:
            noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device,
                                 dtype=torch.float32)
            prev_sample = mean + scale * noise
        log_prob = (
            flow_sde_log_prob(prev_sample, mean, torch.as_tensor(scale, dtype=torch.float32, device=sample.device),
                              sde_type, include_normalizer=include_logprob_normalizer)
            if return_logprobs
            else None
        )
        if return_sqrt_dt:
            sqrt_dt = (sigma - sigma_next).sqrt()
            sqrt_dt = sqrt_dt.expand(sample.shape[0]).clone() if sqrt_dt.dim() == 0 else sqrt_dt.reshape(-1)
            return prev_sample, log_prob, mean, std_dev_t, sqrt_dt
        return prev_sample, log_prob, mean, std_dev_t
