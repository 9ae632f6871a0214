"""The configuration keys, presets and metrics, documented once and rendered into the docs.

The keys are documented in the config's field metadata (read into :data:`CONFIG_KEYS`) and the
presets by their definitions (:data:`rollout_correction_core._src.presets.PRESETS`); the metrics here.
``python tools/reference.py --guide docs/guide.md`` regenerates the reference block of
docs/guide.md, ``python tools/reference.py --config-md docs/config.md`` the
configuration page (``python tools/reference.py`` prints the reference as a page);
tests keep both committed files in step with this module.
"""

from __future__ import annotations

import dataclasses
import sys

from rollout_correction_core._src.config import METRIC_FAMILIES, RolloutCorrectionConfig
from rollout_correction_core._src.presets import PRESETS
from rollout_correction_core._src.vocab import FIRST_GENERATION_KEYS
from rollout_correction.presets_cli import PRESET_HEADER, preset_rows

__all__ = ["CONFIG_KEYS", "LEGACY_KEYS", "METRICS", "FAMILY_OF", "PRESET_HEADER", "preset_rows", "render_markdown",
           "render_config_page", "update_readme", "write_config_page"]


def _default(f: dataclasses.Field) -> str:
    text = "null" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else \
        ", ".join(f.default) if isinstance(f.default, tuple) else str(f.default)
    return f"{text} ({f.metadata['note']})" if f.metadata["note"] else text


#: key -> (allowed values, default, meaning), read from the config's fields
CONFIG_KEYS: dict[str, tuple[str, str, str]] = {
    f.name: (f.metadata["values"], _default(f), f.metadata["doc"])
    for f in dataclasses.fields(RolloutCorrectionConfig) if f.init}

#: first-generation key -> how it maps
LEGACY_KEYS: dict[str, str] = {
    **FIRST_GENERATION_KEYS,
    "rollout_rs: token | sequence | geometric": "ratio band on ρ_t, ∏ρ_t, exp(mean log ρ_t) — the same "
                                                "criteria as token_k1, seq_sum_k1, seq_mean_k1",
}

#: metric name (without the rollout_corr/ prefix) -> meaning
METRICS: dict[str, str] = {
    "rollout_is_mean": "mean IS weight over valid tokens (bounded, before batch normalisation)",
    "rollout_is_std": "std of the bounded weights over valid tokens, sqrt(E[w²] − E[w]²)",
    "rollout_is_max": "largest weight: over tokens (token level) or exp of the largest unclamped "
                      "log weight, capped at e^20 (sequence / geometric)",
    "rollout_is_min": "smallest weight, likewise",
    "rollout_is_eff_sample_size": "ESS fraction (E[w]+1e-8)²/E[w²] over valid tokens; 1 = uniform weights",
    "rollout_is_ratio_fraction_high": "share of raw weights above the upper bound (tokens or sequences)",
    "rollout_is_ratio_fraction_low": "share of raw weights below the lower bound (1/upper when none is set)",
    "rollout_is_seq_mean": "mean over sequences of the per-sequence mean weight",
    "rollout_is_seq_std": "unbiased std over sequences of the per-sequence mean weight",
    "rollout_is_seq_max": "largest per-sequence mean weight",
    "rollout_is_seq_min": "smallest per-sequence mean weight",
    "rollout_is_seq_max_deviation": "max over sequences of |mean weight − 1|",
    "rollout_is_seq_fraction_high": "share of sequences whose raw mean weight exceeds the upper bound",
    "rollout_is_seq_fraction_low": "share of sequences whose raw mean weight is below the lower bound",
    "rollout_is_raw_mean": "mean over valid tokens of ρ_t before truncation, masking and rejection (only the ±20 "
                           "bound on log ρ applies)",
    "rollout_is_seq_raw_mean": "mean over sequences of ∏_t ρ_t, likewise before truncation, masking and rejection",
    "rollout_is_seq_raw_ess": "Kish ESS (Σw)²/(n·Σw²) of the per-sequence weights before truncation",
    "rollout_is_seq_log_mean": "mean over sequences of the log weight (Σ log ρ_t or mean log ρ_t), unclamped",
    "rollout_is_seq_collapsed_fraction": "share of sequences whose weight before truncation is below 0.1",
    "rollout_is_oob_ratio": "IcePop: share of valid tokens whose weight was zeroed",
    "rollout_is_batch_norm_factor": "the batch mean the weights were divided by (1 if ≤ 1e-8)",
    "rollout_is_veto_fraction": "share of sequences rejected by the veto",
    "rollout_is_catastrophic_token_fraction": "share of valid tokens with unclamped ρ_t below the veto threshold",
    "rollout_is_veto_high_fraction": "share of sequences rejected by the high-side veto",
    "rollout_is_catastrophic_high_token_fraction": "share of valid tokens with unclamped ρ_t above the high-side "
                                                   "veto threshold",
    "rollout_is_masked_fraction": "first-generation name of rollout_rs_masked_fraction",
    "rollout_is_seq_masked_fraction": "first-generation name of rollout_rs_seq_masked_fraction",
    "rollout_rs_<option>_mean": "token mean of the option's statistic (sequence statistics broadcast over tokens)",
    "rollout_rs_<option>_max / _min": "extremes over tokens (token options) or sequences (sequence options)",
    "rollout_rs_<option>_fraction_high / _fraction_low": "share above / below the statistic bounds "
                                                         "(fraction_low only for k1)",
    "rollout_rs_<option>_std": "token-weighted std of the statistic clamped to its bounds",
    "rollout_rs_<option>_seq_mean / _seq_std / _seq_max / _seq_min": "statistics of the per-sequence value",
    "rollout_rs_<option>_seq_max_deviation": "max over sequences of |value|",
    "rollout_rs_<option>_seq_fraction_high / _seq_fraction_low": "share of sequences above / below the bounds",
    "rollout_rs_<option>_masked_fraction": "share of valid tokens this option rejects",
    "rollout_rs_<option>_seq_masked_fraction": "share of sequences with at least one token this option rejects",
    "rollout_rs_masked_fraction": "share of valid tokens rejected by the chained options",
    "rollout_rs_seq_masked_fraction": "share of sequences with at least one rejected token",
    "training_ppl": "mean over sequences of exp(−mean log π_train)",
    "training_log_ppl": "mean over sequences of −mean log π_train",
    "rollout_ppl": "mean over sequences of exp(−mean log π_rollout)",
    "rollout_log_ppl": "mean over sequences of −mean log π_rollout",
    "kl": "mean over tokens of log π_rollout − log π_train: k1 estimate of KL(π_rollout‖π_train)",
    "k3_kl": "mean over tokens of ρ − 1 − log ρ: k3 estimate of the same KL, ≥ 0",
    "log_ppl_diff": "mean over sequences of d = mean log π_rollout − mean log π_train",
    "log_ppl_abs_diff": "mean over sequences of |d|",
    "log_ppl_diff_max / log_ppl_diff_min": "extremes of d over sequences",
    "ppl_ratio": "mean over sequences of exp(d) = training PPL / rollout PPL",
    "chi2_token": "E_tok[ρ²] − 1: χ² divergence at token level (IS variance)",
    "chi2_seq": "E_seq[(∏ρ_t)²] − 1: χ² divergence at sequence level",
    "chi2_token_sn / chi2_seq_sn": "self-normalised χ²: E[ρ²]/E[ρ]² − 1 over tokens, and of ∏_t ρ_t over "
        "sequences; ≥ 0 on every sample (E[ρ²] − 1 is not)",
    "nonfinite_seq_fraction": "share of sequences dropped for a NaN/±inf log-prob or an engine sentinel at a "
                              "valid position",
    "sentinel_token_fraction": "share of valid tokens holding a log-prob ≤ log_prob_floor (an engine's sentinel, "
                               "e.g. vLLM's −9999); their sequences are dropped (or raise)",
    "rollout_rs_rejected_positive_fraction": "with advantages: share of the fully rejected sequences whose "
        "advantage (mean over valid tokens) is > 0 (0 when none is rejected)",
    "max_abs_log_ratio": "expect-zero mode: max |old − rollout| over valid tokens (non-finite as 1e30)",
    "prob_abs_diff_mean / _max / _std": "mean, max and std (n − 1) over tokens of |p_train − p_rollout|, "
        "p = π(y_t) of the sampled token (verl's training/rollout_probs_diff_*)",
    "prob_pearson / log_prob_pearson": "Pearson correlation over tokens of p_train and p_rollout, and of their "
        "logs (0 without spread)",
    "js_divergence": "mean over tokens of log cosh(Δ_t/2), Δ_t = log π_train − log π_rollout: NeMo-RL's "
        "js_divergence_error",
    "log_prob_abs_diff_seq_mean": "mean over sequences of mean |Δ_t| (slime's train_rollout_logprob_abs_diff)",
    "log_prob_abs_diff_max": "largest |Δ_t| over tokens",
    "log_prob_abs_diff_gt1 / _gt2": "share of tokens with |Δ_t| > 1 / > 2",
    "alignment_mae / alignment_late_mae / alignment_early_mae": "with check_alignment: mean |old − rollout| "
        "over adjacent valid pairs as given, with rollout read one position later, and one earlier",
    "alignment_pairs": "with check_alignment: number of adjacent valid token pairs compared",
    "m2po_masked_fraction": "with rollout_m2po_threshold: share of the tokens kept by rejection that M2PO masks",
    "m2po_m2_before / m2po_m2_after": "batch mean of (log ρ_t)² over the tokens before / after M2PO masking",
    "opsm_masked_fraction": "with rollout_opsm_delta (loss metrics): share of valid tokens in dropped sequences",
    "opsm_seq_masked_fraction": "share of sequences OPSM drops (advantage < 0 and D(y) > δ)",
    "opsm_seq_kl_mean": "mean over sequences of D(y) = mean log(π_rollout/π_θ) over finite valid tokens",
}


#: metric (a key of METRICS) -> the family that computes it (the config's ``metrics`` key); every other
#: metric is the ``default`` family's. "decision": computed whenever the setting named is on.
FAMILY_OF: dict[str, str] = {
    "rollout_is_raw_mean": "raw", "rollout_is_seq_raw_mean": "raw", "chi2_token_sn / chi2_seq_sn": "chi2",
    "rollout_is_seq_raw_ess": "detail", "rollout_is_seq_log_mean": "detail", "rollout_is_seq_collapsed_fraction": "detail",
    "sentinel_token_fraction": "sentinel", "max_abs_log_ratio": "expect_zero (and with expect_zero_atol)",
    "nonfinite_seq_fraction": "always",
    **{k: "mismatch" for k in ("prob_abs_diff_mean / _max / _std", "prob_pearson / log_prob_pearson", "js_divergence",
                               "log_prob_abs_diff_seq_mean", "log_prob_abs_diff_max", "log_prob_abs_diff_gt1 / _gt2")},
    **{k: "with its setting" for k in ("alignment_mae / alignment_late_mae / alignment_early_mae", "alignment_pairs",
                                       "m2po_masked_fraction", "m2po_m2_before / m2po_m2_after", "opsm_masked_fraction",
                                       "opsm_seq_masked_fraction", "opsm_seq_kl_mean")},
}


def _table(header: list[str], rows: list[tuple[str, ...]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _keys_and_presets(keys_title: str, presets_intro: str) -> list[str]:
    """The key table, the first-generation keys and the preset table, as markdown lines."""
    return [
        f"## {keys_title}",
        "",
        _table(["key", "values", "default", "meaning"],
               [(f"`{k}`", v, d, m) for k, (v, d, m) in CONFIG_KEYS.items()]),
        "",
        "### Accepted first-generation keys",
        "",
        _table(["key", "maps to"], [(f"`{k}`", v) for k, v in LEGACY_KEYS.items()]),
        "",
        "## Presets",
        "",
        presets_intro,
        "",
        _table(list(PRESET_HEADER), [(f"`{r[0]}`",) + r[1:] for r in preset_rows()]),
        "",
    ]


def render_markdown() -> str:
    parts = [
        "# Reference: configuration keys, presets, metrics",
        "",
        "Generated by `python tools/reference.py --guide docs/guide.md`; do not edit by hand.",
        "",
        *_keys_and_presets("Configuration keys (`RolloutCorrectionConfig`)",
                           "`RolloutCorrectionConfig.<name>()` or `RolloutCorrectionConfig.from_preset(\"<name>\")`."),
        "## Metrics",
        "",
        "Every metric is logged as `rollout_corr/<name>`. Statistics over an empty set "
        "(no valid token, no valid sequence) are reported as 0. At segment level (`rollout_is=\"segment\"`, "
        "and for a `segment_*` rejection option) every per-sequence statistic below is taken over the "
        "segments (turns) with ≥ 1 valid token instead of the sequences.",
        "",
        "### Metric families",
        "",
        "A call computes the families the config's `metrics` key selects (default: `[default]`; `all`: every "
        "family; `[]`: only what its decisions need). A family not selected records no statistic: no slot in "
        "the reduction, no kernel in the compiled pass, no operation in the eager one. Statistics a decision "
        "needs are recorded whatever is selected: the counts (and `nonfinite_seq_fraction`), the mean batch "
        "normalisation divides by, the rows every rejection criterion rejects (`rollout_rs_all_rejected`) and "
        "expect-zero's maximum. Selecting every family gives the numbers of the release before the families, "
        "bit for bit (`tests/test_metric_families.py`). `mismatch_metrics: true` selects `mismatch`.",
        "",
        _table(["family", "what it adds"], [(f"`{k}`", v) for k, v in METRIC_FAMILIES.items()]),
        "",
        _table(["metric", "family", "meaning"], [(f"`{k}`", FAMILY_OF.get(k, "default"), v)
                                                 for k, v in METRICS.items()]),
        "",
    ]
    return "\n".join(parts)


def _signature(name: str) -> str:
    args = ", ".join(f"{a}={d!r}" for a, d in PRESETS[name].args.items())
    return f"{name}({args})"


def render_config_page() -> str:
    """docs/config.md: every key, the first-generation keys, and every preset with its arguments,
    its keys and what it is for."""
    parts = [
        "# Configuration reference",
        "",
        "Generated by `python tools/reference.py --config-md docs/config.md` from the "
        "config's fields and the preset definitions (`core/src/rollout_correction_core/_src/config.py`, "
        "`core/src/rollout_correction_core/_src/presets.py`); do not edit by hand.",
        "",
        "A `RolloutCorrectionConfig` is validated when it is built; an invalid value raises `ConfigError` "
        "naming the key and what is allowed. Every entry point accepts a config, a preset name, a dict "
        "of keys, an OmegaConf node or a dataclass with these keys (`rollout_correction.as_config`):",
        "",
        "```python",
        "from rollout_correction import RolloutCorrectionConfig, as_config",
        "",
        "cfg = RolloutCorrectionConfig(rollout_is=\"sequence\", rollout_is_threshold=2.0)",
        "cfg = RolloutCorrectionConfig.decoupled_seq_is_rs(rs_threshold=\"0.8_1.25\")  # a preset",
        "cfg = RolloutCorrectionConfig.from_preset(\"decoupled_seq_is_rs\", rs_threshold=\"0.8_1.25\")",
        "cfg = RolloutCorrectionConfig.from_yaml(\"ppo.yaml\", key=\"algorithm.rollout_correction\")",
        "cfg = as_config({\"rollout_is\": \"token\"})",
        "```",
        "",
        *_keys_and_presets(
            "Keys", "Each preset is a classmethod with the arguments shown (`RolloutCorrectionConfig.<name>(...)`) "
            "and is also available by name (`from_preset(\"<name>\", ...)`, `as_config(\"<name>\")`, "
            "`rollout-correction presets`)."),
        "### What each preset is for",
        "",
        _table(["preset", "call", "keys set", "description"],
               [(f"`{n}`", f"`{_signature(n)}`",
                 ", ".join(f"`{k}`" for k in p.keys) or "none (the defaults)",
                 " ".join(p.doc.split()) + (f" Another name for `{p.alias_of}`." if p.alias_of else ""))
                for n, p in PRESETS.items()]),
        "",
    ]
    return "\n".join(parts)


def _rewrite(path: str, new: str, old: str | None = None) -> bool:
    """Write ``new`` to ``path`` unless it already holds it; True if the file changed."""
    if old is None:
        try:
            with open(path, encoding="utf-8") as f:
                old = f.read()
        except FileNotFoundError:
            old = None
    if new != old:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != old


_START, _END = "<!-- reference:start -->", "<!-- reference:end -->"


def update_readme(path: str) -> bool:
    """Rewrite the generated block of ``path`` between the reference markers; True if changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(_START, 1)
    _, tail = rest.split(_END, 1)
    body = render_markdown().split("\n", 3)[3]  # drop the page title and the generated-by line
    return _rewrite(path, f"{head}{_START}\n{body.strip()}\n{_END}{tail}", text)


def write_config_page(path: str = "docs/config.md") -> bool:
    """Write :func:`render_config_page` to ``path``; True if it changed."""
    return _rewrite(path, render_config_page())


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) > 1 and sys.argv[1] == "--guide":
        update_readme(sys.argv[2] if len(sys.argv) > 2 else "docs/guide.md")
    elif len(sys.argv) > 1 and sys.argv[1] == "--config-md":
        write_config_page(sys.argv[2] if len(sys.argv) > 2 else "docs/config.md")
    else:
        sys.stdout.write(render_markdown())
