"""Truncated sampling supports: trainer log-probs renormalised over the sampler's kept set.

When the rollout engine samples with top-k / top-p / min-p, the behaviour policy is the truncated
distribution q_S(y) = q(y) / Σ_{v∈S} q(v) on the kept set S, and engines that return "processed"
log-probs (vLLM ``logprobs_mode="processed_logprobs"``) report log q_S(y). A trainer taking a
full-vocabulary log-softmax reports log p(y), so the log-ratio becomes

    log p(y) − log q_S(y) = log Z_p(S) + [log p_S(y) − log q_S(y)],      Z_p(S) = Σ_{v∈S} p(v),

i.e. every ratio carries the kept mass Z_p(S) < 1 (TRL #6789): a comparison of two distributions
on different supports, not a policy difference. The fix compares like with like, log p_S(y) (see
:func:`renormalized_log_probs`); under the sampler E_{y∼q_S}[p_S(y) / q_S(y)] = 1, while the raw
ratio has expectation Z_p(S). S is either given (the engine's kept-token mask, exact) or
reconstructed from the sampling settings on the trainer logits (:func:`sampling_support_mask`).

Conventions:

* Ties: top-k keeps every token tied with the k-th largest logit (as vLLM and transformers do);
  at the top-p boundary every token tied with the last kept one is kept as well, so the
  reconstruction never depends on the order a sort happens to put equal values in.
* A sampled token is in the engine's kept set by definition. If the reconstruction on trainer
  logits leaves it out (the two engines disagree at the boundary), ``outside_support="include"``
  (default) adds it to S at that position and ``outside_support="raise"`` raises with the
  row and column. ``SupportLogProbs.in_support`` reports the positions either way.
* Tokens whose trainer logit is −inf are never in S. A sampled token with a −inf trainer logit
  gets log-prob −inf (the trainer deems it impossible); a position whose logits contain NaN or
  +inf gets NaN. Both reach the core, whose ``on_nonfinite`` policy rejects the sequence (or
  raises). Positions outside ``response_mask`` get 0 in every output, whatever their inputs.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional, Union

import torch

from rollout_correction import METRIC_PREFIX

__all__ = [
    "SupportLogProbs",
    "sampling_support_mask",
    "renormalized_log_probs",
    "support_metrics",
]

Setting = Union[None, int, float, torch.Tensor]
SamplingOrder = Literal["vllm", "hf", "sglang"]
OutsideSupport = Literal["include", "raise"]

_ORDERS = {  # each filter on the survivors of the previous one; SGLang: all on the full distribution
    "vllm": ("min_p", "top_k", "top_p"),  # v1 sampler: min-p is an argmax-invariant logits processor
    "hf": ("top_k", "top_p", "min_p"),  # transformers generate(): the warpers in this order
    "sglang": None,
}


class SupportLogProbs(NamedTuple):
    """Trainer log-probs of the sampled tokens on the sampler's kept support, each (B, T):
    ``log_prob`` float32 log p_S(y), to compare with the engine's processed log-prob (pass it as
    ``old_log_prob``); ``full_log_prob`` float32 log p(y) over the full vocabulary (temperature
    applied); ``kept_log_mass`` float32 log Z_p(S) ≤ 0, the bias the raw ratio carries; ``in_support``
    bool, the sampled token was in the kept set as given or reconstructed (before
    ``outside_support="include"`` added it; True on padding)."""

    log_prob: torch.Tensor
    full_log_prob: torch.Tensor
    kept_log_mass: torch.Tensor
    in_support: torch.Tensor


def _setting(value: Setting, name: str, lead_shape: torch.Size, device: torch.device,
             dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A scalar or per-row / per-position sampling setting as a tensor of shape lead_shape + (1,)."""
    if value is None:
        return None
    t = torch.as_tensor(value, device=device, dtype=dtype)
    if t.dim() > len(lead_shape) or tuple(t.shape) != tuple(lead_shape[: t.dim()]):
        raise ValueError(
            f"{name} must be a scalar or have a leading shape of the logits {tuple(lead_shape)} "
            f"(one value per row or per position); got shape {tuple(t.shape)}")
    t = t.reshape(tuple(t.shape) + (1,) * (len(lead_shape) - t.dim()))
    if dtype.is_floating_point and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite; got {value!r}")
    return t.expand(tuple(lead_shape)).unsqueeze(-1)


def _scaled_logits(logits: torch.Tensor, temperature: Setting) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor (..., V); got {type(logits).__name__}"
                        + (f" of dtype {logits.dtype}" if isinstance(logits, torch.Tensor) else ""))
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary dimension; got shape {tuple(logits.shape)}")
    tau = _setting(1.0 if temperature is None else temperature, "temperature", logits.shape[:-1],
                   logits.device, torch.float32)
    if bool((tau <= 0).any()):
        raise ValueError("temperature must be > 0 (greedy decoding has no sampling distribution to "
                         f"correct); got {temperature!r}")
    return logits.float() / tau


def _keep_top_k(z: torch.Tensor, keep: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose logit is ≥ the k-th largest kept logit (ties at the k-th value kept)."""
    vocab = z.shape[-1]
    masked = torch.where(keep, z, float("-inf"))
    ordered = masked.sort(dim=-1, descending=True).values
    active = (k > 0) & (k < vocab)
    kth = ordered.gather(-1, (k - 1).clamp(0, vocab - 1))
    kth = torch.where(active, kth, torch.full_like(kth, float("-inf")))
    return keep & (z >= kth)


def _keep_top_p(z: torch.Tensor, keep: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the most probable tokens until their mass reaches p, plus every token tied with the last."""
    probs = torch.where(keep, z, float("-inf")).softmax(dim=-1)
    ordered = probs.sort(dim=-1, descending=True).values
    mass_before = ordered.cumsum(dim=-1) - ordered
    n_kept = (mass_before < p).sum(dim=-1, keepdim=True).clamp(min=1)
    cutoff = ordered.gather(-1, n_kept - 1)
    active = p < 1.0
    return keep & (~active | (probs >= cutoff))


def _keep_min_p(z: torch.Tensor, keep: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with p(v) ≥ min_p · max_u p(u), i.e. z_v ≥ max z + log min_p."""
    top = torch.where(keep, z, float("-inf")).amax(dim=-1, keepdim=True)
    active = min_p > 0
    threshold = top + torch.log(torch.where(active, min_p, torch.ones_like(min_p)))
    return keep & (~active | (z >= threshold))


def sampling_support_mask(logits: torch.Tensor, *, temperature: Setting = 1.0, top_k: Setting = None,
                          top_p: Setting = None, min_p: Setting = None,
                          order: SamplingOrder = "vllm") -> torch.Tensor:
    """The set of tokens a top-k / top-p / min-p sampler keeps, reconstructed on these logits.

    With z = logits / τ and p = softmax(z) over the tokens still kept at each step:

        top-k:  keep v  iff  z_v ≥ z_(k)                         (z_(k) the k-th largest; ties kept)
        top-p:  keep v  iff  p_v ≥ p_(j*),  j* = max{j : Σ_{i<j} p_(i) < top_p}
        min-p:  keep v  iff  p_v ≥ min_p · max_u p_u

    ``order``: ``"vllm"`` (min-p, top-k, top-p, each on the renormalised survivors), ``"hf"``
    (top-k, top-p, min-p) or ``"sglang"`` (each on the full distribution, then intersected).
    Tokens with logit −inf or NaN are never kept.

    Args:
      logits: (..., V) trainer logits, any float dtype (computed in float32).
      temperature: τ > 0; a scalar or a tensor of the leading shape, e.g. (B,) or (B, T).
      top_k: int k; None, k ≤ 0 or k ≥ V disables it (vLLM uses −1 for "off").
      top_p: in (0, 1]; None or 1 disables it.
      min_p: in [0, 1]; None or 0 disables it.
      order: "vllm" | "hf" | "sglang".

    Returns:
      (..., V) bool mask of kept tokens.
    """
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {sorted(_ORDERS)}; got {order!r}")
    z = _scaled_logits(logits, temperature)
    lead, dev = z.shape[:-1], z.device
    k = _setting(top_k, "top_k", lead, dev, torch.long)
    p = _setting(top_p, "top_p", lead, dev, torch.float32)
    m = _setting(min_p, "min_p", lead, dev, torch.float32)
    if p is not None and bool(((p <= 0) | (p > 1)).any()):
        raise ValueError(f"top_p must be in (0, 1]; got {top_p!r}")
    if m is not None and bool(((m < 0) | (m > 1)).any()):
        raise ValueError(f"min_p must be in [0, 1]; got {min_p!r}")
    filters = {"top_k": (_keep_top_k, k), "top_p": (_keep_top_p, p), "min_p": (_keep_min_p, m)}
    keep = finite = z > float("-inf")  # False for −inf and NaN
    for name in _ORDERS[order] or filters:  # in sequence, or each on the full distribution (sglang)
        fn, arg = filters[name]
        if arg is not None:
            keep = fn(z, keep, arg) if _ORDERS[order] else keep & fn(z, finite, arg)
    return keep


def _kept_ids(kept_ids: torch.Tensor, lead: torch.Size, vocab: int, device: torch.device) -> torch.Tensor:
    """``kept_ids`` checked (integer, (B, T, k), ids in [0, V) or the padding −1), sorted along k."""
    if not isinstance(kept_ids, torch.Tensor) or kept_ids.is_floating_point() or kept_ids.is_complex() \
            or kept_ids.dtype == torch.bool:
        got = f"dtype {kept_ids.dtype}" if isinstance(kept_ids, torch.Tensor) else type(kept_ids).__name__
        raise TypeError(f"kept_ids must be an integer tensor (B, T, k) of kept token ids padded with -1; got {got}")
    if kept_ids.dim() != 3 or kept_ids.shape[:2] != lead:
        raise ValueError(f"kept_ids must be (B, T, k) with (B, T) = {tuple(lead)}, the logits' leading shape, "
                         f"padded with -1; got shape {tuple(kept_ids.shape)}")
    ids = kept_ids.to(device=device, dtype=torch.long)
    bad = (ids < -1) | (ids >= vocab)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"kept_ids holds id {int(ids[where])} at {where}, outside the vocabulary [0, {vocab}) "
                         "of the logits (-1 is the only padding value)")
    return ids.sort(dim=-1).values


def renormalized_log_probs(logits: torch.Tensor, tokens: torch.Tensor, *,
                           kept_mask: Optional[torch.Tensor] = None, kept_ids: Optional[torch.Tensor] = None,
                           temperature: Setting = 1.0, top_k: Setting = None, top_p: Setting = None,
                           min_p: Setting = None, order: SamplingOrder = "vllm",
                           response_mask: Optional[torch.Tensor] = None,
                           outside_support: OutsideSupport = "include") -> SupportLogProbs:
    """Trainer log-probs of the sampled tokens, renormalised over the sampler's kept support S.

        log p_S(y) = z_y/τ − logsumexp_{v∈S} z_v/τ,      log Z_p(S) = logsumexp_{v∈S} z_v/τ − logsumexp_v z_v/τ

    Compare ``log_prob`` with the engine's processed log-probs: the ratio then measures the mismatch
    only, not the kept mass (TRL #6789; DeepSeek-V3.2's "keep sampling mask").

    Args:
      logits: (B, T, V) trainer logits at the positions that predicted ``tokens``.
      tokens: (B, T) sampled token ids; ignored (any value) where ``response_mask`` is 0.
      kept_mask: (B, T, V) bool, the engine's kept tokens (exact).
      kept_ids: (B, T, k) integer, the engine's kept token ids at each position padded with −1
        (slime's replay of the sampler's top-p set); a repeated id counts once. The same S as
        ``kept_mask`` without a (B, T, V) mask: memory O(B·T·k) beyond the logits. Give one of
        ``kept_mask``, ``kept_ids`` or the settings.
      temperature, top_k, top_p, min_p, order: the sampler's settings, see
        :func:`sampling_support_mask`. ``temperature`` is applied in every case.
      response_mask: (B, T) 0/1 or bool; outputs are 0 outside it. Default: all valid.
      outside_support: "include" adds a sampled token the kept set misses to S at that
        position; "raise" raises ValueError naming the first such (row, column).

    Returns:
      SupportLogProbs(log_prob, full_log_prob, kept_log_mass, in_support), each (B, T).
    """
    if outside_support not in ("include", "raise"):
        raise ValueError(f"outside_support must be 'include' or 'raise'; got {outside_support!r}")
    z = _scaled_logits(logits, temperature)
    if z.dim() != 3:
        raise ValueError(f"logits must be (B, T, V); got shape {tuple(z.shape)}")
    lead, vocab = z.shape[:-1], z.shape[-1]
    if response_mask is None:
        valid = torch.ones(lead, dtype=torch.bool, device=z.device)
    else:
        if response_mask.shape != lead:
            raise ValueError(f"response_mask has shape {tuple(response_mask.shape)} but logits have "
                             f"leading shape {tuple(lead)}")
        valid = response_mask.to(device=z.device) != 0
    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise TypeError("tokens must be an integer tensor of sampled token ids")
    if tokens.shape != lead:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)} but logits have leading shape "
                         f"{tuple(lead)} (logits are (B, T, V), tokens (B, T))")
    bad = valid & ((tokens < 0) | (tokens >= vocab))
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"token id {int(tokens[where])} at position {where} is outside the vocabulary "
                         f"[0, {vocab}) of the logits")
    given = [name for name, value in (("kept_mask", kept_mask), ("kept_ids", kept_ids), ("top_k", top_k),
                                      ("top_p", top_p), ("min_p", min_p)) if value is not None]
    if len(given) > 1 and given[0] in ("kept_mask", "kept_ids"):
        raise ValueError("pass one of kept_mask, kept_ids (the engine's kept tokens) or the settings "
                         f"top_k/top_p/min_p; got {', '.join(given)}")

    index = torch.where(valid, tokens.to(z.device), torch.zeros_like(tokens, device=z.device)).long()
    index = index.unsqueeze(-1)
    # No distribution at all: a NaN / +inf logit, or every logit −inf (the row's max is then not finite).
    broken = ~torch.isfinite(z.amax(dim=-1))
    if kept_ids is not None:
        in_support, log_kept, kept_any, z_safe = _kept_set_from_ids(z, index, broken, valid, kept_ids,
                                                                    outside_support, tokens)
    else:
        keep = _dense_kept_set(logits, z, kept_mask, temperature, top_k, top_p, min_p, order)
        in_support, log_kept, kept_any, z_safe = _kept_set_from_mask(z, index, broken, valid, keep,
                                                                     outside_support, tokens)
    z_y = z_safe.gather(-1, index).squeeze(-1)
    log_total = torch.logsumexp(z_safe, dim=-1)
    # An empty kept set (the sampled token itself has a −inf logit): log p_S(y) is −inf whichever
    # finite normaliser is used; the full one keeps the gradient finite.
    log_kept = torch.where(kept_any, log_kept, log_total)
    log_kept_mass = torch.where(kept_any, log_kept - log_total, torch.full_like(log_kept, float("-inf")))
    nan = torch.full_like(z_y, float("nan"))
    zero = torch.zeros_like(z_y)

    def finish(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, torch.where(broken, nan, x), zero)

    return SupportLogProbs(
        log_prob=finish(z_y - log_kept),
        full_log_prob=finish(z_y - log_total),
        kept_log_mass=finish(log_kept_mass),
        in_support=in_support,
    )


def _dense_kept_set(logits, z, kept_mask, temperature, top_k, top_p, min_p, order) -> torch.Tensor:
    """The dense (B, T, V) kept set: the engine's ``kept_mask`` (−inf logits left out) or the
    reconstruction from the settings."""
    if kept_mask is None:
        return sampling_support_mask(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                     order=order)
    if kept_mask.shape != z.shape:
        raise ValueError(f"kept_mask has shape {tuple(kept_mask.shape)} but logits have shape {tuple(z.shape)}")
    return kept_mask.to(device=z.device, dtype=torch.bool) & (z > float("-inf"))


def _check_in_support(in_support: torch.Tensor, tokens: torch.Tensor) -> None:
    if not bool(in_support.all()):
        where = tuple(int(i) for i in (~in_support).nonzero()[0])
        raise ValueError(f"sampled token {int(tokens[where])} at position {where} is outside the kept "
                         "support (kept_mask, kept_ids or top_k/top_p/min_p disagree with the sampled tokens)")


def _kept_set_from_mask(z, index, broken, valid, keep, outside_support, tokens):
    """(in_support, logsumexp_{v∈S} z_v, S non-empty, z with the broken rows zeroed) from a dense S."""
    in_support = keep.gather(-1, index).squeeze(-1) | ~valid
    if outside_support == "raise":
        _check_in_support(in_support, tokens)
    else:
        keep = keep.scatter(-1, index, True)
    z_safe = torch.where(broken.unsqueeze(-1), torch.zeros_like(z), z)
    keep = keep & ((z > float("-inf")) | broken.unsqueeze(-1))
    kept_any = keep.any(dim=-1)
    masked = torch.where(keep | ~kept_any.unsqueeze(-1), z_safe, float("-inf"))
    return in_support, torch.logsumexp(masked, dim=-1), kept_any, z_safe


def _kept_set_from_ids(z, index, broken, valid, kept_ids, outside_support, tokens):
    """The same from (B, T, k) kept ids: gathers and a logsumexp over k + 1 entries, no (B, T, V) mask."""
    ids = _kept_ids(kept_ids, z.shape[:-1], z.shape[-1], z.device)
    first = torch.ones_like(ids[..., :1], dtype=torch.bool)
    distinct = torch.cat([first, ids[..., 1:] != ids[..., :-1]], dim=-1) & (ids >= 0)
    keep = distinct & (z.gather(-1, ids.clamp(min=0)) > float("-inf"))   # NaN and −inf never kept
    hit = (keep & (ids == index)).any(dim=-1)
    in_support = hit | ~valid
    if outside_support == "raise":
        _check_in_support(in_support, tokens)
    # z is this call's own scaled copy of the logits: zeroing the broken rows in place keeps it the
    # only (B, T, V) float tensor (their outputs are NaN; their gradients stay finite).
    z_safe = z.masked_fill_(broken.unsqueeze(-1), 0.0)
    z_tok = z_safe.gather(-1, index)
    add = ~hit.unsqueeze(-1) & (z_tok > float("-inf")) & (outside_support == "include")
    z_set = torch.cat([z_safe.gather(-1, ids.clamp(min=0)), z_tok], dim=-1)
    keep = torch.cat([keep, add], dim=-1)
    kept_any = keep.any(dim=-1)
    masked = torch.where(keep, z_set, float("-inf"))
    masked = torch.where(kept_any.unsqueeze(-1), masked, torch.zeros_like(masked))
    return in_support, torch.logsumexp(masked, dim=-1), kept_any, z_safe


def support_metrics(result: SupportLogProbs, response_mask: Optional[torch.Tensor] = None,
                    prefix: str = METRIC_PREFIX) -> dict[str, torch.Tensor]:
    """Over valid tokens, as 0-d float32 tensors (no sync; 0 with no valid token; non-finite
    positions left out of the means): ``support_kept_mass_mean`` = mean_t Z_p(S_t),
    ``support_log_kept_mass_mean`` = mean_t log Z_p(S_t), ``support_outside_fraction`` = mean_t 1[y_t ∉ S_t].
    """
    lm = result.kept_log_mass
    valid = torch.ones_like(lm, dtype=torch.bool) if response_mask is None else response_mask.to(lm.device) != 0
    finite = valid & torch.isfinite(lm)
    n = finite.sum().clamp(min=1).float()
    n_valid = valid.sum().clamp(min=1).float()
    safe = torch.where(finite, lm, torch.zeros_like(lm))
    return {
        f"{prefix}support_kept_mass_mean": torch.where(finite, safe.exp(), torch.zeros_like(lm)).sum() / n,
        f"{prefix}support_log_kept_mass_mean": safe.sum() / n,
        f"{prefix}support_outside_fraction": (valid & ~result.in_support).sum().float() / n_valid,
    }
