"""The adapters' dump: one file per training step that ``rollout-correction diagnose DIR`` reads.

Each file is ``torch.save`` of a dict of CPU tensors in the plain layout the readers take with no
column flag:

=====================  ===========  =============================================================
key                    shape        content
=====================  ===========  =============================================================
``rollout_log_probs``  (B, T)       log π_rollout of the response tokens, in the dtype given
``old_log_probs``      (B, T)       log π_old (the trainer's) of the same tokens, dtype given
``response_mask``      (B, T) bool  the tokens the correction sees
``response_length``    (B,) int64   positions of each row's response (valid: mask ∧ position < it)
``policy_version``     (B,) int64   the trainer step that consumed the rows
=====================  ===========  =============================================================

named ``step_{step:06d}.pt`` (``step_{step:06d}_rank_{rank}.pt`` under ``torch.distributed``). The
tensors are copied to the CPU once per step, and the file is written under a temporary name and
renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

__all__ = ["StepDump", "dump_path", "write_step_dump"]


def _rank() -> Optional[int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return None


def dump_path(directory: str, step: int, rank: Optional[int] = None) -> str:
    name = f"step_{int(step):06d}" + ("" if rank is None else f"_rank_{int(rank)}") + ".pt"
    return os.path.join(os.fspath(directory), name)


def write_step_dump(directory: str, step: int, *, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                    response_mask: torch.Tensor, response_lengths: Optional[torch.Tensor] = None,
                    policy_version: Optional[int] = None, rank: Any = "auto") -> str:
    """Writes one step's (B, T) log-probs and mask; returns the path.

    response_lengths: (B,) positions of each row's response (default: one past the last masked-in
    position); policy_version: default ``step``; rank: ``"auto"`` (the ``torch.distributed`` rank
    when initialised), None, or an int.
    """
    if not (old_log_probs.shape == rollout_log_probs.shape == response_mask.shape) or old_log_probs.dim() != 2:
        raise ValueError(f"expected three (B, T) tensors of one shape, got {tuple(old_log_probs.shape)}, "
                         f"{tuple(rollout_log_probs.shape)}, {tuple(response_mask.shape)}")
    mask = response_mask.detach().to("cpu") != 0
    B, T = mask.shape
    if response_lengths is None:
        last = torch.where(mask, torch.arange(1, T + 1), 0)
        response_lengths = last.max(dim=1).values if T else torch.zeros(B, dtype=torch.int64)
    data = {
        "rollout_log_probs": rollout_log_probs.detach().to("cpu"),
        "old_log_probs": old_log_probs.detach().to("cpu"),
        "response_mask": mask,
        "response_length": response_lengths.detach().to("cpu", torch.int64).reshape(B),
        "policy_version": torch.full((B,), int(step if policy_version is None else policy_version), dtype=torch.int64),
    }
    os.makedirs(directory, exist_ok=True)
    path = dump_path(directory, step, _rank() if rank == "auto" else rank)
    tmp = path + ".tmp"
    torch.save(data, tmp)
    os.replace(tmp, path)
    return path


class StepDump:
    """Collects rows over the micro-batches of a step and writes them once (:func:`write_step_dump`).

    ``add`` copies a micro-batch's rows to the CPU (1-D per-row tensors or (B, T) tensors with a
    mask); ``flush(step)`` writes everything added since the last flush, padded to the longest row.
    """

    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        self._rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, old_log_probs, rollout_log_probs, response_mask) -> None:
        """(B, T) tensors, or sequences of 1-D per-row tensors of each row's length."""
        if isinstance(old_log_probs, torch.Tensor) and old_log_probs.dim() == 2:
            old_log_probs, rollout_log_probs, response_mask = (list(t.unbind(0)) for t in
                                                              (old_log_probs, rollout_log_probs, response_mask))
        rows = list(zip(old_log_probs, rollout_log_probs, response_mask))
        if not len(old_log_probs) == len(rollout_log_probs) == len(response_mask) == len(rows):
            raise ValueError(f"old_log_probs, rollout_log_probs and response_mask hold {len(old_log_probs)}, "
                             f"{len(rollout_log_probs)} and {len(response_mask)} rows; they must hold the same rows")
        for i, (o, r, m) in enumerate(rows):
            if not o.numel() == r.numel() == m.numel():  # never truncated or padded to fit (Megatron-LM #7015)
                raise ValueError(f"row {len(self._rows) + i} of this dump: the trainer's log-probs hold {o.numel()} "
                                 f"tokens, the engine's {r.numel()} and the response mask {m.numel()}; align them "
                                 "token by token before dumping")
        for o, r, m in rows:
            self._rows.append((o.detach().reshape(-1).to("cpu"), r.detach().reshape(-1).to("cpu"),
                               m.detach().reshape(-1).to("cpu") != 0))

    def flush(self, step: int, policy_version: Optional[int] = None) -> Optional[str]:
        """Writes the rows added since the last flush (nothing when there are none); returns the path."""
        if not self._rows:
            return None
        rows, self._rows = self._rows, []
        T = max(o.numel() for o, _, _ in rows)
        lengths = torch.tensor([o.numel() for o, _, _ in rows], dtype=torch.int64)

        def pad(i, dtype):
            out = torch.zeros(len(rows), T, dtype=dtype)
            for b, row in enumerate(rows):
                out[b, : row[i].numel()] = row[i]
            return out

        return write_step_dump(self.directory, step, old_log_probs=pad(0, rows[0][0].dtype),
                               rollout_log_probs=pad(1, rows[0][1].dtype), response_mask=pad(2, torch.bool),
                               response_lengths=lengths, policy_version=policy_version)
