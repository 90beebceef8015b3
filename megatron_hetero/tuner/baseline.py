"""The baseline: the best plan plain Megatron expresses, for the report's comparison.

Plain Megatron runs the same layers on every stage (and chunk), the same micro-batches on every
replica and one recompute setting everywhere (:func:`baseline_policies`); it has the flags for
module-input offload and for the interleaved schedule's micro-batch group, so the baseline
uses them where they are faster (:func:`best_group`).
"""

from __future__ import annotations


from ..cost.model import CostModel
from ..plan import Offload, Plan, replace_grid
from ..sim.step import SimResult, simulate
from .policy import Option, Policy
from .refine import group_choices
from .space import Structure
from .tables import StageTable, StageTables, per_chunk_recompute

__all__ = ["baseline_policies", "best_group"]


def baseline_policies(st: Structure, tables: list[list[StageTable]], n: int,
                      search_tables: StageTables, *, precision: str,
                      module_inputs: bool) -> list[list[Policy]] | None:
    """One memory policy for every stage of ``st`` with ``n`` layers each (``tables`` its stage
    tables, from ``search_tables``): full recompute of the fewest layers that fit on every
    stage (counted per chunk, as Megatron does), or selective recompute everywhere where that
    fits and is faster; with ``module_inputs``, the module inputs offloaded everywhere with the
    fewest layers of recompute that then fit, where that is faster. None when nothing fits."""
    p, v, big = st.pp, st.vp, search_tables.problem.model.num_layers + 1
    every = list({id(tb): tb for rows in tables for tb in rows}.values())  # each table once
    # one stage of each device type and place (first, last or neither): the others have the
    # same seconds, all stages holding the same layers under the same policy
    kinds = {(types[s], s == 0, s == p - 1): (types, s)
             for types, _ in st.templates for s in range(p)}

    def slowest(option: Option) -> float:
        """The slowest stage's seconds per micro-batch with ``option`` on every stage."""
        policy = Policy(recompute=option.recompute(n),
                        offload=Offload(module_inputs=option.module_inputs))
        return max(search_tables.seconds(st, types, s, layers=n, policy=policy,
                                         precision=precision)
                   for types, s in kinds.values())

    k = per_chunk_recompute(max(tb.base.layers_or(n, big) for tb in every), n, v)
    choice = Option(layers=k) if k <= n else None
    if k and all(tb.sel.fits(n) for tb in every):
        full_t = float("inf") if choice is None else slowest(choice)
        if max(float(tb.t_sel[n]) for tb in every) < full_t:
            choice = Option(selective=True)
    if module_inputs and k:  # with no recompute needed, offloading module inputs is no faster
        kmi = per_chunk_recompute(max(tb.base_mi.layers_or(n, big) for tb in every), n, v)
        if kmi <= n:
            mi = Option(layers=kmi, module_inputs=True)
            if choice is None or slowest(mi) < slowest(choice):
                choice = mi
    if choice is None:
        return None
    policy = Policy(recompute=choice.recompute(n),
                    offload=Offload(module_inputs=choice.module_inputs))
    return [[policy] * p for _ in st.templates]


def best_group(plan: Plan, sim: SimResult, cost: CostModel) -> tuple[Plan, SimResult]:
    """``plan`` (simulated as ``sim``) with the interleaved schedule's micro-batch group that
    simulates fastest among :func:`.refine.group_choices`, where it still fits memory. Plain
    Megatron has the flag too, so the baseline gets its best group as well."""
    if plan.virtual_pipeline_size == 1:
        return plan, sim
    p, ms = plan.pipeline_model_parallel_size, [pipe.num_microbatches for pipe in plan.pipelines]
    best = (plan, sim)
    for g in group_choices(p, ms):
        if g > p:
            cand = replace_grid(plan, microbatch_group_size=g)
            if not all(cost.stage_memory(cand, d, s).fits for d in range(len(ms))
                       for s in range(p)):
                continue  # more in flight than the cards hold: no need to time it
            got = simulate(cand, cost, record_events=False)
            if got.fits_memory and got.step_time_s < best[1].step_time_s * (1 - 1e-9):
                best = (cand, got)
    return best
