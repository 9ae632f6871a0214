"""What a demo figure carries with it: the provenance of the run that produced it, and the 95 %
interval over seeds it is judged by.

* :func:`provenance` — commit (and whether the work tree had changes), torch and Python versions,
  CPU model and logical CPUs, worker processes × threads per process, UTC date, and the command.
  ``summary.json`` and every results file under ``docs/results/`` carry it.
* :func:`interval` — mean and a two-sided 95 % Student-t interval over seeds,
  ``mean ± t(0.975, n − 1) · s / √n`` (``s`` the sample standard deviation); no interval from one
  seed.
* :func:`tied_with_best` — the methods whose interval overlaps the interval of the method with
  the highest mean. Overlapping intervals are a tie: the demo ranks nothing inside them.

Runs are deterministic on one machine, but floating-point rounding differs between CPUs and
reinforcement learning amplifies it, so a figure is reproducible on the machine and commit its
provenance names, and comparable with others only through its interval.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path

__all__ = ["provenance", "t_quantile", "interval", "tied_with_best", "PROVENANCE_FIELDS"]

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


def tied_with_best(stats: dict[str, dict]) -> list[str] | None:
    """The names (in order) whose interval overlaps the interval of the highest mean, the best
    included; None when some entry has no interval (one seed: nothing can be called a tie)."""
    named = {k: s for k, s in stats.items() if s["n"] > 0}
    if not named or any(s["ci"] is None for s in named.values()):
        return None
    best = max(named, key=lambda k: named[k]["mean"])
    lo = named[best]["ci"][0]
    return [k for k, s in named.items() if s["ci"][1] >= lo]
