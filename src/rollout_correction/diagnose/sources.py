"""Which reader reads a dump: the plain column readers (:mod:`.readers`) or an engine's (:mod:`.engines`).

A file, a folder of files or a glob pattern (:func:`~.readers.expand_inputs`) is one dump; each file
is read by the engine named, or by the engine its keys show (only when the log-prob columns keep
their default names), or as plain columns. ``engines`` builds on ``readers``; this module sits above
both, so neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Iterator

from .engines import ENGINES, READERS, detect_engine
from .readers import Chunk, Columns, detect_format, expand_inputs, iter_jsonl, iter_npz, iter_parquet, iter_pt


def resolve_engine(path: str, fmt: str, columns: Columns, engine: str | None) -> str | None:
    """The engine whose reader reads ``path``: ``engine`` when given (``plain``: none), else the one
    recognised by the file's keys (only when the log-prob columns are not named explicitly); a pickle
    is read only as SkyRL's."""
    if engine is not None and engine != "auto":
        if engine == "plain":
            if fmt == "pickle":
                raise ValueError(f"{path}: a pickle is read only as SkyRL's TrainingInputBatch (--engine skyrl)")
            return None
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {('auto', 'plain', *ENGINES)}")
        return engine
    default = Columns()
    if fmt != "pickle" and (columns.rollout_log_probs, columns.old_log_probs) != (default.rollout_log_probs,
                                                                                 default.old_log_probs):
        return None
    return detect_engine(path, fmt)


def iter_file_chunks(path: str, columns: Columns, chunk_rows: int, fmt: str | None,
                     engine: str | None) -> tuple[str | None, Iterator[Chunk]]:
    """(the engine read, the chunks) of one file."""
    fmt = detect_format(path, fmt)
    name = resolve_engine(path, fmt, columns, engine)
    if name is not None:
        return name, READERS[name](path, columns, chunk_rows)
    reader = {"parquet": iter_parquet, "jsonl": iter_jsonl, "pt": iter_pt, "npz": iter_npz}[fmt]
    return None, reader(path, columns, chunk_rows)


def iter_chunks(path: str, columns: Columns | None = None, chunk_rows: int = 2048,
                fmt: str | None = None, engine: str | None = None) -> Iterator[Chunk]:
    """Yields the rows of ``path`` (a file, a folder of files or a glob pattern) in blocks of at most
    ``chunk_rows`` rows. ``engine``: read as that engine's dump (see :mod:`.engines`); ``None`` /
    ``"auto"`` recognises it by its keys, ``"plain"`` reads the columns as named."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    columns = columns or Columns()
    for file in expand_inputs(path):
        yield from iter_file_chunks(file, columns, chunk_rows, fmt, engine)[1]


__all__ = ["iter_chunks", "iter_file_chunks", "resolve_engine"]
