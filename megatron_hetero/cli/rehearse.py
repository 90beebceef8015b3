"""``megatron-hetero rehearse PLAN``: the command's handler. The rehearsal itself is
:func:`megatron_hetero.emulate.rehearse.rehearse` (every plan shape); this module is imported
only when the subcommand runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..hardware.inventory import load_inventory
from ..placement.inventory import check_against_inventory
from ..plan import load_any_plan
from ..emulate.host import check_rank_count
from ..emulate.slow import parse_slow
from ..errors import HeteroError
from ..limits import check_quantity
from ..telemetry.rebalance import RebalancePolicy, check_rebalanceable

__all__ = ["rehearse_main"]


def rehearse_main(args) -> int:
    """Handler of ``megatron-hetero rehearse``."""
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # megatron's Apex/TE notices, per rank
    inventory = load_inventory(args.inventory) if args.inventory else None
    plan = load_any_plan(args.plan, catalog=inventory.catalog if inventory else None)
    catalog = plan.catalog  # the built-in (or the inventory's) catalog plus the plan's gpus
    if inventory is not None:
        check_against_inventory(plan, inventory, source=args.plan)
    check_rank_count(plan, max_ranks=args.max_ranks, source=args.plan)  # before torch loads
    slow = [parse_slow(text, plan, steps=args.steps) for text in args.slow]
    policy = _rebalance_policy(args, plan)
    if args.telemetry_interval is not None and not 1 <= args.telemetry_interval <= 1000:
        raise HeteroError(f"--telemetry-interval: found {args.telemetry_interval}; expected a "
                          "number of steps from 1 to 1000")
    # megatron-core and torch load here, seconds, once the plan is known to be rehearsable
    from ..emulate.rehearse import RehearsalConfig, format_report, rehearse
    try:
        config = RehearsalConfig(steps=args.steps, hidden_size=args.hidden_size,
                                 time_scale=args.time_scale, memory_cap=not args.no_memory_cap,
                                 seed=args.seed, max_ranks=args.max_ranks, nice=args.nice,
                                 emulate_links=args.emulate_links,
                                 link_latency_s=args.link_latency, slow=slow,
                                 telemetry=Path(args.telemetry) if args.telemetry else None,
                                 telemetry_interval=args.telemetry_interval,
                                 rebalance=policy)
    except ValueError as exc:
        raise HeteroError(str(exc)) from None
    if args.time_scale is not None:  # finite and in range for the config; bounded here
        check_quantity("time_scale", args.time_scale, source="time_scale (--time-scale)")
    check_quantity("link_latency_s", args.link_latency, source="link_latency_s (--link-latency)")
    progress = lambda msg: print(f"[rehearse] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    result = rehearse(plan, config, catalog=catalog, verify=args.verify, source=args.plan,
                      progress=progress, inventory=inventory,
                      calibration_file=args.calibration)
    print(format_report(result, source=args.plan, real=plan.model))
    if args.verify:
        return _verify_verdict(result, plan.world_size, config.steps)
    return 0


def _verify_verdict(result, world_size: int, steps: int) -> int:
    """Print what ``--verify`` compared and its verdict; 0 when it passed, else 1."""
    from ..emulate.verify import verdict_lines

    if result.precision_verdict is not None:  # a bf16 or fp16 plan, in its own precision
        print("\n".join(verdict_lines(result.precision_verdict, world_size)))
        return 0 if result.precision_verdict.ok else 1
    if result.verify_message is not None:
        print(f"verify: FAILED: the {world_size}-rank run diverges from the "
              f"single-process run: {result.verify_message}")
        return 1
    how = ("SGD (momentum 0.9): linear in the gradient, so rounding cannot grow into a "
           "difference as it can under Adam" if result.verify_optimizer == "sgd" else
           "Adam in fp32 (the plan offloads optimizer state, which megatron-core does for Adam "
           "only, and the CPU stack's offload runs fp32 parameters only)")
    print(f"verify: losses and final parameters match the single-process run "
          f"(fp32, rtol 1e-5, atol 1e-5) over {steps} steps, both trained with {how}")
    return 0


def _rebalance_policy(args, plan) -> RebalancePolicy | None:
    """``--rebalance``'s policy (its flags checked, the plan checked rebalanceable), or None."""
    if not args.rebalance:
        for flag, value, default in (("--rebalance-threshold", args.rebalance_threshold, 1.15),
                                     ("--rebalance-patience", args.rebalance_patience, 2)):
            if value != default:
                raise HeteroError(f"{flag}: given without --rebalance")
        return None
    threshold, patience = args.rebalance_threshold, args.rebalance_patience
    if not (1.0 < threshold <= 100.0):  # NaN fails too
        raise HeteroError(f"--rebalance-threshold: found {threshold}; expected a ratio above 1 "
                          "and at most 100")
    if not 1 <= patience <= 1000:
        raise HeteroError(f"--rebalance-patience: found {patience}; expected a number of "
                          "reports from 1 to 1000")
    check_rebalanceable(plan, source=args.plan)
    return RebalancePolicy(threshold=threshold, patience=patience)
