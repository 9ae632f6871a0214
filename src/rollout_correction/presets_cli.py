"""``rollout-correction presets``: list the configuration presets."""

from __future__ import annotations

import argparse

from .reference import PRESET_HEADER, preset_rows


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
