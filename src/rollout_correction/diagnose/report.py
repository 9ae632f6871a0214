"""The report: ``summary.json``, ``report.md`` + PNGs, a self-contained ``report.html``, and a
terminal summary.

The content is assembled once as a list of blocks (headings, paragraphs, tables, figures) and
rendered to Markdown and to HTML, so the two reports always say the same thing.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from dataclasses import asdict

import numpy as np

from rollout_correction import METRIC_PREFIX
from rollout_correction.console import LOG_WIDTH

from .diagnosis import Diagnosis
from .profile import HEALTHY_BAND, VETO_THRESHOLD
from .sentinels import describe

P = METRIC_PREFIX

#: One-line meaning of each off-policy metric (π_train = the trainer's log-probs column).
METRIC_HELP = {
    "training_ppl": "mean over rows of exp(−mean log π_train)",
    "training_log_ppl": "mean over rows of −mean log π_train",
    "rollout_ppl": "mean over rows of exp(−mean log π_rollout)",
    "rollout_log_ppl": "mean over rows of −mean log π_rollout",
    "kl": "mean over tokens of log π_rollout − log π_train (k1, can be < 0)",
    "k3_kl": "mean over tokens of ρ − 1 − log ρ (k3, ≥ 0)",
    "log_ppl_diff": "mean over rows of (rollout log-PPL − training log-PPL); the sign says which side is "
                    "more confident",
    "log_ppl_abs_diff": "mean over rows of |log-PPL difference|",
    "log_ppl_diff_max": "largest per-row log-PPL difference",
    "log_ppl_diff_min": "smallest per-row log-PPL difference",
    "ppl_ratio": "mean over rows of training PPL / rollout PPL",
    "chi2_token": "mean over tokens of ρ² − 1",
    "chi2_seq": "mean over rows of (∏ρ)² − 1",
    "nonfinite_seq_fraction": "rows dropped for a NaN/inf log-prob",
    # mixture of experts (diagnose_tensors(..., routing=...), rollout_correction.moe.routing_agreement)
    "routing_match": "share of (token, layer) top-k expert sets the engine and the trainer agree on",
    "routing_overlap": "mean share of the top-k experts the two routings have in common",
    "routing_token_differs": "share of tokens routed to a different expert set in at least one layer",
    "routing_tokens": "tokens compared for the routing agreement",
    "routing_confidence_engine": "mean top-k router probability mass of the engine's own choice",
    "routing_confidence_trainer": "mean top-k router probability mass of the trainer's own choice",
    "routing_confidence_diff": "trainer − engine routing confidence",
    # mismatch metrics (p = π of the sampled token, Δ = log π_train − log π_rollout)
    "prob_abs_diff_mean": "mean over tokens of |p_train − p_rollout| (verl's rollout_probs_diff_mean)",
    "prob_abs_diff_max": "largest |p_train − p_rollout|",
    "prob_abs_diff_std": "std over tokens of |p_train − p_rollout| (n − 1)",
    "prob_pearson": "Pearson correlation of p_train and p_rollout over tokens",
    "log_prob_pearson": "Pearson correlation of log p_train and log p_rollout over tokens",
    "js_divergence": "mean over tokens of log cosh(Δ/2) (NeMo-RL's js_divergence_error)",
    "log_prob_abs_diff_seq_mean": "mean over rows of mean |Δ| (slime's train_rollout_logprob_abs_diff)",
    "log_prob_abs_diff_max": "largest |Δ|",
    "log_prob_abs_diff_gt1": "share of tokens with |Δ| > 1",
    "log_prob_abs_diff_gt2": "share of tokens with |Δ| > 2",
    # ratio bands (MaxText #5231), ρ = π_train / π_rollout
    "ratio_band_tight_fraction": "share of tokens with ρ in [0.999, 1.002]",
    "ratio_band_1pct_fraction": "share of tokens with |ρ − 1| ≤ 0.01",
    "ratio_band_5pct_fraction": "share of tokens with |ρ − 1| ≤ 0.05",
}


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return f"{int(x):,}"
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.3e}"
    return f"{x:.4g}"


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    return x


# ------------------------------------------------------------------------------------ summary


def summary_dict(diag: Diagnosis) -> dict:
    """The content of ``summary.json``.

    Top level: every ``rollout_corr/...`` off-policy metric (same keys and values as
    ``compute_offpolicy_metrics`` on the whole file), ``recommended_preset``, ``health`` (one
    entry per check: name, value, threshold, verdict, detail) and ``health_verdict`` (the worst),
    plus the recommendation's reason, the raw weights per level, the what-if table, the input
    counters and ``sentinels`` (engine sentinels per side: counts, lowest value, first (row, column)
    positions; :mod:`.sentinels`).
    """
    res, rec = diag.profile, diag.recommendation
    c = res.counters
    out: dict = dict(res.metrics)
    out["recommended_preset"] = rec.preset
    out["recommendation"] = {"case": rec.case, "reason": rec.reason, "inputs": rec.inputs, "notes": rec.notes}
    out["health"] = [ch.as_dict() for ch in diag.health]
    out["health_verdict"] = diag.worst_verdict
    out["weights"] = res.levels
    out["what_if"] = res.what_if
    out["input"] = {**diag.source, **asdict(c)}
    out["sentinels"] = res.sentinels
    if res.version:
        out["by_policy_version"] = {str(v): {"rows": e["rows"], "tokens": e["tokens"],
                                             "k3_kl": e["k3"] / max(e["tokens"], 1),
                                             "kl": -e["log_ratio"] / max(e["tokens"], 1)}
                                    for v, e in sorted(res.version.items())}
    out.update({f"extra/{k}": v for k, v in res.extras.items()})
    return _json_safe(out)


# ------------------------------------------------------------------------------------ content


def _top_tokens(diag: Diagnosis, k: int = 10) -> list[list]:
    tok = diag.profile.token
    if tok is None:
        return []
    order = np.argsort(-tok.sums["k3"])[:k]
    total = max(tok.sums["k3"].sum(), 1e-300)
    rows = []
    for t in order:
        if tok.count[t] == 0 or tok.sums["k3"][t] <= 0:
            continue
        rows.append([int(t), int(tok.count[t]), tok.sums["k3"][t] / tok.count[t],
                     tok.sums["log_ratio"][t] / tok.count[t], f"{100 * tok.sums['k3'][t] / total:.1f} %"])
    return rows


def build_blocks(diag: Diagnosis, figures: list[str]) -> list[tuple]:
    """The report as blocks: ("h1"|"h2"|"p", text), ("table", header, rows), ("img", file, caption)."""
    res, rec, c = diag.profile, diag.recommendation, diag.profile.counters
    m = res.metrics
    mean_len = c.tokens / c.rows_used if c.rows_used else 0.0
    blocks: list[tuple] = [("h1", "Rollout mismatch diagnosis")]
    src = diag.source
    engine = src.get("engine", "plain")
    kind = src.get("format") if engine in (None, "plain") else f"{engine} dump, {src.get('format')}"
    files = f" · {len(src['files'])} files" if src.get("files") else ""
    blocks.append(("p", f"Input: `{src.get('path')}` ({kind}){files} · {c.rows:,} rows · {c.tokens:,} "
                        f"response tokens · mean length {mean_len:.1f} · longest {c.max_length:,} · "
                        f"diagnosed in {src.get('elapsed_seconds', float('nan')):.1f} s"))
    blocks.append(("h2", "Recommendation"))
    reason = rec.reason[:1].upper() + rec.reason[1:]
    blocks.append(("p", f"**Recommended preset: `{rec.preset}`** (rule: *{rec.case}*). {reason}."))
    blocks.append(("p", f"Use it with `RolloutCorrectionConfig.from_preset(\"{rec.preset}\")`. The rule is "
                        "documented in docs/diagnose.md; the what-if table below shows every preset on this data."))
    for note in rec.notes:
        blocks.append(("p", f"**Response length.** {note[:1].upper() + note[1:]}."))

    blocks.append(("h2", "Health checks"))
    blocks.append(("table", ["check", "value", "healthy", "verdict", "meaning"],
                   [[ch.name, ch.value, ch.threshold, ch.verdict, ch.detail] for ch in diag.health]))

    sentinels = res.sentinels
    if sentinels.get("tokens"):
        blocks.append(("h2", "Engine sentinels"))
        blocks.append(("p", f"Log-probs at or below {sentinels['floor']:g} at response positions: values an engine "
                            "writes where it has no log-prob (vLLM returns −9999), not log-probabilities. Rows are "
                            "counted from 0 in the order of the dump, columns from the first response token."))
        blocks.append(("table", ["log-probs from", "sentinels", "rows", "lowest", "first positions (row, column)"],
                       [[s["source"], s["tokens"], s["rows"], s["lowest"],
                         " ".join(f"({r}, {c})" for r, c in s["positions"])]
                        for s in (sentinels["rollout"], sentinels["trainer"]) if s["tokens"]]))

    captions = {
        "diagnose_log_ratio.png": "Per-token log-ratio log ρ = log π_train − log π_rollout: the bulk on a linear "
                                  "axis (left) and the tails on a symmetric-log axis (right; each side shows "
                                  "|log ρ| in decades).",
        "diagnose_weights.png": "Raw importance weights at token, sequence and geometric level: histograms of "
                                "log w (0 means w = 1; dashed lines: the [0.5, 2] band when in range).",
        "diagnose_position.png": "Mismatch by token position (grey: number of tokens at that position).",
        "diagnose_length.png": "Mismatch by response length: per-token KL (left) and the sequence weight "
                               "(right).",
        "diagnose_what_if.png": "What-if: each distinct correction applied to this data (★ = recommended); the "
                                "table below lists every preset.",
        "diagnose_version.png": "Mismatch by policy version.",
    }
    blocks.append(("h2", "Figures"))
    for f in figures:
        blocks.append(("img", f, captions.get(f, f)))

    blocks.append(("h2", "Off-policy metrics"))
    blocks.append(("p", "The same keys and values `compute_offpolicy_metrics` returns on the whole file "
                        "(ρ = π_train / π_rollout per token)."))
    blocks.append(("table", ["metric", "value", "meaning"],
                   [[k, v, METRIC_HELP.get(k[len(P):], "")] for k, v in m.items()]))

    blocks.append(("h2", "Importance weights (raw)"))
    blocks.append(("p", "Untruncated weights, clamped to e^±20: token w = ρₜ, sequence w = ∏ρₜ, geometric "
                        "w = (∏ρₜ)^(1/L). ESS = (Σw)² / (n·Σw²) over tokens (token) or rows (sequence, "
                        "geometric)."))
    rows = []
    for level, d in res.levels.items():
        rows.append([level, d["n"], d["mean"], d["std"], d["ess"], f"{100 * d['fraction_outside']:.3g} %",
                     math.exp(max(min(d["min_log_w"], 700), -700)), math.exp(max(min(d["max_log_w"], 700), -700)),
                     d["log_std"]])
    blocks.append(("table", ["level", "n", "mean", "std", "ESS", f"∉ [{HEALTHY_BAND[0]}, {HEALTHY_BAND[1]}]",
                             "min", "max", "std of log w"], rows))
    blocks.append(("p", f"Rows with a catastrophic token (ρ < {VETO_THRESHOLD:g}): {c.rows_vetoed:,} of "
                        f"{c.rows_used:,}; catastrophic tokens: {c.tokens_catastrophic:,}."))

    blocks.append(("h2", "What-if: every preset on this data"))
    blocks.append(("p", "truncated = share of weights the threshold changes (TIS: ratio above the cap, over "
                        "tokens for token level and rows for sequence level; IcePop: tokens outside the band); "
                        "rejected = share of tokens / rows that rejection sampling removes; ESS = (Σw)²/(n·Σw²) "
                        "of the final weights (IS weight × kept) over all valid tokens. Presets that differ "
                        "only in the loss (bypass / REINFORCE) share their weights and masks."))
    blocks.append(("table", ["preset", "IS weights", "truncated", "rejected tokens", "rejected rows", "ESS",
                             "mean weight", "same weights and masks as"],
                   [[("**" + w["preset"] + "** ★") if w["preset"] == rec.preset else w["preset"],
                     w["is_weights"], w["truncated_fraction"], w["rejected_token_fraction"],
                     w["rejected_seq_fraction"], w["ess"], w["mean_weight"], w["same_as"] or ""]
                    for w in res.what_if]))

    if res.version:
        blocks.append(("h2", "By policy version"))
        blocks.append(("table", ["version", "rows", "tokens", "kl per token", "k3 per token"],
                       [[v, int(e["rows"]), int(e["tokens"]), -e["log_ratio"] / max(e["tokens"], 1),
                         e["k3"] / max(e["tokens"], 1)] for v, e in sorted(res.version.items())]))
    files = diag.source.get("files")
    if files:
        blocks.append(("h2", "By file"))
        blocks.append(("p", "The files were diagnosed as one dump (every statistic above is over their concatenation); "
                            "per file: rows, rows left out for a non-finite log-prob, engine sentinels, valid tokens, "
                            "and the mean per token of kl (log π_rollout − log π_train) and k3."))
        blocks.append(("table", ["file", "step", "rows", "non-finite rows", "engine sentinels", "tokens", "kl per token",
                                 "k3 per token"],
                       [[f["file"], "" if f["step"] is None else f["step"], f["rows"], f["rows_nonfinite"],
                         f["sentinel_tokens"], f["tokens"], f["kl"], f["k3_kl"]] for f in files]))
    top = _top_tokens(diag)
    if top:
        blocks.append(("h2", "Tokens contributing most to the KL"))
        blocks.append(("table", ["token id", "count", "mean k3", "mean log ρ", "share of total k3"], top))
    if "reward_seq_log_ratio_corr" in res.extras:
        blocks.append(("p", "Correlation between the reward and the sequence log-weight log ∏ρ: "
                            f"{res.extras['reward_seq_log_ratio_corr']:+.3f} (a strong correlation means the "
                            "mismatch biases the gradient towards or away from rewarded responses)."))
    return blocks


# ------------------------------------------------------------------------------------ renderers


def _md_cell(x) -> str:
    return _fmt(x).replace("|", "\\|")


def render_markdown(blocks: list[tuple]) -> str:
    """Markdown; in a table with a "verdict" column, ``warn`` / ``fail`` are set in bold."""
    out: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind == "h1":
            out.append(f"# {b[1]}\n")
        elif kind == "h2":
            out.append(f"## {b[1]}\n")
        elif kind == "p":
            out.append(b[1] + "\n")
        elif kind == "table":
            header, rows = b[1], b[2]
            out.append("| " + " | ".join(header) + " |")
            out.append("|" + "|".join("---" for _ in header) + "|")
            vcol = header.index("verdict") if "verdict" in header else -1
            for r in rows:
                cells = [_md_cell(x) for x in r]
                if vcol >= 0 and r[vcol] != "ok":
                    cells[vcol] = f"**{r[vcol].upper()}**"
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})\n\n*{b[2]}*\n")
    return "\n".join(out)


def _inline(text: str) -> str:
    """Escapes text and renders the two inline marks we use: **bold** and `code`."""
    t = html.escape(text)
    parts = t.split("**")
    t = "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(parts))
    parts = t.split("`")
    t = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = t.split("*")
    return "".join(f"<em>{p}</em>" if i % 2 else p for i, p in enumerate(parts)) if len(parts) % 2 else t


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1180px;margin:24px auto;
padding:0 16px;color:#222;line-height:1.45}
h1{font-size:1.6em;border-bottom:2px solid #1f77b4;padding-bottom:4px}
h2{font-size:1.2em;margin-top:1.6em;color:#1f3b57}
table{border-collapse:collapse;font-size:.86em;margin:.6em 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f6f9}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.warn td{background:#fff6e0} tr.fail td{background:#fde8e8}
td.v-ok{color:#2a7d2a;font-weight:600} td.v-warn{color:#b36b00;font-weight:700} td.v-fail{color:#c62828;font-weight:700}
code{background:#f3f3f3;padding:0 3px;border-radius:3px}
figure{margin:.8em 0} figure img{max-width:100%} figcaption{font-size:.85em;color:#555}
.rec{background:#eef6ee;border-left:4px solid #2ca02c;padding:8px 12px}
"""


def render_html(blocks: list[tuple], images: dict[str, bytes]) -> str:
    """A single self-contained page: figures are embedded as base64 PNG data URIs."""
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
           "<title>Rollout mismatch diagnosis</title>", f"<style>{_CSS}</style></head><body>"]
    in_rec = False
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2"):
            in_rec = b[1] == "Recommendation"
            out.append(f"<{kind}>{html.escape(b[1])}</{kind}>")
        elif kind == "p":
            cls = " class='rec'" if in_rec and b[1].startswith("**Recommended") else ""
            out.append(f"<p{cls}>{_inline(b[1])}</p>")
        elif kind == "table":
            header, rows = b[1], b[2]
            out.append("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header)
                       + "</tr></thead><tbody>")
            vcol = header.index("verdict") if "verdict" in header else -1
            for r in rows:
                verdict = r[vcol] if vcol >= 0 else ""
                cells = []
                for j, x in enumerate(r):
                    if j == vcol:
                        cells.append(f"<td class='v-{html.escape(x)}'>{html.escape(x)}</td>")
                    elif isinstance(x, (int, float, np.number)) and not isinstance(x, bool):
                        cells.append(f"<td class='num'>{html.escape(_fmt(x))}</td>")
                    else:
                        cells.append(f"<td>{_inline(_fmt(x))}</td>")
                out.append(f"<tr class='{verdict}'>{''.join(cells)}</tr>")
            out.append("</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(images[b[1]]).decode("ascii")
            out.append(f"<figure><img alt='{html.escape(b[2])}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{html.escape(b[2])}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(diag: Diagnosis, out_dir: str) -> dict[str, str]:
    """Writes summary.json, report.md, report.html and the PNG figures into ``out_dir``.

    Returns name → path of every file written.
    """
    from .plots import all_figures

    os.makedirs(out_dir, exist_ok=True)
    images = all_figures(diag.profile, diag.recommendation.preset)
    written: dict[str, str] = {}
    for name, data in images.items():
        path = os.path.join(out_dir, name)
        with open(path, "wb") as fh:
            fh.write(data)
        written[name] = path
    blocks = build_blocks(diag, list(images))
    for name, text in (("report.md", render_markdown(blocks)), ("report.html", render_html(blocks, images)),
                       ("summary.json", json.dumps(summary_dict(diag), indent=2, ensure_ascii=False))):
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        written[name] = path
    return written


# ------------------------------------------------------------------------------------ terminal

_KEY_METRICS = ("kl", "k3_kl", "chi2_token", "chi2_seq", "ppl_ratio", "log_ppl_abs_diff", "training_ppl",
                "rollout_ppl", "routing_match", "routing_token_differs",
                "prob_abs_diff_mean", "prob_abs_diff_max", "prob_pearson", "js_divergence", "log_prob_abs_diff_gt2",
                "ratio_band_tight_fraction", "ratio_band_1pct_fraction", "ratio_band_5pct_fraction")


def print_summary(diag: Diagnosis, out_dir: str | None = None, file=None) -> None:
    """A compact terminal summary (rich tables when ``rich`` is installed, plain text otherwise)."""
    res, rec, c = diag.profile, diag.recommendation, diag.profile.counters
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is part of the diagnose extra
        Console = None
    lines_metrics = [(k, res.metrics[P + k]) for k in _KEY_METRICS if P + k in res.metrics]
    if Console is None:  # pragma: no cover
        print(f"{c.rows:,} rows, {c.tokens:,} tokens", file=file)
        for k, v in lines_metrics:
            print(f"  {k:<20} {_fmt(v)}", file=file)
        for ch in diag.health:
            print(f"  [{ch.verdict:>4}] {ch.name}: {_fmt(ch.value)} (healthy {ch.threshold})", file=file)
        if res.sentinels.get("tokens"):
            print(f"engine sentinels (log-prob ≤ {res.sentinels['floor']:g}): {describe(res.sentinels)}", file=file)
        print(f"recommended preset: {rec.preset} — {rec.reason}", file=file)
        for note in rec.notes:
            print(f"note: {note}", file=file)
        return
    console = Console(file=file)
    if not console.is_terminal:  # a log: the tables within LOG_WIDTH (a terminal: its own width)
        console.width = LOG_WIDTH
    mean_len = c.tokens / c.rows_used if c.rows_used else 0.0
    console.print(f"[bold]Rollout mismatch diagnosis[/bold] · {c.rows:,} rows · {c.tokens:,} tokens · "
                  f"mean length {mean_len:.1f}")
    t = Table(title="Off-policy metrics (rollout_corr/…)", show_lines=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in lines_metrics:
        t.add_row(k, _fmt(v))
    for level in ("token", "sequence"):
        t.add_row(f"ESS ({level} weights)", _fmt(res.levels[level]["ess"]))
    console.print(t)
    h = Table(title="Health checks")
    h.add_column("check", overflow="fold")
    h.add_column("value", justify="right")
    h.add_column("healthy")
    h.add_column("verdict")
    style = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    for ch in diag.health:
        h.add_row(ch.name, _fmt(ch.value), ch.threshold, f"[{style[ch.verdict]}]{ch.verdict}[/]")
    console.print(h)
    if res.sentinels.get("tokens"):
        console.print(f"[bold red]Engine sentinels[/] (log-prob ≤ {res.sentinels['floor']:g}): "
                      f"{describe(res.sentinels)}")
    w = Table(title="What-if (one row per distinct correction; full table in the report)")
    for col in ("preset", "truncated", "rejected tokens", "rejected rows", "ESS"):
        w.add_column(col, justify="left" if col == "preset" else "right",
                     overflow="fold")  # a narrow terminal: a long name goes on two lines, never cut
    for e in res.what_if:
        if e["same_as"] is not None and e["preset"] != rec.preset:
            continue
        name = f"[bold green]{e['preset']} ★[/]" if e["preset"] == rec.preset else e["preset"]
        w.add_row(name, _fmt(e["truncated_fraction"]), _fmt(e["rejected_token_fraction"]),
                  _fmt(e["rejected_seq_fraction"]), _fmt(e["ess"]))
    console.print(w)
    console.print(f"[bold green]Recommended preset: {rec.preset}[/] — {rec.reason}")
    for note in rec.notes:
        console.print(f"[yellow]Response length[/]: {note}")
    if out_dir:
        console.print(f"Report: {os.path.join(out_dir, 'report.html')} · {os.path.join(out_dir, 'report.md')} · "
                      f"{os.path.join(out_dir, 'summary.json')}")
