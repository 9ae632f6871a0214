"""Streaming readers for dumped rollouts: Parquet, JSONL, ``.pt`` and ``.npz``.

Every reader yields :class:`Chunk` objects — a block of whole rows, padded to the longest row of
the block — so a file of any size is diagnosed with bounded memory:

* Parquet: one record batch at a time (``pyarrow.parquet.ParquetFile.iter_batches``);
* JSONL: line by line;
* ``.npz``: uncompressed members are memory-mapped, compressed members are decompressed as a
  stream, row block by row block;
* ``.pt``: ``torch.load(..., mmap=True)`` so tensors stay on disk until a block is sliced.

Two layouts are understood, per column:

* **padded** — a 2-D array ``(rows, T)``; which positions are response tokens comes from the
  ``response_mask`` column (``(rows, T)``, 0/1 or bool) or from a ``lengths`` column (the first
  ``lengths[i]`` positions of row ``i``); without either the reader refuses the file unless
  ``Columns.all_valid`` says every position is a response token;
* **ragged** — one list per row (Parquet/JSONL list columns, a list of 1-D tensors in ``.pt``),
  or a flat 1-D array of all tokens plus a ``lengths`` column (``.npz`` / ``.pt``). Every listed
  value is a response token unless a mask or lengths column says otherwise.

A position is valid iff  mask ≠ 0 (when a mask column exists) ∧ position < lengths (when a
lengths column exists) ∧ position < the row's own length. Ragged rows read without a mask whose
other columns show that they hold the prompt too are refused (:func:`check_response_only`).

:func:`.sources.iter_chunks` reads a file, a folder of files or a glob pattern (:func:`expand_inputs`)
as one dump, with these readers or, for a file an RL engine wrote (slime, NeMo-RL, prime-rl, SkyRL),
that engine's reader (:mod:`.engines`, which builds on this module).
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_correction.console import one_line

FORMATS = ("parquet", "jsonl", "pt", "npz", "pickle")


@dataclass(frozen=True)
class Columns:
    """Names of the columns to read. ``None`` disables an optional column.

    Optional columns (everything but the two log-prob columns) are used when present under their
    default name; a name given explicitly must exist in the file.
    """

    rollout_log_probs: str = "rollout_log_probs"
    old_log_probs: str = "old_log_probs"
    response_mask: str | None = "response_mask"
    lengths: str | None = "response_length"
    rewards: str | None = "reward"
    policy_version: str | None = "policy_version"
    token_ids: str | None = "responses"
    #: padded (2-D) log-probs without a mask or lengths column are refused unless this is set
    all_valid: bool = False
    #: read the log-probs in float64, which holds every value of any float format exactly (the
    #: zero-diff certificate compares bits), instead of float32
    exact: bool = False

    def optional_fields(self) -> tuple[str, ...]:
        return ("response_mask", "lengths", "rewards", "policy_version", "token_ids")


@dataclass
class Chunk:
    """A block of whole rows, padded to ``T`` = the longest row of the block.

    old_log_probs, rollout_log_probs: (B, T) float32 (float64 with ``Columns.exact``); 0 at invalid positions.
    response_mask: (B, T) bool, True at response tokens.
    rewards: (B,) float64 or None.  policy_version: (B,) int64 or None.
    token_ids: (B, T) int64 or None (0 at invalid positions).
    """

    old_log_probs: np.ndarray
    rollout_log_probs: np.ndarray
    response_mask: np.ndarray
    rewards: np.ndarray | None = None
    policy_version: np.ndarray | None = None
    token_ids: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.response_mask.shape[0])

    def take(self, rows: np.ndarray, width: int) -> Chunk:
        """The chunk of the given rows, cut to the first ``width`` positions (which must hold every
        valid position of those rows)."""
        def sel(a):
            return None if a is None else np.ascontiguousarray(a[rows][:, :width] if a.ndim == 2 else a[rows])

        return Chunk(sel(self.old_log_probs), sel(self.rollout_log_probs), sel(self.response_mask),
                     sel(self.rewards), sel(self.policy_version), sel(self.token_ids))


# --------------------------------------------------------------------------------------------
# Column pieces: what one column looks like inside one block of rows.


@dataclass
class _Dense:
    """(B, T) array, one row per sample."""

    array: np.ndarray


@dataclass
class _Ragged:
    """Row i holds values[offsets[i]:offsets[i+1]]; offsets start at 0."""

    values: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class _PerRow:
    """(B,) one scalar per sample."""

    array: np.ndarray


def _pad(piece: _Dense | _Ragged, width: int, dtype, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns (values (B, width), in_row (B, width) bool: the position exists in the row)."""
    if isinstance(piece, _Dense):
        arr = np.asarray(piece.array)
        out = np.zeros((arr.shape[0], width), dtype=dtype)
        out[:, : arr.shape[1]] = arr
        in_row = np.zeros((arr.shape[0], width), dtype=bool)
        in_row[:, : arr.shape[1]] = True
        return out, in_row
    lengths = piece.lengths
    in_row = np.arange(width)[None, :] < lengths[:, None]
    out = np.zeros(in_row.shape, dtype=dtype)
    out[in_row] = piece.values[: int(piece.offsets[-1])]  # row-major order = concatenation order
    return out, in_row


def _row_lengths(piece: _Dense | _Ragged) -> np.ndarray:
    if isinstance(piece, _Dense):
        return np.full(piece.array.shape[0], piece.array.shape[1], dtype=np.int64)
    return piece.lengths.astype(np.int64)


def _check_same_lengths(got: np.ndarray, want: np.ndarray, source: str, first_row: int, what: str) -> None:
    """Raises naming the first row where ``got`` (lengths of one column) differs from ``want``."""
    bad = np.nonzero(got != want)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{source}: row {first_row + i}: " + what.format(got=int(got[i]), want=int(want[i])))


def _check_piece(piece: Any, name: str, source: str) -> None:
    if isinstance(piece, _PerRow):
        raise ValueError(
            f"{source}: column {name!r} holds one scalar per row; it must hold one value per token "
            "(a 2-D array, or one list per row, or a flat array with a lengths column)"
        )


def assemble_chunk(pieces: dict[str, Any], columns: Columns, source: str, first_row: int) -> Chunk:
    """Turns the per-column pieces of one block of rows into a padded :class:`Chunk`.

    Raises ValueError naming the column and row when the columns disagree.
    """
    c_old, c_roll = columns.old_log_probs, columns.rollout_log_probs
    old, roll = pieces[c_old], pieces[c_roll]
    for name, piece in ((c_old, old), (c_roll, roll)):
        _check_piece(piece, name, source)
    len_old, len_roll = _row_lengths(old), _row_lengths(roll)
    if len_old.shape != len_roll.shape:
        raise ValueError(f"{source}: columns {c_old!r} and {c_roll!r} have different numbers of rows")
    _check_same_lengths(len_old, len_roll, source, first_row,
                        f"{c_old!r} has {{got}} values but {c_roll!r} has {{want}}; both must have one value "
                        "per position")
    n_rows = len_old.shape[0]
    width = int(len_old.max()) if n_rows else 0
    dtype = np.float64 if columns.exact else np.float32
    old_arr, in_row = _pad(old, width, dtype, c_old)
    roll_arr, _ = _pad(roll, width, dtype, c_roll)
    valid = in_row

    mask_name = columns.response_mask
    if mask_name is not None and mask_name in pieces:
        mask_piece = pieces[mask_name]
        _check_piece(mask_piece, mask_name, source)
        _check_same_lengths(_row_lengths(mask_piece), len_old, source, first_row,
                            f"{mask_name!r} has {{got}} positions but the log-prob columns have {{want}}; the "
                            "mask must align with the log-probs")
        mask_arr, _ = _pad(mask_piece, width, np.float64, mask_name)
        if not np.isin(mask_arr, (0.0, 1.0)).all():
            raise ValueError(f"{source}: column {mask_name!r} must hold only 0/1 (or bool) values")
        valid = valid & (mask_arr != 0)

    len_name = columns.lengths
    if len_name is not None and len_name in pieces:
        lens = pieces[len_name]
        if not isinstance(lens, _PerRow):
            raise ValueError(f"{source}: column {len_name!r} must hold one integer per row")
        lens = np.asarray(lens.array).astype(np.int64)
        bad = np.nonzero((lens < 0) | (lens > len_old))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{source}: row {first_row + i}: {len_name!r} = {int(lens[i])} is outside "
                f"[0, {int(len_old[i])}] (the number of log-prob positions in that row)"
            )
        valid = valid & (np.arange(width)[None, :] < lens[:, None])

    has_mask = mask_name is not None and mask_name in pieces
    has_len = len_name is not None and len_name in pieces
    if isinstance(old, _Dense) and not (has_mask or has_len or columns.all_valid):
        raise ValueError(
            f"{source}: the log-prob columns are padded 2-D arrays but there is no response mask or lengths "
            f"column to tell response tokens from padding; name one with --mask-col / --lengths-col, or pass "
            "--all-valid if every position is a response token")
    old_arr[~valid] = 0.0
    roll_arr[~valid] = 0.0
    chunk = Chunk(old_log_probs=old_arr, rollout_log_probs=roll_arr, response_mask=valid)
    for attr, dtype in (("rewards", np.float64), ("policy_version", np.int64)):
        name = getattr(columns, attr)
        if name is not None and name in pieces:
            piece = pieces[name]
            if not isinstance(piece, _PerRow):
                raise ValueError(f"{source}: column {name!r} must hold one scalar per row")
            arr = np.asarray(piece.array)
            if arr.shape[0] != n_rows:
                raise ValueError(f"{source}: column {name!r} has {arr.shape[0]} rows, expected {n_rows}")
            setattr(chunk, attr, arr.astype(dtype))
    name = columns.token_ids
    if name is not None and name in pieces:
        piece = pieces[name]
        _check_piece(piece, name, source)
        _check_same_lengths(_row_lengths(piece), len_old, source, first_row,
                            f"{name!r} has {{got}} values but the log-prob columns have {{want}}")
        ids, _ = _pad(piece, width, np.int64, name)
        ids[~valid] = 0
        chunk.token_ids = ids
    return chunk


def _wanted(columns: Columns, available: list[str], source: str) -> list[str]:
    """The columns to read: required ones must exist; explicitly named optional ones too."""
    default = Columns()
    missing = [n for n in (columns.rollout_log_probs, columns.old_log_probs) if n not in available]
    if missing:
        raise ValueError(
            f"{source}: missing column(s) {missing}; available: {sorted(available)}. "
            "Name the columns with --rollout-col / --old-col."
        )
    wanted = [columns.rollout_log_probs, columns.old_log_probs]
    for f in columns.optional_fields():
        name = getattr(columns, f)
        if name is None:
            continue
        if name in available:
            wanted.append(name)
        elif name != getattr(default, f):
            raise ValueError(f"{source}: column {name!r} (given for {f}) not found; available: {sorted(available)}")
    return wanted


# --------------------------------------------------------------------------------------------
# Never the wrong tokens: ragged rows that hold the prompt too


def _mask_like(name: str) -> bool:
    low = name.lower()
    return low.endswith(("mask", "masks")) and "attention" not in low and not low.startswith("is_")


def _seq_len(v) -> int | None:
    if isinstance(v, (list, tuple)):
        return len(v)
    if hasattr(v, "shape") and len(getattr(v, "shape")) == 1:
        return int(v.shape[0])
    return None


def check_response_only(source: str, columns: Columns, row_lengths: np.ndarray, extras: dict[str, list],
                        lengths: np.ndarray | None = None) -> None:
    """Refuses ragged rows, read without a mask, whose other columns show that they hold the prompt too.

    Ragged rows are taken as the response, every value a token. That is wrong when
    (a) the rows' lengths exceed their response lengths (the lengths column) while the rows differ in
    length, (b) an unused column named like a mask (``loss_mask``, ``token_loss_mask``, …) has one 0/1
    per position and some zeros, or (c) an unused prompt column and a completion / response column
    have lengths that add up to the row's. ``extras``: the first rows of the file's unused columns
    (one value per row). ``--all-valid`` turns the check off.
    """
    if columns.all_valid or row_lengths.size == 0:
        return
    hint = " or --all-valid if every position really is a response token"
    if lengths is not None and np.unique(row_lengths).size > 1 and (row_lengths > lengths).any():
        i = int(np.nonzero(row_lengths > lengths)[0][0])
        raise ValueError(
            f"{source}: row {i} holds {int(row_lengths[i])} log-probs for a response of {int(lengths[i])} tokens "
            f"({columns.lengths!r}): the rows hold more than the response (the prompt?), and counting their first "
            f"positions would count prompt tokens; pass the response mask with --mask-col NAME{hint}")
    n = row_lengths.size
    for name, vals in extras.items():
        if not _mask_like(name) or len(vals) < n:
            continue
        lens = [_seq_len(v) for v in vals[:n]]
        if any(L is None for L in lens) or not np.array_equal(np.asarray(lens), row_lengths):
            continue
        flat = np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1) for v in vals[:n]] or [np.zeros(0)])
        if flat.size and np.isin(flat, (0.0, 1.0)).all() and (flat == 0).any():
            raise ValueError(
                f"{source}: the log-prob rows are read without a mask, but column {name!r} holds one 0/1 per "
                f"position with {int((flat == 0).sum())} zeros in the first {n} rows: counting every position "
                f"would count the prompt or masked tokens; pass --mask-col {name}{hint}")

    def per_row(prefixes):
        for name, vals in extras.items():
            low = name.lower()
            if low.startswith(prefixes) and not _mask_like(name) and len(vals) >= n:
                lens = [_seq_len(v) if _seq_len(v) is not None else
                        (int(v) if isinstance(v, (int, np.integer)) else None) for v in vals[:n]]
                if all(L is not None for L in lens):
                    yield name, np.asarray(lens, dtype=np.int64)

    for p_name, p_len in per_row(("prompt",)):
        for c_name, c_len in per_row(("completion", "response")):
            if p_len.any() and np.array_equal(p_len + c_len, row_lengths):
                raise ValueError(
                    f"{source}: each log-prob row is as long as {p_name!r} + {c_name!r}: the rows hold the prompt "
                    f"as well as the response, and every position would be counted; pass the response mask with "
                    f"--mask-col NAME{hint}")


# --------------------------------------------------------------------------------------------
# Parquet


def _arrow_piece(arr, name: str, source: str, null_as_nan: bool = False):
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.null_count:
        raise ValueError(f"{source}: column {name!r} has null rows; every row needs a value")
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        flat = arr.flatten().to_numpy(zero_copy_only=False)
        return _Dense(flat.reshape(len(arr), t.list_size))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        offsets = arr.offsets.to_numpy().astype(np.int64)
        values = arr.flatten()
        if values.null_count and not (null_as_nan and pa.types.is_floating(values.type)):
            raise ValueError(f"{source}: column {name!r} has null values inside a row")
        return _Ragged(values.to_numpy(zero_copy_only=False), offsets - offsets[0])
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return _PerRow(arr.to_numpy(zero_copy_only=False))
    raise ValueError(f"{source}: column {name!r} has unsupported type {t}")


def iter_parquet(path: str, columns: Columns, chunk_rows: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    wanted = _wanted(columns, pf.schema_arrow.names, path)
    row = 0
    log_probs = (columns.rollout_log_probs, columns.old_log_probs)
    for batch in pf.iter_batches(batch_size=chunk_rows, columns=wanted):
        pieces = {n: _arrow_piece(batch.column(n), n, path, null_as_nan=n in log_probs) for n in wanted}
        old = pieces[columns.old_log_probs]
        if row == 0 and isinstance(old, _Ragged) and columns.response_mask not in pieces:
            names = [n for n in pf.schema_arrow.names if n not in wanted and (
                _mask_like(n) or n.lower().startswith(("prompt", "completion", "response")))]
            extras = {}
            if names:
                first = next(pf.iter_batches(batch_size=batch.num_rows, columns=names))
                extras = {n: first.column(n).to_pylist() for n in names}
            lens = pieces.get(columns.lengths)
            check_response_only(path, columns, old.lengths, extras,
                                np.asarray(lens.array).astype(np.int64) if isinstance(lens, _PerRow) else None)
        yield assemble_chunk(pieces, columns, path, row)
        row += batch.num_rows


# --------------------------------------------------------------------------------------------
# JSONL


def _json_pieces(rows: list[dict], wanted: list[str], source: str, first_line: int,
                 nan_for_null: tuple[str, ...] = ()) -> dict:
    """Per-column pieces of a block of JSON records. In the columns named in ``nan_for_null`` a
    ``null`` inside a row's list is read as NaN (JSON has no NaN; writers put ``null`` in its place)."""
    pieces = {}
    for name in wanted:
        vals = [r.get(name) for r in rows]
        bad = [i for i, v in enumerate(vals) if v is None]
        if bad:
            raise ValueError(f"{source}: line {first_line + bad[0]}: column {name!r} is missing or null")
        is_list = [isinstance(v, list) for v in vals]
        if all(is_list):
            lengths = np.fromiter((len(v) for v in vals), dtype=np.int64, count=len(vals))
            offsets = np.zeros(len(vals) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            items = itertools.chain.from_iterable(vals)
            if name in nan_for_null:
                items = (math.nan if v is None else v for v in items)
            try:
                flat = np.fromiter(items, dtype=np.float64, count=int(offsets[-1]))
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"{source}: lines {first_line}-{first_line + len(rows) - 1}: column {name!r} holds a "
                    f"non-numeric value ({exc}); use NaN for missing log-probs"
                ) from None
            pieces[name] = _Ragged(flat, offsets)
        elif not any(is_list):
            try:
                pieces[name] = _PerRow(np.asarray(vals, dtype=np.float64))
            except (TypeError, ValueError):
                raise ValueError(f"{source}: column {name!r} must be numeric") from None
        else:
            i = is_list.index(False) if is_list[0] else is_list.index(True)
            raise ValueError(f"{source}: line {first_line + i}: column {name!r} mixes lists and scalars")
    return pieces


def _json_loader():
    """orjson.loads when installed (several times faster), falling back to json.loads for lines
    orjson refuses (json also accepts the NaN / Infinity tokens that dumps of log-probs contain)."""
    try:
        import orjson
    except ImportError:
        return json.loads

    def loads(line: bytes):
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:
            return json.loads(line)

    return loads


def _jsonl_chunk(rows: list[dict], wanted: list[str], columns: Columns, path: str, first_line: int,
                 row: int) -> Chunk:
    pieces = _json_pieces(rows, wanted, path, first_line,
                          nan_for_null=(columns.rollout_log_probs, columns.old_log_probs))
    old = pieces[columns.old_log_probs]
    if row == 0 and isinstance(old, _Ragged) and columns.response_mask not in pieces:
        lens = pieces.get(columns.lengths)
        extras = {k: [r.get(k) for r in rows] for k in rows[0] if k not in wanted}
        check_response_only(path, columns, old.lengths, extras,
                            np.asarray(lens.array).astype(np.int64) if isinstance(lens, _PerRow) else None)
    return assemble_chunk(pieces, columns, path, row)


def iter_json_records(path: str, chunk_rows: int) -> Iterator[tuple[int, list[dict]]]:
    """(line number of the first record, records) of a JSONL file in blocks of ``chunk_rows`` records;
    blank lines are skipped."""
    loads = _json_loader()
    rows: list[dict] = []
    first = 1
    with open(path, "rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}: line {line_no}: expected a JSON object per line")
            if not rows:
                first = line_no
            rows.append(rec)
            if len(rows) == chunk_rows:
                yield first, rows
                rows = []
    if rows:
        yield first, rows


def iter_jsonl(path: str, columns: Columns, chunk_rows: int) -> Iterator[Chunk]:
    wanted: list[str] | None = None
    row = 0
    for first_line, rows in iter_json_records(path, chunk_rows):
        if wanted is None:
            wanted = _wanted(columns, list(rows[0]), f"{path} (line {first_line})")
        yield _jsonl_chunk(rows, wanted, columns, path, first_line, row)
        row += len(rows)
    if wanted is None:
        raise ValueError(f"{path}: the file holds no rows")


# --------------------------------------------------------------------------------------------
# Array containers (.npz / .pt): every column is read sequentially, block by block.


class _ArrayColumn:
    """Sequential reader over one array column (memory-mapped, in-memory or a stream)."""

    def __init__(self, name: str, shape: tuple[int, ...], read):
        self.name, self.shape, self._read = name, shape, read

    def read(self, n: int) -> np.ndarray:
        """The next n leading-axis entries."""
        return self._read(n)


def _sliceable_column(name: str, arr) -> _ArrayColumn:
    pos = [0]

    def read(n: int):
        out = arr[pos[0] : pos[0] + n]
        pos[0] += n
        if hasattr(out, "numpy"):  # a torch tensor: numpy has no bfloat16, widen half types per block
            out = out.float() if out.is_floating_point() and out.element_size() < 4 else out
            return out.numpy()
        return np.asarray(out)

    return _ArrayColumn(name, tuple(arr.shape), read)


def _npy_stream_column(name: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> _ArrayColumn:
    """A .npy member of a zip: memory-mapped if stored uncompressed, else streamed."""
    fh = zf.open(info)
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    if dtype.hasobject:
        raise ValueError(
            f"{path}: member {name!r} is an object array; store ragged data as a flat 1-D array "
            "plus a lengths column"
        )
    if fortran and len(shape) > 1:
        raise ValueError(f"{path}: member {name!r} is Fortran-ordered; save it C-ordered")
    header_len = fh.tell()
    if info.compress_type == zipfile.ZIP_STORED:
        # Data offset = local header + name + extra + npy header.
        with open(path, "rb") as raw:
            raw.seek(info.header_offset)
            local = raw.read(30)
            n_name = int.from_bytes(local[26:28], "little")
            n_extra = int.from_bytes(local[28:30], "little")
        offset = info.header_offset + 30 + n_name + n_extra + header_len
        fh.close()
        if int(np.prod(shape)) == 0:
            return _sliceable_column(name, np.zeros(shape, dtype=dtype))
        mm = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
        return _sliceable_column(name, mm)
    row_items = int(np.prod(shape[1:])) if len(shape) > 1 else 1

    def read(n: int):
        data = fh.read(n * row_items * dtype.itemsize)
        got = len(data) // (row_items * dtype.itemsize)
        return np.frombuffer(data, dtype=dtype).reshape((got,) + tuple(shape[1:]))

    return _ArrayColumn(name, tuple(shape), read)


class _ListColumn:
    """A list of per-row 1-D arrays (ragged rows in a .pt file)."""

    def __init__(self, name: str, rows: list):
        self.name, self.rows, self.pos = name, rows, 0
        self.shape = (len(rows),)

    def read(self, n: int) -> _Ragged:
        block = [np.asarray(r.numpy() if hasattr(r, "numpy") else r).reshape(-1) for r in self.rows[self.pos : self.pos + n]]
        self.pos += n
        lengths = np.array([len(b) for b in block], dtype=np.int64)
        offsets = np.zeros(len(block) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(block) if block else np.zeros(0)
        return _Ragged(values, offsets)


def _iter_array_columns(cols: dict, columns: Columns, source: str, chunk_rows: int) -> Iterator[Chunk]:
    """Shared by .npz and .pt: decides each column's layout and reads it in blocks of rows."""
    wanted = _wanted(columns, list(cols), source)
    len_name = columns.lengths if columns.lengths in wanted else None
    lengths = None
    if len_name is not None:
        lengths = np.asarray(cols[len_name].read(cols[len_name].shape[0])).astype(np.int64).reshape(-1)
    n_rows = None
    kinds: dict[str, str] = {}
    for name in wanted:
        col = cols[name]
        if name == len_name:
            kinds[name], rows = "scalar", len(lengths)
        elif isinstance(col, _ListColumn):
            kinds[name], rows = "list", col.shape[0]
        elif len(col.shape) == 2:
            kinds[name], rows = "dense", col.shape[0]
        elif len(col.shape) == 1 and name in (columns.rewards, columns.policy_version):
            kinds[name], rows = "scalar", col.shape[0]
        elif len(col.shape) == 1:
            if lengths is None:
                raise ValueError(
                    f"{source}: column {name!r} is a flat 1-D array; ragged data stored flat needs a "
                    f"lengths column (--lengths-col, default {Columns().lengths!r})"
                )
            if col.shape[0] != int(lengths.sum()):
                raise ValueError(
                    f"{source}: column {name!r} has {col.shape[0]} values but the lengths column sums "
                    f"to {int(lengths.sum())}"
                )
            kinds[name], rows = "flat", len(lengths)
        else:
            raise ValueError(f"{source}: column {name!r} has unsupported shape {col.shape}")
        if n_rows is None:
            n_rows = rows
        elif rows != n_rows:
            raise ValueError(f"{source}: column {name!r} has {rows} rows, expected {n_rows}")
    row = 0
    while row < n_rows:
        n = min(chunk_rows, n_rows - row)
        pieces: dict[str, Any] = {}
        flat_offsets = None
        for name in wanted:
            kind = kinds[name]
            if kind == "scalar":
                pieces[name] = _PerRow(lengths[row : row + n] if name == len_name else cols[name].read(n))
            elif kind == "list":
                pieces[name] = cols[name].read(n)
            elif kind == "dense":
                pieces[name] = _Dense(cols[name].read(n))
            else:
                if flat_offsets is None:
                    flat_offsets = np.zeros(n + 1, dtype=np.int64)
                    np.cumsum(lengths[row : row + n], out=flat_offsets[1:])
                pieces[name] = _Ragged(cols[name].read(int(flat_offsets[-1])), flat_offsets)
        if flat_offsets is not None and len_name is not None:
            # Row lengths already delimit the rows; do not apply them a second time as a mask.
            pieces.pop(len_name, None)
        yield assemble_chunk(pieces, columns, source, row)
        row += n


def iter_npz(path: str, columns: Columns, chunk_rows: int) -> Iterator[Chunk]:
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a readable .npz file (not a zip archive: text, or cut short); pass a file "
                         f"written by numpy.savez, or --format to read it as another format")
    with zipfile.ZipFile(path) as zf:
        cols = {}
        for info in zf.infolist():
            if info.filename.endswith(".npy"):
                name = info.filename[: -len(".npy")]
                cols[name] = info
        wanted = _wanted(columns, list(cols), path)
        opened = {name: _npy_stream_column(name, zf, cols[name], path) for name in wanted}
        yield from _iter_array_columns(opened, columns, path, chunk_rows)


def torch_load(path: str):
    """``torch.load`` with ``weights_only=True`` (tensors and plain containers; no code from the file runs),
    memory-mapped when the file allows it; an object outside that set, or a file that is not a whole
    ``torch.save`` file (text, truncated), is refused with a ValueError."""
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch's notes on the pickle protocol say nothing about the dump
            warnings.simplefilter("ignore")
            try:
                return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        raise ValueError(f"{path}: refused: the file holds more than tensors and plain containers, which "
                         f"torch.load(weights_only=True) cannot read without running code from it "
                         f"({first[-1] if first else exc})") from None
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as exc:  # text, a truncated or damaged archive: torch raises many kinds of error
        reason = one_line(exc).split(". ")[0]
        raise ValueError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {reason}); "
                         f"pass a file written by torch.save, or --format to read it as another format") from None


def iter_pt(path: str, columns: Columns, chunk_rows: int) -> Iterator[Chunk]:
    import torch

    obj = torch_load(path)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected torch.save of a dict of tensors or lists, got {type(obj).__name__}")
    wanted = _wanted(columns, [k for k in obj if isinstance(k, str)], path)
    cols: dict[str, Any] = {}
    for name in wanted:
        v = obj[name]
        if isinstance(v, torch.Tensor):
            cols[name] = _sliceable_column(name, v)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(r, (torch.Tensor, list, tuple)) for r in v):
            cols[name] = _ListColumn(name, list(v))
        elif isinstance(v, (list, tuple)):
            cols[name] = _sliceable_column(name, np.asarray(v))
        else:
            raise ValueError(f"{path}: entry {name!r} must be a tensor or a list, got {type(v).__name__}")
    old = cols[columns.old_log_probs]
    if isinstance(old, _ListColumn) and columns.response_mask not in cols:
        n = min(chunk_rows, len(old.rows))
        row_lengths = np.array([_seq_len(np.asarray(r).reshape(-1)) for r in old.rows[:n]], dtype=np.int64)
        extras = {k: list(v[:n]) for k, v in obj.items() if isinstance(k, str) and k not in wanted
                  and isinstance(v, (list, tuple, torch.Tensor))}
        lens = obj.get(columns.lengths) if columns.lengths in wanted else None
        check_response_only(path, columns, row_lengths, extras,
                            None if lens is None else np.asarray(lens[:n]).astype(np.int64).reshape(-1))
    yield from _iter_array_columns(cols, columns, path, chunk_rows)


# --------------------------------------------------------------------------------------------


def detect_format(path: str, fmt: str | None = None) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")
        return fmt
    lower = path.lower()
    for ext, name in _EXTENSIONS:
        if lower.endswith(ext):
            return name
    raise ValueError(f"{path}: cannot tell the format from the extension; pass --format {{{','.join(FORMATS)}}}")


_EXTENSIONS = ((".parquet", "parquet"), (".pq", "parquet"), (".jsonl", "jsonl"), (".json", "jsonl"),
               (".ndjson", "jsonl"), (".pt", "pt"), (".pth", "pt"), (".npz", "npz"), (".pkl", "pickle"),
               (".pickle", "pickle"))


def _natural_key(path: str) -> list:
    """Sort key that orders step_2 before step_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def expand_inputs(path: str) -> list[str]:
    """The files that form one dump: ``path`` itself, every file with a known extension under a folder
    (recursively), or the files a glob pattern matches; in natural order (step_2 before step_10)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        found = [os.path.join(d, f) for d, _, files in os.walk(path) for f in files
                 if f.lower().endswith(tuple(e for e, _ in _EXTENSIONS))]
        if not found:
            raise ValueError(f"{path}: the folder holds no dump file ({', '.join(e for e, _ in _EXTENSIONS)})")
        return sorted(found, key=_natural_key)
    if os.path.exists(path):
        return [path]
    if glob.has_magic(path):
        found = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
        if not found:
            raise FileNotFoundError(f"{path}: the pattern matches no file")
        return sorted(found, key=_natural_key)
    raise FileNotFoundError(f"{path}: no such file")


__all__ = ["FORMATS", "Chunk", "Columns", "assemble_chunk", "check_response_only", "detect_format", "expand_inputs",
           "iter_json_records", "torch_load"]
