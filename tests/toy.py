"""An enumerable toy: a tabular autoregressive policy small enough to list every sequence.

The policy generates a sequence y = (y_1, …, y_n), n ≤ T, over a vocabulary of V tokens. The
state before step t is the prefix s_t = y_<t, and each state has its own row of logits:

    π_θ(y_t | y_<t) = softmax(θ[s_t])[y_t],        log π_θ(y) = Σ_t log π_θ(y_t | y_<t)

With a ``stop_token`` a sequence ends as soon as that token is drawn (so lengths vary and rows
are padded); without one every sequence has length T and there are B = V^T of them.

Because every sequence is one row of a (B, T) batch, expectations are finite sums and the score
of a tabular softmax has a closed form, ∂ log π_θ(y_t | s_t) / ∂θ[s, a] = 1[s = s_t]·(1[a = y_t] −
π_θ(a | s_t)). That gives exact references for gradient estimators, e.g. the on-policy gradient

    ∇_θ E_π[A] (with A fixed) = E_π[A ∇ log π_θ(y)] = Σ_y π_θ(y) A(y) Σ_t ∇ log π_θ(y_t | y_<t)

To make a loss averaged over rows equal an expectation under a behaviour policy μ, scale each
row's advantage by μ(y)·B (:func:`scaled_advantages`): with ``seq-mean-token-sum`` aggregation
(1/B) Σ_y μ(y)·B·f(y) = Σ_y μ(y) f(y) = E_μ[f].

Example::

    space = enumerate_sequences(vocab_size=3, horizon=3)
    theta = random_logits(space, scale=1.0, generator=torch.Generator().manual_seed(0))
    mu = perturb(theta, scale=0.3, generator=torch.Generator().manual_seed(1))
    log_pi = sequence_log_probs(theta, space)               # (B,)
    exact = exact_policy_gradient(theta, space, advantages)  # (S, V)

Run ``python tests/toy.py`` for the gradient error of naive and corrected PPO on
this toy (docs/validation.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SequenceSpace", "enumerate_sequences", "random_logits", "perturb", "token_log_probs",
           "sequence_log_probs", "token_scores", "exact_policy_gradient", "scaled_advantages"]


@dataclass(frozen=True)
class SequenceSpace:
    """Every sequence of a tabular autoregressive policy, one per row.

    tokens: (B, T) int64, y_t (0 at padding).
    mask: (B, T) bool, True at the sequence's tokens.
    states: (B, T) int64, index of the prefix y_<t among the ``num_states`` prefixes that can be
        continued (0 at padding).
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    states: torch.Tensor
    num_states: int
    vocab_size: int
    stop_token: Optional[int]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def horizon(self) -> int:
        return self.tokens.shape[1]

    def check_logits(self, logits: torch.Tensor) -> None:
        """Raise ValueError unless ``logits`` is a float (num_states, vocab_size) table."""
        shape = (self.num_states, self.vocab_size)
        if tuple(logits.shape) != shape or not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor of shape {shape} (states × vocabulary), "
                             f"got {tuple(logits.shape)} {logits.dtype}")


def enumerate_sequences(vocab_size: int, horizon: int, stop_token: Optional[int] = None) -> SequenceSpace:
    """List every sequence of length ≤ ``horizon`` the policy can produce, in lexicographic order.

    Without ``stop_token`` these are the V^T sequences of length T. With it, a sequence ends at
    its first ``stop_token`` or at length T, whichever comes first.
    """
    if vocab_size < 2 or horizon < 1:
        raise ValueError(f"need vocab_size ≥ 2 and horizon ≥ 1, got vocab_size={vocab_size}, "
                         f"horizon={horizon}")
    if stop_token is not None and not 0 <= stop_token < vocab_size:
        raise ValueError(f"stop_token={stop_token} is not a token of a vocabulary of size {vocab_size}")
    state_of: dict[tuple[int, ...], int] = {}
    rows: list[tuple[tuple[int, ...], list[int]]] = []

    def extend(prefix: tuple[int, ...]) -> None:
        state_of.setdefault(prefix, len(state_of))
        for v in range(vocab_size):
            seq = prefix + (v,)
            if len(seq) == horizon or v == stop_token:
                rows.append((seq, [state_of[seq[:t]] for t in range(len(seq))]))
            else:
                extend(seq)

    extend(())
    B = len(rows)
    tokens = torch.zeros(B, horizon, dtype=torch.long)
    states = torch.zeros(B, horizon, dtype=torch.long)
    mask = torch.zeros(B, horizon, dtype=torch.bool)
    for i, (seq, st) in enumerate(rows):
        n = len(seq)
        tokens[i, :n] = torch.tensor(seq)
        states[i, :n] = torch.tensor(st)
        mask[i, :n] = True
    return SequenceSpace(tokens, mask, states, len(state_of), vocab_size, stop_token)


def random_logits(space: SequenceSpace, scale: float = 1.0, generator: Optional[torch.Generator] = None,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A (num_states, vocab_size) table of N(0, scale²) logits."""
    return scale * torch.randn(space.num_states, space.vocab_size, generator=generator, dtype=dtype)


def perturb(logits: torch.Tensor, scale: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits + N(0, scale²) noise: a nearby policy (e.g. a mismatched behaviour policy μ)."""
    noise = torch.randn(logits.shape, generator=generator, dtype=logits.dtype)
    return logits.detach() + scale * noise


def token_log_probs(logits: torch.Tensor, space: SequenceSpace, fill: float = 0.0) -> torch.Tensor:
    """(B, T) log π_θ(y_t | y_<t), differentiable in ``logits``; ``fill`` at padding."""
    space.check_logits(logits)
    lp = torch.log_softmax(logits, dim=-1)[space.states, space.tokens]
    return torch.where(space.mask, lp, torch.full((), fill, dtype=lp.dtype))


def sequence_log_probs(logits: torch.Tensor, space: SequenceSpace) -> torch.Tensor:
    """(B,) log π_θ(y) = Σ_t log π_θ(y_t | y_<t). The probabilities sum to 1 over the rows."""
    return token_log_probs(logits, space).sum(-1)


def token_scores(logits: torch.Tensor, space: SequenceSpace) -> torch.Tensor:
    """(B, T, S, V) closed-form ∇_θ log π_θ(y_t | y_<t) (no autograd); 0 at padding.

    The only non-zero row of the (S, V) gradient is s_t: onehot(y_t) − softmax(θ[s_t]).
    """
    space.check_logits(logits)
    B, T = space.tokens.shape
    S, V = logits.shape
    probs = torch.softmax(logits.detach(), dim=-1)
    row = torch.nn.functional.one_hot(space.tokens, V).to(probs.dtype) - probs[space.states]  # (B, T, V)
    row = torch.where(space.mask.unsqueeze(-1), row, torch.zeros((), dtype=row.dtype))
    state_onehot = torch.nn.functional.one_hot(space.states, S).to(probs.dtype)              # (B, T, S)
    return state_onehot.unsqueeze(-1) * row.unsqueeze(-2)


def exact_policy_gradient(logits: torch.Tensor, space: SequenceSpace,
                          advantages: torch.Tensor) -> torch.Tensor:
    """(S, V) E_π[A ∇ log π_θ(y)] = Σ_y π_θ(y) A(y) Σ_t ∇ log π_θ(y_t | y_<t), by enumeration.

    ``advantages``: (B,) one value per sequence, held fixed (not differentiated).
    """
    if tuple(advantages.shape) != (space.batch_size,):
        raise ValueError(f"advantages must have shape ({space.batch_size},), got {tuple(advantages.shape)}")
    pi = sequence_log_probs(logits.detach(), space).exp()
    return torch.einsum("b,btsv->sv", pi * advantages.to(pi.dtype), token_scores(logits, space))


def scaled_advantages(advantages: torch.Tensor, behaviour_log_probs: torch.Tensor, space: SequenceSpace
                      ) -> torch.Tensor:
    """(B, T) per-token advantages A(y)·μ(y)·B on the sequence's tokens, 0 at padding.

    With ``seq-mean-token-sum`` aggregation over all B rows, a loss Σ_t ℓ_t(y)·A(y)·μ(y)·B averages
    to E_μ[Σ_t ℓ_t(y) A(y)], an exact expectation under the behaviour policy μ.
    """
    B = space.batch_size
    if tuple(advantages.shape) != (B,) or tuple(behaviour_log_probs.shape) != (B,):
        raise ValueError(f"advantages and behaviour_log_probs must have shape ({B},), got "
                         f"{tuple(advantages.shape)} and {tuple(behaviour_log_probs.shape)}")
    row = advantages * behaviour_log_probs.detach().exp() * B
    return torch.where(space.mask, row.unsqueeze(-1), torch.zeros((), dtype=row.dtype))
