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
    group.add_argument("--hetero-rebalance", action="store_true",
                       help="move the replicas' micro-batch shares between global batches when "
                            "the telemetry sees a replica drift from the plan (needs "
                            "--hetero-telemetry; turns on --calculate-per-token-loss)")
    group.add_argument("--hetero-rebalance-threshold", type=float, default=None, metavar="X",
                       help="a replica drifts beyond X times the replicas' median measured/"
                            "predicted time (default 1.15)")
    group.add_argument("--hetero-rebalance-patience", type=int, default=None, metavar="N",
                       help="reports in a row a replica must drift before shares move (default 2)")
    group.add_argument("--hetero-inventory", type=str, default=None, metavar="INVENTORY",
                       help="the pool's inventory.yaml: the telemetry's predictions use its "
                            "links (default: the catalog's, one group per device type)")
    return parser
