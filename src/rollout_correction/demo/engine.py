"""A simulated rollout engine: what vLLM / SGLang are to the trainer, in miniature.

Shared by ``rollout-correction demo`` (it samples every training batch) and
``rollout-correction diagnose --example`` (it produces the example file).

It keeps its own copy of the policy weights and its own sampling loop with a KV cache, and
returns the tokens it sampled together with the per-token log-probabilities *it* assigned to
them — the behaviour policy π_rollout. Three things make it differ from the trainer's fp32
policy π_old, all of them real numerics rather than injected noise:

* ``precision``: the copy runs in ``fp32``, ``bf16`` or ``fp16``;
* ``quant``: the weights of every linear layer inside the transformer blocks are fake-quantised
  (symmetric absmax, one scale per output channel or per tensor — ``granularity``): ``int8`` /
  ``int4`` / ``int3`` / ``int2`` round to 2^(b−1)−1 levels each side (``int2``: ternary −s, 0, s), ``fp8`` rounds through
  ``float8_e4m3fn`` after scaling the max to 448; embeddings and the output head stay at
  ``precision``; in a mixture-of-experts model each expert's matrices (the 3-D expert weights)
  are quantised the same way, expert by expert, and the routers stay at ``precision``, as
  MoE inference engines do;
* ``lag``: the engine loads the trainer's weights from ``lag`` optimizer steps ago, as an
  asynchronous RL system does.

With ``precision="fp32", quant="none", lag=0`` the engine is the trainer (the on-policy
reference); its log-probs then differ from the trainer's only by the KV-cache path's rounding.
"""

from __future__ import annotations

import copy
import inspect
from collections import deque

import torch

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rollout_correction.supports import sampling_support_mask

__all__ = ["PRECISIONS", "QUANTS", "GRANULARITIES", "fake_quantize", "sample", "RolloutEngine"]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTS = ("none", "int8", "fp8", "int4", "int3", "int2")
GRANULARITIES = ("channel", "tensor")
_INT_BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
_FP8_MAX = 448.0


def fake_quantize(weight: torch.Tensor, quant: str, granularity: str = "channel") -> torch.Tensor:
    """Quantise-dequantise a (out, in) weight; returns fp32.

    int-b:  s = max|w| / (2^(b−1) − 1),  ŵ = s · clamp(round(w / s), −(2^(b−1) − 1), 2^(b−1) − 1)
    fp8:    s = max|w| / 448,            ŵ = s · fp32(fp8_e4m3(w / s))

    with the max taken over each output row (``granularity="channel"``) or the whole tensor.
    """
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    w = weight.detach().float()
    if quant == "none":
        return w.clone()
    if w.dim() != 2:
        raise ValueError(f"fake_quantize expects a 2-D weight, got shape {tuple(w.shape)}")
    absmax = (w.abs().amax(dim=1, keepdim=True) if granularity == "channel" else w.abs().amax()).clamp_min(1e-12)
    if quant == "fp8":
        scale = absmax / _FP8_MAX
        return (w / scale).to(torch.float8_e4m3fn).float() * scale
    qmax = 2 ** (_INT_BITS[quant] - 1) - 1
    scale = absmax / qmax
    return torch.clamp(torch.round(w / scale), -qmax, qmax) * scale


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    kept: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache.

    Args:
      prompts: (B, P) int64 prompt tokens (same length for every row).
      max_new_tokens: T, number of tokens to generate.
      greedy: take argmax instead of sampling at temperature 1.
      top_k, top_p: truncate the sampling distribution to the kept set S (vLLM's order: top-k,
        then top-p) and sample from π restricted to S and renormalised, as inference engines do.
        The reported log-probs are then those of the truncated distribution, log π_S(y) =
        log π(y) − log π(S) — what engines return as "processed" log-probs.
      kept: if a list is given, the (B, V) bool kept set of every step is appended to it.
    Returns:
      responses (B, T) int64 and their log-probabilities log π(yₜ | x, y<ₜ) (B, T) float32,
      computed from the model's own logits (cast to fp32 before the softmax).
    """
    if prompts.dim() != 2:
        raise ValueError(f"prompts must be (B, P), got shape {tuple(prompts.shape)}")
    forward = _dense_llama_forward if _is_dense_llama(model) else _hf_forward
    logits, cache = forward(model, prompts, None)
    tokens, log_probs = [], []
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        if top_k is not None or top_p is not None:
            keep = sampling_support_mask(logits, top_k=top_k, top_p=top_p, order="vllm")
            logp = torch.log_softmax(logp.masked_fill(~keep, -torch.inf), dim=-1)
            if kept is not None:
                kept.append(keep)
        if greedy:
            nxt = logp.argmax(dim=-1, keepdim=True)
        else:
            nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        tokens.append(nxt)
        log_probs.append(logp.gather(-1, nxt))
        if t + 1 < max_new_tokens:
            logits, cache = forward(model, nxt, cache)
    return torch.cat(tokens, dim=1), torch.cat(log_probs, dim=1)


def _is_dense_llama(model: torch.nn.Module) -> bool:
    from transformers import LlamaForCausalLM

    return type(model) is LlamaForCausalLM and model.config._attn_implementation in ("sdpa", "eager")


def _hf_forward(model: torch.nn.Module, ids: torch.Tensor, cache):
    """One KV-cache step through the model's own forward: (last position's logits, cache)."""
    # transformers ≥ 5.2x names the KV cache ``cache`` (argument and output) and warns on the old
    # ``past_key_values``; earlier releases know only the old name.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, use_cache=True, **({cache_arg: cache} if cache is not None else {}))
    return out.logits[:, -1], out[cache_arg]


def _dense_llama_forward(model: torch.nn.Module, ids: torch.Tensor, cache):
    """The same KV-cache step as :func:`_hf_forward` for a dense ``LlamaForCausalLM``, calling its
    layers' own modules (norms, projections, rotary embedding, MLP) without the model-level
    wrappers, whose per-call cost dominates at this model size; the logits and sampled tokens are
    the same bit for bit (tests/test_demo.py). ``cache``: a (key, value) pair per layer, or None."""
    inner = model.model
    b, s = ids.shape
    past = 0 if cache is None else cache[0][0].shape[2]
    x = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(x, torch.arange(past, past + s).unsqueeze(0))
    new = []
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (b, s, -1, attn.head_dim)
        q, k = apply_rotary_pos_emb(attn.q_proj(h).view(shape).transpose(1, 2),
                                    attn.k_proj(h).view(shape).transpose(1, 2), cos, sin)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        if cache is not None:
            k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=s > 1, scale=attn.scaling)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        new.append((k, v))
    return model.lm_head(inner.norm(x[:, -1])), new


class RolloutEngine:
    """A reduced-precision, optionally quantised and stale copy of the trainer's policy."""

    def __init__(self, template: torch.nn.Module, precision: str = "fp32", quant: str = "none", lag: int = 0,
                 granularity: str = "channel"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
        if quant not in QUANTS:
            raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.precision, self.quant, self.lag, self.granularity = precision, quant, lag, granularity
        self.model = copy.deepcopy(template).to(PRECISIONS[precision]).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._quantized = {name for name, mod in self.model.named_modules()
                           if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}"}
        # MoE expert weights: (experts, out, in) parameters of an ``experts`` module.
        self._quantized_experts = {name for name, p in self.model.named_parameters()
                                   if p.dim() == 3 and ".experts." in f".{name}" and ".layers." in f".{name}"}
        self._history: deque[dict[str, torch.Tensor]] = deque(maxlen=lag + 1)

    @property
    def is_exact(self) -> bool:
        return self.precision == "fp32" and self.quant == "none" and self.lag == 0

    @torch.no_grad()
    def sync(self, trainer: torch.nn.Module) -> None:
        """Receive the trainer's current weights; load the ones from ``lag`` syncs ago."""
        snapshot = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
        self._history.append(snapshot)
        weights = self._history[0]
        params = dict(self.model.named_parameters())
        for name, src in weights.items():
            if name not in params:
                continue
            module_name = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and module_name in self._quantized:
                src = fake_quantize(src, self.quant, self.granularity)
            elif name in self._quantized_experts:
                src = torch.stack([fake_quantize(w, self.quant, self.granularity) for w in src])
            params[name].copy_(src.to(params[name].dtype))

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
                 greedy: bool = False, top_k: int | None = None, top_p: float | None = None,
                 kept: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample responses; returns (responses, rollout_log_prob), see :func:`sample`."""
        return sample(self.model, prompts, max_new_tokens, generator=generator, greedy=greedy,
                      top_k=top_k, top_p=top_p, kept=kept)
