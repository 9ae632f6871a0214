"""Synthetic tasks with a verifiable reward.

A task turns a batch of digit strings into prompts and checks responses exactly:

    prompt   = [BOS, d₁, …, dₙ, SEP]          (n + 2 tokens)
    response = f(d₁, …, dₙ)                   (n tokens, fixed length, no EOS)
    reward   = 1 if response == f(d) else 0   (``exact``)
             or mean_t 1[responseₜ == f(d)ₜ]  (``partial``: fraction of positions right)

``sort`` asks for the digits in ascending order, ``reverse`` for them backwards. Both are easy
to learn to a few tens of percent with supervised fine-tuning and leave room for RL to improve.
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


@dataclass(frozen=True)
class Task:
    """A digit task: ``name`` in ``TASKS``, ``n_digits`` digits per prompt."""

    name: str = "sort"
    n_digits: int = 6
    reward_kind: str = "exact"

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.name!r}")
        if self.reward_kind not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {self.reward_kind!r}")
        if not 2 <= self.n_digits <= 64:
            raise ValueError(f"n_digits must be in [2, 64], got {self.n_digits}")

    @property
    def prompt_len(self) -> int:
        return self.n_digits + 2

    @property
    def response_len(self) -> int:
        return self.n_digits

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
        """(B, n_digits) digits -> (B, response_len) correct responses."""
        if self.name == "sort":
            return digits.sort(dim=1).values
        return digits.flip(1)

    def reward(self, responses: torch.Tensor, digits: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        """(B, response_len) responses -> (B,) float32 reward in [0, 1] (``kind`` defaults to the task's)."""
        if responses.shape != (digits.shape[0], self.response_len):
            raise ValueError(
                f"responses must have shape {(digits.shape[0], self.response_len)}, got {tuple(responses.shape)}"
            )
        right = responses == self.answers(digits)
        if (kind or self.reward_kind) == "exact":
            return right.all(dim=1).float()
        return right.float().mean(dim=1)
