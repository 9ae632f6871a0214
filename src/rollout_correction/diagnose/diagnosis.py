"""Diagnose a file (or tensors): read → profile → health checks → recommendation."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .health import Check, health_checks, routing_checks
from .profile import MismatchProfile, ProfileResult
from .readers import Chunk, Columns, detect_format, expand_inputs
from .recommend import Recommendation, recommend
from .sentinels import log_prob_floor
from .sources import iter_file_chunks


@dataclass
class Diagnosis:
    profile: ProfileResult
    health: list[Check]
    recommendation: Recommendation
    source: dict = field(default_factory=dict)  # path, format, columns, elapsed seconds

    @property
    def worst_verdict(self) -> str:
        order = {"ok": 0, "warn": 1, "fail": 2}
        return max((c.verdict for c in self.health), key=order.__getitem__, default="ok")


def _finish(profile: MismatchProfile, source: dict) -> Diagnosis:
    if profile.counters.rows == 0:
        raise ValueError(f"{source.get('path', 'input')}: no rows to diagnose")
    if profile.counters.tokens == 0 and profile.counters.tokens_positive_log_prob:
        raise ValueError(f"{source.get('path', 'input')}: every row holds a value > 0, which no log-probability "
                         "is: these columns hold something else (probabilities? logits?)")
    if profile.counters.tokens == 0:
        raise ValueError(
            f"{source.get('path', 'input')}: no valid response token (every row is empty, masked out, or "
            "holds a non-finite log-prob); check the mask / lengths columns")
    res = profile.result()
    return Diagnosis(profile=res, health=health_checks(res), recommendation=recommend(res), source=source)


def _totals(profile: MismatchProfile) -> np.ndarray:
    """(rows, rows with a non-finite log-prob, tokens, Σ log ρ, Σ k3, engine sentinels) read so far."""
    c, pos = profile.counters, profile.position
    return np.array([c.rows, c.rows_nonfinite, c.tokens, pos.sums["log_ratio"].sum(), pos.sums["k3"].sum(),
                     profile.sentinels.tokens])


def _file_entry(path: str, root: str, engine: str | None, delta: np.ndarray) -> dict:
    from .engines import step_of

    rows, nonfinite, tokens, log_ratio, k3, sentinels = delta
    rel = os.path.relpath(path, root) if os.path.isdir(root) else path
    return {"file": rel, "engine": engine or "plain", "step": step_of(rel), "rows": int(rows),
            "rows_nonfinite": int(nonfinite), "tokens": int(tokens), "sentinel_tokens": int(sentinels),
            "kl": -log_ratio / tokens if tokens else 0.0, "k3_kl": k3 / tokens if tokens else 0.0}


def diagnose_file(path: str, columns: Columns | None = None, chunk_rows: int = 2048, fmt: str | None = None,
                  presets: list[str] | None = None, engine: str | None = None, config=None,
                  progress=None) -> Diagnosis:
    """Streams ``path`` in blocks of ``chunk_rows`` rows and diagnoses the mismatch.

    path: a file, a folder of files or a glob pattern; several files are diagnosed as one dump (the
    statistics of their concatenation), with per-file rows, tokens, kl and k3 in ``source["files"]``.
    engine: read as that engine's dump (:mod:`.engines`); None recognises it by its keys.
    presets: what-if presets (default every preset of ``RolloutCorrectionConfig``).
    config: the correction's config (a ``RolloutCorrectionConfig``, a preset name or a mapping); its
    ``log_prob_floor`` is the engine-sentinel floor (:mod:`.sentinels`; default −1000).
    progress: called as ``progress(files_done, files_total, entry)`` after each file, with its entry of
    ``source["files"]``.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    columns = columns or Columns()
    t0 = time.perf_counter()
    profile = MismatchProfile(presets=presets, log_prob_floor=log_prob_floor(config))
    files, formats, engines = [], set(), set()
    inputs = expand_inputs(path)
    for file in inputs:
        before = _totals(profile)
        name, chunks = iter_file_chunks(file, columns, chunk_rows, fmt, engine)
        for chunk in chunks:
            profile.update(chunk)
        formats.add(detect_format(file, fmt))
        engines.add(name or "plain")
        files.append(_file_entry(file, str(path), name, _totals(profile) - before))
        if progress is not None:
            progress(len(files), len(inputs), files[-1])
    source = {"path": str(path), "format": ",".join(sorted(formats)), "engine": ",".join(sorted(engines)),
              "columns": columns.__dict__.copy(), "chunk_rows": chunk_rows}
    if len(files) > 1:
        source["files"] = files
    diag = _finish(profile, source)
    diag.source["elapsed_seconds"] = time.perf_counter() - t0
    return diag


def _as_numpy(x, dtype) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, any dtype (bf16 included), any device
        return x.detach().to("cpu", dtype=torch.float32).numpy().astype(dtype, copy=False)
    return np.asarray(x, dtype=dtype)


def diagnose_tensors(old_log_prob, rollout_log_prob, response_mask, presets: list[str] | None = None,
                     chunk_rows: int = 2048, routing: tuple | None = None, config=None) -> Diagnosis:
    """Diagnoses in-memory (B, T) tensors or arrays (``response_mask`` 0/1 or bool).

    ``routing``: for a mixture-of-experts model, ``(engine_record, trainer_record[, mask])`` —
    :class:`rollout_correction.moe.RoutingRecord` s of the same tokens (and the mask of the recorded
    positions to compare); their :func:`~rollout_correction.moe.routing_agreement` (and, when both
    carry router probabilities, :func:`~rollout_correction.moe.routing_confidence`) joins the
    metrics and its check the health checks. ``config``: as for :func:`diagnose_file`.
    """
    old, roll = _as_numpy(old_log_prob, np.float32), _as_numpy(rollout_log_prob, np.float32)
    mask = _as_numpy(response_mask, np.float32) != 0
    if not (old.shape == roll.shape == mask.shape) or old.ndim != 2:
        raise ValueError(f"expected three (B, T) arrays of one shape, got {old.shape}, {roll.shape}, {mask.shape}")
    t0 = time.perf_counter()
    profile = MismatchProfile(presets=presets, log_prob_floor=log_prob_floor(config))
    for s in range(0, old.shape[0], chunk_rows):
        sl = slice(s, s + chunk_rows)
        profile.update(Chunk(np.where(mask[sl], old[sl], 0), np.where(mask[sl], roll[sl], 0), mask[sl]))
    diag = _finish(profile, {"path": "<tensors>", "format": "tensors"})
    if routing is not None:
        add_routing(diag, *routing)
    diag.source["elapsed_seconds"] = time.perf_counter() - t0
    return diag


def add_routing(diag: Diagnosis, engine_record, trainer_record, mask=None) -> Diagnosis:
    """Add the routing agreement of two records to a diagnosis (metrics and health check)."""
    from rollout_correction import metrics_to_floats
    from rollout_correction.moe import routing_agreement, routing_confidence

    values = metrics_to_floats(routing_agreement(engine_record, trainer_record, mask))
    if engine_record.topk_mass is not None and trainer_record.topk_mass is not None:
        values.update(metrics_to_floats(routing_confidence(engine_record, trainer_record, mask)))
    diag.profile.metrics.update(values)
    diag.health.extend(routing_checks(values))
    return diag
