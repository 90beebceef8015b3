"""The search space: structures (parallel sizes and pipeline templates) with a lower bound on
their step time, kept apart from the per-stage costs (:mod:`.tables`).

A *structure* fixes the tensor-parallel size ``t``, the stage count ``p``, the micro-batch size
and a list of pipeline *templates* (the device type of each stage) with how many pipelines
follow each:

* homogeneous: for any subset of the device types (:func:`subsets`), as many single-type
  pipelines of each type as its GPUs allow (uneven data parallelism between types);
* mixed: every pipeline holds ``k_T`` stages of each type ``T`` of a subset (``k`` near the
  proportion of that type's GPUs), the types in each stage order (:func:`orders`):
  memory-rich types early, where stages hold the most in-flight activations, or a slow type
  early with few layers per stage; GPUs left over form homogeneous pipelines of their type.

Every structure with ``p > 1`` is also offered interleaved (Megatron's virtual pipeline stages,
``v`` = 2 .. ``max_virtual_pipeline_size`` model chunks per stage, and beyond that the chunk
counts plain Megatron's even split allows) where the micro-batches form whole groups of ``p``,
or of a larger group up to ``2 p`` (:func:`~megatron_hetero.schedule.rules.whole_group`: a
global batch of 256 micro-batches on 3 stages runs groups of 4, the plan's
``microbatch_group_size``); its lower bound divides the fill and drain by ``v``. The pipeline count of a structure always
divides the global batch (:func:`_divisible_templates`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable

from .. import models as M
from ..cost.model import CostModel
from ..cost.stage import StageShape
from ..hardware.inventory import Inventory
from ..plan import ModelSpec, Recompute
from ..plan.checks import FP32_OPTIMIZER_OFFLOAD, optimizer_offload_runs
from ..schedule.rules import whole_group
from .experts import block_replicas, expert_grids
from .problem import Problem

__all__ = ["Structure", "infeasible_message", "structures", "templates", "subsets", "orders", "slots", "tp_sizes",
           "upper_bound_step_time"]


@dataclass(frozen=True, slots=True)
class Structure:
    tp: int
    pp: int
    mbs: int
    templates: tuple[tuple[tuple[str, ...], int], ...]
    """(stage device types, number of pipelines) per template."""
    vp: int = 1
    """Model chunks per stage (interleaved 1F1B when > 1)."""
    ep: int = 1
    """Expert parallelism of an MoE model (:func:`.experts.expert_grids`)."""
    etp: int | None = None
    """Expert TP of an MoE model (:func:`.experts.expert_grids`); None: TP, Megatron's
    default (a dense model's)."""

    @property
    def block_replicas(self) -> int:
        """The replicas one expert block spans (they run one micro-batch count)."""
        return block_replicas(self.tp, self.ep, self.etp)

    @property
    def num_pipelines(self) -> int:
        return sum(n for _, n in self.templates)


def upper_bound_step_time(model: ModelSpec, inventory: Inventory, global_batch_size: int,
                          cost: CostModel, shapes: Iterable[tuple[int, int]] = ()) -> float:
    """Model FLOPs of one step over the summed achievable FLOP/s of every GPU in the inventory
    (:func:`bound_flops_rate`: the same figures the plans are priced with)."""
    shapes = tuple(shapes)
    rate = sum(n * bound_flops_rate(cost, gpu, shapes)
               for gpu, n in sorted(inventory.gpu_counts().items()))
    return M.step_model_flops(model, global_batch_size) / rate


def bound_flops_rate(cost: CostModel, gpu: str, shapes: Iterable[tuple[int, int]]) -> float:
    """FLOP/s one GPU of type ``gpu`` can reach under the cost model: the catalog (or profile)
    efficiency's rate, or, where a profile measured a layer or the output layer at a
    (micro-batch size, TP size) of ``shapes``, the fastest rate those measured seconds give, so
    that no plan priced from them beats the bound (a CPU profile's layers at one shape can run
    faster than its efficiency, taken at another, says)."""
    rate = cost.flops_rate(gpu)
    prof = cost.profiles.get(gpu)
    if prof is None:
        return rate
    m = cost.model
    for b, tp in shapes:
        for part, flops in (("layer", M.layer_forward_flops(m, b)),
                            ("output", M.output_forward_flops(m, b, tp))):
            got = prof.times(part, model=m, micro_batch_size=b, tensor_parallel_size=tp)
            if got is not None and sum(got) > 0:
                rate = max(rate, 3.0 * flops / tp / sum(got))
    return rate


def slots(inventory: Inventory, tp: int) -> dict[str, int]:
    """Tensor-parallel groups of size ``tp`` each type can host (groups stay in a node)."""
    out: dict[str, int] = {}
    for g in inventory.groups:
        out[g.gpu] = out.get(g.gpu, 0) + g.nodes * (g.gpus_per_node // tp)
    return {t: n for t, n in out.items() if n > 0}


def tp_sizes(problem: Problem) -> list[int]:
    """Tensor-parallel sizes searched: those dividing the heads and query groups that fit a
    node (and that ``tensor_parallel_sizes`` allows)."""
    m = problem.model
    widest = max(g.gpus_per_node for g in problem.inv.groups)
    allowed = problem.opt.tensor_parallel_sizes
    return [t for t in range(1, widest + 1)
            if m.num_attention_heads % t == 0 and m.num_query_groups % t == 0
            and (allowed is None or t in allowed)]


def subsets(problem: Problem, types: list[str]) -> list[tuple[str, ...]]:
    """Subsets of device types to build pipelines from, in ``types`` order: all of them for
    up to three types; beyond that every single type and pair, and the fastest-first
    prefixes (leaving out slow types is what pays; leaving out a fast one rarely does)."""
    if len(types) <= 3:
        return [c for r in range(1, len(types) + 1) for c in itertools.combinations(types, r)]
    rate = problem.cost("bf16").flops_rate
    by_speed = sorted(types, key=lambda t: (-rate(t), types.index(t)))
    chosen = {c for r in (1, 2) for c in itertools.combinations(types, r)}
    for r in range(3, len(types) + 1):
        chosen.add(tuple(t for t in types if t in by_speed[:r]))
    return sorted(chosen, key=lambda c: (len(c), [types.index(t) for t in c]))


def orders(n: int) -> list[tuple[int, ...]]:
    """Stage orders of the types of a mixed pipeline (indices into the subset, which is
    memory-rich first): every order for up to three types, else memory-rich first and its
    reverse. Memory-rich early stages hold the most in-flight micro-batches; but a slow
    type with few layers per stage can hold them too, and then the fast type's stages
    on the late positions need less memory (no recompute or offload there)."""
    if n <= 3:
        return list(itertools.permutations(range(n)))
    return [tuple(range(n)), tuple(range(n - 1, -1, -1))]


def _compositions(ranges: list[range], total: int):
    """Tuples with one value from each range, summing to ``total`` (in lexicographic order)."""
    if not ranges:
        if total == 0:
            yield ()
        return
    rest_min = sum(r.start for r in ranges[1:])
    rest_max = sum(r.stop - 1 for r in ranges[1:])
    for k in ranges[0]:
        if rest_min <= total - k <= rest_max:
            for tail in _compositions(ranges[1:], total - k):
                yield (k, *tail)


def templates(problem: Problem, tp: int, pp: int) -> list[tuple[tuple[tuple[str, ...], int], ...]]:
    """The pipeline templates of ``pp`` stages of ``tp`` GPUs each: homogeneous ones per
    subset of types, then mixed ones (see the module docstring); without repeats."""
    free = slots(problem.inv, tp)
    types = [t for t in problem.types if t in free]
    chosen = subsets(problem, types)
    out = []
    for subset in chosen:
        homo = tuple(((t,) * pp, free[t] // pp) for t in subset if free[t] // pp > 0)
        if len(homo) == len(subset):
            out.append(homo)
    for subset in chosen:
        if len(subset) < 2 or len(subset) > pp:
            continue
        total = sum(free[t] for t in subset)
        ranges = []
        for t in subset:
            x = pp * free[t] / total
            ranges.append(range(max(1, math.floor(x) - 1), min(pp, math.ceil(x) + 1) + 1))
        for ks in _compositions(ranges, pp):
            D = min(free[t] // k for t, k in zip(subset, ks))
            if D < 1:
                continue
            left = [((t,) * pp, (free[t] - D * k) // pp) for t, k in zip(subset, ks)]
            left = [x for x in left if x[1]]
            for order in orders(len(subset)):
                mixed = tuple(subset[i] for i in order for _ in range(ks[i]))
                out.append(tuple([(mixed, D)] + left))
    seen, unique = set(), []
    for t in out:
        if t not in seen:
            seen.add(t)
            unique.append(t)
    return unique


def _divisible_templates(templates, global_batch_size: int):
    """``templates`` with pipelines dropped, one at a time from the largest group (the last of
    equals), until their count divides ``global_batch_size``: the runtime runs an uneven plan
    only when Megatron's step accounting (micro-batch size x DP x micro-batches) can equal the
    global batch (:func:`megatron_hetero.runtime.plan_args.virtual_micro_batch_size`)."""
    tm = list(templates)
    while global_batch_size % sum(n for _, n in tm):
        i = max(range(len(tm)), key=lambda i: (tm[i][1], i))
        tm[i] = (tm[i][0], tm[i][1] - 1)
        tm = [x for x in tm if x[1] > 0]
    return tuple(tm)


def structures(problem: Problem) -> list[tuple[float, Structure]]:
    """All structures with a lower bound on their step time, sorted by it. The bound: every
    pipeline's fill and drain of ``p - 1`` micro-batches each (``(p - 1) / v`` interleaved)
    perfectly balanced (its per-micro-batch time the whole model's time on its stages'
    combined speed, TP communication included), every other micro-batch paced by the least
    slowest stage whole layers allow (:func:`_whole_layers`), shares water-filled
    continuously."""
    opt, gbs = problem.opt, problem.gbs
    L = problem.model.num_layers
    rates: dict[tuple, float] = {}  # micro-batches per second of one pipeline
    shared: dict[tuple, tuple] = {}  # one object per distinct list of templates
    counts_of: dict[tuple, tuple] = {}  # (type, stages) of a template's stage types
    # (bound, tp, pp, micro-batch size, chunks, templates): sorted as they stand (the order of
    # the bound, then the structure's fields), each structure built once it is known to be new
    out = []
    for tp in tp_sizes(problem):
        for pp in range(1, min(L, opt.max_pipeline_stages) + 1):
            # chunk counts: beyond max_virtual_pipeline_size only what plain Megatron can
            # express (an even split), so that the baseline is not understated
            chunks = [v for v in range(2, L // pp + 1)
                      if v <= opt.max_virtual_pipeline_size or L % (pp * v) == 0]
            for tmpl in templates(problem, tp, pp):
                D = sum(n for _, n in tmpl)
                prec = problem.precision_for({t for types, _ in tmpl for t in types})
                cost = problem.cost(prec)
                for mbs in opt.micro_batch_sizes:
                    if gbs % mbs:
                        continue
                    total = gbs // mbs
                    tm, Dm = tmpl, D
                    if total < D:  # fewer micro-batches than pipelines: use fewer pipelines
                        tm = tuple((types, n * total // D) for types, n in tmpl
                                   if n * total // D > 0) or ((tmpl[0][0], 1),)
                        Dm = sum(n for _, n in tm)
                    if gbs % Dm:  # the runtime needs it (Megatron's step accounting)
                        tm = _divisible_templates(tm, gbs)
                        Dm = sum(n for _, n in tm)
                    tm = shared.setdefault(tm, tm)
                    grids = expert_grids(problem.model, tp, tm, total)
                    unit = whole_group(pp, [total])  # micro-batch groups of the interleaving
                    interleaves = not (pp == 1 or unit is None or total // unit < Dm)
                    for ep, etp in grids:
                        paces = []  # (balanced s per micro-batch, whole-layer ones, pipelines)
                        for types, n in tm:
                            # the stage order does not change the bound: key by type counts
                            counts = counts_of.get(types)
                            if counts is None:
                                counts = counts_of[types] = tuple((t, types.count(t))
                                                                  for t in sorted(set(types)))
                            key = (prec, counts, tp, mbs, ep)
                            got = rates.get(key)
                            if got is None:  # a layer's compute, its experts one by one too
                                layer = [(sum(cost.layer_times(t, mbs, tp, sp=tp > 1))
                                          + sum(cost.sequential_expert_times(t, mbs, tp, ep)), k)
                                         for t, k in counts]
                                got = rates[key] = (sum(k / (L * x) for x, k in layer),
                                                    _whole_layers(layer, L))
                            paces.append((1 / got[0], got[1], n))
                        rate = _rate(paces)
                        out.append((_bound(paces, total, pp - 1, rate), tp, pp, mbs, 1, ep,
                                    etp or 0, tm))
                        if interleaves:
                            out.extend((_bound(paces, total, (pp - 1) / v, rate), tp, pp, mbs, v,
                                        ep, etp or 0, tm) for v in chunks)
    out.sort()
    unique, seen = [], set()
    for lb, tp, pp, mbs, v, ep, etp, tm in out:
        key = (tp, pp, mbs, v, ep, etp, id(tm))  # equal templates are one object
        if key not in seen:
            seen.add(key)
            unique.append((lb, Structure(tp, pp, mbs, tm, v, ep, etp or None)))
    return unique


def _whole_layers(layer: list[tuple[float, int]], L: int) -> float:
    """The least time ``T`` such that stages of these (seconds per layer, stages) can hold
    ``L`` whole layers with none over ``T``: a bound on the slowest stage, which at a large
    batch sets the pace (80 layers on 61 stages: two on some, 1.5 times the balanced time)."""
    def fits(T: float) -> bool:
        return sum(k * math.floor(T / x * (1 + 1e-12)) for x, k in layer) >= L
    candidates = sorted({x * j for x, k in layer for j in range(1, -(-L // k) + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def _rate(paces: list[tuple[float, float, int]]) -> float:
    """The denominator of :func:`_bound`: micro-batches per second of the pipelines at their
    whole-layer pace (the same for every fill)."""
    return sum(n / T for _, T, n in paces)


def _bound(paces: list[tuple[float, float, int]], total: int, fill: float, rate: float) -> float:
    """The step time bound of :func:`structures` for pipelines of (balanced seconds per
    micro-batch ``b``, whole-layer slowest stage ``T``, count): a pipeline of ``m``
    micro-batches takes at least ``(fill + 1) b + (m - 1) T``, the shares are continuous
    (``rate``: :func:`_rate` of ``paces``)."""
    return (total + sum(n * ((fill + 1) * b / T - 1) for b, T, n in paces)) / rate


def infeasible_message(problem: Problem) -> str:
    """Why nothing fits: the leanest single-type stage of every type against its memory."""
    model, inv = problem.model, problem.inv
    parts = []
    full = Recompute(granularity="full", method="uniform", num_layers=1)
    for gpu in problem.types:
        cost = problem.cost(problem.precision_for([gpu]))
        tp = max(t for t in tp_sizes(problem)
                 if any(g.gpu == gpu and g.gpus_per_node >= t for g in inv.groups))
        n_gpus = inv.gpu_counts()[gpu]
        pp = max(1, min(model.num_layers, n_gpus // tp))
        per = -(-model.num_layers // pp)
        need = cost.memory(StageShape(device_type=gpu, chunk_layers=(per,), micro_batch_size=1,
                                      tensor_parallel_size=tp, sequence_parallel=tp > 1,
                                      recompute=full, pipeline_size=pp, num_microbatches=pp,
                                      data_parallel_size=max(1, n_gpus // (tp * pp))))
        parts.append(f"{gpu}: {need.total / 1e9:.1f} GB needed per GPU, {need.capacity / 1e9:.1f} GB "
                     f"available (all {n_gpus} of them as TP={tp} x PP={pp}, {per} layers per "
                     "stage, full recompute, micro-batch 1)")
    text = (f"{model.name} does not fit on {inv.source} under any plan the search "
            f"covers; the leanest single-type stage needs: " + "; ".join(parts))
    if not problem.opt.optimizer_offload:
        text += ("; no stage may offload optimizer state " + (
            f"in {problem.opt.precision} ({FP32_OPTIMIZER_OFFLOAD})"
            if not optimizer_offload_runs(problem.opt.precision or "bf16")
            else "(--no-optimizer-offload)"))
    reserve = problem.cost(problem.precision_for(problem.types)).host_reserve_bytes
    short = [f"groups[{i}] ({g.gpu}) host_memory_gb {g.host_memory_gb:g} is less than the "
             f"{reserve / 1e9:g} GB host reserve" for i, g in enumerate(inv.groups)
             if g.host_memory_gb is not None and g.host_memory_gb * 1e9 < reserve]
    if short:
        text += "; and " + ", ".join(short)
    return text
