"""What a demo figure carries with it: the provenance of the run that produced it, and the 95 %
interval over seeds it is judged by.

* :func:`provenance` — commit (and whether the work tree had changes), torch and Python versions,
  CPU model and logical CPUs, worker processes × threads per process, UTC date, and the command.
  ``summary.json`` and every results file under ``docs/results/`` carry it.
* :func:`interval` — mean and a two-sided 95 % Student-t interval over seeds,
  ``mean ± t(0.975, n − 1) · s / √n`` (``s`` the sample standard deviation); no interval from one
  seed.
* :func:`paired_difference` — a comparison of two methods on the same seeds: the per-seed
  differences dₛ = aₛ − bₛ (both runs of seed s start from one SFT checkpoint and see the same
  prompts), the 95 % t-interval of their mean and the sign count. A comparison is *above* or
  *below* when that interval excludes 0 and *tied* when it covers 0, nothing else.
* :func:`tied_with_best` — the methods whose paired interval against the method with the highest
  mean covers 0. The demo ranks nothing inside a tie.

Runs are deterministic on one machine, but floating-point rounding differs between CPUs and
reinforcement learning amplifies it, so a figure is reproducible on the machine and commit its
provenance names, and comparable with others only through its interval.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path

__all__ = ["provenance", "t_quantile", "interval", "paired_difference", "verdict", "tied_with_best",
           "PROVENANCE_FIELDS"]

#: The fields :func:`provenance` records (every results file has them all).
PROVENANCE_FIELDS = ("commit", "dirty", "torch", "python", "cpu", "logical_cpus", "workers", "threads", "date",
                     "command")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` reports)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def provenance(command: str, workers: int, threads: int) -> dict:
    """Where and how a figure was produced. ``commit`` is None outside a git checkout (an installed
    wheel); ``dirty`` is True when tracked files differed from that commit."""
    import torch

    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit,
        "dirty": bool(status) if status is not None else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "workers": workers,
        "threads": threads,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
    }


def _cos_power_integral(theta: float, power: float, n: int = 2000) -> float:
    """∫₀^θ cos(u)^power du by Simpson's rule (a smooth integrand on a bounded interval)."""
    h = theta / n
    total = 1.0 + math.cos(theta) ** power
    for i in range(1, n):
        total += (4 if i % 2 else 2) * math.cos(i * h) ** power
    return total * h / 3


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` degrees of freedom.

    With x = √df · tan u, the density of t becomes proportional to cos(u)^(df − 1) on
    (−π/2, π/2), so P(0 < T < x) / P(0 < T) = ∫₀^u cos^(df−1) / ∫₀^(π/2) cos^(df−1) = 2p − 1; the
    angle is found by bisection."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    whole = _cos_power_integral(math.pi / 2, df - 1)
    lo, hi = 0.0, math.pi / 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if _cos_power_integral(mid, df - 1) / whole < 2 * p - 1:
            lo = mid
        else:
            hi = mid
    return math.sqrt(df) * math.tan((lo + hi) / 2)


def interval(values, level: float = 0.95) -> dict:
    """Mean, sample standard deviation (n − 1), n and the two-sided Student-t interval of the mean
    of the finite ``values``; ``ci`` is None for fewer than two values (no spread to judge by)."""
    xs = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not xs:
        return {"mean": float("nan"), "std": float("nan"), "n": 0, "ci": None}
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": mean, "std": 0.0, "n": 1, "ci": None}
    std = statistics.stdev(xs)
    half = t_quantile(0.5 + level / 2, len(xs) - 1) * std / math.sqrt(len(xs))
    return {"mean": mean, "std": std, "n": len(xs), "ci": [mean - half, mean + half]}


def paired_difference(a: dict, b: dict, level: float = 0.95) -> dict:
    """``a − b`` judged seed by seed: ``a`` and ``b`` map a seed to a run's figure.

    dₛ = aₛ − bₛ over the seeds both have (finite values only); returns :func:`interval` of the dₛ
    (mean, std, n, ``ci`` = mean ± t(0.975, n − 1) · s_d / √n, None for one seed), the sign count
    ``above`` / ``below`` / ``equal`` (dₛ > 0, < 0, = 0), the ``seeds`` used and the
    :func:`verdict`.
    """
    seeds = [k for k in a if k in b and all(isinstance(x, (int, float)) and math.isfinite(x) for x in (a[k], b[k]))]
    diffs = [float(a[k]) - float(b[k]) for k in seeds]
    out = interval(diffs, level)
    out.update(above=sum(d > 0 for d in diffs), below=sum(d < 0 for d in diffs), equal=sum(d == 0 for d in diffs),
               seeds=seeds)
    out["verdict"] = verdict(out)
    return out


def verdict(diff: dict) -> str | None:
    """"above" (the paired interval lies above 0), "below" (below 0), "tied" (it covers 0); None
    without an interval (one seed)."""
    if diff.get("ci") is None:
        return None
    lo, hi = diff["ci"]
    return "above" if lo > 0 else "below" if hi < 0 else "tied"


def tied_with_best(finals: dict[str, dict]) -> list[str] | None:
    """The names (in order) tied with the highest mean: the best itself and every method whose
    paired interval against it (:func:`paired_difference`) covers 0. ``finals`` maps a name to
    {seed: figure}; None when a comparison has no interval (one seed: nothing is called a tie)."""
    means = {k: statistics.fmean(v.values()) for k, v in finals.items() if v}
    if not means:
        return None
    best = max(means, key=means.get)
    out = []
    for k in means:
        if k == best:
            out.append(k)
            continue
        v = verdict(paired_difference(finals[k], finals[best]))
        if v is None:
            return None
        if v == "tied":
            out.append(k)
    return out
