"""The plugin's own Megatron-LM arguments (``extra_args_provider``)."""

from __future__ import annotations

import argparse

__all__ = ["add_hetero_args", "DEVICE_TYPE_ENV"]

DEVICE_TYPE_ENV = "MEGATRON_HETERO_DEVICE_TYPE"


def add_hetero_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--hetero-plan`` and friends to Megatron's parser; usable as ``extra_args_provider``."""
    group = parser.add_argument_group(title="megatron-hetero")
    group.add_argument("--hetero-plan", type=str, default=None, metavar="PLAN",
                       help="plan.yaml from `megatron-hetero tune`: placement, layer split, "
                            "per-replica micro-batches and per-stage memory policies")
    group.add_argument("--hetero-device-type", type=str, default=None, metavar="GPU",
                       help=f"catalog GPU type of this rank's device, overriding detection "
                            f"(also ${DEVICE_TYPE_ENV})")
    group.add_argument("--hetero-telemetry", type=str, default=None, metavar="DIR",
                       help="write what each stage of each replica measures in a step, beside "
                            "what the plan predicted, to DIR/telemetry.jsonl (with DIR/plan.yaml); "
                            "read it with `megatron-hetero report DIR`")
    group.add_argument("--hetero-telemetry-interval", type=int, default=None, metavar="N",
                       help="report every N-th step (default 10)")
    group.add_argument("--hetero-inventory", type=str, default=None, metavar="INVENTORY",
                       help="the pool's inventory.yaml: the telemetry's predictions use its "
                            "links (default: the catalog's, one group per device type)")
    return parser
