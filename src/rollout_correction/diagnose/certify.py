"""``rollout-correction diagnose --certify DUMP``: a zero-diff certificate for "true on-policy" runs.

A run whose rollout engine and trainer compute the same numbers (batch-invariant kernels, the
same precision, the same weights) needs no correction at all; this checks that it really is so.
The dump passes only if, on every valid token, the rollout's and the trainer's log-probs are the
same bits: log π_rollout(y_t) and log π_train(y_t) are read in float64 (which holds every float16,
bfloat16, float32 and float64 value exactly) and compared as 64-bit patterns, so −0.0 ≠ 0.0 and a
NaN equals only the same NaN. Otherwise the certificate names how many tokens differ, the first
diverging (row, position) in file order, the largest |Δ| = |log π_train − log π_rollout| (a
non-finite value counts as infinite), and per response position the share of tokens that differ
and their largest |Δ| (``certificate_positions.png``). Rows and positions count from 0: the row of
the file (of the files' concatenation for a folder), the position inside the row's response (for an
engine whose rows hold the prompt too, counted from the response's first token).

With a tolerance (``--atol X``, slime's CI gate uses 1e-6) a token also passes when
|Δ| ≤ X; the dump passes when every valid token does, and the certificate reads as above with
"differ" meaning "differ by more than X". ``max_abs_diff`` is the largest |Δ| over all valid tokens
either way.

The file is streamed in blocks of rows through the readers of ``rollout-correction diagnose``, so
every format and layout it reads can be certified, with bounded memory.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
from dataclasses import dataclass, field

import numpy as np

from .readers import Columns
from .sources import iter_chunks

__all__ = ["Certificate", "certify_file", "write_certificate", "print_certificate"]

#: How many of the largest differences the certificate lists.
TOP_DIFFERENCES = 10


@dataclass
class Certificate:
    """The result of :func:`certify_file`.

    tokens / rows: valid tokens and rows read; differing: valid tokens whose log-probs differ in
    any bit; first: (row, position) of the first of them, None when there is none; largest: up to
    :data:`TOP_DIFFERENCES` dicts (row, position, rollout, trainer, abs_diff), largest |Δ| first;
    per_position: per response position, [valid tokens, differing tokens, largest |Δ|];
    atol: the tolerance (None: bit for bit); max_abs_diff: the largest |Δ| of any valid token.
    """

    path: str
    atol: float | None = None
    max_abs_diff: float = 0.0
    rows: int = 0
    tokens: int = 0
    differing: int = 0
    first: tuple[int, int] | None = None
    largest: list[dict] = field(default_factory=list)
    per_position: list[list[float]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.differing == 0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed,
                "first": None if self.first is None else {"row": self.first[0], "position": self.first[1]}}


def _abs_diff(old: np.ndarray, roll: np.ndarray) -> np.ndarray:
    """|old − rollout| with a non-finite value or difference counted as +inf."""
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(old - roll)
    return np.where(np.isfinite(d), d, np.inf)


def certify_file(path: str, columns: Columns | None = None, chunk_rows: int = 2048,
                 fmt: str | None = None, engine: str | None = None, atol: float | None = None) -> Certificate:
    """Compare the two log-prob columns of ``path`` (a file, folder or glob; an engine's dump is read
    as :func:`~.sources.iter_chunks` reads it) on every valid token: bit for bit, or with ``atol``
    within |Δ| ≤ atol (a token whose bits agree passes either way, even a non-finite one)."""
    if atol is not None and not 0.0 <= atol < np.inf:
        raise ValueError(f"atol={atol!r}: expected a finite number ≥ 0, e.g. 1e-6")
    columns = dataclasses.replace(columns or Columns(), exact=True)
    cert = Certificate(path, atol=atol)
    heap: list[tuple[float, int, int, int, float, float]] = []  # (|Δ|, −row, −position, serial, rollout, old)
    total = np.zeros(0, dtype=np.int64)
    differ = np.zeros(0, dtype=np.int64)
    top = np.zeros(0, dtype=np.float64)
    serial = 0
    for chunk in iter_chunks(path, columns, chunk_rows, fmt, engine):
        old, roll, valid = chunk.old_log_probs, chunk.rollout_log_probs, chunk.response_mask
        first_row = cert.rows
        cert.rows += chunk.num_rows
        cert.tokens += int(valid.sum())
        T = valid.shape[1]
        if T > total.size:
            grow = T - total.size
            total, differ = np.pad(total, (0, grow)), np.pad(differ, (0, grow))
            top = np.pad(top, (0, grow))
        bad = valid & (old.view(np.int64) != roll.view(np.int64))
        total[:T] += valid.sum(0)
        if not bad.any():
            continue
        d = np.where(bad, _abs_diff(old, roll), 0.0)
        cert.max_abs_diff = max(cert.max_abs_diff, float(d.max()))
        if atol is not None:
            bad &= ~(d <= atol)
            if not bad.any():
                continue
            d = np.where(bad, d, 0.0)
        cert.differing += int(bad.sum())
        differ[:T] += bad.sum(0)
        top[:T] = np.maximum(top[:T], d.max(0))
        rows, cols = np.nonzero(bad)  # row-major: the first pair is the first in file order
        if cert.first is None:
            cert.first = (first_row + int(rows[0]), int(cols[0]))
        k = min(TOP_DIFFERENCES, rows.size)
        for i in np.argpartition(-d[rows, cols], k - 1)[:k]:
            r, c = int(rows[i]), int(cols[i])
            item = (float(d[r, c]), -(first_row + r), -c, serial, float(roll[r, c]), float(old[r, c]))
            serial += 1
            if len(heap) < TOP_DIFFERENCES:
                heapq.heappush(heap, item)
            else:
                heapq.heappushpop(heap, item)
    cert.largest = [{"row": -r, "position": -c, "rollout": ro, "trainer": tr, "abs_diff": d}
                    for d, r, c, _, ro, tr in sorted(heap, reverse=True)]
    cert.per_position = [[int(n), int(m), float(x)] for n, m, x in zip(total, differ, top)]
    return cert


def _plot_positions(cert: Certificate) -> bytes:
    """Per response position: the share of valid tokens that differ, and their largest |Δ|."""
    from .plots import _RED, _BLUE, _plt, _png

    plt = _plt()
    pos = np.arange(len(cert.per_position))
    arr = np.asarray(cert.per_position, dtype=np.float64).reshape(-1, 3)
    share = np.divide(arr[:, 1], arr[:, 0], out=np.zeros(len(arr)), where=arr[:, 0] > 0)
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    a.plot(pos, share, color=_RED, lw=1.2)
    a.set_ylabel("tokens that differ")
    a.set_ylim(0, max(1e-9, share.max()) * 1.05)
    a.set_title(f"{cert.differing:,} of {cert.tokens:,} tokens differ; first at row {cert.first[0]}, "
                f"position {cert.first[1]}" if cert.first else "no token differs")
    finite = np.where(np.isfinite(arr[:, 2]), arr[:, 2], np.nan)
    b.plot(pos, finite, color=_BLUE, lw=1.2)
    if np.isinf(arr[:, 2]).any():
        b.scatter(pos[np.isinf(arr[:, 2])], np.zeros(int(np.isinf(arr[:, 2]).sum())), color=_RED, marker="x",
                  label="non-finite")
        b.legend()
    b.set_ylabel("largest |Δ log p|")
    b.set_xlabel("response position")
    fig.tight_layout()
    return _png(fig)


def write_certificate(cert: Certificate, out_dir: str) -> list[str]:
    """``certificate.json`` and, when a token differs, ``certificate_positions.png``; the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "certificate.json")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(cert.to_dict(), f, indent=1, allow_nan=True)
    if not cert.passed:
        paths.append(os.path.join(out_dir, "certificate_positions.png"))
        with open(paths[1], "wb") as f:
            f.write(_plot_positions(cert))
    return paths


def print_certificate(cert: Certificate, paths: list[str], file=None) -> None:
    """The verdict on the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    from rollout_correction.console import LOG_WIDTH

    console = Console(file=file)
    if not console.is_terminal:  # a log: the table within LOG_WIDTH (a terminal: its own width)
        console.width = LOG_WIDTH
    within = "bit for bit" if cert.atol is None else f"within |Δ| ≤ {cert.atol:g} (largest {cert.max_abs_diff:.3g})"
    if cert.passed:
        console.print(f"[bold green]PASS[/bold green] {cert.path}: rollout and trainer log-probs agree {within} "
                      f"on all {cert.tokens:,} valid tokens of {cert.rows:,} rows")
    else:
        row, pos = cert.first
        beyond = "" if cert.atol is None else f" by more than {cert.atol:g}"
        console.print(f"[bold red]FAIL[/bold red] {cert.path}: {cert.differing:,} of {cert.tokens:,} valid tokens "
                      f"differ{beyond}; first divergence at row {row}, position {pos}")
        t = Table(title="largest differences")
        for col in ("row", "position", "rollout log p", "trainer log p", "|Δ|"):
            t.add_column(col, justify="right")
        for d in cert.largest:
            t.add_row(str(d["row"]), str(d["position"]), repr(d["rollout"]), repr(d["trainer"]), f"{d['abs_diff']:.3g}")
        console.print(t)
    for p in paths:
        console.print(f"  wrote {p}")
