"""The headline results files under ``docs/results/``: what each one measures.

``tools/run_demo_results.sh`` runs them all at one commit, and ``tests/test_results_tables.py``
checks every file against this table (its scenario, methods and seeds) and its claims against a
recomputation from its runs.

* ``demo-default.json`` — ``rollout-correction demo`` itself (the default scenario, methods and
  seeds, on the whole machine: its wall time is the README's);
* ``demo-stale.json`` — the default scenario with every listed method on seeds 0–4;
* ``demo-stale-seeds5-9.json`` — the default command on the disjoint seeds 5–9: the claims must
  hold on a second set of seeds too;
* ``demo-quantized.json`` and ``demo-long.json`` — the other two scenarios.

Aliases at one update per batch (GSPO, CISPO, DPPO-TV / -KL, sequence TIS: ``config.ALIASES``) run
only in the several-updates table; the newer criteria run in ``stale``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_correction.demo.config import DEFAULT_METHODS, DEFAULT_SEEDS, METHODS, SCENARIOS


@dataclass(frozen=True)
class Headline:
    name: str                     # the results file, docs/results/<name>
    scenario: str
    methods: tuple[str, ...]      # empty: the scenario's default methods (``rollout-correction demo``)
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    default_command: bool = False  # run as ``rollout-correction demo`` alone on the machine (timed)


#: The field's presets added to the quantized comparison where this version defines them.
FIELD_PRESETS = ("prime_rl_ipo", "prime_rl_icepop")

HEADLINES: dict[str, Headline] = {h.name: h for h in (
    Headline("demo-default.json", "stale", DEFAULT_METHODS, default_command=True),
    Headline("demo-stale.json", "stale", (
        "on_policy", "naive", "bypass_ppo", "token_tis", "seq_is_rs", "geo_rs", "pure_is", "icepop", "geo_is", "opsm",
        "m2po", "topr", "binary_kl_rs", "veto2", "kpop_rs", "dp_rs", "lp_err_rs", "minpro", "rollout_is")),
    Headline("demo-stale-seeds5-9.json", "stale", DEFAULT_METHODS, seeds=(5, 6, 7, 8, 9)),
    Headline("demo-quantized.json", "quantized", ("on_policy", "naive", "token_tis", "bypass_ppo", "icepop", "m2po")
             + tuple(m for m in FIELD_PRESETS if m in METHODS)),
    Headline("demo-long.json", "long", tuple(SCENARIOS["long"]["methods"])),
)}


#: The report plots each headline file's page shows: results file -> {report file: docs/img/ name}.
IMAGES: dict[str, dict[str, str]] = {
    "demo-stale.json": {"overview.png": "demo.png", "methods.png": "demo-methods.png"},
    "demo-quantized.json": {"overview.png": "demo-quantized.png", "methods.png": "demo-methods-quantized.png"},
    "demo-long.json": {"by_length.png": "demo-long-by-length.png"},
}


def key(name: str) -> str:
    """The short name ``--only`` takes: ``demo-stale-seeds5-9.json`` -> ``stale-seeds5-9``."""
    return name.removeprefix("demo-").removesuffix(".json")
