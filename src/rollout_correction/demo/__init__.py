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
"""
