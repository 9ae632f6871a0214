"""Packed batches: B sequences laid end to end in one (1, N) or (N,) stream, delimited by ``cu_seqlens``.

Engines that remove padding (verl's ``use_remove_padding``, slime, Megatron's THD format, flash-attn's
varlen kernels) hold a batch as N tokens and the (B + 1,) cumulative offsets ``cu_seqlens`` (0, l₁,
l₁ + l₂, …, N). Every computation of this library is defined per sequence, so a packed batch is
scattered into the (B, T) layout of its padded form (T = the longest sequence, or ``max_seqlen``),
computed there, and the per-token results are gathered back: the weights, the mask, every metric,
the loss and its gradient are those of the padded form by construction.

``cu_seqlens`` is checked on the host when reading it is free (on the CPU) or needed (no
``max_seqlen`` given: one read of B + 1 integers): it must start at 0, not decrease and end at N.
With ``max_seqlen`` on a device nothing is read; a token that a malformed ``cu_seqlens`` or a too
small ``max_seqlen`` places outside the (B, T) layout is left out (weight 0, mask 0, no gradient).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Optional

import torch

from .segments import Segments

__all__ = ["Packing"]  # packable: the decorator of the entry points


class Packing:
    """The padded (B, T) layout of a packed batch of ``n`` tokens given by ``segments.cu_seqlens``."""

    def __init__(self, segments: Segments, n: int, device: torch.device) -> None:
        cu = segments.cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point() \
                or cu.dtype == torch.bool:
            got = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"Segments.cu_seqlens must be a 1-D integer tensor of B + 1 offsets (0, l1, l1 + l2, "
                             f"…, N), got {got}")
        T = segments.max_seqlen
        if T is not None and (isinstance(T, bool) or not isinstance(T, int) or T < 0):
            raise ValueError(f"Segments.max_seqlen={T!r} must be an integer ≥ 0 (the longest sequence)")
        self.B = B = cu.numel() - 1
        cu = cu.to(device=device, dtype=torch.int64)
        if T is None or cu.device.type == "cpu":
            offsets = cu.tolist()
            lengths = [b - a for a, b in zip(offsets, offsets[1:])]
            if offsets[0] != 0 or min(lengths, default=0) < 0 or offsets[-1] != n:
                raise ValueError(f"Segments.cu_seqlens must start at 0, never decrease and end at the {n} tokens "
                                 f"of the packed inputs; got {offsets[:6]}{' …' if len(offsets) > 6 else ''}")
            longest = max(lengths, default=0)
            if T is not None and T < longest:
                raise ValueError(f"Segments.max_seqlen={T} is shorter than the longest sequence ({longest} tokens)")
            T = longest if T is None else T
        self.T = T
        idx = torch.arange(n, device=device)
        row = torch.searchsorted(cu[1:], idx, right=True)  # B for a token after the last offset
        col = idx - cu[row.clamp(max=B)]
        self.inside = (row < B) & (col >= 0) & (col < T)
        self.flat = torch.where(self.inside, row * T + col, B * T)  # outside: one spare slot past the layout

    @classmethod
    def of(cls, segments: Optional[Segments], like: torch.Tensor) -> Optional["Packing"]:
        """The packing of ``segments`` for inputs shaped like ``like`` ((1, N) or (N,)), or None for a
        padded batch."""
        if segments is None or segments.cu_seqlens is None:
            return None
        if like.dim() not in (1, 2) or (like.dim() == 2 and like.shape[0] != 1):
            raise ValueError(f"packed inputs (Segments.cu_seqlens given) must be (1, N) or (N,), got "
                             f"{tuple(like.shape)}")
        return cls(segments, like.shape[-1], like.device)

    def pad(self, x: Optional[torch.Tensor], name: str = "a packed input", fill: float = 0) -> Optional[torch.Tensor]:
        """(B, T) of a packed (1, N) / (N,) tensor (differentiable), ``fill`` at padding; a (B,) per-sequence
        tensor and None are returned as they are."""
        if x is None or (x.dim() == 1 and x.shape[0] == self.B and x.shape[0] != self.flat.shape[0]):
            return x
        flat = x.reshape(-1)
        if x.dim() > 2 or flat.shape != self.flat.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; the packed inputs hold {self.flat.shape[0]} "
                             f"tokens: (1, {self.flat.shape[0]}) or ({self.flat.shape[0]},) per token, or ({self.B},) "
                             "per sequence where a per-sequence value is taken")
        out = flat.new_full((self.B * self.T + 1,), fill)
        return out.index_put((self.flat,), flat)[:-1].view(self.B, self.T)

    def unpad(self, x: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
        """The packed tokens of a (B, T) result, shaped like ``like`` (0 for a token outside the layout)."""
        if x is None:
            return None
        values = x.reshape(-1)[self.flat.clamp(max=max(self.B * self.T - 1, 0))] if x.numel() else \
            x.new_zeros(self.flat.shape)
        return torch.where(self.inside, values, torch.zeros((), dtype=x.dtype, device=x.device)).view(like.shape)

    def unpad_result(self, result, like: torch.Tensor):
        """:meth:`unpad` applied to every (B, T) tensor of a result (a tensor, a tuple, or the weights and
        mask of a correction output); anything else as it is."""
        if isinstance(result, tuple):
            return tuple(self.unpad_result(x, like) for x in result)
        if isinstance(result, torch.Tensor) and result.dim() == 2 and result.shape == (self.B, self.T):
            return self.unpad(result, like)
        if hasattr(result, "response_mask") and hasattr(result, "weights"):  # a CorrectionOutput
            return dataclasses.replace(result, weights=self.unpad(result.weights, like),
                                       response_mask=self.unpad(result.response_mask, like))
        return result

    def turns(self, segments: Segments) -> Optional[Segments]:
        """The turns of ``segments`` (``ids`` packed like the tokens) in the padded layout, or None."""
        return None if segments.ids is None else Segments(self.pad(segments.ids, "Segments.ids"), segments.count)


def packable(*names: str) -> Callable:
    """Decorator: a call whose ``segments`` keyword holds ``cu_seqlens`` runs on the padded form of the
    tensors named ``names`` (the first one's shape is the packed shape), with the turns of ``segments``,
    and its per-token results ((B, T) tensors, alone, in a tuple, or the weights and mask of a
    :class:`CorrectionOutput`) come back packed; scalars, metrics and (B,) values are returned as they are."""
    def wrap(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            like = bound.arguments[names[0]]
            packing = Packing.of(bound.arguments.get("segments"), like)
            if packing is None:
                return fn(*args, **kwargs)
            for name in names:
                if name in bound.arguments:
                    bound.arguments[name] = packing.pad(bound.arguments[name], name)
            bound.arguments["segments"] = packing.turns(bound.arguments["segments"])
            return packing.unpad_result(fn(*bound.args, **bound.kwargs), like)

        return call

    return wrap
