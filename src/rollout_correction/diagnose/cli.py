"""``rollout-correction diagnose``: measure the mismatch in a dump of log-probs, write a report.

    rollout-correction diagnose FILE --out DIR      # Parquet / JSONL / .pt / .npz / an engine's dump
    rollout-correction diagnose DIR_OR_GLOB         # several files diagnosed as one dump
    rollout-correction diagnose --example [--out DIR]
    rollout-correction diagnose --certify FILE [--out DIR]   # zero-diff check: exit 0 pass, 1 fail
    rollout-correction diagnose --certify FILE --atol 1e-6  # the same within |Δ log p| ≤ 1e-6
"""

from __future__ import annotations

import argparse
import os

from rollout_correction.console import CommandError, refuse_held_folder, report_folder

from .engines import ENGINES
from .readers import FORMATS, Columns

DEFAULT_OUT = "diagnose_report"
# What makes a folder another run's report (an explicit --out holding one is refused without --force).
REPORT_MARKERS = ("summary.json", "report.md", "report.html", "certificate.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?",
                        help="dump of rollouts: a .parquet, .jsonl, .pt, .npz or (SkyRL) .pkl file, a folder of "
                             "them or a glob pattern (quoted); several files are diagnosed as one dump")
    parser.add_argument("--out", default=None,
                        help=f"report directory (default: a new ./{DEFAULT_OUT}/<date>-<time>/, with "
                             f"{DEFAULT_OUT}/latest pointing at the newest); refused when it holds another "
                             f"report, unless --force")
    parser.add_argument("--force", action="store_true", help="write into an --out that holds another report")
    parser.add_argument("--example", action="store_true",
                        help="generate an example dump with a reduced-precision rollout engine and diagnose it")
    parser.add_argument("--certify", action="store_true",
                        help="zero-diff certificate: pass (exit 0) only if rollout and trainer log-probs agree bit "
                             "for bit on every valid token; otherwise report where they differ (exit 1)")
    parser.add_argument("--atol", type=float, default=None,
                        help="with --certify: pass when every valid token's |Δ log p| ≤ ATOL instead of bit for bit")
    parser.add_argument("--format", choices=FORMATS, default=None, help="input format (default: from the extension)")
    parser.add_argument("--engine", choices=("auto", "plain", *ENGINES), default="auto",
                        help="read the dump as that engine writes it (see docs/diagnose.md); auto (default): "
                             "recognised by its keys unless --rollout-col / --old-col name the columns; plain: "
                             "the columns as named")
    d = Columns()
    cols = parser.add_argument_group("columns")
    cols.add_argument("--rollout-col", default=d.rollout_log_probs, help="rollout-engine log-probs")
    cols.add_argument("--old-col", default=d.old_log_probs, help="trainer log-probs (π_old, or π_θ in bypass mode)")
    cols.add_argument("--mask-col", default=d.response_mask,
                      help="response mask (0/1); used when present; 'none' to ignore")
    cols.add_argument("--lengths-col", default=d.lengths,
                      help="response lengths (first N positions valid); used when present; 'none' to ignore")
    cols.add_argument("--all-valid", action="store_true",
                      help="padded arrays without mask or lengths: every position is a response token")
    cols.add_argument("--rewards-col", default=d.rewards, help="per-row reward (optional)")
    cols.add_argument("--version-col", default=d.policy_version, help="per-row policy version (optional)")
    cols.add_argument("--token-ids-col", default=d.token_ids, help="response token ids (optional)")
    parser.add_argument("--chunk-rows", type=int, default=2048, help="rows per streamed block (default 2048)")
    parser.add_argument("--presets", default=None,
                        help="comma-separated presets for the what-if table (default: all)")
    parser.add_argument("--example-rows", type=int, default=512, help="rows of the --example dump (default 512)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--quiet", action="store_true", help="no terminal summary")


def _none(x: str | None) -> str | None:
    return None if x is None or x.lower() == "none" else x


def run(args: argparse.Namespace) -> int:
    from .diagnosis import diagnose_file
    from .report import print_summary, write_report

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    path = args.file
    if args.example and path:
        raise CommandError("give either FILE or --example, not both")
    if not args.example and not path:
        raise CommandError("give a FILE to diagnose, or --example")
    if getattr(args, "atol", None) is not None and not args.certify:
        raise CommandError("--atol applies to --certify only")
    if args.example:  # the input is generated into the report folder
        from .example import write_example

        out = _report_folder(args)
        path = os.path.join(out, "example_rollouts.parquet")
        if not args.quiet:
            print(f"generating {args.example_rows} responses with a bf16, int4-weight rollout engine "
                  f"→ {path}", flush=True)
        write_example(path, n_rows=args.example_rows)
    else:  # a folder in use is refused now; the report folder is made once the input has been read
        refuse_held_folder(args.out, REPORT_MARKERS, force=args.force)
        out = None
    columns = Columns(
        rollout_log_probs=args.rollout_col, old_log_probs=args.old_col, response_mask=_none(args.mask_col),
        lengths=_none(args.lengths_col), rewards=_none(args.rewards_col), policy_version=_none(args.version_col),
        token_ids=_none(args.token_ids_col), all_valid=args.all_valid)
    if args.certify:
        return _certify(path, columns, args, out)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()] if args.presets else None
    # a bad file raises ValueError / FileNotFoundError: one line and exit 2 at the command line (cli.py)
    diag = diagnose_file(path, columns, chunk_rows=args.chunk_rows, fmt=args.format, presets=presets,
                         engine=args.engine, progress=None if args.quiet else _file_lines())
    out = out or _report_folder(args)
    write_report(diag, out)
    if not args.quiet:
        print_summary(diag, out)
    return 0


def _report_folder(args: argparse.Namespace) -> str:
    return str(report_folder(args.out, DEFAULT_OUT, REPORT_MARKERS, force=args.force))


def _file_lines():
    """One plain line per file read, with the elapsed time and an ETA, when a dump has several."""
    from rollout_correction.console import ProgressLines

    lines: list[ProgressLines] = []

    def progress(done: int, total: int, entry: dict) -> None:
        if total < 2:
            return
        if not lines:
            lines.append(ProgressLines(total))
        lines[0].finished(entry["file"], f"{entry['rows']} rows, {entry['tokens']} tokens")

    return progress


def _certify(path: str, columns: Columns, args: argparse.Namespace, out: str | None) -> int:
    """The zero-diff certificate of ``path``: 0 when it passes, 1 when a token differs, 2 on an error.
    The report folder (``out``, or a new one) is made once the file has been read."""
    from .certify import certify_file, print_certificate, write_certificate

    cert = certify_file(path, columns, chunk_rows=args.chunk_rows, fmt=args.format, engine=args.engine,
                        atol=getattr(args, "atol", None))
    paths = write_certificate(cert, out or _report_folder(args))
    if not args.quiet:
        print_certificate(cert, paths)
    return 0 if cert.passed else 1
