"""Figures of the report, drawn with matplotlib's Agg backend and returned as PNG bytes."""

from __future__ import annotations

import io
import math

import numpy as np

from rollout_correction import METRIC_PREFIX

from .histograms import Histogram, KeyedSums, key_bin_edges
from .profile import HEALTHY_BAND, LOG_CLAMP, VETO_THRESHOLD, ProfileResult

_BLUE, _ORANGE, _GREEN, _GREY, _RED = "#1f77b4", "#ff7f0e", "#2ca02c", "#9a9a9a", "#d62728"


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    _plt().close(fig)
    return buf.getvalue()


def _trim(h: Histogram) -> tuple[np.ndarray, np.ndarray]:
    """Edges and counts without the empty bins at both ends (keeps at least the centre)."""
    nz = np.nonzero(h.counts)[0]
    if nz.size == 0:
        mid = h.counts.size // 2
        return h.edges[mid - 1 : mid + 2], h.counts[mid - 1 : mid + 1]
    lo, hi = max(nz[0] - 1, 0), min(nz[-1] + 2, h.counts.size)
    return h.edges[lo : hi + 1], h.counts[lo:hi]


def _hist_axes(ax, h: Histogram, color: str, label: str, lines: dict[str, float]) -> None:
    edges, counts = _trim(h)
    total = max(h.total, 1)
    ax.stairs(counts / total, edges, fill=True, color=color, alpha=0.35)
    ax.stairs(counts / total, edges, color=color, label=label)
    ax.set_xscale("symlog", linthresh=1e-4, linscale=0.5)
    ax.set_yscale("log")
    for text, x in lines.items():
        if edges[0] <= x <= edges[-1]:
            ax.axvline(x, color=_GREY, lw=0.8, ls="--")
            ax.text(x, 1.0, text, transform=ax.get_xaxis_transform(), fontsize=7, color="#555",
                    ha="center", va="bottom", rotation=0)
    ax.set_ylabel("fraction")
    ax.grid(alpha=0.25, which="major")


def _linear_axes(ax, lh, color: str, lines: dict[str, float]) -> None:
    h = lh.hist
    total = max(lh.total, 1)
    ax.stairs(h.counts / total, h.edges, fill=True, color=color, alpha=0.35)
    ax.stairs(h.counts / total, h.edges, color=color)
    for text, x in lines.items():
        if h.edges[0] <= x <= h.edges[-1]:
            ax.axvline(x, color=_GREY, lw=0.8, ls="--")
            ax.text(x, 1.0, text, transform=ax.get_xaxis_transform(), fontsize=7, color="#555",
                    ha="center", va="bottom")
    ax.axvline(0.0, color="#333", lw=0.6)
    ax.set_ylabel("fraction")
    ax.grid(alpha=0.25)
    outside = lh.underflow + lh.overflow
    if outside:
        ax.text(0.98, 0.95, f"{100 * outside / total:.2g}% outside the axis", transform=ax.transAxes,
                fontsize=7, ha="right", va="top", color="#555")


def plot_log_ratio(res: ProfileResult) -> bytes:
    """Per-token log ρ = old − rollout: the bulk on a linear axis, the tails on a symmetric-log axis."""
    plt = _plt()
    fig, (ax0, ax1) = plt.subplots(1, 2, layout="constrained", figsize=(12, 3.4))
    lo, hi = math.log(HEALTHY_BAND[0]), math.log(HEALTHY_BAND[1])
    _linear_axes(ax0, res.linear["token"], _BLUE, {"ρ=0.5": lo, "ρ=2": hi})
    ax0.set_xlabel("log ρₜ = log π_train − log π_rollout")
    ax0.set_title("bulk (linear axis)", fontsize=9)
    _hist_axes(ax1, res.histograms["token"], _BLUE, "tokens",
               {"ρ=0.5": lo, "ρ=2": hi, f"ρ={VETO_THRESHOLD:g}": math.log(VETO_THRESHOLD)})
    ax1.set_xlabel("log ρₜ (symmetric log axis: each side shows |log ρ| in decades)")
    ax1.set_title("tails (symmetric-log axis, linear inside ±1e-4)", fontsize=9)
    t = res.levels["token"]
    fig.suptitle(f"Per-token log-ratio · {t['n']:,} tokens · k3 KL = {res.metrics[METRIC_PREFIX + 'k3_kl']:.3g}",
                 fontsize=10)
    return _png(fig)


def plot_weights(res: ProfileResult) -> bytes:
    """log w at token / sequence / geometric level, with the [0.5, 2] band and the ±20 clamp."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, layout="constrained", figsize=(12, 3.4), sharey=False)
    lo, hi = math.log(HEALTHY_BAND[0]), math.log(HEALTHY_BAND[1])
    titles = {"token": "token  w = ρₜ", "sequence": "sequence  w = ∏ρₜ", "geometric": "geometric  w = (∏ρₜ)^(1/L)"}
    for ax, (level, color) in zip(axes, (("token", _BLUE), ("sequence", _ORANGE), ("geometric", _GREEN))):
        d = res.levels[level]
        _linear_axes(ax, res.linear[level], color, {"0.5": lo, "2": hi, "e⁻²⁰": -LOG_CLAMP, "e²⁰": LOG_CLAMP})
        ax.set_xlabel("log w")
        ax.set_title(f"{titles[level]}\nESS {d['ess']:.3f} · mean {d['mean']:.3g} · std {d['std']:.3g} · "
                     f"{100 * d['fraction_outside']:.2g}% ∉ [0.5, 2]", fontsize=9)
    return _png(fig)


def _loglog(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.25)


def _binned_profile(prof: KeyedSums, names: tuple[str, ...], start: int = 0):
    keys = np.nonzero(prof.count)[0]
    if keys.size == 0:
        return None
    edges = key_bin_edges(int(keys.max()))
    b = prof.binned(edges)
    ok = b["count"] > 0
    centre = (edges[:-1] + edges[1:] - 1) / 2.0 + start
    width = np.diff(edges).astype(np.float64)
    out = {"x": centre[ok], "count": b["count"][ok], "per_key": b["count"][ok] / width[ok]}
    for n in names:
        out[n] = b[n][ok] / b["count"][ok]
    return out


def plot_position(res: ProfileResult) -> bytes:
    """Mismatch by token position: mean |log ρ| and mean k3 per position bin, token count below."""
    plt = _plt()
    fig, ax = plt.subplots(layout="constrained", figsize=(7.5, 3.4))
    d = _binned_profile(res.position, ("abs_log_ratio", "k3", "log_ratio"), start=1)
    if d is not None:
        ax.plot(d["x"], d["abs_log_ratio"], "o-", ms=3, color=_BLUE, label="mean |log ρ|")
        ax.plot(d["x"], d["k3"], "s-", ms=3, color=_ORANGE, label="mean k3 (KL)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax2 = ax.twinx()
        ax2.fill_between(d["x"], d["per_key"], step="mid", color=_GREY, alpha=0.15)
        ax2.set_ylabel("tokens at this position", color="#777")
        ax2.set_yscale("log")
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
    ax.set_xlabel("token position in the response (1 = first)")
    ax.set_ylabel("mismatch per token")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.25)
    ax.set_title("Mismatch by token position", fontsize=10)
    return _png(fig)


def plot_length(res: ProfileResult) -> bytes:
    """Mismatch by response length: per-token k3, |log ∏ρ| and the share of rows with ∏ρ ∉ [0.5, 2]."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, layout="constrained", figsize=(12, 3.4))
    d = _binned_profile(res.length, ("k3_mean", "abs_seq_log_ratio", "seq_outside"))
    if d is not None:
        ax = axes[0]
        ax.plot(d["x"], d["k3_mean"], "o-", ms=3, color=_ORANGE, label="per-token k3 (row mean)")
        _loglog(ax, "response length (tokens)", "k3 KL per token")
        ax2 = ax.twinx()
        ax2.fill_between(d["x"], d["per_key"], step="mid", color=_GREY, alpha=0.15)
        ax2.set_ylabel("rows of this length", color="#777")
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.legend(loc="upper left", fontsize=8)
        ax = axes[1]
        ax.plot(d["x"], d["abs_seq_log_ratio"], "o-", ms=3, color=_BLUE, label="mean |log ∏ρ|")
        _loglog(ax, "response length (tokens)", "|sequence log-weight|")
        ax3 = ax.twinx()
        ax3.plot(d["x"], 100 * d["seq_outside"], "^-", ms=3, color=_RED, label="% rows with ∏ρ ∉ [0.5, 2]")
        ax3.set_ylabel("% rows outside [0.5, 2]", color=_RED)
        ax3.set_ylim(0, 100)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax3.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    axes[0].set_title("Per-token mismatch by response length", fontsize=10)
    axes[1].set_title("Sequence weight by response length", fontsize=10)
    return _png(fig)


def plot_what_if(what_if: list[dict], recommended: str) -> bytes:
    """Horizontal bars per distinct correction: ESS after correction, truncated and rejected fractions.

    Presets whose weights and masks equal an earlier preset's (they differ only in the loss) are
    left out, except the recommended one.
    """
    plt = _plt()
    rows = [r for r in what_if if r.get("same_as") is None or r["preset"] == recommended]
    n = len(rows)
    fig, ax = plt.subplots(layout="constrained", figsize=(7.5, 0.3 * n + 1.5))
    y = np.arange(n)
    ess = [r["ess"] for r in rows]
    trunc = [r["truncated_fraction"] for r in rows]
    rej = [r["rejected_token_fraction"] for r in rows]
    ax.barh(y - 0.27, ess, height=0.27, color=_GREEN, label="ESS after correction")
    ax.barh(y, trunc, height=0.27, color=_ORANGE, label="truncated / out-of-band")
    ax.barh(y + 0.27, rej, height=0.27, color=_RED, label="rejected tokens")
    ax.set_yticks(y)
    ax.set_yticklabels([("★ " if r["preset"] == recommended else "") + r["preset"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.0)
    ax.set_xlabel("fraction")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    ax.grid(alpha=0.25, axis="x")
    ax.set_title("What-if: each distinct correction on this data", fontsize=10)
    return _png(fig)


def plot_version(res: ProfileResult) -> bytes | None:
    """Per-token k3 KL by policy version (staleness), when the file has a version column."""
    if len(res.version) < 2:
        return None
    plt = _plt()
    vers = sorted(res.version)
    k3 = [res.version[v]["k3"] / max(res.version[v]["tokens"], 1) for v in vers]
    fig, ax = plt.subplots(layout="constrained", figsize=(7.5, 3.0))
    ax.bar([str(v) for v in vers], k3, color=_BLUE)
    ax.set_yscale("log")
    ax.set_xlabel("policy version")
    ax.set_ylabel("k3 KL per token")
    ax.set_title("Mismatch by policy version", fontsize=10)
    ax.grid(alpha=0.25, axis="y")
    return _png(fig)


def all_figures(res: ProfileResult, recommended: str) -> dict[str, bytes]:
    """name → PNG bytes for every figure of the report."""
    figs = {
        "diagnose_log_ratio.png": plot_log_ratio(res),
        "diagnose_weights.png": plot_weights(res),
        "diagnose_position.png": plot_position(res),
        "diagnose_length.png": plot_length(res),
    }
    if res.what_if:
        figs["diagnose_what_if.png"] = plot_what_if(res.what_if, recommended)
    v = plot_version(res)
    if v is not None:
        figs["diagnose_version.png"] = v
    return figs
