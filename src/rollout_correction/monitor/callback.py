"""A ``transformers`` ``TrainerCallback`` that feeds every log call to a :class:`HealthMonitor`.

Works with any ``transformers.Trainer`` subclass whose logs carry ``rollout_corr/*`` metrics
(TRL's GRPOTrainer with this library's adapter, or your own trainer). On each ``on_log`` the
monitor sees the logged metrics at ``state.global_step``; alerts go to the
``rollout_correction.monitor`` logger, and the ``rollout_corr/health/*`` numbers are added to the
same log dict, so the trainer's own reporters (wandb, TensorBoard, MLflow, …) record them — as
long as this callback runs before them: add it with :meth:`HealthMonitorCallback.add_to`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from transformers import TrainerCallback

from .monitor import HealthMonitor, canonical_metrics

__all__ = ["HealthMonitorCallback"]


class HealthMonitorCallback(TrainerCallback):
    """Args:
        monitor: the monitor to feed (a default :class:`HealthMonitor` if None).
        save_path: write the monitor's JSONL history here at the end of training (relative
            paths are taken inside ``args.output_dir``).
        only_with_metrics: skip log calls that carry no ``rollout_corr/`` metric (evaluation
            logs, the final training summary), so they do not count as steps.
    """

    def __init__(self, monitor: Optional[HealthMonitor] = None, save_path: Union[str, Path, None] = None,
                 only_with_metrics: bool = True) -> None:
        self.monitor = monitor if monitor is not None else HealthMonitor()
        self.save_path = save_path
        self.only_with_metrics = only_with_metrics

    def add_to(self, trainer) -> "HealthMonitorCallback":
        """Put this callback first in ``trainer``'s callback list (before the reporters, so the
        health numbers reach them in the same log call). Returns self."""
        handler = trainer.callback_handler
        handler.callbacks = [cb for cb in handler.callbacks if cb is not self]
        handler.callbacks.insert(0, self)
        return self

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        if self.only_with_metrics and not canonical_metrics(logs):
            return
        self.monitor.update(state.global_step, logs)
        logs.update(self.monitor.health_metrics())

    def on_train_end(self, args, state, control, **kwargs):
        if self.save_path is None:
            return
        path = Path(self.save_path)
        if not path.is_absolute():
            path = Path(args.output_dir) / path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.monitor.save(path)
