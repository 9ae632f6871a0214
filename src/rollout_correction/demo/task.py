"""Synthetic tasks with a verifiable reward.

A task turns a batch of digit strings into prompts and checks responses exactly:

    prompt   = [BOS, d₁, …, dₙ, SEP]          (n + 2 tokens)
    response = f(d₁, …, dₙ) c₁ … c_m          (n answer tokens, then m continuation tokens; no EOS)
    reward   = 1 if answer == f(d) else 0     (``exact``)
             or mean_t 1[answerₜ == f(d)ₜ]    (``partial``: fraction of answer positions right)

``sort`` asks for the digits in ascending order, ``reverse`` for them backwards. Both are easy
to learn to a few tens of percent with supervised fine-tuning and leave room for RL to improve.

``tail`` = m > 0 makes the response long: after the answer the model continues with m tokens that
the reward does not score, as it does not score the text of a long response before or around its
final answer. The supervised warm start teaches them from a fixed random bigram language model
over the digits (``BIGRAM``: each row a Dirichlet(3) draw, about 2.2 nats of entropy per token), so
the policy's continuation is neither deterministic nor uniform, and an engine whose numerics differ
from the trainer's differs from it on every continuation token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DIGITS = 10
SEP = 10
BOS = 11
VOCAB_SIZE = 12

TASKS = ("sort", "reverse")
REWARDS = ("exact", "partial")
MAX_TAIL = 4096


def _bigram(seed: int = 123, alpha: int = 3) -> torch.Tensor:
    """(10, 10) transition matrix P[a, b] = P(next digit b | digit a), each row a Dirichlet(alpha)
    draw: normalised Gamma(alpha) draws, each the sum of ``alpha`` exponential draws of a fixed
    generator (the same matrix on every machine)."""
    u = torch.rand(alpha, DIGITS, DIGITS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = -torch.log(u).sum(dim=0)
    return (g / g.sum(dim=1, keepdim=True)).float()


#: The continuation's language model (``Task.tail``).
BIGRAM = _bigram()


@dataclass(frozen=True)
class Task:
    """A digit task: ``name`` in ``TASKS``, ``n_digits`` digits per prompt."""

    name: str = "sort"
    n_digits: int = 6
    reward_kind: str = "exact"
    tail: int = 0           # unscored continuation tokens after the answer

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.name!r}")
        if self.reward_kind not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {self.reward_kind!r}")
        if not 2 <= self.n_digits <= 64:
            raise ValueError(f"n_digits must be in [2, 64], got {self.n_digits}")
        if not 0 <= self.tail <= MAX_TAIL:
            raise ValueError(f"tail must be in [0, {MAX_TAIL}], got {self.tail}")

    @property
    def prompt_len(self) -> int:
        return self.n_digits + 2

    @property
    def answer_len(self) -> int:
        """The scored tokens at the start of the response."""
        return self.n_digits

    @property
    def response_len(self) -> int:
        return self.n_digits + self.tail

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    def sample_digits(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n, n_digits) int64 uniform random digits."""
        return torch.randint(0, DIGITS, (n, self.n_digits), generator=generator)

    def prompts(self, digits: torch.Tensor) -> torch.Tensor:
        """(B, n_digits) digits -> (B, prompt_len) prompt tokens."""
        b = digits.shape[0]
        bos = torch.full((b, 1), BOS, dtype=torch.long)
        sep = torch.full((b, 1), SEP, dtype=torch.long)
        return torch.cat([bos, digits, sep], dim=1)

    def answers(self, digits: torch.Tensor) -> torch.Tensor:
        """(B, n_digits) digits -> (B, answer_len) correct answers."""
        if self.name == "sort":
            return digits.sort(dim=1).values
        return digits.flip(1)

    def continuation(self, last: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """(B,) last answer tokens -> (B, tail) tokens of the bigram language model that follows them."""
        out, prev = [], last
        for _ in range(self.tail):
            prev = torch.multinomial(BIGRAM[prev], 1, generator=generator).squeeze(1)
            out.append(prev)
        return torch.stack(out, dim=1) if out else last.new_zeros(last.shape[0], 0)

    def demonstrations(self, digits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """(B, n_digits) digits -> (B, response_len) supervised targets: the answer, then a continuation."""
        answers = self.answers(digits)
        return torch.cat([answers, self.continuation(answers[:, -1], generator)], dim=1) if self.tail else answers

    def reward(self, responses: torch.Tensor, digits: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        """(B, response_len) responses (or their first answer_len tokens) -> (B,) float32 reward in [0, 1]
        of the answer (``kind`` defaults to the task's); the continuation is not scored."""
        if responses.dim() != 2 or responses.shape[0] != digits.shape[0] or \
                responses.shape[1] not in (self.answer_len, self.response_len):
            raise ValueError(
                f"responses must have shape {(digits.shape[0], self.response_len)}, got {tuple(responses.shape)}"
            )
        right = responses[:, :self.answer_len] == self.answers(digits)
        if (kind or self.reward_kind) == "exact":
            return right.all(dim=1).float()
        return right.float().mean(dim=1)
