"""What ``megatron-hetero validate`` checks, as one function: the command itself and every
command that writes a plan (``replan``) call it, the latter on the staged file before it
replaces anything, so that no command writes a plan that ``validate`` refuses."""

from __future__ import annotations

from ..cost import CostModel
from ..cost.model import DEFAULT_MEMORY_HEADROOM, usable_memory_text
from ..errors import SchemaError
from ..hardware.inventory import GPUGroup, Inventory
from ..placement.inventory import check_against_inventory, check_plan_vendors
from ..plan import Plan
from ..plan.checks import check_offload
from ..sim.fits import check_fits
from ..sim.step import simulate

__all__ = ["validate_plan", "check_memory", "own_gpus"]


def validate_plan(plan: Plan, inventory: Inventory | None, *, source: str,
                  memory_check: bool = True,
                  memory_headroom: float = DEFAULT_MEMORY_HEADROOM) -> None:
    """Raise the one-line error ``validate`` gives for ``plan`` (read from ``source``) on
    ``inventory`` (None: the plan alone, its memory checked on the cards its catalog names:
    :func:`own_gpus`)."""
    check_offload(plan, source=source)
    if inventory is not None:
        check_against_inventory(plan, inventory, source=source)
    if plan.one_grid:
        check_plan_vendors(plan, inventory.catalog if inventory else plan.catalog, source=source)
        dp = plan.data_parallel_size
        if not plan.uniform_data_parallel and plan.global_batch_size % dp:
            # What the runtime refuses at start (runtime.plan_args.virtual_micro_batch_size).
            raise SchemaError(source, "global_batch_size", plan.global_batch_size,
                              f"a multiple of the number of pipelines ({dp}) when their "
                              "micro-batches differ (Megatron's step accounting, micro-batch "
                              "size x DP x micro-batches, must equal it at run time)")
    if memory_check:
        check_memory(plan, inventory if inventory is not None else own_gpus(plan, source),
                     source=source, memory_headroom=memory_headroom)


def own_gpus(plan: Plan, source: str) -> Inventory:
    """The pool a plan names without an inventory: each of its device types (known from its
    catalog, the built-in one plus its own ``gpus:``) as one node of as many cards as it needs.
    A stage's memory depends on its card and its shape only; host memory is not checked (no
    node gives ``host_memory_gb``)."""
    groups = [GPUGroup(gpu=gpu, nodes=1, gpus_per_node=n)
              for gpu, n in sorted(plan.device_counts().items())]
    return Inventory(groups=groups, catalog=plan.catalog, source=source)


def check_memory(plan: Plan, inventory: Inventory, *, source: str,
                 memory_headroom: float = DEFAULT_MEMORY_HEADROOM) -> None:
    """Each stage's memory on its card, less the memory headroom (and each node's host memory),
    as the simulator counts it."""
    cost = CostModel(plan.model, inventory, precision=plan.precision,
                     use_distributed_optimizer=plan.use_distributed_optimizer,
                     memory_headroom=memory_headroom)
    check_fits(plan, simulate(plan, cost, record_events=False), source=source,
               skip_hint=f"{usable_memory_text(memory_headroom)}; --no-memory-check skips "
                         "this check")
