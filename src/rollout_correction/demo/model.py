"""The policy: a tiny causal LM built from a transformers config (no download).

``build_model`` returns a ``LlamaForCausalLM`` (RMSNorm, rotary positions, SwiGLU MLP) whose
size is chosen by name; the same class serves the trainer and the rollout engine's copy.
The size ``moe`` is a mixture-of-experts ``MixtralForCausalLM`` instead (``MOE_SIZES``).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from rollout_correction.demo.task import BOS, VOCAB_SIZE

# name -> (hidden size, MLP size, layers, heads)
MODEL_SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (48, 128, 2, 4),     # ~56k parameters
    "small": (64, 192, 3, 4),    # ~125k parameters
    "base": (128, 384, 4, 8),    # ~660k parameters
}

# Mixture of experts: name -> (hidden size, expert MLP size, layers, heads, experts, top-k).
# Each layer's router picks 2 of 4 SwiGLU experts per token (Mixtral: softmax, top-2, renormalised).
MOE_SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "moe": (48, 64, 2, 4, 4, 2),   # ~80k parameters, ~40k active per token
}
MODEL_SIZES.update({name: spec[:4] for name, spec in MOE_SIZES.items()})


def _build_moe(size: str, max_len: int) -> MixtralForCausalLM:
    hidden, mlp, layers, heads, experts, top_k = MOE_SIZES[size]
    config = MixtralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_len,
        num_local_experts=experts, num_experts_per_tok=top_k, router_aux_loss_coef=0.0,
        tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=None, pad_token_id=None,
        experts_implementation="eager",
    )
    return MixtralForCausalLM(config)


def build_model(size: str = "tiny", max_len: int = 64, seed: int | None = None) -> LlamaForCausalLM:
    """A freshly initialised causal LM of the named size, in fp32, in train mode."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model size must be one of {sorted(MODEL_SIZES)}, got {size!r}")
    hidden, mlp, layers, heads = MODEL_SIZES[size]
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=None,
        pad_token_id=None,
    )
    if seed is not None:
        torch.manual_seed(seed)
    model = _build_moe(size, max_len) if size in MOE_SIZES else LlamaForCausalLM(config)
    model.train()
    return model


def response_log_probs(model: torch.nn.Module, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probabilities of the response tokens under ``model`` (teacher forcing).

    log π(yₜ | x, y<ₜ) for every response position t, computed in fp32.

    Args:
      tokens: (B, prompt_len + T) prompt followed by response.
      prompt_len: number of prompt tokens.
    Returns:
      (B, T) float32 log-probabilities (attached to the graph if ``model`` requires grad).
    """
    if tokens.dim() != 2 or tokens.shape[1] <= prompt_len:
        raise ValueError(f"tokens must be (B, prompt_len + T) with T >= 1, got {tuple(tokens.shape)}")
    logits = model(tokens[:, :-1], use_cache=False).logits[:, prompt_len - 1 :].float()
    targets = tokens[:, prompt_len:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
