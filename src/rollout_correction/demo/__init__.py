"""``rollout-correction demo``: reproduce the training-inference mismatch and its fix on a laptop.

The pieces, each short and readable on its own:

* ``task.py``    — synthetic digit tasks with a verifiable reward;
* ``model.py``   — a tiny transformers causal LM built from a config;
* ``engine.py``  — the rollout engine: own weights copy, KV-cache sampling, reduced precision,
                   fake-quantised and/or stale weights, per-token sampling log-probs;
* ``trainer.py`` — SFT warm start, then GRPO with the library's correction and loss;
* ``config.py``  — the methods compared and the scenarios offered;
* ``runner.py``  — every method × seed over worker processes, with progress bars;
* ``report.py``  — summary.json, plots and report.md;
* ``cli.py``     — the flags.

``--async`` (asynchronous RL, measured in wall-clock time against synchronous RL):

* ``async_rollout.py`` — the engine in its own process, shared-memory weights with a version,
                         the bounded queue and the staleness bound η;
* ``async_runner.py``  — synchronous and asynchronous runs on the same batches;
* ``async_report.py``  — async-summary.json, the accuracy-against-wall-clock plot, async-report.md.
"""
