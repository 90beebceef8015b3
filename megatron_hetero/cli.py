"""``megatron-hetero``: argument parsing only; the work happens in the modules named below.

Each subcommand names its handler as ``module:function``; the module is imported only when the
subcommand runs, so ``validate`` and ``tune`` never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from ._version import __version__
from .errors import HeteroError

__all__ = ["main", "build_parser"]

_EPILOG = "Run `megatron-hetero COMMAND --help` for a command's options."


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="check a plan (and that an inventory can host it)",
                       description="Check PLAN against the plan schema and its invariants; with "
                                   "--inventory, also that the inventory has the GPUs it needs. "
                                   "Exits 0 when valid, 1 with the offending field path when not.")
    p.add_argument("plan", metavar="PLAN", help="plan.yaml")
    p.add_argument("--inventory", metavar="INV", help="inventory.yaml the plan must fit")
    p.set_defaults(handler="megatron_hetero.commands:validate_main")


def _add_args(sub) -> None:
    p = sub.add_parser("args", help="print the Megatron-LM arguments a plan implies",
                       description="Print the Megatron-LM arguments PLAN implies, as one "
                                   "shell-ready line ending in --hetero-plan PLAN.")
    p.add_argument("plan", metavar="PLAN", help="plan.yaml")
    p.add_argument("--one-per-line", action="store_true", help="print one argument per line")
    p.set_defaults(handler="megatron_hetero.commands:args_main")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-hetero",
        description="Plan and run Megatron-LM training on a mixed pool of GPUs.",
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


_COMMANDS = [_add_validate, _add_args]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, func = args.handler.split(":")
    handler = getattr(importlib.import_module(module), func)
    try:
        return int(handler(args) or 0)
    except HeteroError as exc:
        print(f"megatron-hetero {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"megatron-hetero {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
