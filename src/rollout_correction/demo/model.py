"""The policy: a tiny causal LM built from a transformers config (no download).

``build_model`` returns a ``LlamaForCausalLM`` (RMSNorm, rotary positions, SwiGLU MLP) whose
size is chosen by name; the same class serves the trainer and the rollout engine's copy.
The size ``moe`` is a mixture-of-experts ``MixtralForCausalLM`` instead (``MOE_SIZES``).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

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


def is_dense_llama(model: torch.nn.Module) -> bool:
    """Whether :func:`dense_forward` serves ``model``: a dense ``LlamaForCausalLM`` (SDPA or eager)."""
    return type(model) is LlamaForCausalLM and model.config._attn_implementation in ("sdpa", "eager")


def dense_forward(model: LlamaForCausalLM, ids: torch.Tensor, cache: list | None = None,
                  last_only: bool = True) -> tuple[torch.Tensor, list]:
    """A forward of a dense ``LlamaForCausalLM`` through its layers' own modules (norms,
    projections, rotary embedding, MLP), without the model-level wrappers, whose per-call cost
    dominates at the demo's sizes; differentiable.

    ``cache``: a (key, value) pair per layer for the positions before ``ids`` (every row the same
    length), a :class:`GrowingCache` (extended in place and returned), or None. Returns the logits
    of the last position (``last_only``) or of every position of ``ids``, and the cache extended by
    ``ids``. Without a cache, or for one new position, the logits equal the model's own forward bit
    for bit (tests/test_demo.py).
    """
    inner = model.model
    b, s = ids.shape
    grow = isinstance(cache, GrowingCache)
    past = 0 if cache is None else cache.length if grow else cache[0][0].shape[2]
    x = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(x, torch.arange(past, past + s).unsqueeze(0))
    # Causal attention over the cache and the new positions: position past + i sees keys ≤ past + i.
    mask = torch.ones(s, past + s, dtype=torch.bool).tril(past) if past and s > 1 else None
    new = []
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (b, s, -1, attn.head_dim)
        q, k = apply_rotary_pos_emb(attn.q_proj(h).view(shape).transpose(1, 2),
                                    attn.k_proj(h).view(shape).transpose(1, 2), cos, sin)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        if grow:
            k, v = cache.extend(i, k, v)
        elif cache is not None:
            k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             is_causal=not past and s > 1, scale=attn.scaling)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        new.append((k, v))
    if grow:
        cache.length += s
        new = cache
    return model.lm_head(inner.norm(x[:, -1] if last_only else x)), new


class GrowingCache(list):
    """A KV cache that a sampling loop extends one position at a time: each layer's keys and values
    live in a buffer of fixed capacity and are written in place, instead of concatenating the whole
    cache again for every generated token (quadratic in the response length). :func:`dense_forward`
    reads the first ``length`` positions, the same values a concatenated cache holds."""

    def __init__(self, cache: list, capacity: int):
        length = cache[0][0].shape[2]
        if capacity < length:
            raise ValueError(f"capacity ({capacity}) must hold the cache's {length} positions")
        super().__init__()
        for k, v in cache:
            kb, vb = (t.new_empty(t.shape[:2] + (capacity,) + t.shape[3:]) for t in (k, v))
            kb[:, :, :length], vb[:, :, :length] = k, v
            self.append((kb, vb))
        self.length = length

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer``'s new keys and values after the cached ones; the keys and values so far."""
        end = self.length + k.shape[2]
        kb, vb = self[layer]
        if end > kb.shape[2]:
            raise ValueError(f"the cache holds {kb.shape[2]} positions, {end} requested")
        kb[:, :, self.length:end], vb[:, :, self.length:end] = k, v
        return kb[:, :, :end], vb[:, :, :end]


def group_prompts(prompts: torch.Tensor, group_size: int) -> torch.Tensor:
    """The one prompt of each group of ``group_size`` consecutive rows (rows of a group must share it)."""
    if group_size < 1 or prompts.shape[0] % group_size:
        raise ValueError(f"group_size ({group_size}) must divide the {prompts.shape[0]} rows")
    shared = prompts[::group_size]
    if not torch.equal(shared.repeat_interleave(group_size, dim=0), prompts):
        raise ValueError(f"every group of {group_size} consecutive rows must share one prompt")
    return shared


def expand_cache(cache: list, group_size: int) -> list:
    """A per-group KV cache repeated for every row of its group."""
    return [tuple(t.repeat_interleave(group_size, dim=0) for t in pair) for pair in cache]


def response_log_probs(model: torch.nn.Module, tokens: torch.Tensor, prompt_len: int,
                       group_size: int = 1) -> torch.Tensor:
    """Log-probabilities of the response tokens under ``model`` (teacher forcing).

    log π(yₜ | x, y<ₜ) for every response position t, computed in fp32.

    Args:
      tokens: (B, prompt_len + T) prompt followed by response.
      prompt_len: number of prompt tokens.
      group_size: G > 1 when every G consecutive rows share their prompt (GRPO's samples of one
        prompt): a dense model then runs each prompt once and its responses on top of the prompt's
        KV cache, as a prefix-caching engine does; the log-probs agree with the full forward to
        float rounding (tests/test_demo.py), the gradient flows through the shared prompt.
    Returns:
      (B, T) float32 log-probabilities (attached to the graph if ``model`` requires grad).
    """
    if tokens.dim() != 2 or tokens.shape[1] <= prompt_len:
        raise ValueError(f"tokens must be (B, prompt_len + T) with T >= 1, got {tuple(tokens.shape)}")
    targets = tokens[:, prompt_len:]
    if group_size > 1 and is_dense_llama(model):
        first, cache = dense_forward(model, group_prompts(tokens[:, :prompt_len], group_size))
        logits = first.repeat_interleave(group_size, dim=0).unsqueeze(1)
        if targets.shape[1] > 1:
            rest, _ = dense_forward(model, targets[:, :-1], expand_cache(cache, group_size), last_only=False)
            logits = torch.cat([logits, rest], dim=1)
        logits = logits.float()
    else:
        logits = model(tokens[:, :-1], use_cache=False).logits[:, prompt_len - 1 :].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
