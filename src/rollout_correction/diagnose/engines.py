"""The dumps RL engines write, read as the engine writes them.

Each engine stores the rollout engine's and the trainer's log-probs of the sampled tokens in its own
layout; a reader here turns one file into :class:`~.readers.Chunk` s whose columns are *response
positions* (position 0 = the first token of the response), with the engine's own masks applied:

========  =====================================  ==================================================
engine    file                                   rollout / trainer log-probs, valid tokens
========  =====================================  ==================================================
slime     ``torch.save`` per rollout             ``rollout_log_probs`` / ``log_probs`` per sample,
          (``--save-debug-train-data``,          over the response; valid where ``loss_masks`` ≠ 0.
          ``--dump-details``): since             ``{format_version: 2, samples: [dict per
          Aug 2026 ``format_version`` 2,         sample]}``; before: ``{rollout_id, rank,
          before ``{rollout_id, rank,            rollout_data: {column: per-sample list}}`` (with
          rollout_data}``                        context parallelism those hold each rank's slices
                                                 and are refused)
NeMo-RL   ``train_data_step{N}.jsonl``           ``generation_logprobs`` / ``prev_logprobs`` over
                                                 prompt + response, right-padded, every value
                                                 wrapped in a one-element list; valid where
                                                 ``token_loss_mask`` ≠ 0 and ``sample_loss_mask``
                                                 ≠ 0, from position 1 (its loss reads ``[:, 1:]``)
prime-rl  ``token_exports/step_{N}/rank_{R}.     ``inference_logprobs`` / ``trainer_logprobs`` over
          jsonl`` (``trainer.enable_token_       prompt + response (non-finite values as
          export``)                              ``null``); valid where ``loss_mask`` and, when the
                                                 record has them, ``rl_weights`` ≠ 0 or
                                                 ``ref_kl_weights`` ≠ 0 (the tokens its mismatch
                                                 KL covers)
SkyRL     ``dumped_data/global_step_{N}_         a pickle of ``TrainingInputBatch``:
          training_input.pkl``                   ``rollout_logprobs`` / ``action_log_probs``
          (``trainer.dump_data_batch``)          (B, max_response), right-aligned; valid where
                                                 ``loss_mask`` ≠ 0 and ``response_mask`` ≠ 0; the
                                                 ``pad_size`` rows it appends are dropped
========  =====================================  ==================================================

Where a row holds the prompt too (NeMo-RL, prime-rl) the response starts at the row's first valid
token (neither format stores the prompt length); SkyRL's response starts at max_response − its
length. The SkyRL pickle is read by :class:`SkyRLUnpickler`, which resolves only the names that
format needs to inert stand-ins and refuses every other one, so no code in the file runs.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from .readers import (Chunk, Columns, _Dense, _json_pieces, _PerRow, _Ragged, assemble_chunk,
                      iter_json_records, torch_load)

ENGINES = ("slime", "nemo-rl", "prime-rl", "skyrl")

#: internal column names of the pieces the engine readers build
_COLUMNS = dict(rollout_log_probs="rollout", old_log_probs="old", response_mask="mask", lengths=None,
                rewards="reward", policy_version="version", token_ids="ids")


def _columns(columns: Columns) -> Columns:
    return Columns(**_COLUMNS, exact=columns.exact)


# --------------------------------------------------------------------------------------------
# Response positions


def to_response_positions(chunk: Chunk, start: np.ndarray, source: str, first_row: int) -> Chunk:
    """Shifts row i left by ``start[i]`` so that column j is position j of the row's response.

    Raises when a valid position lies before its row's response start.
    """
    B, T = chunk.response_mask.shape
    start = np.asarray(start, dtype=np.int64).reshape(B)
    if B == 0 or not start.any():
        return chunk
    before = chunk.response_mask & (np.arange(T)[None, :] < start[:, None])
    if before.any():
        i = int(np.nonzero(before.any(1))[0][0])
        raise ValueError(f"{source}: row {first_row + i}: a valid token lies before the response start "
                         f"({int(start[i])})")
    mask = chunk.response_mask
    last = np.where(mask.any(1), T - np.argmax(mask[:, ::-1], axis=1), start)  # one past the last valid
    width = int((last - start).max())
    idx = start[:, None] + np.arange(width)[None, :]
    inside = idx < T
    idx = np.minimum(idx, max(T - 1, 0))

    def shift(a, fill):
        if a is None:
            return None
        out = np.take_along_axis(a, idx, axis=1)
        out[~inside] = fill
        return np.ascontiguousarray(out)

    return Chunk(shift(chunk.old_log_probs, 0.0), shift(chunk.rollout_log_probs, 0.0),
                 shift(chunk.response_mask, False), chunk.rewards, chunk.policy_version,
                 shift(chunk.token_ids, 0))


def _first_valid(mask: _Ragged) -> np.ndarray:
    """Per row of a ragged 0/1 mask: the index of its first non-zero value (0 for a row with none)."""
    starts, ends = mask.offsets[:-1], mask.offsets[1:]
    nonzero = np.flatnonzero(np.asarray(mask.values[: int(mask.offsets[-1])]) != 0)
    k = np.searchsorted(nonzero, starts)  # the first non-zero at or after each row's start
    found = np.minimum(k, max(nonzero.size - 1, 0))
    hit = (k < nonzero.size) & (nonzero[found] < ends) if nonzero.size else np.zeros(len(starts), dtype=bool)
    return np.where(hit, nonzero[found] - starts if nonzero.size else 0, 0).astype(np.int64)


def _same_offsets(a: _Ragged, b: _Ragged, what: str, source: str, first_row: int) -> None:
    bad = np.nonzero(a.lengths != b.lengths)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{source}: row {first_row + i}: {what} has {int(b.lengths[i])} values but the log-probs "
                         f"have {int(a.lengths[i])}")


def _ragged_chunk(pieces: dict, mask: _Ragged, columns: Columns, source: str, first_row: int,
                  start_at_first_valid: bool) -> Chunk:
    pieces["mask"] = mask
    chunk = assemble_chunk(pieces, _columns(columns), source, first_row)
    if start_at_first_valid:
        chunk = to_response_positions(chunk, _first_valid(mask), source, first_row)
    return chunk


# --------------------------------------------------------------------------------------------
# NeMo-RL and prime-rl: JSONL


def _require(rec: dict, keys: tuple[str, ...], engine: str, source: str, line: int, why: str = "") -> None:
    missing = [k for k in keys if k not in rec]
    if missing:
        raise ValueError(f"{source}: line {line}: a {engine} record needs {missing}{why}; it has {sorted(rec)}")


def _unwrap(value: Any, key: str, source: str, line: int) -> Any:
    """NeMo-RL's ``log_batched_dict_as_jsonl`` writes each value as a one-element list (a batch of one)."""
    if not isinstance(value, list) or len(value) != 1:
        raise ValueError(f"{source}: line {line}: NeMo-RL writes {key!r} as a one-element list (a batch of "
                         f"one row); got {type(value).__name__}"
                         + (f" of length {len(value)}" if isinstance(value, list) else ""))
    return value[0]


def iter_nemo_rl(path: str, columns: Columns, chunk_rows: int) -> Iterator[Chunk]:
    """NeMo-RL's ``train_data_step{N}.jsonl`` (``logger.log_batched_dict_as_jsonl``)."""
    keys = ("generation_logprobs", "prev_logprobs", "token_loss_mask")
    row = 0
    for first, recs in iter_json_records(path, chunk_rows):
        flat = []
        for k, rec in enumerate(recs):
            _require(rec, keys, "NeMo-RL", path, first + k)
            out = {"rollout": _unwrap(rec["generation_logprobs"], "generation_logprobs", path, first + k),
                   "old": _unwrap(rec["prev_logprobs"], "prev_logprobs", path, first + k),
                   "token_mask": _unwrap(rec["token_loss_mask"], "token_loss_mask", path, first + k)}
            if "sample_loss_mask" in rec:
                out["sample_mask"] = _unwrap(rec["sample_loss_mask"], "sample_loss_mask", path, first + k)
            if "input_lengths" in rec:
                out["input_length"] = _unwrap(rec["input_lengths"], "input_lengths", path, first + k)
            if "rewards" in rec:
                out["reward"] = _unwrap(rec["rewards"], "rewards", path, first + k)
            if "token_ids" in rec:
                out["ids"] = _unwrap(rec["token_ids"], "token_ids", path, first + k)
            flat.append(out)
        names = [n for n in ("rollout", "old", "token_mask", "reward", "ids") if all(n in r for r in flat)]
        pieces = _json_pieces(flat, names, path, first, nan_for_null=("rollout", "old"))
        token_mask = pieces.pop("token_mask")
        _same_offsets(pieces["old"], token_mask, "'token_loss_mask'", path, row)
        values = np.asarray(token_mask.values, dtype=np.float64) != 0
        pos = np.arange(values.size) - np.repeat(token_mask.offsets[:-1], token_mask.lengths)
        values &= pos >= 1  # its loss reads token_mask[:, 1:]
        if all("input_length" in r for r in flat):
            lens = np.repeat(np.asarray([r["input_length"] for r in flat], dtype=np.int64), token_mask.lengths)
            values &= pos < lens
        if all("sample_mask" in r for r in flat):
            keep = np.asarray([r["sample_mask"] for r in flat], dtype=np.float64) != 0
            values &= np.repeat(keep, token_mask.lengths)
        yield _ragged_chunk(pieces, _Ragged(values.astype(np.float64), token_mask.offsets), columns, path, row, True)
        row += len(recs)


def iter_prime_rl(path: str, columns: Columns, chunk_rows: int) -> Iterator[Chunk]:
    """prime-rl's token export (``token_exports/step_{N}/rank_{R}.jsonl``, one record per sequence)."""
    row = 0
    for first, recs in iter_json_records(path, chunk_rows):
        for k, rec in enumerate(recs):
            _require(rec, ("inference_logprobs", "trainer_logprobs", "loss_mask"), "prime-rl", path, first + k,
                     " (its rows hold prompt + completion: without the loss mask the prompt would be counted)")
        flat = [{"rollout": r["inference_logprobs"], "old": r["trainer_logprobs"], "mask": r["loss_mask"],
                 **({"ids": r["token_ids"]} if "token_ids" in r else {})} for r in recs]
        names = ["rollout", "old", "mask"] + (["ids"] if all("ids" in f for f in flat) else [])
        pieces = _json_pieces(flat, names, path, first, nan_for_null=("rollout", "old"))
        mask = pieces.pop("mask")
        _same_offsets(pieces["old"], mask, "'loss_mask'", path, row)
        values = np.asarray(mask.values, dtype=np.float64) != 0
        # The component weight streams, where present: prime-rl's mismatch KL covers the loss-mask
        # tokens that are rl or ref_kl members (ce-only tokens have no sampling log-prob).
        streams = [s for s in ("rl_weights", "ref_kl_weights")
                   if all(isinstance(r.get(s), list) and all(v is not None for v in r[s]) for r in recs)]
        if streams:
            member = np.zeros_like(values)
            for s in streams:
                w = _json_pieces([{s: r[s]} for r in recs], [s], path, first)[s]
                _same_offsets(pieces["old"], w, repr(s), path, row)
                member |= np.asarray(w.values) != 0
            values &= member
        yield _ragged_chunk(pieces, _Ragged(values.astype(np.float64), mask.offsets), columns, path, row, True)
        row += len(recs)


# --------------------------------------------------------------------------------------------
# slime: torch.save of a dict


def _as_1d(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        t = value.detach().cpu()
        t = t.float() if t.is_floating_point() and t.element_size() < 4 else t
        return t.numpy().reshape(-1)
    return np.asarray(value).reshape(-1)


def _slime_samples(obj: dict, source: str) -> list[dict]:
    """The per-sample dicts of either slime layout."""
    if "samples" in obj:
        samples = obj["samples"]
        if not isinstance(samples, list):
            raise ValueError(f"{source}: slime's 'samples' must be a list of per-sample dicts")
        return samples
    data = obj.get("rollout_data")
    if not isinstance(data, dict) or "response_lengths" not in data:
        raise ValueError(f"{source}: not a slime train dump (expected 'samples' or 'rollout_data' with "
                         f"'response_lengths'); keys: {sorted(k for k in obj if isinstance(k, str))}")
    n = len(data["response_lengths"])
    per_sample = {k: v for k, v in data.items() if hasattr(v, "__len__") and not isinstance(v, (str, bytes))
                  and len(v) == n}
    return [{k: v[i] for k, v in per_sample.items()} for i in range(n)]


def iter_slime(path: str, columns: Columns, chunk_rows: int) -> Iterator[Chunk]:
    """slime's ``--save-debug-train-data`` file (both layouts)."""
    obj = torch_load(path)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected slime's dict, got {type(obj).__name__}")
    samples = _slime_samples(obj, path)
    for row in range(0, len(samples), chunk_rows):
        block = samples[row: row + chunk_rows]
        cols: dict[str, list[np.ndarray]] = {"rollout": [], "old": [], "mask": [], "ids": []}
        rewards = []
        for k, s in enumerate(block):
            i = row + k
            for key in ("rollout_log_probs", "log_probs", "response_lengths"):
                if key not in s:
                    raise ValueError(f"{path}: sample {i} has no {key!r} (it has {sorted(s)}); slime dumps "
                                     "'log_probs' when the trainer computes or captures them")
            n = int(s["response_lengths"])
            rollout, old = _as_1d(s["rollout_log_probs"]), _as_1d(s["log_probs"])
            mask = _as_1d(s["loss_masks"]) if "loss_masks" in s else np.ones(n)
            for name, arr in (("rollout_log_probs", rollout), ("log_probs", old), ("loss_masks", mask)):
                if arr.size != n:
                    raise ValueError(
                        f"{path}: sample {i}: {name!r} has {arr.size} values for a response of {n} tokens; a slime "
                        "dump written before Aug 2026 with context parallelism holds each rank's slices — dump "
                        "with --context-parallel-size 1 or a slime that restores them")
            cols["rollout"].append(rollout)
            cols["old"].append(old)
            cols["mask"].append(mask)
            if "tokens" in s:
                cols["ids"].append(_as_1d(s["tokens"])[-n:] if n else np.zeros(0, np.int64))
            rewards.append(s.get("rewards", s.get("raw_reward")))
        pieces: dict[str, Any] = {}
        for name, rows in cols.items():
            if len(rows) == len(block):
                lengths = np.array([r.size for r in rows], dtype=np.int64)
                offsets = np.zeros(len(rows) + 1, dtype=np.int64)
                np.cumsum(lengths, out=offsets[1:])
                pieces[name] = _Ragged(np.concatenate(rows) if rows else np.zeros(0), offsets)
        if all(isinstance(r, (int, float)) or hasattr(r, "item") for r in rewards):
            pieces["reward"] = _PerRow(np.array([float(r) for r in rewards]))
        mask = pieces.pop("mask")
        yield _ragged_chunk(pieces, mask, columns, path, row, False)


# --------------------------------------------------------------------------------------------
# SkyRL: a pickle of TrainingInputBatch, read without running code from the file


class _Inert:
    """Stands in for a tensor pickled through torch's storage (SkyRL before Jan 2026 pickled the
    batch's items that way besides the state it reads); never called on the file's bytes."""


def _inert(*_args, **_kwargs) -> _Inert:
    return _Inert()


class _SkyRLBatch(dict):
    """Stand-in for SkyRL's ``TrainingInputBatch``: keeps the state ``__getstate__`` wrote."""

    state: dict | None = None

    def __setstate__(self, state: dict) -> None:
        self.state = state


def _rebuild_batch(cls: type, state: dict) -> _SkyRLBatch:
    obj = _SkyRLBatch()
    obj.__setstate__(state)
    return obj


class SkyRLUnpickler(pickle.Unpickler):
    """Resolves only the names a SkyRL ``TrainingInputBatch`` pickle refers to, to stand-ins.

    The batch class and its rebuild helper (``skyrl.backends.skyrl_train.training_batch``, formerly
    ``skyrl_train.training_batch``) become :class:`_SkyRLBatch`; ``torch.device`` is torch's; the
    names of torch's storage-level tensor pickling that older releases also wrote become
    :func:`_inert`. Any other name raises ``pickle.UnpicklingError``.
    """

    _BATCH_MODULES = ("skyrl.backends.skyrl_train.training_batch", "skyrl_train.training_batch")
    _INERT = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
              ("torch.storage", "_load_from_bytes")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._BATCH_MODULES:
            if name == "_rebuild_tensor_batch":
                return _rebuild_batch
            if name in ("TrainingInputBatch", "TensorBatch", "TrainingOutputBatch"):
                return _SkyRLBatch
        if (module, name) in self._INERT:
            return _inert
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) == ("torch", "device"):
            import torch

            return torch.device
        raise pickle.UnpicklingError(f"{module}.{name}")


def load_skyrl(path: str) -> tuple[dict[str, Any], dict]:
    """(columns as numpy arrays, metadata) of a SkyRL ``TrainingInputBatch`` pickle."""
    try:
        with open(path, "rb") as fh:
            obj = SkyRLUnpickler(fh).load()
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path}: refused to unpickle: the file refers to {exc}, which a SkyRL TrainingInputBatch "
                         "dump (trainer.dump_data_batch) does not; only those pickles are read, since unpickling "
                         "anything else can run code") from None
    except (EOFError, AttributeError, ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"{path}: not a readable SkyRL TrainingInputBatch pickle ({exc})") from None
    if not isinstance(obj, _SkyRLBatch) or not isinstance(obj.state, dict) or "batch_dict" not in obj.state:
        raise ValueError(f"{path}: the pickle holds {type(obj).__name__}, not a SkyRL TrainingInputBatch")
    out: dict[str, Any] = {}
    for key, value in obj.state["batch_dict"].items():
        if value is None or not isinstance(value, dict) or value.get("format") == "tensor_list":
            continue
        if value.get("format") == "torch":
            import torch

            t = torch.load(io.BytesIO(value["data"]), map_location="cpu", weights_only=True)
            out[key] = (t.float() if t.is_floating_point() else t).numpy()
        else:
            out[key] = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    return out, obj.state.get("metadata") or {}


def iter_skyrl(path: str, columns: Columns, chunk_rows: int) -> Iterator[Chunk]:
    """SkyRL's ``trainer.dump_data_batch`` pickle."""
    data, meta = load_skyrl(path)
    for key in ("rollout_logprobs", "action_log_probs", "loss_mask"):
        if key not in data:
            raise ValueError(f"{path}: the SkyRL batch has no {key!r} (it has {sorted(data)})"
                             + ("; SkyRL stores it when the generator returns rollout log-probs"
                                if key == "rollout_logprobs" else ""))
    old = data["action_log_probs"]
    n_rows = old.shape[0] - int(meta.get("pad_size", 0) or 0)  # rows SkyRL appends for data parallelism
    valid = data["loss_mask"] != 0
    if "response_mask" in data:
        valid = valid & (data["response_mask"] != 0)
    T = old.shape[1]
    if "response_mask" in data:
        resp_len = (data["response_mask"] != 0).sum(1)
    else:
        resp_len = T - np.argmax(valid | (np.arange(T)[None, :] == T - 1), axis=1)
    ids = data["sequences"][:, -T:] if "sequences" in data and data["sequences"].shape[1] >= T else None
    for row in range(0, n_rows, chunk_rows):
        sl = slice(row, min(row + chunk_rows, n_rows))
        pieces: dict[str, Any] = {"rollout": _Dense(data["rollout_logprobs"][sl]), "old": _Dense(old[sl]),
                                  "mask": _Dense(valid[sl].astype(np.float64))}
        if ids is not None:
            pieces["ids"] = _Dense(ids[sl])
        chunk = assemble_chunk(pieces, _columns(columns), path, row)
        yield to_response_positions(chunk, T - resp_len[sl], path, row)


# --------------------------------------------------------------------------------------------
# Recognising a file


READERS = {"slime": iter_slime, "nemo-rl": iter_nemo_rl, "prime-rl": iter_prime_rl, "skyrl": iter_skyrl}


def _first_record(path: str) -> dict | None:
    try:
        return next(iter_json_records(path, 1))[1][0]
    except (StopIteration, ValueError):
        return None  # the plain reader reports the problem


def engine_of_keys(keys) -> str | None:
    """The engine whose dump has these top-level keys (a JSONL record's or a ``torch.save`` dict's)."""
    keys = set(keys)
    if {"generation_logprobs", "prev_logprobs", "token_loss_mask"} <= keys:
        return "nemo-rl"
    if {"inference_logprobs", "trainer_logprobs"} <= keys:
        return "prime-rl"
    if {"format_version", "samples"} <= keys or {"rollout_id", "rollout_data"} <= keys:
        return "slime"
    return None


def detect_engine(path: str, fmt: str) -> str | None:
    """The engine that wrote ``path``, recognised by its keys; None for the plain layout."""
    if fmt == "pickle":
        return "skyrl"
    if fmt == "jsonl":
        rec = _first_record(path)
        return engine_of_keys(rec) if rec is not None else None
    if fmt == "pt":
        try:
            obj = torch_load(path)
        except Exception:  # noqa: BLE001 - the plain reader reports the problem
            return None
        return engine_of_keys(k for k in obj if isinstance(k, str)) if isinstance(obj, dict) else None
    return None


_STEP = re.compile(r"(?:step|rollout|iter(?:ation)?)[_\-]?(\d+)", re.IGNORECASE)


def step_of(path: str) -> int | None:
    """The step or rollout number a file name carries (``train_data_step3.jsonl``, ``step_3/rank_0.jsonl``,
    ``global_step_3_training_input.pkl``, slime's ``train_data/3.pt``), else None."""
    hits = _STEP.findall(path.replace(os.sep, "/"))
    if hits:
        return int(hits[-1])
    stem = os.path.splitext(os.path.basename(path))[0]
    return int(stem) if stem.isdigit() else None


__all__ = ["ENGINES", "READERS", "SkyRLUnpickler", "detect_engine", "engine_of_keys", "load_skyrl", "step_of",
           "to_response_positions"]
