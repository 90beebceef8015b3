"""Shrinking a plan for a rehearsal: the model narrowed in width, the plan otherwise as it is.

- :func:`shrink_model`: hidden size, heads, FFN, vocabulary and sequence scaled down together.
- :func:`shrink_plan`: the same plan (devices, layer split, micro-batches, policies) on it.
- :func:`without_module_inputs`: the plan with module-input offload off (the CPU ranks cannot
  run it).
"""

from __future__ import annotations

import dataclasses

from ..errors import HeteroError
from ..hardware.catalog import Catalog
from ..plan import ModelSpec, Plan, plan_from_data

__all__ = ["shrink_model", "shrink_plan", "without_module_inputs"]


def _round_to(x: float, unit: int) -> int:
    return max(unit, int(round(x / unit)) * unit)


def shrink_model(m: ModelSpec, hidden_size: int, tp: int = 1) -> ModelSpec:
    """``m`` shrunk in width to ``hidden_size``: heads keep a head size of at least 8 and the
    model's query-group ratio where they can; FFN, vocabulary and sequence keep their ratio to the
    hidden size. Layer count and everything else stay. A model no wider than ``hidden_size``
    is returned unchanged."""
    if hidden_size >= m.hidden_size:
        return m
    h = hidden_size
    r = h / m.hidden_size
    gqa = m.num_attention_heads // m.num_query_groups
    heads = groups = None
    for n in range(min(m.num_attention_heads, max(h // 8, 1)), 0, -1):
        if h % n or n % tp or (h // n) % 2:  # rope needs an even size per head
            continue
        g = n // gqa if n % gqa == 0 and (n // gqa) % tp == 0 else n
        heads, groups = n, g
        break
    if heads is None:
        raise HeteroError(f"--hidden-size {h}: no head count divides it into even head sizes "
                          f"and is divisible by the tensor-parallel size {tp}; use a multiple of "
                          f"{8 * tp}")
    return dataclasses.replace(
        m, name=f"{m.name}-shrunk-h{h}", hidden_size=h, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=_round_to(m.ffn_hidden_size * r, 8 * tp),
        vocab_size=_round_to(m.vocab_size * r, 16 * tp),
        seq_length=min(m.seq_length, max(16, _round_to(m.seq_length * r, 8))))


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
