"""Fixed-bin statistics that accumulate over chunks of rows.

Nothing here keeps per-token data: a histogram is a vector of counts over fixed edges, and a
profile is a vector of sums indexed by an integer key (token position, response length, policy
version, token id) that grows as larger keys are seen. Merging two chunks is adding vectors, so the
result does not depend on how the file was split.
"""

from __future__ import annotations

import numpy as np
import torch


def symlog_edges(lo: float = 1e-6, hi: float = 1e3, per_decade: int = 16) -> np.ndarray:
    """Bin edges symmetric around 0, log-spaced in |x| from ``lo`` to ``hi``.

    edges = [-hi, …, -lo, 0, lo, …, hi]; values with |x| < lo fall into the two central bins and
    values beyond ±hi into the outermost bins (counted there, and also in ``underflow``/``overflow``).
    """
    if not (0 < lo < hi):
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    n = round(float(np.log10(hi / lo)) * per_decade) + 1
    pos = np.logspace(np.log10(lo), np.log10(hi), n)
    return np.concatenate([-pos[::-1], [0.0], pos])


class Histogram:
    """Counts of values over fixed ``edges`` (len K+1 → K bins), accumulated chunk by chunk.

    Bin k holds edges[k] ≤ x < edges[k+1]; x < edges[0] goes to bin 0 and x ≥ edges[-1] to bin
    K-1 (and is also counted in ``underflow`` / ``overflow``). Non-finite values are rejected.
    """

    def __init__(self, edges: np.ndarray):
        edges = np.asarray(edges, dtype=np.float64)
        if edges.ndim != 1 or edges.size < 2 or not np.all(np.diff(edges) > 0):
            raise ValueError("edges must be a strictly increasing 1-D array of at least 2 values")
        self.edges = edges
        self._edges_t = torch.as_tensor(edges, dtype=torch.float64)
        self._edges_f32 = self._edges_t.float() if np.all(np.diff(edges.astype(np.float32)) > 0) else None
        self.counts = np.zeros(edges.size - 1, dtype=np.int64)
        self.underflow = 0
        self.overflow = 0

    def update(self, values: torch.Tensor) -> None:
        """values: tensor of finite numbers (float32 values are binned against float32 edges)."""
        v = values.reshape(-1)
        if v.numel() == 0:
            return
        if not torch.isfinite(v).all():
            raise ValueError("histogram values must be finite")
        if v.dtype == torch.float32 and self._edges_f32 is not None:
            edges = self._edges_f32
        else:
            v, edges = v.to(torch.float64), self._edges_t
        idx = torch.bucketize(v, edges, right=True) - 1
        self.underflow += int((idx < 0).sum())
        self.overflow += int((idx >= self.counts.size).sum())
        idx = idx.clamp_(0, self.counts.size - 1)
        self.counts += torch.bincount(idx, minlength=self.counts.size).numpy()

    @property
    def total(self) -> int:
        return int(self.counts.sum())


class AdaptiveLinearHistogram:
    """Linear bins whose range is fixed from the first ``warmup`` values, then frozen.

    The first values are buffered (at most ``warmup``); the range becomes ±2·q where q is the
    larger of |0.5 %| and |99.5 %| quantile of the buffer, split into ``bins`` equal bins. Later values
    outside the range are counted in ``underflow`` / ``overflow`` (not in any bin). The result
    depends on the order of the rows only through the choice of range.
    """

    def __init__(self, bins: int = 121, warmup: int = 20000):
        self.bins, self.warmup = bins, warmup
        self._buffer: list[torch.Tensor] = []
        self._buffered = 0
        self.hist: Histogram | None = None
        self.underflow = 0
        self.overflow = 0

    def _freeze(self) -> None:
        data = torch.cat(self._buffer) if self._buffer else torch.zeros(0, dtype=torch.float64)
        if data.numel() == 0:
            data = torch.zeros(1, dtype=torch.float64)
        sample = data[:: max(1, data.numel() // 1_000_000)]  # torch.quantile has an input size limit
        lo, hi = torch.quantile(sample, torch.tensor([0.005, 0.995], dtype=data.dtype)).tolist() \
            if data.numel() > 1 else (float(data[0]), float(data[0]))
        a = 2.0 * max(abs(lo), abs(hi), 1e-9)
        self.hist = Histogram(np.linspace(-a, a, self.bins + 1))
        self._buffer = []
        self._add(data)

    def _add(self, v: torch.Tensor) -> None:
        e = self.hist.edges
        v = v.to(torch.float64)
        under = int((v < e[0]).sum())
        over = int((v >= e[-1]).sum())
        self.underflow += under
        self.overflow += over
        # equal-width bins: torch.histc, which ignores values outside [e0, e_last] and puts
        # x = e_last in the last bin (so subtract those, counted as overflow above)
        counts = torch.histc(v, bins=self.bins, min=float(e[0]), max=float(e[-1])).to(torch.int64)
        counts[-1] -= int((v == e[-1]).sum())
        self.hist.counts += counts.numpy()

    def update(self, values: torch.Tensor) -> None:
        v = values.reshape(-1).to(torch.float64)
        if self.hist is None:
            self._buffer.append(v)
            self._buffered += v.numel()
            if self._buffered >= self.warmup:
                self._freeze()
            return
        self._add(v)

    def finish(self) -> AdaptiveLinearHistogram:
        if self.hist is None:
            self._freeze()
        return self

    @property
    def total(self) -> int:
        return (self.hist.total if self.hist is not None else 0) + self.underflow + self.overflow


class KeyedSums:
    """Per-key sums of several named quantities; keys are non-negative integers.

    ``update(keys, **values)`` adds values[name][i] to sums[name][keys[i]]; ``count`` counts keys.
    """

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.count = np.zeros(0, dtype=np.float64)
        self.sums = {n: np.zeros(0, dtype=np.float64) for n in names}

    def _grow(self, size: int) -> None:
        if size <= self.count.size:
            return
        new = max(size, 2 * self.count.size)
        self.count = np.pad(self.count, (0, new - self.count.size))
        for n in self.names:
            self.sums[n] = np.pad(self.sums[n], (0, new - self.sums[n].size))

    def update(self, keys: np.ndarray, weights: np.ndarray | None = None, **values: np.ndarray) -> None:
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if keys.size == 0:
            return
        if keys.min() < 0:
            raise ValueError("keys must be non-negative")
        size = int(keys.max()) + 1
        self._grow(size)
        w = None if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        self.count[:size] += np.bincount(keys, weights=w, minlength=size)
        for n in self.names:
            self.sums[n][:size] += np.bincount(keys, weights=np.asarray(values[n], dtype=np.float64).reshape(-1),
                                               minlength=size)

    def add_dense(self, count: np.ndarray, **sums: np.ndarray) -> None:
        """Adds vectors already indexed by key (key = position in the vector)."""
        size = int(np.asarray(count).size)
        self._grow(size)
        self.count[:size] += count
        for n in self.names:
            self.sums[n][:size] += sums[n]

    def mean(self, name: str) -> np.ndarray:
        """Per-key mean of ``name`` (NaN where a key has no count; callers drop those keys)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, self.sums[name] / np.maximum(self.count, 1e-300), np.nan)

    def binned(self, edges: np.ndarray) -> dict[str, np.ndarray]:
        """Re-bins keys into [edges[k], edges[k+1]) ranges: returns count and sums per range."""
        keys = np.arange(self.count.size)
        idx = np.searchsorted(edges, keys, side="right") - 1
        ok = (idx >= 0) & (idx < edges.size - 1)
        out = {"count": np.bincount(idx[ok], weights=self.count[ok], minlength=edges.size - 1)}
        for n in self.names:
            out[n] = np.bincount(idx[ok], weights=self.sums[n][ok], minlength=edges.size - 1)
        return out


def key_bin_edges(max_key: int, n_bins: int = 48) -> np.ndarray:
    """Integer edges covering [0, max_key]: one bin per key when few, else geometric growth.

    Short positions/lengths get fine bins (where most data is), long ones coarse bins.
    """
    if max_key < 0:
        return np.array([0, 1])
    if max_key + 1 <= n_bins:
        return np.arange(max_key + 2)
    e = np.unique(np.round(np.geomspace(1, max_key + 1, n_bins)).astype(np.int64))
    return np.unique(np.concatenate([[0], e, [max_key + 1]]))
