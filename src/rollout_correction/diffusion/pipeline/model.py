"""The policy of the pipeline demo: a tiny diffusers ``SD3Transformer2DModel`` built from a config.

* **Prompts** are P fixed random text embeddings (``encoder_hidden_states`` (P, L, d) and
  ``pooled_projections`` (P, d)); the empty prompt, used by classifier-free guidance, is zeros.
* **Data / reward**: prompt p owns a fixed unit-RMS latent pattern πₚ (C, H, W). The warm-start
  data of prompt p are x₀ = a·πₚ + 0.3·ε with a ~ N(0, 1); the reward of a generated latent is its
  projection on the pattern, r(x₀, p) = mean(x₀·πₚ) (a verifiable score that needs no download:
  "how strongly does the image show its prompt's pattern"). The warm-started model scores about 0
  on average with a spread of about 1; RL pushes a upwards.
* **Warm start**: a short rectified-flow pretraining (x_σ = (1 − σ)·x₀ + σ·ε, target v = ε − x₀,
  σ ~ U(0, 1)) so that the sampler produces structured latents before RL.
* **Velocity**: ``velocity(...)`` runs the transformer at timestep σ·1000 (diffusers' convention),
  with true CFG v = v_∅ + g·(v_p − v_∅) when g > 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelConfig", "PromptBank", "build_transformer", "velocity", "reward", "warm_start"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny transformer and of its latents (D = channels·size² latent dimensions)."""

    channels: int = 16
    size: int = 8
    patch: int = 2
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    text_dim: int = 32
    text_len: int = 4
    num_prompts: int = 4

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.size, self.size)


def build_transformer(cfg: ModelConfig, seed: int) -> nn.Module:
    """A randomly initialised ``SD3Transformer2DModel`` (diffusers) of the configured size, fp32."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=cfg.size,
        patch_size=cfg.patch,
        in_channels=cfg.channels,
        out_channels=cfg.channels,
        num_layers=cfg.layers,
        attention_head_dim=cfg.head_dim,
        num_attention_heads=cfg.heads,
        joint_attention_dim=cfg.text_dim,
        caption_projection_dim=cfg.heads * cfg.head_dim,
        pooled_projection_dim=cfg.text_dim,
        pos_embed_max_size=cfg.size,
    )


class PromptBank:
    """Fixed prompt embeddings and reward patterns (seeded, no download)."""

    def __init__(self, cfg: ModelConfig, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.text = torch.randn(cfg.num_prompts, cfg.text_len, cfg.text_dim, generator=g)
        self.pooled = torch.randn(cfg.num_prompts, cfg.text_dim, generator=g)
        pat = torch.randn(cfg.num_prompts, *cfg.latent_shape, generator=g)
        # smooth patterns (2×2 blocks) so that they are image-like at the patch size
        pat = torch.nn.functional.avg_pool2d(pat, 2).repeat_interleave(2, -1).repeat_interleave(2, -2)
        self.patterns = pat / pat.pow(2).mean(dim=(1, 2, 3), keepdim=True).sqrt()

    def embeds(self, prompt: torch.Tensor, dtype: torch.dtype, null: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        text, pooled = self.text[prompt], self.pooled[prompt]
        if null:
            text, pooled = torch.zeros_like(text), torch.zeros_like(pooled)
        return text.to(dtype), pooled.to(dtype)


def velocity(
    model: nn.Module,
    x: torch.Tensor,
    timestep: torch.Tensor,
    prompt: torch.Tensor,
    bank: PromptBank,
    cfg_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """v_θ(x, σ) in ``dtype`` (the weights' dtype); ``timestep`` (B,) on diffusers' 0–1000 scale."""
    xin = x.to(dtype)
    text, pooled = bank.embeds(prompt, dtype)
    v = model(hidden_states=xin, encoder_hidden_states=text, pooled_projections=pooled,
              timestep=timestep.to(dtype), return_dict=False)[0]
    if cfg_scale > 1.0:
        ntext, npooled = bank.embeds(prompt, dtype, null=True)
        v0 = model(hidden_states=xin, encoder_hidden_states=ntext, pooled_projections=npooled,
                   timestep=timestep.to(dtype), return_dict=False)[0]
        v = v0 + cfg_scale * (v - v0)
    return v


def reward(x0: torch.Tensor, prompt: torch.Tensor, bank: PromptBank) -> torch.Tensor:
    """r = mean(x₀·πₚ) per sample, (B,) float32."""
    return (x0.float() * bank.patterns[prompt]).mean(dim=(1, 2, 3))


def warm_start(model: nn.Module, bank: PromptBank, steps: int, seed: int, batch: int = 32,
               lr: float = 2e-3, cond_drop: float = 0.1) -> list[float]:
    """Rectified-flow pretraining on the prompts' data (x₀ = a·πₚ + 0.3·ε); returns the losses.

    A fraction ``cond_drop`` of the rows is trained with the empty prompt, so the model also has an
    unconditional velocity for classifier-free guidance.
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    cfg = bank.cfg
    for _ in range(steps):
        prompt = torch.randint(cfg.num_prompts, (batch,), generator=g)
        a = torch.randn(batch, 1, 1, 1, generator=g)
        x0 = a * bank.patterns[prompt] + 0.3 * torch.randn(batch, *cfg.latent_shape, generator=g)
        eps = torch.randn(batch, *cfg.latent_shape, generator=g)
        sigma = torch.rand(batch, generator=g)
        xs = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
        drop = torch.rand(batch, generator=g) < cond_drop
        text, pooled = bank.embeds(prompt, torch.float32)
        text = torch.where(drop.view(-1, 1, 1), torch.zeros_like(text), text)
        pooled = torch.where(drop.view(-1, 1), torch.zeros_like(pooled), pooled)
        v = model(hidden_states=xs, encoder_hidden_states=text, pooled_projections=pooled,
                  timestep=sigma * 1000.0, return_dict=False)[0]
        loss = (v - (eps - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError("warm start diverged (non-finite flow-matching loss)")
    return losses
