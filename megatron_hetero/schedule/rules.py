"""Megatron's pipeline-schedule rules as plan checks, and the order of one stage's forwards and
backwards under the heterogeneity-aware 1F1B (per-stage warm-up).

Non-interleaved 1F1B, stage ``s`` of ``p``, ``m`` micro-batches, warm-up ``w``: the stage runs
``w`` forwards, then one forward and one backward in turn (``F(w+k)``, ``B(k)``) until the
forwards run out, then the ``w`` backwards left. Megatron's ``w`` is ``min(p - s - 1, m)``
(``num_warmup_microbatches`` in ``forward_backward_pipelining_without_interleaving``). A plan
may give a stage more (``Stage.warmup_microbatches``): the extra forwards in flight let the
stage go on computing while its sends cross a slow link to the next stage, the first half of
Harp's heterogeneity-aware 1F1B (arXiv 2509.24859; Harp counts the steady state's first forward
too, so its "last stage runs 1" is ``w = 0`` here).

The rules a plan's counts must follow (:func:`check_warmups`, on load, with the field path):

- at most the replica's ``num_microbatches``;
- the last stage at least 0, and every other stage at least one more than the next
  (``w[s] >= min(w[s + 1] + 1, m)``), which keeps every count at or above Megatron's default
  ``min(p - s - 1, m)``. The runtime's schedule (:mod:`megatron_hetero.mcore.warmup_schedule`)
  needs counts that never rise along the pipeline to be free of deadlock; the ``+ 1`` is
  Megatron's own step (each stage keeps its successor fed while it waits for a gradient);
- only plans with more than one stage, and no model chunks but on a chain of meshes.

With model chunks (``v`` > 1) on a chain of meshes, the chain's own schedule
(:mod:`megatron_hetero.mcore.mesh_interleaved`) runs each rank's interleaved order with its
stage's count: the forward chunk-steps before the steady state's first forward (the first
backward follows ``w + 1`` forwards), default Megatron's interleaved
``2 (P - s - 1) + (v - 1) g`` (:func:`~.order.warmup_count`). The counts it takes are
``0 .. m v`` whose ranks' orders complete (:mod:`.chain`: no closed form; the wrap-around
bridge bounds each count from above as well as below). A plan of one pipeline grid with chunks
(format 1, or one mesh) does not take the field: Megatron's interleaved schedule runs it, and
has its own knob that gives its stages slack, the micro-batch group (``Plan.microbatch_group_size``, searched by the
tuner: a group of ``g`` warms every stage up ``(v - 1) g`` virtual micro-batches); its
overlapped sends pair each rank's exchanges with its neighbours' under its own fixed offsets, so
other offsets need a second schedule of our own. Measured with the simulator on the issue's
pool (16 A100 + 16 V100 joined by 0.1 GB/s, Llama-2 13B, GBS 256; ``docs/launch.md``): the
tuner's best plan is interleaved (VP 2, group 4) and its busiest stage waits 0.41 s of a
30.16 s step, so a per-stage warm-up there could gain at most 1.4%; the best non-interleaved
plan (32.74 s) leaves 1.22 s of bubble on its busiest stage.

No torch here: the tuner, the simulator and the plan use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..errors import Described, SchemaError
from .chain import check_chain_warmups
from .order import warmup_count

__all__ = ["StageSchedule", "stage_schedule", "one_f_one_b", "megatron_warmup",
           "pipeline_warmups", "has_extra_warmup", "stage_program", "check_warmups",
           "check_stage_warmups", "chain_warmup",
           "group_fits", "whole_group", "named_group"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSchedule:
    """What one stage of one replica runs in a training step."""

    warmup: int
    """Forwards before the steady state's first forward (Megatron's ``num_warmup_microbatches``)."""
    ops: tuple[str, ...]
    """Its forwards and backwards in run order: ``"F3"`` the forward of micro-batch 3, ``"B1"``
    the backward of micro-batch 1."""
    megatron_warmup: int
    """Megatron's own count for this stage (``min(p - s - 1, m)``)."""

    @property
    def extra(self) -> int:
        """Warm-up forwards beyond Megatron's."""
        return self.warmup - self.megatron_warmup


def megatron_warmup(p: int, s: int, m: int) -> int:
    """Megatron's warm-up forwards on stage ``s`` of ``p`` with ``m`` micro-batches."""
    return min(p - s - 1, m)


def one_f_one_b(m: int, warmup: int) -> tuple[str, ...]:
    """The 1F1B order of ``m`` micro-batches after ``warmup`` warm-up forwards (at most ``m``)."""
    if not 0 <= warmup <= m:
        raise ValueError(f"warm-up {warmup} outside 0..{m}")
    ops = [f"F{i}" for i in range(warmup)]
    for k in range(m - warmup):
        ops += [f"F{warmup + k}", f"B{k}"]
    return tuple(ops + [f"B{k}" for k in range(m - warmup, m)])


def pipeline_warmups(pipeline, v: int = 1, group: int | None = None) -> list[int]:
    """The warm-up of every stage of a :class:`~megatron_hetero.plan.Pipeline` run with ``v``
    model chunks a stage (micro-batch group ``group``): the stage's ``warmup_microbatches``,
    else Megatron's default (:func:`~.order.warmup_count`)."""
    p, m = len(pipeline.stages), pipeline.num_microbatches
    return [warmup_count(p, s, m, v, group) if st.warmup_microbatches is None
            else st.warmup_microbatches for s, st in enumerate(pipeline.stages)]


def chain_warmup(plan, slot) -> int | None:
    """The warm-up forwards of ``slot``'s stage in the chain's own schedule
    (:attr:`~megatron_hetero.plan.Plan.own_chain_schedule`): its count on its replica's path
    through the chain (:meth:`~megatron_hetero.plan.Plan.path_pipeline`) where some stage of
    that path departs from Megatron's count, else None (Megatron's count, or the interleaved
    order's)."""
    path = plan.path_pipeline(slot.replica)
    v, group = plan.virtual_pipeline_size, plan.microbatch_group
    if not has_extra_warmup(path, v, group):
        return None
    return pipeline_warmups(path, v, group)[plan.global_stage(slot)]


def has_extra_warmup(pipeline, v: int = 1, group: int | None = None) -> bool:
    """Whether some stage of ``pipeline`` (``v`` chunks a stage, micro-batch group ``group``)
    warms up other than Megatron would: more, without chunks (the rules allow no less; the
    runtime then runs this pipeline under :mod:`megatron_hetero.mcore.warmup_schedule`, a
    chain of meshes its own schedule), or any other count, with chunks (a chain of meshes)."""
    p, m = len(pipeline.stages), pipeline.num_microbatches
    return any(w != warmup_count(p, s, m, v, group)
               for s, w in enumerate(pipeline_warmups(pipeline, v, group)))


def stage_schedule(plan, pipeline: int, stage: int) -> StageSchedule:
    """Warm-up and order of forwards and backwards of ``stage`` of replica ``pipeline`` of a
    non-interleaved :class:`~megatron_hetero.plan.Plan` (what its rank runs per step, under
    Megatron's 1F1B or the per-stage warm-up schedule alike)."""
    if plan.virtual_pipeline_size > 1:
        raise ValueError("an interleaved plan runs Megatron's interleaved order "
                         "(megatron_hetero.schedule.order.rank_order)")
    pipe = plan.pipelines[pipeline]
    p, m = len(pipe.stages), pipe.num_microbatches
    w = pipeline_warmups(pipe)[stage]
    return StageSchedule(warmup=w, ops=one_f_one_b(m, w), megatron_warmup=megatron_warmup(p, stage, m))


def stage_program(warmups, stage: int, m: int) -> tuple[tuple[str, int], ...]:
    """What stage ``stage`` of a pipeline whose stages warm up ``warmups`` does, in order, for
    ``m`` micro-batches: its 1F1B ops (``("forward", j)``, ``("backward", i)``) and around them
    its messages, ``A(j)`` the activations of micro-batch ``j`` (to the next stage), ``G(i)``
    their gradients (back): ``("post_recv_prev", j)`` posts the receive of ``A(j)``,
    ``("wait_prev", j)`` waits for it, ``("send_next", j)`` posts its send;
    ``("post_recv_next", i)``, ``("wait_next", i)`` and ``("send_prev", i)`` likewise for
    ``G(i)``. Posting never blocks; a stage blocks only waiting for the data its next op needs.

    Both ends of a link post its messages in one order, that of the upper stage ``u``'s ops
    (``A(j)`` before ``G(i)`` when ``j <= w[u] + i``), so a transport that matches each link's
    messages in the order posted (NCCL's two-rank communicator of ``send``/``recv``; gloo)
    pairs them: the lower stage posts the receives of the ``A(j)`` it has not run yet before it
    sends each ``G(i)``. With warm-ups that never rise along the pipeline, a stage then waits
    only for its neighbours to reach earlier ops of their own order (the forward of ``j`` on
    the previous stage, the backward of ``i`` on the next) and never in a cycle: a cycle needs
    a stage ``s`` to run ``B(i)`` before ``F(j)`` while ``s + 1`` runs ``F(j)`` before
    ``B(i)``, that is ``w[s] + i < j <= w[s + 1] + i``."""
    p, w = len(warmups), warmups[stage]
    first, last = stage == 0, stage == p - 1
    upstream = None if first else warmups[stage - 1]
    out: list[tuple[str, int]] = []
    posted = 0  # receives of A(j) posted: j < posted

    def post_prev_through(j: int) -> None:
        nonlocal posted
        while posted <= min(j, m - 1):
            out.append(("post_recv_prev", posted))
            posted += 1

    for op in one_f_one_b(m, w):
        k = int(op[1:])
        if op[0] == "F":
            if not first:
                post_prev_through(k)
                out.append(("wait_prev", k))
            out.append(("forward", k))
            if not last:
                out.append(("send_next", k))
        else:
            if not last:
                out += [("post_recv_next", k), ("wait_next", k)]
            out.append(("backward", k))
            if not first:
                post_prev_through(upstream + k)
                out.append(("send_prev", k))
    return tuple(out)


def check_warmups(plan) -> None:
    """Raise :class:`SchemaError` naming ``pipelines[d].stages[s].warmup_microbatches`` where a
    format-1 plan's warm-up counts break the rules of the module docstring."""
    for d, pipe in enumerate(plan.pipelines):
        check_stage_warmups([st.warmup_microbatches for st in pipe.stages],
                            pipe.num_microbatches, plan.virtual_pipeline_size,
                            lambda s, d=d: f"pipelines[{d}].stages[{s}].warmup_microbatches",
                            f"pipelines[{d}]")


def check_stage_warmups(given: list, m: int, v: int, path, replica: str, *,
                        chain: bool = False, group: int | None = None) -> None:
    """The rules of the module docstring over one pipeline of ``len(given)`` stages (a
    format-1 pipeline, or a replica's path through a chain of meshes): ``given`` each stage's
    ``warmup_microbatches`` (None: Megatron's), ``m`` the path's micro-batches, ``v`` the
    model chunks per stage, ``path(s)`` the field path of stage ``s``'s count, ``replica`` that
    of the path's micro-batch count's owner; ``chain``: the path crosses meshes (the chain's
    own schedule runs it, which takes counts with chunks too, micro-batch group ``group``:
    :func:`~.chain.check_chain_warmups`)."""
    if v > 1 and chain:
        if any(w is not None for w in given):
            check_chain_warmups(given, m, v, group, path, replica)
        return
    p = len(given)
    for s, w in enumerate(given):
        if w is None:
            continue
        if v > 1:
            raise SchemaError("", path(s), w, f"absent: a plan of one pipeline grid with "
                              f"model chunks ({v} a stage) runs Megatron's own interleaved "
                              "schedule, which takes no per-stage warm-up "
                              "(microbatch_group_size gives its stages slack); per-stage "
                              "warm-ups with chunks run on a chain of meshes (format 2)")
        if p == 1 and w != 0:
            raise SchemaError("", path(s), w, "absent or 0 (a plan with one pipeline "
                              "stage runs no pipeline schedule to warm up)")
        if w > m:
            raise SchemaError("", path(s), w, f"at most {m}, the micro-batches of "
                              f"{replica} (num_microbatches)")
    if v > 1:
        return
    counts = [megatron_warmup(p, s, m) if w is None else w for s, w in enumerate(given)]
    if counts[-1] < 0:
        raise SchemaError("", path(p - 1), counts[-1], "at least 0")
    for s in range(p - 2, -1, -1):
        need = min(counts[s + 1] + 1, m)
        if counts[s] < need:
            found = (counts[s] if given[s] is not None else
                     Described(f"nothing (Megatron's default {counts[s]})"))
            raise SchemaError("", path(s), found, f"at least {need}: stage {s + 1} "
                              f"warms up {counts[s + 1]}, and each stage warms up at least "
                              f"one more micro-batch than the next, or all {m} (as "
                              "Megatron's p - s - 1 does)")


def whole_group(p: int, microbatches) -> int | None:
    """The least micro-batch group ``g`` from ``p`` up to ``2 p`` that divides every count of
    ``microbatches``: ``p`` (Megatron's default) where ``p`` does, else a group the plan names in
    ``microbatch_group_size`` so that Megatron's interleaved schedule runs whole groups (a
    global batch of 256 micro-batches on 3 stages: groups of 4); None where none does."""
    return _whole_group(p, tuple(microbatches))


@lru_cache(maxsize=65536)
def _whole_group(p: int, microbatches: tuple[int, ...]) -> int | None:
    """:func:`whole_group`, once per pipeline size and counts (the search asks for the same
    pipeline sizes and global batch over and over)."""
    return next((g for g in range(p, 2 * p + 1) if all(m % g == 0 for m in microbatches)), None)


def group_fits(g: int, p: int, microbatches) -> bool:
    """Whether Megatron's interleaved schedule takes micro-batch group ``g`` on ``p`` stages
    for each of ``microbatches``: ``p <= g <= m``, the remainder of ``m`` over ``g`` 0 or at
    least ``p``."""
    return all(p <= g <= m and (m % g == 0 or m % g >= p) for m in microbatches)


def named_group(p: int, v: int, microbatches) -> int | None:
    """The ``microbatch_group_size`` a plan names for micro-batch counts made whole groups of
    (:func:`whole_group`): None (Megatron's default, ``p``) where ``p`` divides them or the
    pipeline is not interleaved (``v`` = 1)."""
    g = whole_group(p, microbatches) if v > 1 else None
    return None if g == p else g
