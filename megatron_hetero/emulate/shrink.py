"""Shrinking a plan for a rehearsal: the model narrowed in width, the plan otherwise as it is.

- :func:`shrink_plan`: the same plan (devices, layer split, micro-batches, policies) on the
  model narrowed by :func:`megatron_hetero.models.shrink_model` (hidden size, heads, FFN,
  vocabulary and sequence scaled down together).
- :func:`offload_min_numel`: the smallest module input the shrunk plan's stages offload, so
  that they offload the module inputs the real plan's do.
- :func:`without_module_inputs`: the plan with module-input offload off, where the installed
  megatron-core has no fine-grained activation offloading.
"""

from __future__ import annotations

import dataclasses
import math

from ..hardware.catalog import Catalog
from ..models import shrink_model
from ..plan import Plan, any_plan_from_data, plan_from_data

__all__ = ["shrink_plan", "offload_min_numel", "without_module_inputs", "MIN_OFFLOADED_NUMEL"]

MIN_OFFLOADED_NUMEL = 1024 * 1024
"""megatron-core's ``TransformerConfig.min_offloaded_tensor_size`` (0.16.1, 0.17.1), which
Megatron-LM has no option for: module inputs smaller than this many elements stay on the GPU."""


def shrink_plan(plan: Plan, hidden_size: int, catalog: Catalog | None = None, *,
                precision: str | None = None) -> Plan:
    """The same plan (devices, layer split, micro-batches, policies) on the shrunk model (its
    heads divisible by every mesh's TP), in ``precision`` where given, without its prediction;
    of every shape (one grid or a chain of meshes)."""
    tp = math.lcm(*(m.tensor_model_parallel_size for m in plan.meshes))
    data = plan.to_data()
    data["model"] = dataclasses.asdict(shrink_model(plan.model, hidden_size, tp))
    if precision is not None:
        data["precision"] = precision
    data.pop("prediction", None)
    return any_plan_from_data(data, source="<shrunk plan>", catalog=catalog)


def offload_min_numel(real: Plan, shrunk: Plan) -> int:
    """:data:`MIN_OFFLOADED_NUMEL` scaled by the shrunk over the real size of a layer's input
    (sequence x hidden; the micro-batch stays): a module input of the shrunk model reaches it
    where the real one reaches megatron-core's threshold."""
    ratio = (shrunk.model.seq_length * shrunk.model.hidden_size
             / (real.model.seq_length * real.model.hidden_size))
    return max(1, round(MIN_OFFLOADED_NUMEL * ratio))


def without_module_inputs(plan: Plan, catalog: Catalog | None = None
                          ) -> tuple[Plan, list[tuple[int, int]]]:
    """``plan`` with every stage's ``offload.module_inputs`` off, and the (pipeline, stage) slots
    that had it: the rehearsal's plan where the installed megatron-core has no fine-grained
    activation offloading (0.16.1 and 0.17.1 have it), so the CPU ranks keep those tensors.
    (Their memory caps still count them as offloaded: :func:`.memory.memory_caps` scales the
    real plan's estimate, with the offload, to the shrunk plan's as the CPU runs it, without.)"""
    slots = [(d, s) for d, pipe in enumerate(plan.pipelines)
             for s, stage in enumerate(pipe.stages) if stage.offload.module_inputs]
    if not slots:
        return plan, []
    data = plan.to_data()
    for d, s in slots:
        data["pipelines"][d]["stages"][s]["offload"]["module_inputs"] = False
    return (plan_from_data(data, source="<rehearsed plan>", catalog=catalog or plan.catalog),
            slots)
