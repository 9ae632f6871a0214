"""Agreement across the ranks of a group: at every call, every rank exchanges what the others do.

A collective pairs the ranks' values position by position, so the ranks of a group must exchange
the same layout (the statistics' slots), for the same settings (configuration, thresholds, row
counts). Under ``verify="always"`` (the default) this holds at every call, with no host sync in
correct use on a device:

* **The first exchange** of a kind (its first line, e.g. the call's name) on a group is agreed
  explicitly: one all-reduce (MAX of a fingerprint and its negation) read on the host. A mismatch
  raises :class:`LayoutMismatchError` on every rank, naming the ranks, the first differing line and
  who holds what. The group then records the agreed settings and layout of that kind.
* **Every later exchange** carries the agreement inside it: its sizes are the recorded layout's,
  and its MAX reduction carries, after the statistics, a fingerprint of this rank's settings (fp
  and −fp), whether they changed since the record (−changed), and a hash per line of the settings
  (h and −h). A rank knows on its host whether its own settings changed, so only a rank that
  changed reads the verdict (one sync; a change of every rank to the same settings is a new
  agreement, and a new layout is then exchanged once more). A rank whose layout changed sends the
  recorded layout's identities, so no collective ever pairs buffers of different sizes.
* **A mismatch** is raised at once on every rank where every rank reads the verdict (on the CPU,
  where a read is free; or when every rank changed). Otherwise (a device, some ranks unchanged)
  the call's weights and keep mask are multiplied by the device-side verdict, so a batch corrected
  with settings that differ across ranks is learned from by no rank (weights 0, mask 0), and every
  rank raises at its next exchange on the group (the verdict is copied to pinned host memory
  behind an event, never waited for within the call) or where the metrics are read as floats.
  Collectives that follow the statistics (M2PO, OPSM) run as the recorded settings say, so that a
  rank that changed still takes part in the others' collectives until the error.

Each kind of exchange (the first line of its description: the call, and whether the correction holds
advantages) keeps its own record, so that kinds can alternate on a group at no cost; the ranks of a
group must make the same kinds of call in the same order, which the record of a kind cannot check.

``verify="once"`` agrees on each (group, fingerprint) the first time it is seen and trusts it after:
faster, and unsafe under configurations that change between calls. The setting travels with the
call (:func:`verifying`, a context variable), never in module state.

Context-parallel row exchanges and the ``on_nonfinite="raise"`` check agree explicitly at every call
(their row counts are data, known only after an exchange): one host read per call, measured in
``benchmarks/bench_agreement.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

__all__ = ["LayoutMismatchError"]  # the rest is the machinery of stats.py and the entry points


class LayoutMismatchError(ValueError):
    """The ranks of a group are about to exchange different things (different configurations, row
    counts or partials): a positional collective would mis-pair or add unlike quantities."""


_VERIFY: contextvars.ContextVar[str] = contextvars.ContextVar("rollout_correction_verify", default="always")


@contextlib.contextmanager
def verifying(setting: str) -> Iterator[None]:
    """Run the block under ``setting`` ("always" or "once"), for this thread or task only."""
    token = _VERIFY.set(setting)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def verify_setting() -> str:
    """The verify setting of the current call."""
    return _VERIFY.get()


def fingerprint(lines: Sequence[str]) -> int:
    """A 50-bit hash of ``lines``, the same in every process (an exact float64 and int64 value)."""
    return int.from_bytes(hashlib.blake2b("\n".join(lines).encode(), digest_size=8).digest(), "little") >> 14


def _dist():
    import torch.distributed as dist

    return dist


def group_ranks(group: object) -> list[int]:
    """Global ranks of ``group`` (no communication)."""
    return list(_dist().get_process_group_ranks(group))


def group_device(group: object) -> torch.device:
    """The device of a collective on ``group``: this process's CUDA device under NCCL, else the CPU."""
    nccl = "nccl" in str(_dist().get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _per_group(table: "weakref.WeakKeyDictionary", group: object, default):
    """``table[group]`` (created from ``default()``), or a fresh value for a group that cannot be held weakly."""
    try:
        return table.setdefault(group, default())
    except TypeError:
        return default()


#: Per process group (held weakly: a destroyed group is not kept alive), the fingerprints agreed under "once".
_SEEN: "weakref.WeakKeyDictionary[object, set[int]]" = weakref.WeakKeyDictionary()


def agree(group: object, lines: list[str], name: str, device: Optional[torch.device] = None) -> None:
    """Confirm that every rank of ``group`` (``name`` in errors) is about to exchange the same ``lines``:
    one all-reduce (MAX of a fingerprint and its negation), read on the host, at every call (under
    ``verify="once"``: the first time a (group, lines) is seen). On a mismatch every rank raises
    :class:`LayoutMismatchError` naming the group's ranks, the first differing line and who holds what."""
    dist = _dist()
    fp = fingerprint(lines)
    seen = _per_group(_SEEN, group, set)
    if verify_setting() == "once" and fp in seen:
        return
    if device is None or device.type == "meta":
        device = group_device(group)
    both = torch.tensor([fp, -fp], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)  # (max, −min) of the fingerprints
    high, neg_low = both.tolist()
    if high == fp == -neg_low:
        seen.add(fp)
        return
    raise LayoutMismatchError(mismatch_message(group, name, lines, gather=True))


def mismatch_message(group: object, name: str, lines: Sequence[str], gather: bool = False,
                     differing: Sequence[int] = (), detail: str = "") -> str:
    """The error of a mismatch on ``group``: with ``gather`` (every rank is in this call) the lines of
    every rank are gathered and the first differing one named with who holds what; otherwise the
    lines at ``differing`` (indices of ``lines``) are named as this rank holds them."""
    ranks = group_ranks(group)
    head = f"the ranks of {name} {ranks} are about to exchange different things: "
    tail = (". A collective pairs the ranks' values position by position, so every rank must call with the same "
            "configuration (and max_segments), and every rank of a cp_group with the same rows in the same order")
    if gather:
        layouts: list = [None] * len(ranks)
        _dist().all_gather_object(layouts, list(lines), group=group)
        first = next(i for i in range(max(map(len, layouts)))
                     if len({lay[i] if i < len(lay) else None for lay in layouts}) > 1)
        holders: dict[str, list[int]] = {}
        for rank, lay in zip(ranks, layouts):
            holders.setdefault(lay[first] if first < len(lay) else "nothing", []).append(rank)
        sides = "; ".join(f"{line!r} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                          for line, rs in holders.items())
        return head + sides + tail
    named = ", ".join(repr(lines[i]) for i in differing if i < len(lines)) or "the layout of the statistics"
    return head + f"they differ in {named} (this rank {_dist().get_rank()} holds those){detail}" + tail


@dataclass
class Record:
    """What a group agreed on for one kind of exchange: the settings' lines and fingerprint, and the
    statistics' layout (sum names, max names)."""

    lines: tuple[str, ...]
    fp: int
    sums: tuple[str, ...]
    maxes: tuple[str, ...]


_RECORDS: "weakref.WeakKeyDictionary[object, dict[str, Record]]" = weakref.WeakKeyDictionary()


def recorded(group: object, kind: str) -> Optional[Record]:
    """The settings the ranks of ``group`` last agreed on for exchanges of ``kind``, if any."""
    return _per_group(_RECORDS, group, dict).get(kind)


def record(group: object, kind: str, value: Record) -> None:
    _per_group(_RECORDS, group, dict)[kind] = value


def forget(group: object) -> None:
    """Drop what ``group`` agreed on (after a mismatch, the next exchange agrees explicitly again)."""
    _per_group(_RECORDS, group, dict).clear()
    _per_group(_PENDING, group, list).clear()


class Verdict:
    """The agreement carried by one exchange on ``group`` (module docstring): this rank's settings'
    ``lines`` and fingerprint ``fp``, the group's ``agreed`` record, whether this rank ``changed`` from
    it, and ``vec``, the reduced verdict slots (fp, −fp, −changed, then h and −h per recorded line)."""

    def __init__(self, group: object, kind: str, lines: Sequence[str], fp: int, agreed: Record,
                 changed: bool) -> None:
        self.group, self.kind, self.lines, self.fp, self.agreed, self.changed = group, kind, list(lines), fp, agreed, changed
        self.vec: Optional[torch.Tensor] = None
        self.values: Optional[list[float]] = None  # the reduced slots on the host, once read
        self._host: Optional[torch.Tensor] = None
        self._event: object = None

    def slots(self, device: torch.device) -> torch.Tensor:
        """This rank's verdict slots for the MAX reduction (one hash per line of the record, so that a
        rank learns which settings differ; this rank's lines beyond the record's count are hashed together)."""
        n = len(self.agreed.lines)
        lines = self.lines[:n - 1] + ["\n".join(self.lines[n - 1:])] if n else []
        hashes = [float(fingerprint([x])) for x in lines] + [0.0] * (n - len(lines))
        values = [float(self.fp), -float(self.fp), -float(self.changed)] + [y for h in hashes for y in (h, -h)]
        return torch.tensor(values, dtype=torch.float64, device=device)

    def read(self) -> bool:
        """Whether every rank exchanged this rank's settings, read on the host (from the pinned copy
        behind its event when there is one: a wait on a past point of the stream, never on work queued
        after the exchange)."""
        if self.values is None:
            if self._event is not None:
                self._event.synchronize()
                self.values = self._host.tolist()
            else:
                self.values = self.vec.tolist()
        return self.values[0] == self.fp == -self.values[1]

    def everyone_read(self, free: bool) -> bool:
        """Whether every rank of the group read the verdict in this call (reads are free on this kind of
        device, or every rank changed its settings): the mismatch can then be raised at once everywhere."""
        return free or self.values[2] == -1.0

    def factor(self) -> torch.Tensor | float:
        """1 where the ranks agreed, else 0: a device tensor when the verdict is not known on the host."""
        if self.values is not None:
            return float(self.read())
        return ((self.vec[0] == self.fp) & (self.vec[1] == -self.fp)).to(torch.float32)

    def known_bad(self) -> bool:
        return self.values is not None and not self.read()

    def message(self) -> str:
        self.read()
        pairs = self.values[3:]
        differing = [i for i in range(len(pairs) // 2) if pairs[2 * i] != -pairs[2 * i + 1]]
        return mismatch_message(self.group, "dp_group", self.lines, differing=differing,
                                detail=f" in their exchange of {self.kind}")


#: Per group, the verdicts of earlier exchanges not yet known on the host (checked at its next exchange).
_PENDING: "weakref.WeakKeyDictionary[object, list[Verdict]]" = weakref.WeakKeyDictionary()


def defer(verdict: Verdict) -> None:
    """Keep ``verdict`` for the group's next exchange; a device verdict is copied to pinned memory
    behind an event, so that reading it then waits for nothing queued after this exchange. (A meta tensor
    holds no value to check.)"""
    if verdict.vec.device.type == "meta":
        return
    if verdict.values is None and verdict.vec.device.type == "cuda":
        verdict._host = torch.empty(verdict.vec.shape, dtype=torch.float64, pin_memory=True)
        verdict._host.copy_(verdict.vec, non_blocking=True)
        verdict._event = torch.cuda.Event()
        verdict._event.record()
    _per_group(_PENDING, verdict.group, list).append(verdict)


def latest(group: Optional[object]) -> Optional[Verdict]:
    """The last verdict of ``group`` not yet checked (None without a group or without one)."""
    pending = _per_group(_PENDING, group, list) if group is not None else []
    return pending[-1] if pending else None


def check_pending(group: object) -> None:
    """Raise the mismatch of an earlier exchange on ``group`` that was not known on the host then."""
    pending = _per_group(_PENDING, group, list)
    while pending:
        verdict = pending.pop(0)
        if not verdict.read():
            forget(group)
            raise LayoutMismatchError(verdict.message() + " (found at this rank's next exchange on the group; "
                                      "that call's weights and mask were zeroed on every rank)")


def agreed_setting(verdict: Optional[Verdict], key: str, local: object) -> object:
    """The value of the setting ``key`` that the collectives after an exchange must follow: this rank's
    ``local`` one, or the recorded one's (its ``key=...`` line) when this rank's settings are known to
    differ from the group's."""
    if verdict is None or not verdict.known_bad():
        return local
    prefix = key + "="
    line = next((x for x in verdict.agreed.lines if x.startswith(prefix)), None)
    return None if line is None or line == prefix + "None" else line[len(prefix):]
