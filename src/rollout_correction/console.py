"""What every command does around its work: one-line errors, plain progress lines in a log, and a
new report folder for each invocation.

* :class:`ArgumentParser` — argparse with a bad flag reported on one line (exit 2).
* :class:`CommandError` — an expected failure (a bad file, a bad flag, a report folder in use); the
  ``rollout-correction`` command prints its message on one line and exits 2.
* :class:`ProgressLines` — without a terminal (``| tee``, CI, ``nohup``), one plain line per
  finished unit with the elapsed time and an ETA; no carriage returns, no colour codes.
* :data:`LOG_WIDTH` — without a terminal, no table is wider than this (100 columns).
* :func:`report_folder` — ``<default>/<date>-<time>/`` with ``<default>/latest`` pointing at it,
  or an explicit folder that is refused when it holds another run's report
  (:func:`refuse_held_folder`, which a command may call before it reads its input).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

__all__ = ["LOG_WIDTH", "ArgumentParser", "CommandError", "ProgressLines", "clock", "is_terminal", "one_line",
           "refuse_held_folder", "report_folder"]

#: The widest a table's line gets without a terminal (a pipe, ``tee``, CI): a wider table is printed
#: as one block per row, or its cells wrap.
LOG_WIDTH = 100


class CommandError(Exception):
    """An expected failure of a command; the message names the problem and the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line on stderr and exit 2, not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")


def one_line(text: object) -> str:
    """``text`` with its line breaks and runs of blanks collapsed to single spaces."""
    return " ".join(str(text).split())


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stdout) is an interactive terminal."""
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def clock(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressLines:
    """One plain line per finished unit, for logs::

        [ 3/21] naive PPO · seed 0  0.71  elapsed 1m02s  ETA 6m10s

    The ETA is the time per unit of expected cost finished in this invocation times the cost left.
    Units are weighed by their expected cost (``cost`` of :meth:`finished`, ``total_cost`` for all
    of them; by default 1 each, i.e. units count alike), so that a few cheap units first (a warm
    start) do not make the long ones after them look short. Units already done when it started
    (e.g. resumed runs, ``done`` of them costing ``done_cost``) count as done but not in the rate.
    Work that is no unit (starting worker processes) is left out of the rate by :meth:`units_start`.
    """

    def __init__(self, total: int, done: int = 0, stream: TextIO | None = None,
                 now: Callable[[], float] = time.perf_counter, total_cost: float | None = None,
                 done_cost: float | None = None):
        self.total, self.done, self._start_done = total, done, done
        self.total_cost = float(total if total_cost is None else total_cost)
        self.done_cost = float(done if done_cost is None else done_cost)
        self._start_cost = self.done_cost
        self._stream, self._now = stream, now
        self._t0 = self._rate_t0 = now()

    def units_start(self) -> None:
        """The units start now: the ETA's rate counts time from here; ``elapsed`` still counts from
        the start (e.g. once the worker processes are up: their start-up is no unit's cost)."""
        self._rate_t0 = self._now()

    def finished(self, label: str, detail: str = "", cost: float = 1.0) -> str:
        """Count one finished unit of expected ``cost`` and print its line; returns the line."""
        self.done += 1
        self.done_cost += cost
        now = self._now()
        elapsed = now - self._t0
        rate = (now - self._rate_t0) / max(self.done_cost - self._start_cost, 1e-12)
        left = self.total - self.done
        eta = f"ETA {clock(rate * max(self.total_cost - self.done_cost, 0.0))}" if left > 0 else "done"
        width = len(str(self.total))
        line = one_line(f"[{self.done:>{width}}/{self.total}] {label} {detail}")
        line = f"{line}  elapsed {clock(elapsed)}  {eta}"
        print(line, file=self._stream if self._stream is not None else sys.stdout, flush=True)
        return line


def _stamp(now: datetime.datetime) -> str:
    return now.strftime("%Y%m%d-%H%M%S")


def refuse_held_folder(out: str | Path | None, markers: tuple[str, ...], force: bool = False) -> None:
    """Raise :class:`CommandError` when the explicit folder ``out`` already holds one of ``markers``
    (another run's report) and not ``force``; nothing is created. A command that reads its input
    before it makes its report folder calls this first, so that a folder in use is refused before
    the work."""
    if out is None or force:
        return
    held = [m for m in markers if (Path(out) / m).exists()]
    if held:
        raise CommandError(f"{out} already holds a report ({held[0]}); give another --out, or --force to write "
                           f"over it")


def report_folder(out: str | None, default: str, markers: tuple[str, ...], force: bool = False,
                  reuse: bool = False, now: datetime.datetime | None = None) -> Path:
    """The folder a command writes its report into, created.

    * ``out`` is None: a new ``<default>/<date>-<time>/`` (``-2``, ``-3``… when two start in the same
      second), and ``<default>/latest`` is pointed at it; with ``reuse``, the folder ``latest``
      points at (a resumed run), or a new one when there is none.
    * ``out`` given: that folder, refused with a :class:`CommandError` when it already holds one of
      ``markers`` (another run's report) unless ``force`` or ``reuse``.
    """
    if out is not None:
        path = Path(out)
        refuse_held_folder(path, markers, force=force or reuse)
        path.mkdir(parents=True, exist_ok=True)
        return path
    base = Path(default)
    latest = base / "latest"
    if reuse and latest.is_dir():
        return latest.resolve()
    stamp = _stamp(now or datetime.datetime.now())
    base.mkdir(parents=True, exist_ok=True)
    path, n = base / stamp, 1
    while True:  # mkdir, not exists(): two invocations starting in the same second get two folders
        try:
            path.mkdir()
            break
        except FileExistsError:
            n += 1
            path = base / f"{stamp}-{n}"
    tmp = base / f".latest-{path.name}"
    try:  # a new link renamed over the old one: ``latest`` always names a folder
        os.symlink(path.name, tmp, target_is_directory=True)
        os.replace(tmp, latest)
    except OSError:  # no symbolic links here (some Windows set-ups): the newest folder is named in a file
        if tmp.is_symlink():
            tmp.unlink()
        (base / "LATEST").write_text(path.name + "\n")
    return path
