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

from rollout_correction.demo.model import GrowingCache, dense_forward, expand_cache, group_prompts, is_dense_llama
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


def sample(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    kept: list[torch.Tensor] | None = None,
    group_size: int = 1,
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
      group_size: G > 1 when every G consecutive rows share their prompt (GRPO's samples of one
        prompt): a dense model then reads each prompt once and continues every row from its
        prompt's KV cache (prefix caching; other models read every row), with the same tokens and
        log-probs up to float rounding.
    Returns:
      responses (B, T) int64 and their log-probabilities log π(yₜ | x, y<ₜ) (B, T) float32,
      computed from the model's own logits (cast to fp32 before the softmax).
    """
    if prompts.dim() != 2:
        raise ValueError(f"prompts must be (B, P), got shape {tuple(prompts.shape)}")
    # Inference mode skips autograd's bookkeeping on every small operation of the loop; its
    # tensors cannot enter autograd later, so the caller gets ordinary copies.
    sets = [] if kept is not None else None
    with torch.inference_mode():
        forward = dense_forward if is_dense_llama(model) else _hf_forward
        if forward is dense_forward and group_size > 1:
            logits, cache = dense_forward(model, group_prompts(prompts, group_size))
            logits, cache = logits.repeat_interleave(group_size, dim=0), expand_cache(cache, group_size)
        else:
            logits, cache = forward(model, prompts, None)
        if forward is dense_forward:  # keys and values written in place, not concatenated per token
            cache = GrowingCache(cache, prompts.shape[1] + max_new_tokens)
        tokens, log_probs = [], []
        for t in range(max_new_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            if top_k is not None or top_p is not None:
                keep = sampling_support_mask(logits, top_k=top_k, top_p=top_p, order="vllm")
                logp = torch.log_softmax(logp.masked_fill(~keep, -torch.inf), dim=-1)
                if sets is not None:
                    sets.append(keep)
            if greedy:
                nxt = logp.argmax(dim=-1, keepdim=True)
            else:
                nxt = torch.multinomial(logp.exp(), 1, generator=generator)
            tokens.append(nxt)
            log_probs.append(logp.gather(-1, nxt))
            if t + 1 < max_new_tokens:
                logits, cache = forward(model, nxt, cache)
        responses, log_probs = torch.cat(tokens, dim=1), torch.cat(log_probs, dim=1)
    if kept is not None:
        kept.extend(keep.clone() for keep in sets)
    return responses.clone(), log_probs.clone()


def _hf_forward(model: torch.nn.Module, ids: torch.Tensor, cache):
    """One KV-cache step through the model's own forward: (last position's logits, cache)."""
    # transformers ≥ 5.2x names the KV cache ``cache`` (argument and output) and warns on the old
    # ``past_key_values``; earlier releases know only the old name.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, use_cache=True, **({cache_arg: cache} if cache is not None else {}))
    return out.logits[:, -1], out[cache_arg]


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
                 kept: list[torch.Tensor] | None = None,
                 group_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample responses; returns (responses, rollout_log_prob), see :func:`sample`."""
        return sample(self.model, prompts, max_new_tokens, generator=generator, greedy=greedy,
                      top_k=top_k, top_p=top_p, kept=kept, group_size=group_size)
