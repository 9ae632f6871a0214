"""Sequences split across the ranks of a group (context / sequence parallelism).

Each rank of the group holds a part of every sequence (Megatron's contiguous or "zig-zag" chunks
r and 2·CP−1−r; Ulysses / verl sequence parallelism). The correction is defined per sequence, so
per-sequence reductions span the group, with one collective of O(B) scalars per call:

1. **Collect pass.** The computation runs on the local tokens; every per-sequence reduction goes
   through a :class:`RowExchange`, which records the local (B,) partial and hands it back
   unchanged as a placeholder.
2. **Exchange.** The partials are packed into one (B, k) float64 tensor and all-gathered over the
   group; each rank adds (sums) or takes the maximum (maxima, minima, "any") locally.
3. **Replay pass.** The computation runs again; each reduction now returns the group's value, so
   every decision and every per-token output is the one of the unsplit computation.

A partial must be a function of this rank's tokens only (never of another reduced value); rows
dropped in the replay pass get this rank's own value. Every valid token of a sequence must be held
by exactly one rank, and every rank must hold the same B sequences in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Iterator, Optional, Sequence

import torch

from .agreement import _dist, agree, group_ranks
from .stats import SufficientStats

__all__ = ["RowExchange", "group_ranks", "stats_owner", "check_sequence_group", "reduce_owned", "raise_nonfinite",
           "raise_nonfinite_on_any_rank"]


def describe(call: str, config: object = None, **settings: object) -> list[str]:
    """What a call exchanges, as the lines its ranks agree on: the call, every field of its
    configuration (a dataclass) and the other settings that decide the partials."""
    fields = [f.name for f in dataclasses.fields(config) if f.init] if config is not None else []
    return [call] + [f"{k}={getattr(config, k)!r}" for k in fields] + [f"{k}={v!r}" for k, v in settings.items()]


def check_sequence_group(sequence_group: object) -> None:
    """Raise a clear error unless ``sequence_group`` is usable (initialised, this rank in it)."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("sequence_group needs torch.distributed to be initialised "
                         "(init_process_group) before the call; pass sequence_group=None for whole sequences")
    if dist.get_rank() not in group_ranks(sequence_group):
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of sequence_group "
                         f"{group_ranks(sequence_group)}; pass the group that splits this rank's sequences "
                         "(e.g. Megatron's mpu.get_context_parallel_group())")


def stats_owner(sequence_group: object, process_group: Optional[object]) -> Optional[bool]:
    """Whether this rank's batch statistics enter the reduction over ``process_group``: after the
    exchange every rank of ``sequence_group`` holds the same per-sequence values, so a statistic is
    counted on one rank of the group only. None without ``process_group`` (the sequence group holds
    the whole batch); True when ``process_group`` holds no other rank of ``sequence_group`` (data
    parallel without CP, ``mpu.get_data_parallel_group()``); True on the group's first rank only when
    it holds all of it (``mpu.get_data_parallel_group(with_context_parallel=True)``). A partial
    overlap cannot give whole-batch statistics and raises ValueError.
    """
    if process_group is None:
        return None
    me = _dist().get_rank()
    seq = set(group_ranks(sequence_group))
    dp = set(group_ranks(process_group))
    if me not in dp:
        raise ValueError(f"this rank ({me}) is not a member of process_group {sorted(dp)}")
    common = seq & dp
    if common == {me}:
        return True
    if seq <= dp:
        return me == min(seq)
    raise ValueError(
        f"process_group {sorted(dp)} contains some but not all ranks of sequence_group {sorted(seq)}; pass the "
        "data-parallel group without context parallelism (one rank per sequence group, e.g. "
        "mpu.get_data_parallel_group()) or the one with it (all ranks holding a part of the batch, e.g. "
        "mpu.get_data_parallel_group(with_context_parallel=True))")


def reduce_owned(stats: SufficientStats, process_group: Optional[object], owner: Optional[bool],
                 what: Sequence[str] = ("statistics",)) -> SufficientStats:
    """``stats`` reduced over ``process_group``, counted once per sequence (``owner``: stats_owner);
    ``what`` as for :meth:`SufficientStats.all_reduce`."""
    sums, maxes = stats.sums, stats.maxes
    if owner is False:  # another rank of the sequence group counts these sequences
        sums = {k: torch.zeros_like(v) for k, v in sums.items()}
        maxes = {k: torch.full_like(v, -torch.inf) for k, v in maxes.items()}
    return SufficientStats.from_values(sums, maxes).all_reduce(process_group if owner is not None else None, what)


def raise_nonfinite(bad_rows: torch.Tensor, what: str = "log-prob") -> None:
    """``on_nonfinite="raise"`` with split rows: raised on every rank of the group alike (after the
    exchange, so that no rank is left waiting in it)."""
    if bool(bad_rows.any()):
        b = int(bad_rows.nonzero()[0, 0])
        raise ValueError(f"non-finite {what} at a valid position of row {b} (on this rank or another rank of "
                         "sequence_group; |log-ratio| ≥ 1e30 counts as non-finite); fix the producer, or set "
                         "on_nonfinite='reject' to drop such rows")


def _multi_rank(group: Optional[object]) -> bool:
    return group is not None and _dist().get_world_size(group) > 1


def raise_nonfinite_on_any_rank(bad: torch.Tensor, what: str, process_group: Optional[object],
                                sequence_group: Optional[object]) -> None:
    """``on_nonfinite="raise"`` over groups of several ranks: ``bad`` is this rank's (B, T) "non-finite
    at a valid position". Every rank of both groups raises alike when any has one (the rank holding
    it names the position): one all-reduce per multi-rank group and one host read."""
    seq, dp = _multi_rank(sequence_group), _multi_rank(process_group)
    if not (seq or dp):
        return
    for group, name in ((sequence_group, "cp_group"), (process_group, "dp_group")):
        if _multi_rank(group):  # agreed first: a rank that skips this check is met by its own agreement
            agree(group, [f"on_nonfinite='raise': the {what}"], name, bad.device)
    dist = _dist()
    none = torch.iinfo(torch.int64).max
    rows = torch.arange(bad.shape[0], device=bad.device)
    first = torch.where(bad.any(-1), rows, none).amin().reshape(1) if bad.numel() else rows.new_full((1,), none)
    group_row = first.clone()  # the first bad row of the sequence group (its ranks hold the same rows)
    if seq:
        dist.all_reduce(group_row, op=dist.ReduceOp.MIN, group=sequence_group)
    anywhere = (group_row < none).long()
    if dp:
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=process_group)
    here, group_row, anywhere = torch.cat([first, group_row, anywhere]).tolist()
    if here != none:
        b, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"non-finite {what} at valid position (row {b}, column {t}) on this rank "
                         "(|log-ratio| ≥ 1e30 counts as non-finite); every rank of the group raises too. Fix the "
                         "producer, or set on_nonfinite='reject' to drop such rows")
    if group_row != none:
        raise ValueError(f"non-finite {what} at a valid position of row {group_row} on another rank of "
                         "sequence_group; fix the producer, or set on_nonfinite='reject' to drop such rows")
    if anywhere:
        raise ValueError(f"non-finite {what} at a valid position on another rank of the process or sequence "
                         "group (that rank names it); fix the producer, or set on_nonfinite='reject' to drop such "
                         "rows")


class RowExchange:
    """Per-sequence reductions across ``group`` in two passes with one collective (module docstring)::

        ex = RowExchange(group)
        for _ in ex.passes():          # collect pass, one all_gather, replay pass
            n = ex.sum(mask.sum(-1))   # (B,) partial in, (B,) group value out (final in the replay pass)

    ``group`` None makes every reduction the identity (a single pass, no communication). Before the
    all_gather the ranks agree (:func:`~rollout_correction_core._src.stats.agree`) on ``what`` (the
    call and its configuration), the row count and the partials; a rank without rows takes part too.
    ``families``: the statistic families read from these rows; a log-ratio batch over them takes what a
    dropped row keeps (``sentinel``'s count, ``expect_zero``'s gap; both by default) before dropping it.
    """

    def __init__(self, group: Optional[object], what: Sequence[str] = (),
                 families: Collection[str] = ("sentinel", "expect_zero")) -> None:
        self.group, self.what, self.families = group, list(what), families
        self.mode = "local" if group is None else "collect"
        self._parts: list[tuple[str, torch.Tensor]] = []
        self._values: list[torch.Tensor] = []
        self._next = 0
        self.dropped: Optional[torch.Tensor] = None

    @property
    def final(self) -> bool:
        """True in the pass whose results count (replay, or the only pass without a group)."""
        return self.mode != "collect"

    def passes(self) -> Iterator[str]:
        yield self.mode
        if self.mode == "local":
            return
        self._exchange()
        self.mode = "replay"
        self.dropped = None
        yield self.mode
        if self._next != len(self._values):
            raise RuntimeError("sequence-group replay made fewer reductions than the collect pass")

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        """Group sum of a per-row partial sum (B,), or of k of them stacked (k, B)."""
        return self._op("sum", partial)

    def max(self, partial: torch.Tensor) -> torch.Tensor:
        """Group maximum of a per-row partial maximum (B,) (bool: "any")."""
        return self._op("max", partial)

    def min(self, partial: torch.Tensor) -> torch.Tensor:
        """Group minimum of a per-row partial minimum (B,)."""
        return -self._op("max", -partial)

    def drop(self, rows: torch.Tensor) -> None:
        """Rows (B,) bool excluded from here on: their reductions return the local value."""
        if self.mode == "replay":
            self.dropped = rows if self.dropped is None else self.dropped | rows

    def _op(self, op: str, partial: torch.Tensor) -> torch.Tensor:
        if self.mode == "local":
            return partial
        if self.mode == "collect":
            self._parts.append((op, partial))
            return partial
        if self._next >= len(self._values):
            raise RuntimeError("sequence-group replay made more reductions than the collect pass")
        op0, value = self._parts[self._next][0], self._values[self._next]
        self._next += 1
        if op0 != op or value.shape != partial.shape:
            raise RuntimeError("sequence-group replay does not match the collect pass "
                               f"({op0} {tuple(value.shape)} recorded, {op} {tuple(partial.shape)} asked)")
        out = value.to(partial.dtype)
        if self.dropped is not None:
            out = torch.where(self.dropped, partial, out)
        return out

    def _exchange(self) -> None:
        dist = _dist()
        B = self._parts[0][1].shape[-1] if self._parts else 0
        for _, p in self._parts:
            if p.dim() not in (1, 2) or p.shape[-1] != B:
                raise RuntimeError(f"per-row partials must be (B,) or (k, B) with B = {B}, got {tuple(p.shape)}")
        device = self._parts[0][1].device if self._parts else None
        agree(self.group, self.what + [f"rows {B}", "partials " + " ".join(
            f"{op}{'' if p.dim() == 1 else p.shape[0]}" for op, p in self._parts)], "cp_group", device)
        if B == 0 or not self._parts:  # agreed: no rank has rows (or partials), every reduction is empty
            self._values = [p.detach() for _, p in self._parts]
            return
        columns = [p.detach().reshape(-1, B) for _, p in self._parts]  # (k, B) each: k columns of the exchange
        packed = torch.cat([c.to(device=device, dtype=torch.float64) for c in columns]).T
        world = dist.get_world_size(self.group)
        out = torch.empty((world * B, packed.shape[1]), dtype=packed.dtype, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, packed.contiguous(), group=self.group)
        out = out.view(world, B, packed.shape[1])
        # Both reductions are taken whole and sliced per column (a host-built mask would sync).
        ops = {op for op, _ in self._parts}
        reduced = {"sum": out.sum(0).T if "sum" in ops else None,
                   "max": out.amax(0).T if "max" in ops else None}  # (columns, B) each
        self._values = []
        i = 0
        for (op, p), c in zip(self._parts, columns):
            self._values.append(reduced[op][i:i + c.shape[0]].reshape(p.shape))
            i += c.shape[0]
