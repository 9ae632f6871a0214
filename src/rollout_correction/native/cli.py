"""``rollout-correction native``: build the fused CPU kernels now and say whether the eager pass
uses them.

The kernels are otherwise built on the first CPU correction call (about a second, then
cached); building them ahead — e.g. while a container image is made — moves that out of the first
training step and shows a missing compiler before training starts. Exit 0 when they are in use
(or switched off with ``ROLLOUT_CORRECTION_NATIVE=0``), 1 when they cannot be built.
"""

from __future__ import annotations

import argparse

from . import ENV, library, mode, status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    del args
    try:
        lib = library()
    except RuntimeError:
        lib = None
    print(status())
    if lib is None and mode() != "off":
        print(f"The eager pass runs on ATen instead (same results up to float32 rounding, slower on CPU). "
              f"Install a C compiler (gcc or clang), or set CC; {ENV}=0 silences this.")
        return 1
    return 0
