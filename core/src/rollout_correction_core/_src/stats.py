"""Sufficient statistics that reduce exactly across ranks and chunks.

Every batch-level number the library reports is a function of a few named **sums** and **maxima**
(a minimum is stored as the maximum of the negated value). Sums add and maxima take the max,
whether the parts are data-parallel ranks or streamed chunks, so the derived numbers do not
depend on how the batch was split. All values live in one packed float64 vector: reducing over a
process group takes two collectives (SUM, MAX), reading every value on the host one copy.

The **layout** of that vector is the declaration's (:mod:`.declared`): the recorded statistics,
sums then maxima, in declared order, whatever rows, segments or shapes a rank holds. A rank with
nothing in a slot contributes the reduction's identity (0 for a sum, −inf for a maximum). Every
reduction over a process group is agreed across its ranks, at every call (:mod:`.agreement`): a
mismatch of layout or settings raises :class:`LayoutMismatchError` on every rank.

Values are derived by plain functions that work on :class:`SufficientStats` (0-d device tensors,
no sync) and on :class:`HostStats` (Python floats in float64) alike: ``safe_div``, ``where``,
``sqrt0``, ``exp``, ``clamp``, ``maximum`` below accept both.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Optional, Sequence, Union

import torch

from .agreement import (LayoutMismatchError, Record, Verdict, agree, check_pending, defer, fingerprint, forget,
                        group_device, mismatch_message, record, recorded, verify_setting)
from .constants import warn_deprecated
from .declared import Family, Stat, position

__all__ = ["SufficientStats", "HostStats", "LayoutMismatchError", "Value", "safe_div", "seq_summary", "where", "sqrt0", "exp", "clamp", "maximum"]

Value = Union[torch.Tensor, float]


class _Part:
    __slots__ = ("kind", "name", "value", "rows", "weight", "key")

    def __init__(self, kind: str, name: str, value: torch.Tensor, rows: Optional[torch.Tensor],
                 weight: Optional[torch.Tensor]) -> None:
        self.kind, self.name, self.rows, self.weight = kind, name, rows, weight
        self.value = value.detach() if value.requires_grad else value
        self.key = (kind != "sum", position(name))  # its slot: sums, then maxima and minima, as declared


_CONSTANTS: dict = {}


def device_constant(values: tuple, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A small constant tensor on ``device``, made once per device in eager mode (a copy from the
    host waits for the device) and inside the graph under torch.compile. Never written to."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)
    key = (values, device, dtype)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return _CONSTANTS[key]


def _reduce_shape(parts: list[_Part]) -> torch.Tensor:
    """Parts of one shape, in slot order, reduced to (K + M,) float64: the sums, then the maxima (a
    minimum as the maximum of −x). Computed in an order where every negation, weight and restriction
    (found by identity) applies to one slice: sums (unrestricted, then by restriction and weight),
    maxima (unrestricted, then by restriction), minima (by restriction in reverse, then unrestricted)."""
    masks = {id(p.rows): i for i, p in enumerate(parts) if p.rows is not None}

    def rank(p: _Part) -> tuple:
        r = -1 if p.rows is None else masks[id(p.rows)]
        if p.kind == "sum":
            return 0, r, -1 if p.weight is None else id(p.weight)
        return (1, r) if p.kind == "max" else (2, -r if r >= 0 else -len(parts) - 1)

    order = sorted(range(len(parts)), key=lambda i: rank(parts[i]))
    ordered = [parts[i] for i in order]
    stacked = torch.stack([p.value for p in ordered])  # one copy; dtypes promote (bool < float32 < float64)
    stacked = (stacked if stacked.dtype == torch.float64 else stacked.to(torch.float64)).reshape(len(parts), -1)
    ns, nx = (sum(p.kind == k for p in parts) for k in ("sum", "max"))
    if ns + nx < len(parts):
        stacked[ns + nx:].neg_()
    for a, b, p in _runs(ordered, lambda p: (p.kind == "sum", id(p.weight), p.weight is None)):
        if p.weight is not None:
            stacked[a:b].mul_(p.weight.reshape(1, -1))
    for a, b, p in _runs(ordered, lambda p: (id(p.rows), p.rows is None)):
        if p.rows is not None:  # outside ``rows``: 0 in a sum, −inf in a maximum (or negated minimum)
            fill = device_constant(tuple(0.0 if q.kind == "sum" else -math.inf for q in ordered[a:b]), stacked.device)
            torch.where(p.rows.reshape(1, -1), stacked[a:b], fill.reshape(-1, 1), out=stacked[a:b])
    ext = stacked[ns:]
    vm = ext.amax(1) if ext.shape[1] else ext.new_full((ext.shape[0],), -math.inf)
    reduced = torch.cat((stacked[:ns].sum(1), vm))
    # Back to slot order with one copy: the runs of consecutive slots that sit together in ``reduced``.
    at = {i: j for j, i in enumerate(order)}
    pieces: list[list[int]] = []
    for i in range(len(parts)):
        if pieces and at[i] == pieces[-1][1]:
            pieces[-1][1] += 1
        else:
            pieces.append([at[i], at[i] + 1])
    return reduced if len(pieces) == 1 else torch.cat([reduced[a:b] for a, b in pieces])


def _runs(parts: list[_Part], key) -> list[tuple[int, int, _Part]]:
    """Maximal runs [a, b) of consecutive parts with equal ``key(part)``, with the run's first part."""
    out: list[tuple[int, int, _Part]] = []
    for i, p in enumerate(parts):
        if out and key(out[-1][2]) == key(p):
            out[-1] = (out[-1][0], i + 1, out[-1][2])
        else:
            out.append((i, i + 1, p))
    return out


def _reduced_alone(p: _Part) -> torch.Tensor:
    """One part reduced to a 0-d float64 tensor (a minimum as the maximum of −x), with the arithmetic
    of :func:`_reduce_shape`."""
    x = p.value.to(torch.float64)
    x = x.neg() if p.kind == "min" else x
    x = x * p.weight if p.weight is not None else x
    if p.kind == "sum":
        return (x if p.rows is None else torch.where(p.rows, x, 0.0)).sum()
    if not x.numel():
        return torch.full((), -math.inf, dtype=torch.float64, device=x.device)
    return (x if p.rows is None else torch.where(p.rows, x, -math.inf)).amax()


def _slot_lines(sum_names, max_names) -> list[str]:
    return [f"sum {n}" for n in sum_names] + [f"min {n[1:]}" if n.startswith("-") else f"max {n}" for n in max_names]


def _exchange(packed: torch.Tensor, k: int, group: object) -> torch.Tensor:
    """SUM over ``group`` of ``packed[:k]`` and MAX of the rest, in place (−inf carried through the MAX)."""
    import torch.distributed as dist

    if k:
        dist.all_reduce(packed[:k], op=dist.ReduceOp.SUM, group=group)
    if packed.numel() > k:
        # -inf is not transported reliably by every backend; use the float64 lowest value.
        lowest = torch.finfo(torch.float64).min
        maxes = packed[k:]
        maxes.clamp_min_(lowest)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        maxes.masked_fill_(maxes <= lowest, -math.inf)
    return packed


def reads_are_free(device: torch.device) -> bool:
    """Whether the host reads a value of ``device`` without a device sync (eager, on the CPU)."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


def _slot_name(reading: object, stat: Stat, method: str) -> str:
    """The slot name of ``stat``; a plain name (0.2's form, deprecated) is its own slot name."""
    if isinstance(stat, str):
        method = f"{type(reading).__name__}.{method}"
        warn_deprecated(f"{method}(name)", f"{method}(stat) with a declared Stat", stacklevel=4)
        return stat
    return stat.name


def _declared(name: str, reduce: str) -> Stat:
    """0.2's ``add_<reduce>(name, ...)`` (deprecated): the :class:`Stat` ``name``, declared at its first
    use when the library does not declare it (its slot then follows the slots declared before)."""
    warn_deprecated(f"SufficientStats.add_{reduce}(name, ...)", "SufficientStats.add(stat, ...) with a Stat "
                    "declared by reductions.Family", stacklevel=4)
    try:
        position(name)
    except ValueError:
        kind = {"sum": "sums", "max": "maxes", "min": "mins"}[reduce]
        Family("", **{kind: name})
    return Stat(name, reduce)


class _Reading:
    """The value of a declared :class:`Stat` over the ``sums`` and ``maxes`` mappings."""

    def sum(self, stat: Stat) -> Value:
        return self.sums[_slot_name(self, stat, "sum")]

    def max(self, stat: Stat) -> Value:
        return self.maxes[_slot_name(self, stat, "max")]

    def min(self, stat: Stat) -> Value:
        return -self.maxes["-" + _slot_name(self, stat, "min")]

    def has(self, stat: Stat) -> bool:
        """Whether ``stat`` was recorded."""
        key = "-" + stat.name if stat.reduce == "min" else stat.name
        return key in (self.sums if stat.reduce == "sum" else self.maxes)


class SufficientStats(_Reading):
    """Declared float64 sums and maxima, with exact merge and all-reduce.

    ``add(stat, x)`` records a tensor of any shape for a declared :class:`Stat` (its elements are
    summed, maxed or minned); ``rows=`` (bool, same shape) keeps only those elements, ``weight=``
    (same shape) multiplies them first (sums only). Adding again accumulates. An empty maximum is
    ``-inf``: derivations check the matching count first. Parts are reduced lazily, one stacked
    tensor per shape, on the first read.
    """

    def __init__(self) -> None:
        self._parts: list[_Part] = []
        self._sum_names: list[str] = []
        self._max_names: list[str] = []
        self._vec: Optional[torch.Tensor] = None  # (K + M,) float64: sums, then maxima
        self._views: Optional[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = None
        self.verdict: Optional[Verdict] = None  # an agreement across ranks not known on the host (:mod:`.agreement`)

    @classmethod
    def from_values(cls, sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor]) -> "SufficientStats":
        """Statistics whose values are already reduced (0-d tensors, e.g. returned by a compiled pass)."""
        out = cls()
        values = [v.reshape(()) for v in (*sums.values(), *maxes.values())]
        if values:
            out._set(list(sums), list(maxes), torch.stack(values).double())
        return out

    @classmethod
    def from_vector(cls, declared: list, sums: torch.Tensor) -> "SufficientStats":
        """Statistics holding the already reduced sums ``sums`` ((K,) float64) of ``declared`` (sum
        :class:`Stat` objects, or names), in order."""
        out = cls()
        out._set([getattr(s, "name", s) for s in declared], [], sums.double())
        return out

    @classmethod
    def joined(cls, blocks: list["SufficientStats"]) -> "SufficientStats":
        """The statistics of consecutive blocks of rows recorded by the same code: each statistic's
        values concatenated, so that one reduction covers every block, as if they were one."""
        if len(blocks) == 1:
            return blocks[0]
        parts = list(zip(*(b._parts for b in blocks)))
        if len({len(b._parts) for b in blocks}) > 1 or any(p.name != ps[0].name for ps in parts for p in ps):
            return functools.reduce(cls.merge, blocks, cls())  # recorded differently: merged by name
        cache: dict[tuple, torch.Tensor] = {}  # restrictions and weights shared in every block stay shared

        def join(xs: list) -> Optional[torch.Tensor]:
            key = tuple(map(id, xs))
            if xs[0] is not None and key not in cache:
                cache[key] = torch.cat([x.reshape(-1) for x in xs])
            return cache.get(key)

        groups: dict[tuple, list[int]] = {}  # values of one shape in every block: a stack per block, one cat
        for i, ps in enumerate(parts):
            groups.setdefault(tuple(p.value.shape for p in ps), []).append(i)
        values: dict[int, torch.Tensor] = {}
        for idx in groups.values():  # (dtypes promote exactly: bool < float32 < float64)
            per_block = [torch.stack([parts[i][k].value for i in idx]).reshape(len(idx), -1) for k in range(len(blocks))]
            values.update(zip(idx, torch.cat(per_block, dim=1).unbind()))
        out = cls()
        out._parts = [_Part(ps[0].kind, ps[0].name, values[i], join([p.rows for p in ps]), join([p.weight for p in ps]))
                      for i, ps in enumerate(parts)]
        return out

    def add(self, stat: Stat, value: torch.Tensor, rows: Optional[torch.Tensor] = None,
            weight: Optional[torch.Tensor] = None) -> None:
        """Record ``value`` (any shape; its elements reduce by ``stat.reduce``), restricted to ``rows``
        and, for a sum, multiplied by ``weight`` first."""
        if weight is not None and stat.reduce != "sum":
            raise ValueError(f"{stat.name}: only a sum takes a weight")
        name = "-" + stat.name if stat.reduce == "min" else stat.name
        self._parts.append(_Part(stat.reduce, name, value, rows, weight))

    # 0.2's recording by name, deprecated since 0.3 and removed in 0.4: add() with a declared Stat.
    def add_sum(self, name: str, value: torch.Tensor, rows: Optional[torch.Tensor] = None,
                weight: Optional[torch.Tensor] = None) -> None:
        """Deprecated (removed in 0.4): :meth:`add` with a declared sum :class:`Stat`."""
        self.add(_declared(name, "sum"), value, rows, weight)

    def add_max(self, name: str, value: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        """Deprecated (removed in 0.4): :meth:`add` with a declared max :class:`Stat`."""
        self.add(_declared(name, "max"), value, rows)

    def add_min(self, name: str, value: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        """Deprecated (removed in 0.4): :meth:`add` with a declared min :class:`Stat`."""
        self.add(_declared(name, "min"), value, rows)

    def _set(self, sum_names: list[str], max_names: list[str], vec: Optional[torch.Tensor]) -> None:
        self._sum_names, self._max_names, self._vec = sum_names, max_names, vec
        self._views = None

    def _accumulate(self, names_s: list[str], names_m: list[str], vec: torch.Tensor) -> None:
        """Add (sums) or max (maxima) a packed vector into this object's packed vector."""
        ns = len(names_s)
        if self._vec is None and len(set(names_s)) == ns and len(set(names_m)) == len(names_m):
            self._set(names_s, names_m, vec)
            return
        if self._vec is not None and names_s == self._sum_names and names_m == self._max_names:
            both = (self._vec[:ns] + vec[:ns], torch.maximum(self._vec[ns:], vec[ns:]))
            self._set(names_s, names_m, torch.cat(both))
            return
        # different names (or one recorded twice): combine by name, in the declared order
        merged_s: dict[str, torch.Tensor] = {}
        merged_m: dict[str, torch.Tensor] = {}
        sources = [(names_s, names_m, vec)]
        if self._vec is not None:
            sources.insert(0, (self._sum_names, self._max_names, self._vec))
        for s_names, m_names, v in sources:
            values = v.unbind()
            for n, x in zip(s_names, values[:len(s_names)]):
                merged_s[n] = merged_s[n] + x if n in merged_s else x
            for n, x in zip(m_names, values[len(s_names):]):
                merged_m[n] = torch.maximum(merged_m[n], x) if n in merged_m else x
        layout_s, layout_m = sorted(merged_s, key=position), sorted(merged_m, key=position)
        values = [merged_s[n] for n in layout_s] + [merged_m[n] for n in layout_m]
        self._set(layout_s, layout_m, torch.stack(values))

    def _settle(self) -> None:
        if not self._parts:
            return
        shapes: dict[tuple, list[_Part]] = {}
        for p in self._parts:
            shapes.setdefault((tuple(p.value.shape), p.value.device), []).append(p)
        self._parts = []
        # Parts of one shape reduce together, in the declared slot order (never the shapes').
        into = self if len(shapes) == 1 else SufficientStats()
        for g in shapes.values():
            g.sort(key=lambda p: p.key)
            vec = _reduce_shape(g).to(next(iter(shapes))[1])
            sums = [p.name for p in g if p.kind == "sum"]  # first in slot order
            into._accumulate(sums, [p.name for p in g[len(sums):]], vec)
        if into is not self:
            self._accumulate(into._sum_names, into._max_names, into._vec)

    def each_reduced(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(sums, maxima): each statistic recorded so far reduced on its own to a 0-d float64 tensor, by
        name in slot order (what :meth:`from_values` reads). A compiled pass returns these: the compiler
        fuses the reductions of one size into one loop, where a stacked vector costs a copy per value."""
        values: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        # sorted (key, index) pairs, not a key function: torch 2.4's compiler fails on one in a resumed frame
        for _, i in sorted((p.key, i) for i, p in enumerate(self._parts)):
            p = self._parts[i]
            into, x = values[p.kind != "sum"], _reduced_alone(p)
            into[p.name] = x if p.name not in into else (
                into[p.name] + x if p.kind == "sum" else torch.maximum(into[p.name], x))
        return values

    def packed_vector(self) -> tuple[list[str], list[str], Optional[torch.Tensor]]:
        """(sum names, max names, (K + M,) float64 vector: the sums, then the maxima)."""
        self._settle()
        return self._sum_names, self._max_names, self._vec

    def _named(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        self._settle()
        if self._views is None:
            values = self._vec.unbind() if self._vec is not None else ()
            k = len(self._sum_names)
            self._views = (dict(zip(self._sum_names, values[:k])), dict(zip(self._max_names, values[k:])))
        return self._views

    @property
    def sums(self) -> dict[str, torch.Tensor]:
        return self._named()[0]

    @property
    def maxes(self) -> dict[str, torch.Tensor]:
        return self._named()[1]

    def merge(self, other: "SufficientStats") -> "SufficientStats":
        """Accumulate ``other`` into ``self`` (sums add, maxima take the max)."""
        self._settle()
        names_s, names_m, vec = other.packed_vector()
        if vec is not None:
            self._accumulate(list(names_s), list(names_m), vec)
        return self

    def all_reduce(self, process_group: Optional[object] = None,
                   what: Sequence[str] = ("statistics",)) -> "SufficientStats":
        """Reduce in place over ``process_group`` with one SUM and one MAX collective, agreed across its
        ranks at every call (:mod:`.agreement`). ``what``: the exchange's kind (its first line, e.g. the
        call) and the settings that decide the values (configuration, thresholds), as lines."""
        import torch.distributed as dist

        if process_group is None or not (dist.is_available() and dist.is_initialized()):
            return self
        self._settle()
        check_pending(process_group)
        device = self._vec.device if self._vec is not None else group_device(process_group)
        what = list(what)
        lines = what + _slot_lines(self._sum_names, self._max_names)
        fp, kind = fingerprint(lines), what[0]
        agreed = recorded(process_group, kind) if verify_setting() == "always" else None
        if agreed is None:  # the first exchange of its kind, or verify="once": agreed explicitly
            agree(process_group, lines, "dp_group", device)
            if verify_setting() == "always":
                record(process_group, kind, Record(tuple(what), fp, tuple(self._sum_names), tuple(self._max_names)))
            if self._vec is not None:
                self._set(self._sum_names, self._max_names, _exchange(self._vec.clone(), len(self._sum_names),
                                                                      process_group))
            return self
        own = (tuple(self._sum_names), tuple(self._max_names)) == (agreed.sums, agreed.maxes)
        k, m = len(agreed.sums), len(agreed.maxes)
        body = self._vec if own and self._vec is not None else torch.tensor(
            [0.0] * k + [-math.inf] * m, dtype=torch.float64, device=device)
        verdict = Verdict(process_group, kind, what, fp, agreed, changed=fp != agreed.fp)
        packed = _exchange(torch.cat((body, verdict.slots(device))), k, process_group)
        verdict.vec = packed[k + m:]
        if (verdict.changed and device.type != "meta") or reads_are_free(device):  # free, or its own change
            if verdict.read():
                if verdict.changed:  # every rank changed to the same settings: the group agrees on them
                    record(process_group, kind, Record(tuple(what), fp, tuple(self._sum_names),
                                                       tuple(self._max_names)))
                    if not own:  # the new layout, exchanged once more by every rank
                        return self.all_reduce(process_group, what)
                self._set(self._sum_names, self._max_names, packed[:k + m])
                return self
            if verdict.everyone_read(reads_are_free(device)):
                forget(process_group)
                raise LayoutMismatchError(mismatch_message(process_group, "dp_group", lines, gather=True))
        elif own:
            self._set(self._sum_names, self._max_names, packed[:k + m])
        defer(verdict)  # a mismatch not yet known here: the outputs are zeroed by it, and it is raised later
        self.verdict = verdict
        return self


class HostStats(_Reading):
    """Python floats read like :class:`SufficientStats`, so every derivation runs on both."""

    def __init__(self, sums: dict[str, float], maxes: dict[str, float]) -> None:
        self.sums, self.maxes = sums, maxes


# -- deriving values from reduced statistics (0-d tensors or Python floats) ------------------
def safe_div(num: Value, den: Value) -> Value:
    """num / den, or 0 when den == 0 (a statistic over an empty set is reported as 0)."""
    if isinstance(num, torch.Tensor) or isinstance(den, torch.Tensor):
        den = torch.as_tensor(den, dtype=torch.float64)
        return torch.where(den > 0, num / den.clamp_min(1e-300), 0.0)
    return num / den if den > 0 else 0.0


def where(cond, a: Value, b: Value) -> Value:
    """``a`` where ``cond`` holds, else ``b``."""
    if isinstance(cond, torch.Tensor):
        return torch.where(cond, a, b)
    return a if cond else b


def sqrt0(x: Value) -> Value:
    """sqrt(max(x, 0))."""
    return x.clamp_min(0).sqrt() if isinstance(x, torch.Tensor) else math.sqrt(max(x, 0.0))


def exp(x: Value) -> Value:
    """exp(x) (x must be bounded: callers clamp first)."""
    return x.exp() if isinstance(x, torch.Tensor) else math.exp(x)


def clamp(x: Value, lo: Optional[float] = None, hi: Optional[float] = None) -> Value:
    if isinstance(x, torch.Tensor):
        return x.clamp(lo, hi)
    return min(max(x, -math.inf if lo is None else lo), math.inf if hi is None else hi)


def maximum(a: Value, b: Value) -> Value:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def seq_summary(stats, family, n_rows: Value, center: float) -> dict[str, Value]:
    """mean, unbiased std, max, min and max |x − center| of the per-row values recorded as the
    ``family``'s ``seq_sum``, ``seq_sum2``, ``seq_max`` and ``seq_min``; all 0 when ``n_rows`` is 0,
    std 0 when it is 1. (0.2's ``key``, a name, deprecated: the statistics ``<key>_sum``, ``_sum2``, …)"""
    if isinstance(family, str):
        warn_deprecated("seq_summary(stats, key, ...)", "seq_summary(stats, family, ...) with a Family that "
                        "declares seq_sum, seq_sum2, seq_max and seq_min")
        family = SimpleNamespace(**{f"seq_{k}": Stat(f"{family}_{k}", r) for k, r in
                                    (("sum", "sum"), ("sum2", "sum"), ("max", "max"), ("min", "min"))})
    s, s2 = stats.sum(family.seq_sum), stats.sum(family.seq_sum2)
    mean = safe_div(s, n_rows)
    var = safe_div(s2 - s * mean, n_rows - 1)
    std = where(n_rows > 1, sqrt0(var), 0.0)
    mx, mn = stats.max(family.seq_max), stats.min(family.seq_min)
    has = n_rows > 0
    dev = where(has, maximum(abs(mx - center), abs(mn - center)), 0.0)
    return {"mean": mean, "std": std, "max": where(has, mx, 0.0), "min": where(has, mn, 0.0), "max_deviation": dev}
