"""Sufficient statistics that reduce exactly across ranks and chunks.

Every batch-level number the library reports is a function of a few named **sums** (counts,
sums, sums of squares) and **maxima** (a minimum is stored as the maximum of the negated value).
Sums add and maxima take the max, whether the parts are data-parallel ranks or streamed chunks,
so the derived numbers do not depend on how the batch was split.

Recording is deferred and batched: a part is a per-row vector (B,) or a scalar, optionally
restricted to some rows (``rows``, a (B,) bool mask) and weighted per row (``weight``); when the
values are first needed, parts recorded alike are stacked and reduced together in float64, and
all sums end up in **one packed float64 vector** (all maxima in another). A call with dozens of
statistics therefore costs a handful of kernel launches, reducing over a process group takes two
collectives (one SUM, one MAX), and reading every value on the host is one copy
(:meth:`SufficientStats.to_host`, one device sync).

Values are derived from the statistics by plain functions that work on either form: on
:class:`SufficientStats` they give 0-d device tensors (no sync), on :class:`HostStats` Python
floats computed in float64 (the helpers ``safe_div``, ``where``, ``sqrt0``, ``exp``, ``clamp``,
``maximum`` below accept both).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

__all__ = ["SufficientStats", "HostStats", "Value", "safe_div", "seq_summary", "where", "sqrt0", "exp", "clamp", "maximum"]

Value = Union[torch.Tensor, float]


class _Part:
    __slots__ = ("kind", "name", "value", "rows", "weight")

    def __init__(self, kind: str, name: str, value: torch.Tensor, rows: Optional[torch.Tensor],
                 weight: Optional[torch.Tensor]) -> None:
        self.kind, self.name, self.value, self.rows, self.weight = kind, name, value.detach(), rows, weight


def _reduce_group(kind: str, parts: list[_Part]) -> torch.Tensor:
    """(P,) float64: each part of one group reduced to a scalar (sum, max or −min over its
    elements, restricted to ``rows`` and weighted by ``weight``), with one stacked reduction."""
    first = parts[0]
    stacked = torch.stack([p.value for p in parts])
    if stacked.dtype != torch.float64:
        stacked = stacked.to(torch.float64)
    if first.value.dim() == 0:
        return stacked if kind != "min" else -stacked
    stacked = stacked.reshape(len(parts), -1)
    if kind == "sum":
        if first.weight is not None:
            stacked = stacked * first.weight.reshape(1, -1)
        if first.rows is not None:
            stacked = torch.where(first.rows.reshape(1, -1), stacked, 0.0)
        return stacked.sum(1)
    fill = -math.inf if kind == "max" else math.inf
    if first.rows is not None:
        stacked = torch.where(first.rows.reshape(1, -1), stacked, fill)
    if stacked.shape[1] == 0:
        return torch.full((len(parts),), -math.inf, dtype=torch.float64, device=stacked.device)
    return stacked.amax(1) if kind == "max" else -stacked.amin(1)


class SufficientStats:
    """Named float64 sums and maxima, with exact merge and all-reduce.

    ``add_sum(name, x)`` / ``add_max(name, x)`` / ``add_min(name, x)`` record tensors of any shape
    (their elements are summed / maxed); ``rows=`` (bool, same shape) keeps only those elements,
    ``weight=`` (same shape) multiplies them first (sums only). Adding to an existing name
    accumulates. An empty maximum is ``-inf`` or a large negative number; the code that derives a
    metric checks the matching count before using it.
    """

    def __init__(self) -> None:
        self._parts: list[_Part] = []
        self._sum_names: list[str] = []
        self._max_names: list[str] = []
        self._sum_vec: Optional[torch.Tensor] = None
        self._max_vec: Optional[torch.Tensor] = None
        self._views: Optional[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = None

    @classmethod
    def from_values(cls, sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor]) -> "SufficientStats":
        """Statistics whose values are already reduced (0-d tensors, e.g. returned by a compiled pass)."""
        out = cls()
        out._set("sum", list(sums), torch.stack([v.reshape(()) for v in sums.values()]).double() if sums else None)
        out._set("max", list(maxes), torch.stack([v.reshape(()) for v in maxes.values()]).double() if maxes else None)
        return out

    # -- recording ---------------------------------------------------------------------
    def add_sum(self, name: str, value: torch.Tensor, rows: Optional[torch.Tensor] = None,
                weight: Optional[torch.Tensor] = None) -> None:
        self._parts.append(_Part("sum", name, value, rows, weight))

    def add_max(self, name: str, value: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        self._parts.append(_Part("max", name, value, rows, None))

    def add_min(self, name: str, value: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        self._parts.append(_Part("min", "-" + name, value, rows, None))

    def _set(self, kind: str, names: list[str], vec: Optional[torch.Tensor]) -> None:
        if kind == "sum":
            self._sum_names, self._sum_vec = names, vec
        else:
            self._max_names, self._max_vec = names, vec
        self._views = None

    def _accumulate(self, kind: str, names: list[str], vec: torch.Tensor) -> None:
        """Add (sums) or max (maxima) a packed vector into this object's packed vector."""
        have = self._sum_names if kind == "sum" else self._max_names
        old = self._sum_vec if kind == "sum" else self._max_vec
        combine = torch.add if kind == "sum" else torch.maximum
        if len(set(names)) < len(names):  # a name recorded twice in one settle: combine (rare)
            merged: dict[str, torch.Tensor] = {}
            for n, v in zip(names, vec.unbind()):
                merged[n] = combine(merged[n], v) if n in merged else v
            names, vec = list(merged), torch.stack(list(merged.values()))
        if old is None:
            self._set(kind, names, vec)
        elif names == have:
            self._set(kind, have, combine(old, vec))
        else:  # different names (e.g. merging unrelated families): combine by name
            merged = dict(zip(have, old.unbind()))
            for n, v in zip(names, vec.unbind()):
                merged[n] = combine(merged[n], v) if n in merged else v
            self._set(kind, list(merged), torch.stack(list(merged.values())))

    def _settle(self) -> None:
        if not self._parts:
            return
        groups: dict[tuple, list[_Part]] = {}
        for p in self._parts:
            kind = "sum" if p.kind == "sum" else p.kind
            key = (kind, tuple(p.value.shape), id(p.rows) if p.rows is not None else None,
                   id(p.weight) if p.weight is not None else None, p.value.device)
            groups.setdefault(key, []).append(p)
        self._parts = []
        for target in ("sum", "max"):
            kinds = ("sum",) if target == "sum" else ("max", "min")
            reduced = [(g, _reduce_group(key[0], g)) for key, g in groups.items() if key[0] in kinds]
            if reduced:
                names = [p.name for g, _ in reduced for p in g]
                vec = reduced[0][1] if len(reduced) == 1 else torch.cat([v for _, v in reduced])
                self._accumulate(target, names, vec)

    # -- reading -----------------------------------------------------------------------
    def packed(self) -> tuple[list[str], Optional[torch.Tensor], list[str], Optional[torch.Tensor]]:
        """(sum names, (K,) float64 sums, max names, (M,) float64 maxima)."""
        self._settle()
        return self._sum_names, self._sum_vec, self._max_names, self._max_vec

    def _named(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        self._settle()
        if self._views is None:
            sums = dict(zip(self._sum_names, self._sum_vec.unbind())) if self._sum_vec is not None else {}
            maxes = dict(zip(self._max_names, self._max_vec.unbind())) if self._max_vec is not None else {}
            self._views = (sums, maxes)
        return self._views

    @property
    def sums(self) -> dict[str, torch.Tensor]:
        return self._named()[0]

    @property
    def maxes(self) -> dict[str, torch.Tensor]:
        return self._named()[1]

    def sum(self, name: str) -> torch.Tensor:
        return self.sums[name]

    def max(self, name: str) -> torch.Tensor:
        return self.maxes[name]

    def min(self, name: str) -> torch.Tensor:
        return -self.maxes["-" + name]

    def to_host(self) -> "HostStats":
        """Every value as a Python float, with one device-to-host copy (one sync)."""
        names_s, vs, names_m, vm = self.packed()
        parts = [v for v in (vs, vm) if v is not None]
        if not parts:
            return HostStats({}, {})
        values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        k = len(names_s) if vs is not None else 0
        return HostStats(dict(zip(names_s, values[:k])), dict(zip(names_m, values[k:])))

    # -- combining ---------------------------------------------------------------------
    def merge(self, other: "SufficientStats") -> "SufficientStats":
        """Accumulate ``other`` into ``self`` (sums add, maxima take the max)."""
        self._settle()
        names_s, vs, names_m, vm = other.packed()
        if vs is not None:
            self._accumulate("sum", list(names_s), vs)
        if vm is not None:
            self._accumulate("max", list(names_m), vm)
        return self

    def all_reduce(self, process_group: Optional[object] = None) -> "SufficientStats":
        """Reduce in place over ``process_group`` with one SUM and one MAX collective.

        Every rank must have recorded the same names in the same order (true by construction:
        names and their order depend on the config only, never on the data).
        """
        import torch.distributed as dist

        if process_group is None or not (dist.is_available() and dist.is_initialized()):
            return self
        self._settle()
        if self._sum_vec is not None:
            packed = self._sum_vec.clone()
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=process_group)
            self._set("sum", self._sum_names, packed)
        if self._max_vec is not None:
            # -inf is not transported reliably by every backend; use the float64 lowest value.
            lowest = torch.finfo(torch.float64).min
            packed = self._max_vec.clamp_min(lowest)
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=process_group)
            self._set("max", self._max_names, torch.where(packed <= lowest, -math.inf, packed))
        return self


class HostStats:
    """Reduced statistics as Python floats (see :meth:`SufficientStats.to_host`); the same
    reading interface as :class:`SufficientStats`, so every derivation runs on either."""

    def __init__(self, sums: dict[str, float], maxes: dict[str, float]) -> None:
        self.sums, self.maxes = sums, maxes

    def sum(self, name: str) -> float:
        return self.sums[name]

    def max(self, name: str) -> float:
        return self.maxes[name]

    def min(self, name: str) -> float:
        return -self.maxes["-" + name]


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
    if lo is not None:
        x = max(x, lo)
    return min(x, hi) if hi is not None else x


def maximum(a: Value, b: Value) -> Value:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def seq_summary(stats, key: str, n_rows: Value, center: float) -> dict[str, Value]:
    """mean, unbiased std, max, min and max |x − center| of per-row values recorded under
    ``key`` (as ``<key>_sum``, ``<key>_sum2``, ``<key>_max`` and ``<key>_min``); all 0 when
    ``n_rows`` is 0, std 0 when it is 1."""
    s, s2 = stats.sum(f"{key}_sum"), stats.sum(f"{key}_sum2")
    mean = safe_div(s, n_rows)
    var = safe_div(s2 - s * mean, n_rows - 1)
    std = where(n_rows > 1, sqrt0(var), 0.0)
    mx, mn = stats.max(f"{key}_max"), stats.min(f"{key}_min")
    has = n_rows > 0
    dev = where(has, maximum(abs(mx - center), abs(mn - center)), 0.0)
    return {"mean": mean, "std": std, "max": where(has, mx, 0.0), "min": where(has, mn, 0.0), "max_deviation": dev}
