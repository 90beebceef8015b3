"""Handlers of the plan subcommands (``validate``, ``args``)."""

from __future__ import annotations

import argparse
import shlex

from ..hardware.inventory import load_inventory
from ..hardware.optional import megatron_training_option
from ..plan.megatron_args import megatron_args
from ..placement.inventory import check_plan_gpus
from ..plan import load_any_plan
from ..tuner.commands import memory_headroom
from ..tuner.validation import validate_plan

__all__ = ["validate_main", "args_main"]


def validate_main(args: argparse.Namespace) -> int:
    headroom = memory_headroom(args)
    inventory = load_inventory(args.inventory) if args.inventory else None
    plan = load_any_plan(args.plan, catalog=inventory.catalog if inventory else None)
    validate_plan(plan, inventory, source=args.plan, memory_check=not args.no_memory_check,
                  memory_headroom=headroom)
    if not plan.one_grid:
        print(f"{args.plan}: valid mesh plan for {plan.model.name}: {len(plan.meshes)} meshes, "
              f"PP={plan.pipeline_model_parallel_size} ({plan.world_size} GPUs); layers "
              f"{plan.layer_split}\n{plan.describe()}")
        return 0
    counts = ", ".join(f"{n}x {gpu}" for gpu, n in sorted(plan.device_counts().items()))
    print(f"{args.plan}: valid plan for {plan.model.name}: TP={plan.tensor_model_parallel_size} "
          f"PP={plan.pipeline_model_parallel_size} DP={plan.data_parallel_size}"
          f"{plan.meshes[0].expert_text} ({plan.world_size} GPUs: {counts}); layers {plan.layer_split}; "
          f"micro-batches {[p.num_microbatches for p in plan.pipelines]}")
    catalog = inventory.catalog if inventory else plan.catalog
    vendors = sorted({catalog.get(t).vendor for t in plan.device_counts()})
    if len(vendors) > 1:
        print(f"{args.plan}: GPUs of {len(vendors)} vendors ({', '.join(vendors)}), each "
              "data-parallel group inside one: the runtime runs the world group and the groups "
              "across vendors on gloo and stages the pipeline edges between vendors through "
              "host memory (docs/vendors.md)")
    return 0


def args_main(args: argparse.Namespace) -> int:
    inventory = load_inventory(args.inventory) if args.inventory else None
    plan = load_any_plan(args.plan, catalog=inventory.catalog if inventory else None)
    if inventory is not None:
        check_plan_gpus(plan, inventory, source=args.plan)
    # what `validate` refuses, args refuses with the same line (memory aside: a prediction,
    # which `validate` and `simulate` check)
    validate_plan(plan, inventory, source=args.plan, memory_check=False)
    listed = megatron_args(plan, args.plan)
    if plan.use_distributed_optimizer and megatron_training_option(RESHARDABLE_DEST):
        listed[-2:-2] = [RESHARDABLE_FLAG]  # before --hetero-plan PLAN, which ends the list
    print("\n".join(listed) if args.one_per_line else shlex.join(listed))
    return 0


RESHARDABLE_FLAG = "--dist-ckpt-optim-fully-reshardable"
"""Megatron-LM's option that saves the distributed optimizer's state so that any plan can load
it: ``replan`` can then change TP and PP (Megatron's default, ``dp_reshardable``, loads only at
the saved TP and PP). ``args`` adds it where the installed Megatron-LM has it."""
RESHARDABLE_DEST = "dist_ckpt_optim_fully_reshardable"
