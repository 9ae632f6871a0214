"""Read a logged metrics history: JSONL, a CSV export (wandb, MLflow) or a TensorBoard event
directory. Every reader returns ``[(step, {metric: value}), ...]`` sorted by step, with the
metrics under their logged names (the monitor keeps the ``rollout_corr/`` ones).

Formats:

* **JSONL** — one JSON object per line with a step under ``step``, ``_step``, ``global_step`` or
  ``train/global_step`` and the metrics either flat or under ``"metrics"`` (what
  :meth:`HealthMonitor.save` writes). Lines without a step are numbered in order.
* **CSV, wide** (wandb's panel and run-history exports): a step column (``Step``, ``step``,
  ``_step``, ``global_step``) and one column per metric. wandb's panel export names columns
  ``<run> - <metric>`` and adds ``<metric>__MIN`` / ``__MAX``; the run name is removed and the
  min/max columns are dropped. Empty cells are missing values.
* **CSV, long** (MLflow's metric history: ``MlflowClient.get_metric_history`` rows or the UI
  export): columns ``key`` (or ``metric``), ``value`` and ``step``.
* **TensorBoard** — a directory (searched recursively) of ``events.out.tfevents.*`` files, read
  with the ``tensorboard`` package (``pip install 'rollout-correction[monitor]'``): scalar
  summaries and rank-0 tensor summaries.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Union

__all__ = ["read_history", "read_jsonl", "read_csv", "read_tensorboard"]

History = list[tuple[int, dict[str, float]]]
_STEP_KEYS = ("step", "_step", "global_step", "train/global_step", "Step", "trainer/global_step")


def _number(text) -> float | None:
    if text is None:
        return None
    if isinstance(text, bool):
        return float(text)
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip()
    if not s:
        return None
    try:
        return float(s)
    except ValueError:
        return None


def _merge(rows: dict[int, dict[str, float]]) -> History:
    return [(s, rows[s]) for s in sorted(rows)]


def read_jsonl(path: Union[str, Path]) -> History:
    rows: dict[int, dict[str, float]] = {}
    n = 0
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg}); expected one JSON object per line") from None
        if not isinstance(obj, dict) or "rollout_correction_monitor" in obj:
            continue
        step = next((obj[k] for k in _STEP_KEYS if k in obj and _number(obj[k]) is not None), None)
        step = int(_number(step)) if step is not None else n
        n = step + 1
        flat = obj["metrics"] if isinstance(obj.get("metrics"), dict) else obj
        values = {k: v for k, v in ((k, _number(v)) for k, v in flat.items() if k not in _STEP_KEYS)
                  if v is not None}
        rows.setdefault(step, {}).update(values)
    return _merge(rows)


def _metric_name(column: str) -> str:
    return column.split(" - ", 1)[1] if " - " in column else column


def read_csv(path: Union[str, Path]) -> History:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        rows_in = list(reader)
    lower = {c.lower(): c for c in fields}
    rows: dict[int, dict[str, float]] = {}
    if ("key" in lower or "metric" in lower) and "value" in lower and "step" in lower:  # long (MLflow)
        kc, vc, sc = lower.get("key") or lower["metric"], lower["value"], lower["step"]
        for r in rows_in:
            s, v = _number(r[sc]), _number(r[vc])
            if s is not None and v is not None:
                rows.setdefault(int(s), {})[r[kc]] = v
        return _merge(rows)
    step_col = next((c for c in fields if c in _STEP_KEYS or c.lower() == "step"), None)
    if step_col is None:
        raise ValueError(f"{path}: no step column (looked for {', '.join(_STEP_KEYS)}) and not the long "
                         "key,value,step format")
    metric_cols = [c for c in fields if c != step_col and not c.endswith(("__MIN", "__MAX"))]
    for r in rows_in:
        s = _number(r[step_col])
        if s is None:
            continue
        d = rows.setdefault(int(s), {})
        for c in metric_cols:
            v = _number(r[c])
            if v is not None:
                d[_metric_name(c)] = v
    return _merge(rows)


def read_tensorboard(path: Union[str, Path]) -> History:
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError as exc:
        raise ImportError("reading TensorBoard event files needs the tensorboard package: "
                          "pip install 'rollout-correction[monitor]'") from exc
    path = Path(path)
    files = sorted(path.rglob("events.out.tfevents.*")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no events.out.tfevents.* file found")
    rows: dict[int, dict[str, float]] = {}
    for file in files:
        for event in EventFileLoader(str(file)).Load():
            if not event.HasField("summary"):
                continue
            for v in event.summary.value:
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    x = float(v.simple_value)
                elif kind == "tensor":
                    arr = tensor_util.make_ndarray(v.tensor)
                    if arr.size != 1 or arr.dtype.kind not in "fiub":
                        continue
                    x = float(arr.reshape(()))
                else:
                    continue
                rows.setdefault(int(event.step), {})[v.tag] = x
    return _merge(rows)


def read_history(path: Union[str, Path], fmt: str = "auto") -> History:
    """Read ``path`` as ``fmt`` ("jsonl", "csv", "tensorboard"; "auto" guesses from the path)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if fmt == "auto":
        if p.is_dir() or p.name.startswith("events.out.tfevents"):
            fmt = "tensorboard"
        elif p.suffix.lower() == ".csv":
            fmt = "csv"
        elif p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
            fmt = "jsonl"
        else:
            raise ValueError(f"{path}: cannot tell the format from the name; pass --format jsonl|csv|tensorboard")
    readers = {"jsonl": read_jsonl, "csv": read_csv, "tensorboard": read_tensorboard}
    if fmt not in readers:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(readers)}")
    return readers[fmt](p)
