"""``rollout-correction presets``: list the configuration presets."""

from __future__ import annotations

import argparse

from rollout_correction import RolloutCorrectionConfig


#: Columns of :func:`preset_rows`.
PRESET_HEADER = ("preset", "mode", "IS weights", "rejection", "loss")


def preset_rows() -> list[tuple[str, str, str, str, str]]:
    """(name, mode, IS, RS, loss) for every preset, built from the preset table."""
    rows = []
    for name in RolloutCorrectionConfig.preset_names():
        c = RolloutCorrectionConfig.from_preset(name)
        keys = c.to_dict()  # bands as "lo_hi"
        mode = "bypass" if c.bypass_mode else "decoupled"
        is_ = "—" if c.rollout_is is None else f"{c.rollout_is} {keys['rollout_is_threshold']}"
        rs = "—" if c.rollout_rs is None else f"{c.rollout_rs} {keys['rollout_rs_threshold']}"
        if c.rollout_rs_threshold_lower is not None:
            rs += f" (lower {c.rollout_rs_threshold_lower})"
        if c.rollout_token_veto_threshold is not None:
            rs = ("" if rs == "—" else rs + " + ") + f"veto {c.rollout_token_veto_threshold:g}"
        if c.rollout_token_veto_threshold_high is not None:
            rs = ("" if rs == "—" else rs + " + ") + f"veto above {c.rollout_token_veto_threshold_high:g}"
        if c.bypass_mode:
            loss = c.loss_type
        else:  # decoupled: the policy loss, multiplied by the IS weights when there are any
            loss = f"{c.loss_type} × IS" if c.is_enabled else c.loss_type
        if c.rollout_opsm_delta is not None:
            loss += f" + OPSM δ={c.rollout_opsm_delta:g}"
        if c.rollout_m2po_threshold is not None:
            rs = ("" if rs == "—" else rs + " + ") + f"M2PO τ={c.rollout_m2po_threshold:g}"
        rows.append((name, mode, is_, rs, loss))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")


def run(args: argparse.Namespace) -> int:
    rows = preset_rows()
    header = PRESET_HEADER
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return 0
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text without the [cli] extra
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        for r in (header, *rows):
            print("  ".join(x.ljust(w) for x, w in zip(r, widths)))
        return 0
    table = Table(title="rollout-correction presets")
    for h in header:
        table.add_column(h, no_wrap=h == "preset")
    for r in rows:
        table.add_row(*r)
    Console().print(table)
    return 0
