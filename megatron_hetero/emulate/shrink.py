"""Shrinking a plan for a rehearsal: the model narrowed in width, the plan otherwise as it is.

- :func:`shrink_plan`: the same plan (devices, layer split, micro-batches, policies) on the
  model narrowed by :func:`megatron_hetero.models.shrink_model` (hidden size, heads, FFN,
  vocabulary and sequence scaled down together).
- :func:`without_module_inputs`: the plan with module-input offload off (the CPU ranks cannot
  run it).
"""

from __future__ import annotations

import dataclasses

from ..hardware.catalog import Catalog
from ..models import shrink_model
from ..plan import Plan, plan_from_data

__all__ = ["shrink_plan", "without_module_inputs"]


def shrink_plan(plan: Plan, hidden_size: int, catalog: Catalog | None = None) -> Plan:
    """The same plan (devices, layer split, micro-batches, policies) on the shrunk model."""
    data = plan.to_data()
    data["model"] = dataclasses.asdict(shrink_model(plan.model, hidden_size,
                                                    plan.tensor_model_parallel_size))
    data.pop("prediction", None)
    return plan_from_data(data, source="<shrunk plan>", catalog=catalog)


def without_module_inputs(plan: Plan, catalog: Catalog | None = None
                          ) -> tuple[Plan, list[tuple[int, int]]]:
    """``plan`` with every stage's ``offload.module_inputs`` off, and the (pipeline, stage) slots
    that had it. megatron-core's fine-grained activation offloading copies on CUDA streams and
    runs through Transformer Engine: the CPU ranks keep those tensors. (Their memory caps still
    count them as offloaded: :func:`.memory.memory_caps` scales the real plan's estimate, with
    the offload, to the shrunk plan's as the CPU runs it, without.)"""
    slots = [(d, s) for d, pipe in enumerate(plan.pipelines)
             for s, stage in enumerate(pipe.stages) if stage.offload.module_inputs]
    if not slots:
        return plan, []
    data = plan.to_data()
    for d, s in slots:
        data["pipelines"][d]["stages"][s]["offload"]["module_inputs"] = False
    return (plan_from_data(data, source="<rehearsed plan>", catalog=catalog or plan.catalog),
            slots)
