"""Handlers of the plan subcommands (``validate``, ``args``)."""

from __future__ import annotations

import argparse

from ..hardware.inventory import load_inventory
from ..plan.megatron_args import megatron_args_line, plan_megatron_args
from ..errors import SchemaError
from ..placement.inventory import check_plan_gpus, check_plan_vendors
from ..plan.checks import check_offload
from ..sim.fits import check_fits
from ..plan import load_any_plan
from ..placement.mesh_inventory import check_against_inventory

__all__ = ["validate_main", "args_main"]


def validate_main(args: argparse.Namespace) -> int:
    inventory = load_inventory(args.inventory) if args.inventory else None
    plan = load_any_plan(args.plan, catalog=inventory.catalog if inventory else None)
    check_offload(plan, source=args.plan)
    if inventory is not None:
        check_against_inventory(plan, inventory, source=args.plan)
    if not plan.one_grid:
        if inventory is not None:
            _check_memory(args, plan, inventory)
        print(f"{args.plan}: valid mesh plan for {plan.model.name}: {len(plan.meshes)} meshes, "
              f"PP={plan.pipeline_model_parallel_size} ({plan.world_size} GPUs); layers "
              f"{plan.layer_split}\n{plan.describe()}")
        return 0
    check_plan_vendors(plan, inventory.catalog if inventory else plan.catalog, source=args.plan)
    dp = plan.data_parallel_size
    if not plan.uniform_data_parallel and plan.global_batch_size % dp:
        # What the runtime refuses at start (runtime.plan_args.virtual_micro_batch_size).
        raise SchemaError(args.plan, "global_batch_size", plan.global_batch_size,
                          f"a multiple of the number of pipelines ({dp}) when their micro-batches "
                          "differ (Megatron's step accounting, micro-batch size x DP x "
                          "micro-batches, must equal it at run time)")
    if inventory is not None:
        _check_memory(args, plan, inventory)
    counts = ", ".join(f"{n}x {gpu}" for gpu, n in sorted(plan.device_counts().items()))
    print(f"{args.plan}: valid plan for {plan.model.name}: TP={plan.tensor_model_parallel_size} "
          f"PP={plan.pipeline_model_parallel_size} DP={plan.data_parallel_size} "
          f"({plan.world_size} GPUs: {counts}); layers {plan.layer_split}; "
          f"micro-batches {[p.num_microbatches for p in plan.pipelines]}")
    catalog = inventory.catalog if inventory else plan.catalog
    vendors = sorted({catalog.get(t).vendor for t in plan.device_counts()})
    if len(vendors) > 1:
        print(f"{args.plan}: GPUs of {len(vendors)} vendors ({', '.join(vendors)}), each "
              "data-parallel group inside one: the runtime runs the world group and the groups "
              "across vendors on gloo and stages the pipeline edges between vendors through "
              "host memory (docs/vendors.md)")
    return 0


def _check_memory(args: argparse.Namespace, plan, inventory) -> None:
    """Each stage's memory on its card (and each node's host memory) as the simulator counts
    it, unless ``--no-memory-check``."""
    if args.no_memory_check:
        return
    from ..cost import CostModel
    from ..sim.plan import simulate_plan

    cost = CostModel(plan.model, inventory, precision=plan.precision,
                     use_distributed_optimizer=plan.use_distributed_optimizer)
    check_fits(plan, simulate_plan(plan, cost, record_events=False), source=args.plan,
               skip_hint="--no-memory-check skips this check")


def args_main(args: argparse.Namespace) -> int:
    inventory = load_inventory(args.inventory) if args.inventory else None
    plan = load_any_plan(args.plan, catalog=inventory.catalog if inventory else None)
    if inventory is not None:
        check_plan_gpus(plan, inventory, source=args.plan)
    if args.one_per_line:
        listed = plan_megatron_args(plan, args.plan)
        print("\n".join(listed))
    else:
        print(megatron_args_line(plan, args.plan))
    return 0
