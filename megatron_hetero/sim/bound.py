"""Lower bounds of a simulated step from a plan's priced stages and pipelines, without running
the schedule (:func:`.step.step_lower_bound`, :func:`.step.simulate`'s ``faster_than``): what
each stage's finish is sure to reach (:func:`.pipeline.finish_lower_bound`) and what a step is
sure to go on after it (:func:`after_finish`)."""

from __future__ import annotations

from ..plan import Plan
from .pipeline import EXACT_MOST, backward_holds, finish_lower_bound

__all__ = ["STEP_BOUND_SLACK", "lower_bound", "after_finish", "per_replica"]

STEP_BOUND_SLACK = 1e-6
"""Relative room :func:`.step.step_lower_bound` leaves under its sums: a long pipeline's run is
extrapolated from its steady state, repeats found to a relative 1e-9 (:mod:`.pipeline`)."""


def lower_bound(plan: Plan, lockstep: bool, rep: list[int], inputs,
                after) -> tuple[float, list]:
    """:func:`.step.step_lower_bound` from each path's pipeline (``inputs``:
    :func:`.step._path_inputs`; ``rep``: its representative) and :func:`after_finish`, and
    each path's finish bounds per stage (zeros where a path runs too long to bound)."""
    meshes, index = plan.meshes, plan.stage_index
    per_path: dict[tuple, list[float]] = {}
    finishes = []
    for full, (fwd, bwd, send_f, send_b, m, warmups) in inputs:
        if m > EXACT_MOST:
            return 0.0, [[0.0] * len(index) for _ in inputs]
        got = per_path.get(full)
        if got is None:
            got = per_path[full] = finish_lower_bound(fwd, bwd, send_f, send_b, m,
                                                       warmups=warmups)
        finishes.append(got)
    run_of = per_replica(meshes, lockstep, finishes, rep)[1]
    step = 0.0
    for s, (k, _) in enumerate(index):
        D = meshes[k].data_parallel_size
        mine = run_of if D == len(run_of) else run_of[:D]
        step = max(step, max(f[s] for f in mine) + after[s])
    return step * (1 - STEP_BOUND_SLACK), finishes


def after_finish(plan: Plan, syncs: list[tuple], inputs) -> list[float]:
    """Per stage, the least a step goes on after the stage's slowest replica finishes
    (:func:`.step.simulate`'s sync, ``syncs``: :func:`.step._stage_syncs`), then the slowest
    replica's optimizer step. The gradient sync, where it is not overlapped, whole;
    overlapped, each chunk's sync ends no sooner than the start of that chunk's last backward
    plus its seconds, and the slowest replica's last op is a backward of some chunk that
    started its hold before it finished (:func:`.pipeline.backward_holds`, the longest over
    the paths, ``inputs``): the least over the chunks of its sync less that hold, where
    positive."""
    holds: dict = {}
    out = []
    for s, (comm, chunks, opts) in enumerate(syncs):
        if chunks:
            if not holds:
                holds = {full: backward_holds(*args[:4], args[5]) for full, args in inputs}
            sync = max(0.0, min(x - max(h[s][c] for h in holds.values())
                                for c, x in enumerate(chunks)))
        else:
            sync = comm
        out.append(sync + max(opts))
    return out


def per_replica(meshes, lockstep: bool, runs: list, rep: list[int]):
    """(most replicas of a mesh, per replica index its path's ``runs`` entry, its
    representative): every mesh has as many replicas as paths unless they run in lockstep."""
    most = max(m.data_parallel_size for m in meshes)
    return (most, runs * most, rep * most) if lockstep else (most, runs, rep)
