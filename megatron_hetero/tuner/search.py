"""Plan search over an inventory: parallel sizes, pipeline templates, layer split, micro-batch
shares and per-stage recompute.

The search space is kept apart from the cost model. A *structure* fixes the tensor-parallel size
``t``, the stage count ``p``, the micro-batch size and a list of pipeline *templates* (the device
type of each stage) with how many pipelines follow each:

* homogeneous: for any subset of the device types, as many single-type pipelines of each type as
  its GPUs allow (uneven data parallelism between types);
* mixed: every pipeline holds ``k_T`` stages of each type ``T`` of a subset (``k`` near the
  proportion of that type's GPUs), the types in each stage order (:meth:`_Search.orders`):
  memory-rich types early, where stages hold the most in-flight activations, or a slow type
  early with few layers per stage; GPUs left over form homogeneous pipelines of their type.

With TP > 1 every plan, the baseline's too, runs Megatron's sequence parallelism.

Each structure gets the layer split from a dynamic program (:func:`.split.min_max_split`) that
minimises the slowest stage relative to each template's balanced ideal, with each stage's
cost the time of its cheapest memory policy that fits (full recompute of the fewest layers,
Megatron's ``block`` method; optimizer offload; selective recompute where attention is
unfused); then micro-batch counts by exact min-max water-filling
(:func:`.shares.water_fill`). Structures are visited in order of a lower bound on their step
time and the walk stops once the bound passes the best estimate found. The best few estimates
are simulated (:func:`megatron_hetero.simulate.simulate`) and the best simulated plan wins.

Every structure with ``p > 1`` is also tried interleaved (Megatron's virtual pipeline stages,
``v`` = 2 .. ``max_virtual_pipeline_size`` model chunks per stage) where every stage can hold
``v`` layers and the micro-batches form whole groups of ``p``: its lower bound divides the fill
and drain by ``v``, its memory tables use the exact in-flight peak of the interleaved order,
micro-batch shares are water-filled in units of ``p``, each stage's layers go evenly over its
chunks, a stage's ``block`` recompute covers its first layers in chunk order (the plan's
semantics), and the chosen split's memory is checked exactly. The best two estimates of every chunk
count are simulated too (the estimate misses the bubbles of unequal chunks).

The baseline is the same walk restricted to what plain Megatron expresses: the same layers on
every stage (and chunk), the same micro-batches on every replica, one recompute setting
everywhere. Every plan overlaps its gradient reduction (``TuneOptions.overlap_grad_reduce``).
Everything iterates in sorted order, so the result depends only on the input.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from .. import models as M
from ..cost.model import CostModel
from ..cost.profile_protocol import DeviceProfile
from ..cost.schedule import peak_activations
from ..errors import InfeasibleError
from ..hardware.inventory import Inventory
from ..plan import ModelSpec, Offload, Pipeline, Plan, Recompute, Stage, embedded_gpus
from ..simulate import SimResult, simulate
from .shares import water_fill
from .split import min_max_split

__all__ = ["TuneOptions", "TuneResult", "Structure", "tune", "upper_bound_step_time"]


@dataclass(kw_only=True, slots=True)
class TuneOptions:
    """Knobs of the search."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes tried (those dividing the global batch)."""
    tensor_parallel_sizes: tuple[int, ...] | None = None
    """Tensor-parallel sizes tried (None: every size that divides the heads and fits a node)."""
    max_pipeline_stages: int = 64
    max_virtual_pipeline_size: int = 4
    """Model chunks per stage tried: 1 (plain 1F1B) up to this (interleaved 1F1B), where every
    chunk gets a layer and the micro-batches form whole groups of the pipeline size. The
    baseline (plain Megatron) tries every chunk count its even split allows, more than this
    too, so that a cap here never makes the baseline look slower than plain Megatron can be."""
    optimizer_offload: bool = True
    """Let stages offload optimizer state to the host where memory is short (else recompute only)."""
    overlap_grad_reduce: bool = True
    """Plans (the baseline's too: plain Megatron has the flag) overlap the data-parallel
    gradient reduction with the last backward (``--overlap-grad-reduce``)."""
    finalists: int = 4
    """Best estimates that are simulated before picking the plan."""
    progress: bool = False
    """Show a progress bar (rich) while structures are evaluated."""
    cost_options: dict = field(default_factory=dict)
    """Extra keyword arguments of :class:`CostModel` (flash_attention, workspace_gb, ...)."""


@dataclass(frozen=True, slots=True)
class Structure:
    tp: int
    pp: int
    mbs: int
    templates: tuple[tuple[tuple[str, ...], int], ...]
    """(stage device types, number of pipelines) per template."""
    vp: int = 1
    """Model chunks per stage (interleaved 1F1B when > 1)."""

    @property
    def num_pipelines(self) -> int:
        return sum(n for _, n in self.templates)


@dataclass(slots=True)
class _Candidate:
    structure: Structure
    split: list[int]
    recompute: list[list[int]]
    """Layers recomputed (full, block) per template and stage; ``_SELECTIVE``: selective."""
    offload: list[list[float]]
    """Optimizer-state fraction offloaded per template and stage."""
    microbatches: list[int]
    """Per pipeline, in template order."""
    score: float
    precision: str
    fill: float = 0.0
    """The largest fill-and-drain seconds of a pipeline in the estimate (what interleaving
    divides)."""


@dataclass(kw_only=True, slots=True)
class _Table:
    """Per layer count ``n`` (index 0..L) of one stage position: time per micro-batch without
    recompute; the cheapest memory policy that fits (``k`` layers of full recompute or
    ``_SELECTIVE``, ``f`` of the optimizer state offloaded; k > n: nothing fits) and its time
    per micro-batch, with the offload's per-step cost spread over the average micro-batch
    count; the cheapest recompute-only policy; the baseline's choices (full recompute of
    ``k_base`` layers; whether selective recompute alone fits, and its time); the per-step
    seconds of offloading all of the optimizer."""

    t_none: np.ndarray
    k: np.ndarray
    f: np.ndarray
    t_fit: np.ndarray
    k_rec: np.ndarray
    t_rec: np.ndarray
    k_base: np.ndarray
    t_base: np.ndarray
    sel_fits: np.ndarray
    t_sel: np.ndarray
    off_step: np.ndarray


@dataclass(kw_only=True, slots=True)
class TuneResult:
    plan: Plan
    sim: SimResult
    baseline_plan: Plan | None
    baseline_sim: SimResult | None
    upper_bound_step_time_s: float
    search_time_s: float
    search_cpu_s: float
    """CPU seconds of this process during the search (independent of other load)."""
    structures_evaluated: int
    fell_back_to_baseline: bool


_SELECTIVE = -1
"""Recompute code of a stage that recomputes core attention only (Megatron's ``selective``);
codes >= 0 are layers of full recompute (``block``; all of them: ``uniform``)."""


def _recompute_key(k: int) -> tuple:
    if k == _SELECTIVE:
        return ("selective", None, None)
    return ("none", None, None) if k == 0 else ("full", "block", k)


def _recompute(k: int, n: int) -> Recompute:
    if k == _SELECTIVE:
        return Recompute(granularity="selective")
    if k == 0:
        return Recompute()
    if k >= n:
        return Recompute(granularity="full", method="uniform", num_layers=1)
    return Recompute(granularity="full", method="block", num_layers=k)


def even_chunks(n: int, v: int, early: bool = False) -> tuple[int, ...]:
    """``n`` layers over ``v`` model chunks as evenly as possible, the later chunks taking the
    remainder (fewer of them are in flight: the least memory), or with ``early`` the earlier
    ones (the last stage's last chunk, which also runs the output layer, then holds fewer)."""
    q, r = divmod(n, v)
    return tuple(q + (c < r if early else c >= v - r) for c in range(v))


def _per_chunk(k: int, n: int, v: int) -> int:
    """The baseline's recompute code ``k`` (layers of full recompute on a stage of ``n``)
    rounded up to the same count in each of ``v`` equal chunks: plain Megatron counts
    ``--recompute-num-layers`` per chunk. (The plan's ``block`` covers the stage's first ``k``
    layers in chunk order, which saves at least as much memory for the same work, so the
    baseline is not understated.)"""
    if v == 1 or k <= 0 or k > n:
        return k
    return min(-(-k // v) * v, n)


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


def upper_bound_step_time(model: ModelSpec, inventory: Inventory, global_batch_size: int,
                          cost: CostModel) -> float:
    """Model FLOPs of one step over the summed achievable FLOP/s of every GPU in the inventory."""
    rate = sum(n * cost.flops_rate(gpu) for gpu, n in sorted(inventory.gpu_counts().items()))
    return M.step_model_flops(model, global_batch_size) / rate


class _Search:
    def __init__(self, model: ModelSpec, inventory: Inventory, gbs: int,
                 profiles: Mapping[str, DeviceProfile], options: TuneOptions):
        self.model, self.inv, self.gbs, self.opt = model, inventory, gbs, options
        self.profiles = profiles
        self._costs: dict[str, CostModel] = {}
        self._tables: dict[tuple, _Table] = {}
        self._links: dict[tuple, float] = {}
        self._precisions: dict[frozenset, str] = {}
        counts = inventory.gpu_counts()
        spec = inventory.spec
        # memory-rich first, then faster, then by name
        self.types = sorted(counts, key=lambda g: (-spec(g).memory_gb, -spec(g).bf16_tflops, g))
        self.evaluated = 0

    def cost(self, precision: str) -> CostModel:
        if precision not in self._costs:
            self._costs[precision] = CostModel(self.model, self.inv, profiles=self.profiles,
                                               precision=precision, **self.opt.cost_options)
        return self._costs[precision]

    def precision_for(self, types) -> str:
        key = frozenset(types)
        got = self._precisions.get(key)
        if got is None:
            got = self._precisions[key] = (
                "bf16" if all(self.inv.spec(t).bf16 for t in sorted(key)) else "fp16")
        return got

    # -- enumeration ----------------------------------------------------------------------------
    def slots(self, tp: int) -> dict[str, int]:
        """Tensor-parallel groups of size ``tp`` each type can host (groups stay in a node)."""
        out: dict[str, int] = {}
        for g in self.inv.groups:
            out[g.gpu] = out.get(g.gpu, 0) + g.nodes * (g.gpus_per_node // tp)
        return {t: n for t, n in out.items() if n > 0}

    def tp_sizes(self) -> list[int]:
        m = self.model
        widest = max(g.gpus_per_node for g in self.inv.groups)
        allowed = self.opt.tensor_parallel_sizes
        return [t for t in range(1, widest + 1)
                if m.num_attention_heads % t == 0 and m.num_query_groups % t == 0
                and (allowed is None or t in allowed)]

    def subsets(self, types: list[str]) -> list[tuple[str, ...]]:
        """Subsets of device types to build pipelines from, in ``types`` order: all of them for
        up to three types; beyond that every single type and pair, and the fastest-first
        prefixes (leaving out slow types is what pays; leaving out a fast one rarely does)."""
        if len(types) <= 3:
            return [c for r in range(1, len(types) + 1) for c in itertools.combinations(types, r)]
        rate = self.cost("bf16").flops_rate
        by_speed = sorted(types, key=lambda t: (-rate(t), types.index(t)))
        chosen = {c for r in (1, 2) for c in itertools.combinations(types, r)}
        for r in range(3, len(types) + 1):
            chosen.add(tuple(t for t in types if t in by_speed[:r]))
        return sorted(chosen, key=lambda c: (len(c), [types.index(t) for t in c]))

    @staticmethod
    def orders(n: int) -> list[tuple[int, ...]]:
        """Stage orders of the types of a mixed pipeline (indices into the subset, which is
        memory-rich first): every order for up to three types, else memory-rich first and its
        reverse. Memory-rich early stages hold the most in-flight micro-batches; but a slow
        type with few layers per stage can hold them too, and then the fast type's stages
        on the late positions need less memory (no recompute or offload there)."""
        if n <= 3:
            return list(itertools.permutations(range(n)))
        return [tuple(range(n)), tuple(range(n - 1, -1, -1))]

    def templates(self, tp: int, pp: int) -> list[tuple[tuple[tuple[str, ...], int], ...]]:
        slots = self.slots(tp)
        types = [t for t in self.types if t in slots]
        subsets = self.subsets(types)
        out = []
        for subset in subsets:
            homo = tuple(((t,) * pp, slots[t] // pp) for t in subset if slots[t] // pp > 0)
            if len(homo) == len(subset):
                out.append(homo)
        for subset in subsets:
            if len(subset) < 2 or len(subset) > pp:
                continue
            total = sum(slots[t] for t in subset)
            ranges = []
            for t in subset:
                x = pp * slots[t] / total
                ranges.append(range(max(1, math.floor(x) - 1), min(pp, math.ceil(x) + 1) + 1))
            for ks in _compositions(ranges, pp):
                D = min(slots[t] // k for t, k in zip(subset, ks))
                if D < 1:
                    continue
                left = [((t,) * pp, (slots[t] - D * k) // pp) for t, k in zip(subset, ks)]
                left = [x for x in left if x[1]]
                for order in self.orders(len(subset)):
                    mixed = tuple(subset[i] for i in order for _ in range(ks[i]))
                    out.append(tuple([(mixed, D)] + left))
        seen, unique = set(), []
        for t in out:
            if t not in seen:
                seen.add(t)
                unique.append(t)
        return unique

    def structures(self) -> list[tuple[float, Structure]]:
        """All structures with a lower bound on their step time, sorted by it. The bound: every
        pipeline perfectly balanced (its per-micro-batch time the whole model's time on its
        stages' combined speed, TP communication included), fill and drain of ``p - 1``
        micro-batches each, shares water-filled continuously."""
        L = self.model.num_layers
        rates: dict[tuple, float] = {}  # micro-batches per second of one pipeline
        out = []
        for tp in self.tp_sizes():
            for pp in range(1, min(L, self.opt.max_pipeline_stages) + 1):
                for tmpl in self.templates(tp, pp):
                    D = sum(n for _, n in tmpl)
                    prec = self.precision_for({t for types, _ in tmpl for t in types})
                    cost = self.cost(prec)
                    for mbs in self.opt.micro_batch_sizes:
                        if self.gbs % mbs:
                            continue
                        total = self.gbs // mbs
                        tm, Dm = tmpl, D
                        if total < D:  # fewer micro-batches than pipelines: use fewer pipelines
                            tm = tuple((types, n * total // D) for types, n in tmpl
                                       if n * total // D > 0) or ((tmpl[0][0], 1),)
                            Dm = sum(n for _, n in tm)
                        if self.gbs % Dm:  # the runtime needs it (Megatron's step accounting)
                            tm = _divisible_templates(tm, self.gbs)
                            Dm = sum(n for _, n in tm)
                        speed = 0.0  # micro-batches per second over all pipelines
                        for types, n in tm:
                            # the stage order does not change the bound: key by type counts
                            counts = tuple((t, types.count(t)) for t in sorted(set(types)))
                            key = (prec, counts, tp, mbs)
                            rate = rates.get(key)
                            if rate is None:
                                rate = 0.0
                                for t, k in counts:
                                    lf, lb = cost.layer_times(t, mbs, tp)
                                    rate += k / (L * (lf + lb))
                                rates[key] = rate
                            speed += n * rate
                        lb = (total + Dm * (pp - 1)) / speed
                        out.append((lb, Structure(tp, pp, mbs, tm)))
                        if pp == 1 or total % pp or total // pp < Dm:
                            continue
                        for v in range(2, L // pp + 1):
                            # beyond max_virtual_pipeline_size only what plain Megatron can
                            # express (an even split), so that the baseline is not understated
                            if v > self.opt.max_virtual_pipeline_size and L % (pp * v):
                                continue
                            out.append(((total + Dm * (pp - 1) / v) / speed,
                                        Structure(tp, pp, mbs, tm, v)))
        out.sort(key=lambda x: (x[0], x[1].tp, x[1].pp, x[1].mbs, x[1].vp, x[1].templates))
        unique, seen = [], set()
        for item in out:
            if item[1] not in seen:
                seen.add(item[1])
                unique.append(item)
        return unique

    # -- per-stage tables -----------------------------------------------------------------------
    def table(self, prec: str, gpu: str, tp: int, mbs: int, first: bool, last: bool,
              in_flight: float, D: int, vp: int = 1, pp: int = 1, stage: int = 0,
              m: int = 0) -> "_Table":
        """Costs of one stage position for every layer count (memory and time are linear in it).
        With ``vp`` > 1 chunks the stage is stage ``stage`` of ``pp`` running ``m`` micro-batches
        interleaved, ``in_flight`` its peak chunks in flight over ``vp`` (layers held per layer);
        memory is exact at multiples of ``vp`` layers (even chunks) and linear between."""
        key = (prec, gpu, tp, mbs, first, last, in_flight, D, vp, pp, stage, m)
        got = self._tables.get(key)
        if got is not None:
            return got
        cost, L = self.cost(prec), self.model.num_layers
        none = ("none", None, None)
        sp = tp > 1  # Megatron users run TP with --sequence-parallel; the plans say so
        n = np.arange(L + 1, dtype=float)

        def line(f, unit=1):
            a, b = f(unit), f(2 * unit)
            return a + (n - unit) * (b - a) / unit

        def memory(k, rk):
            if vp == 1:
                return cost.memory_need(gpu, k, first, last, mbs, tp, rk, in_flight, D, 0.0, False, sp)
            return cost.chunked_memory_need(gpu, even_chunks(k, vp), first, last, mbs, tp, rk, pp,
                                            stage, m, D, 0.0, False, sp)

        t_none = line(lambda k: cost.compute_times(gpu, k, first, last, mbs, tp, none, False, sp).total_s)
        mems = {k: memory(k, none) for k in (vp, 2 * vp)}
        mem_none = line(lambda k: mems[k].total, vp)
        opt = line(lambda k: mems[k].optimizer, vp)
        off_step = line(lambda k: cost.optimizer_seconds(gpu, cost.stage_params(k, first, last, tp), D, 1.0)
                        - cost.optimizer_seconds(gpu, cost.stage_params(k, first, last, tp), D, 0.0))
        act = cost.layer_activation_bytes(gpu, mbs, tp, "none", sp)
        saving = in_flight * (act - cost.hidden_bytes(mbs, tp, sp))
        cap = cost.capacity(gpu)
        fwd_layer = cost.layer_times(gpu, mbs, tp)[0]
        m_avg = (self.gbs // mbs) / D
        big = L + 1

        def layers_to_recompute(excess):
            """Fewest layers of full recompute that remove ``excess`` bytes (big: impossible)."""
            k = np.where(excess <= 0, 0, np.ceil(np.maximum(excess, 0) / saving) if saving > 0 else big)
            return np.where((k > n) | (k < 0), big, k).astype(np.int64)

        # A: recompute only (also the baseline's choice)
        k_a = np.where(mem_none <= cap, 0, layers_to_recompute(mem_none + act - cap))
        t_a = np.where(k_a <= n, t_none + np.minimum(k_a, n) * fwd_layer, np.inf)
        # B: offload part of the optimizer state, in steps of 5 %
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(mem_none <= cap, 0.0, np.ceil((mem_none - cap) * (1 + 1e-9) / opt * 20) / 20)
        frac = np.where(np.isfinite(frac), frac, 2.0)
        t_b = np.where(frac <= 1.0, t_none + np.minimum(frac, 1.0) * off_step / m_avg, np.inf)
        # C: offload all of it and recompute what is still missing
        k_c = np.where(mem_none - opt <= cap, 0, layers_to_recompute(mem_none - opt + act - cap))
        t_c = np.where(k_c <= n, t_none + np.minimum(k_c, n) * fwd_layer + off_step / m_avg, np.inf)
        ks, fs, ts = [k_a, np.zeros_like(k_a), k_c], [np.zeros_like(frac), np.minimum(frac, 1.0),
                                                      np.ones_like(frac)], [t_a, t_b, t_c]
        # selective recompute drops the stored s x s attention matrices of an unfused kernel
        # for a recompute of core attention (with a fused kernel it saves nothing)
        sel = ("selective", None, None)
        t_sel = line(lambda k: cost.compute_times(gpu, k, first, last, mbs, tp, sel, False, sp).total_s)
        flash = cost.uses_flash_attention(gpu)
        mem_sel = mem_none if flash else line(lambda k: memory(k, sel).total, vp)
        sel_fits = mem_sel <= cap
        if not flash:
            # D: selective recompute; E: then offload part of the optimizer state
            with np.errstate(divide="ignore", invalid="ignore"):
                frac_e = np.where(sel_fits, 0.0, np.ceil((mem_sel - cap) * (1 + 1e-9) / opt * 20) / 20)
            frac_e = np.where(np.isfinite(frac_e), frac_e, 2.0)
            t_d = np.where(sel_fits, t_sel, np.inf)
            t_e = np.where(frac_e <= 1.0, t_sel + np.minimum(frac_e, 1.0) * off_step / m_avg, np.inf)
            sel_k = np.full_like(k_a, _SELECTIVE)
            ks, fs, ts = ks + [sel_k, sel_k], fs + [np.zeros_like(frac), np.minimum(frac_e, 1.0)], \
                ts + [t_d, t_e]
        pick = np.argmin(np.stack(ts), axis=0)
        k = np.choose(pick, ks)
        f = np.choose(pick, fs)
        t_fit = np.choose(pick, ts)
        t_fit[0] = np.inf
        rec = [0, 3] if len(ts) > 3 else [0]  # recompute only: A, D
        pick_r = np.argmin(np.stack([ts[i] for i in rec]), axis=0)
        k_rec = np.choose(pick_r, [ks[i] for i in rec])
        t_rec = np.choose(pick_r, [ts[i] for i in rec])
        t_rec[0] = np.inf
        t_base = t_a.copy()
        t_base[0] = np.inf
        got = _Table(t_none=t_none, k=k, f=f, t_fit=t_fit, k_rec=k_rec, t_rec=t_rec, k_base=k_a,
                     t_base=t_base, sel_fits=sel_fits, t_sel=t_sel, off_step=off_step)
        self._tables[key] = got
        return got

    # -- evaluation -----------------------------------------------------------------------------
    def stage_tables(self, st: Structure, prec: str) -> list[list[_Table]]:
        """The tables of every (template, stage) of a structure."""
        p, v, D = st.pp, st.vp, st.num_pipelines
        if v == 1:
            return [[self.table(prec, types[s], st.tp, st.mbs, s == 0, s == p - 1, p - s, D)
                     for s in range(p)] for types, _ in st.templates]
        # the peak is monotone in the micro-batches: count them as the average rounded up
        m = p * max(1, -(-(self.gbs // st.mbs) // (D * p)))
        flight = [peak_activations(p, s, m, v, [1.0] * v) / v for s in range(p)]
        return [[self.table(prec, types[s], st.tp, st.mbs, s == 0, s == p - 1, flight[s], D,
                            v, p, s, m) for s in range(p)] for types, _ in st.templates]

    def evaluate(self, st: Structure, *, baseline: bool, offload: bool = True) -> _Candidate | None:
        self.evaluated += 1
        L = self.model.num_layers
        p, tp, mbs, D, v = st.pp, st.tp, st.mbs, st.num_pipelines, st.vp
        total = self.gbs // mbs
        if baseline and (L % (p * v) or total % D or (v > 1 and (total // D) % p)):
            return None
        if v > 1 and (total % p or total // p < D or L < p * v):
            return None
        prec = self.precision_for({t for types, _ in st.templates for t in types})
        cost = self.cost(prec)
        tables = self.stage_tables(st, prec)
        if baseline:
            n = L // p
            split = [n] * p
            # one recompute setting everywhere: full recompute of the same layers on every
            # stage, or selective recompute everywhere when that fits (the faster of the two)
            kmax = _per_chunk(max(int(tb.k_base[n]) for rows in tables for tb in rows), n, v)
            if kmax and all(bool(tb.sel_fits[n]) for rows in tables for tb in rows):
                full_t = np.inf if kmax > n else max(
                    cost.compute_times(types[s], n, s == 0, s == p - 1, mbs, tp, ("full", "block", kmax),
                                       False, tp > 1).total_s
                    for types, _ in st.templates for s in range(p))
                if max(float(tb.t_sel[n]) for rows in tables for tb in rows) < full_t:
                    kmax = _SELECTIVE
            if kmax > n:
                return None
            rec = [[kmax] * p for _ in st.templates]
            off = [[0.0] * p for _ in st.templates]
        else:
            norm = []
            for rows in tables:
                j = min(2, L)  # the tables are linear in the layers; a 1-layer model has two rows
                layer = [tb.t_none[j] - tb.t_none[j - 1] for tb in rows]
                norm.append(1.0 / sum(1.0 / x for x in layer))
            costs = np.max(np.stack([np.stack([tb.t_fit if offload else tb.t_rec for tb in rows]) / w
                                     for rows, w in zip(tables, norm)]), axis=0)
            if v > 1:  # every chunk holds a layer
                costs = costs.copy()
                costs[:, :v] = np.inf
            got = min_max_split(costs, L)
            if got is None:
                return None
            _, split = got
            if offload:
                rec = [[int(tb.k[split[s]]) for s, tb in enumerate(rows)] for rows in tables]
                off = [[float(tb.f[split[s]]) for s, tb in enumerate(rows)] for rows in tables]
            else:
                rec = [[int(tb.k_rec[split[s]]) for s, tb in enumerate(rows)] for rows in tables]
                off = [[0.0] * p for _ in tables]
        fixed, per = [], []
        offload_tail = 0.0
        for ti, (types, count) in enumerate(st.templates):
            stage_t = []
            for s in range(p):
                rk = _recompute_key(rec[ti][s])
                stage_t.append(cost.compute_times(types[s], split[s], s == 0, s == p - 1, mbs, tp, rk,
                                                  False, tp > 1).total_s)
                offload_tail = max(offload_tail, off[ti][s] * float(tables[ti][s].off_step[split[s]]))
            sends = sum(2 * cost.p2p_seconds(mbs, self._link_estimate(types, s, tp, D), tp, tp > 1)
                        for s in range(p - 1))
            c = max(stage_t)
            if v > 1:  # fill and drain shrink v times; every chunk boundary is a send
                wrap = 2 * cost.p2p_seconds(mbs, self._link_estimate((types[-1], types[0]), 0, tp, D),
                                            tp, tp > 1)
                fixed += [(sum(stage_t) - c) / v + v * sends + (v - 1) * wrap] * count
            else:
                fixed += [sum(stage_t) - c + sends] * count
            per += [c] * count
        if baseline:
            mb = [total // D] * D
        elif v > 1:  # whole groups of p micro-batches (Megatron's interleaved schedule)
            units = water_fill(fixed, [c * p for c in per], total // p)
            if units is None:
                return None
            mb = [u * p for u in units]
        else:
            mb = water_fill(fixed, per, total)
            if mb is None:
                return None
        if v > 1 and not self._chunks_fit(st, cost, split, rec, off, mb):
            return None
        step = max(a + k * c for a, c, k in zip(fixed, per, mb))
        step += self._sync_estimate(st, split, cost) + offload_tail
        return _Candidate(st, split, rec, off, mb, step, prec, max(fixed))

    def _chunks_fit(self, st: Structure, cost: CostModel, split, rec, off, mb) -> bool:
        """Exact memory of an interleaved candidate (the tables interpolate between multiples of
        the chunk count): every (template, stage) at its template's most micro-batches."""
        p, v, d = st.pp, st.vp, 0
        for ti, (types, count) in enumerate(st.templates):
            m = max(mb[d:d + count])
            d += count
            for s in range(p):
                chunks = even_chunks(split[s], v)
                rk = _recompute_key(rec[ti][s])
                mem = cost.chunked_memory_need(types[s], chunks, s == 0, s == p - 1, st.mbs, st.tp,
                                               rk, p, s, m, st.num_pipelines,
                                               off[ti][s], False, st.tp > 1)
                if not mem.fits:
                    return False
        return True

    def _link_estimate(self, types: tuple[str, ...], s: int, tp: int, D: int) -> float:
        """Bandwidth between stages ``s`` and ``s + 1`` under :func:`~megatron_hetero.cost.place`
        (stage-major filling): the same node when a node holds both stages of all pipelines."""
        a, b = types[s], types[s + 1]
        if a != b:
            return self.inv.inter_group_bandwidth_gb_s
        key = (a, 2 * D * tp)
        got = self._links.get(key)
        if got is None:
            gi = next(i for i, g in enumerate(self.inv.groups) if g.gpu == a)
            g = self.inv.groups[gi]
            if 2 * D * tp <= g.gpus_per_node:
                got = self.inv.intra_node_bandwidth(gi)
            else:
                got = self.inv.inter_node_bandwidth(gi)
            self._links[key] = got
        return got

    def _sync_estimate(self, st: Structure, split: list[int], cost: CostModel) -> float:
        D = st.num_pipelines
        if D == 1:
            return 0.0
        worst = 0.0
        for s in range(st.pp):
            column = frozenset(types[s] for types, _ in st.templates)
            key = (column, D * st.tp)
            bw = self._links.get(key)
            if bw is None:
                groups = [i for i, g in enumerate(self.inv.groups) if g.gpu in column]
                if len(groups) > 1:
                    bw = self.inv.inter_group_bandwidth_gb_s
                elif D * st.tp <= self.inv.groups[groups[0]].gpus_per_node:
                    bw = self.inv.intra_node_bandwidth(groups[0])
                else:
                    bw = self.inv.inter_node_bandwidth(groups[0])
                self._links[key] = bw
            params = cost.stage_params(split[s], s == 0, s == st.pp - 1, st.tp)
            worst = max(worst, cost.dp_sync_seconds(params, D, bw))
        return worst

    # -- plans ----------------------------------------------------------------------------------
    def to_plan(self, cand: _Candidate, early: bool = False) -> Plan:
        """The plan of a candidate; ``early``: interleaved chunks take the remainder layers
        first (:func:`even_chunks`)."""
        st = cand.structure
        pipelines = []
        d = 0
        v = st.vp
        chunks = [even_chunks(n, v, early) for n in cand.split]
        for ti, (types, count) in enumerate(st.templates):
            for _ in range(count):
                stages = [Stage(device_type=types[s], num_layers=cand.split[s],
                                recompute=_recompute(cand.recompute[ti][s], cand.split[s]),
                                offload=Offload(optimizer_fraction=cand.offload[ti][s]),
                                chunk_layers=list(chunks[s]) if v > 1 else None)
                          for s in range(st.pp)]
                pipelines.append(Pipeline(micro_batch_size=st.mbs,
                                          num_microbatches=cand.microbatches[d], stages=stages))
                d += 1
        return Plan(format_version=1, model=self.model, global_batch_size=self.gbs,
                    tensor_model_parallel_size=st.tp, pipelines=pipelines,
                    precision=cand.precision, use_distributed_optimizer=True,
                    sequence_parallel=st.tp > 1, virtual_pipeline_size=v,
                    overlap_grad_reduce=self.opt.overlap_grad_reduce)

    def walk(self, structures, *, baseline: bool, tick: Callable[[], None]) -> list[_Candidate]:
        """The best estimates (``finalists``) of the structures visited in lower-bound order,
        plus the best two of every chunk count seen: the estimate of an interleaved pipeline
        leaves out the bubbles of chunks of unequal length, so each chunk count is simulated."""
        keep: list[_Candidate] = []
        by_vp: dict[int, list[_Candidate]] = {}
        visited: dict[Structure, _Candidate | None] = {}
        k = self.opt.finalists

        def visit(st: Structure) -> _Candidate | None:
            """Evaluate ``st`` once and file its candidates; its estimate (None: no plan)."""
            if st in visited:
                return visited[st]
            cand = visited[st] = self.evaluate(st, baseline=baseline,
                                               offload=self.opt.optimizer_offload)
            if cand is None:
                return None
            new = [cand]
            if any(f for row in cand.offload for f in row):
                # the offload's per-step cost was spread over micro-batches: compare with the
                # same structure under recompute alone
                other = self.evaluate(st, baseline=False, offload=False)
                if other is not None:
                    new.append(other)
            keep.extend(new)
            keep.sort(key=lambda c: c.score)
            del keep[k:]
            if baseline:  # an even split: equal chunks, the estimate has no chunk bubbles to miss
                return cand
            best = by_vp.setdefault(st.vp, [])
            best += new
            best.sort(key=lambda c: c.score)
            del best[2:]
            return cand

        for lb, st in structures:
            tick()
            if len(keep) >= k and lb >= keep[-1].score:
                break
            if st.vp > 1:
                # interleaving holds more activations than plain 1F1B on every stage: where the
                # same structure without it fits nowhere, it does not either; and it can at
                # best divide that structure's fill and drain by the chunk count (visited still
                # when it may be among the best two of its chunk count, which are simulated)
                flat = visit(dataclasses.replace(st, vp=1))
                if flat is None:
                    continue
                bound = flat.score - flat.fill * (1 - 1 / st.vp)
                mine = by_vp.get(st.vp, [])
                if (len(keep) >= k and bound >= keep[-1].score
                        and (baseline or (len(mine) >= 2 and bound >= mine[-1].score))):
                    continue
            visit(st)
        chosen = {id(c) for c in keep}
        return keep + [c for vp in sorted(by_vp) for c in by_vp[vp] if id(c) not in chosen]

    def best_simulated(self, cands: list[_Candidate]) -> tuple[Plan, SimResult] | None:
        best = None
        for cand in cands:
            # interleaved: the remainder layers on the late chunks (least memory) or the early
            # ones (a lighter last chunk beside the output layer); the simulator picks
            for early in ((False, True) if cand.structure.vp > 1 else (False,)):
                plan = self.to_plan(cand, early)
                try:
                    sim = simulate(plan, self.cost(cand.precision), record_events=False)
                except InfeasibleError:
                    continue
                if not sim.fits_memory:
                    continue
                if best is None or sim.step_time_s < best[1].step_time_s:
                    best = (plan, sim)
        return best

    def infeasible_message(self) -> str:
        parts = []
        none = ("full", "uniform", 1)
        for gpu in self.types:
            cost = self.cost(self.precision_for([gpu]))
            tp = max(t for t in self.tp_sizes()
                     if any(g.gpu == gpu and g.gpus_per_node >= t for g in self.inv.groups))
            n_gpus = self.inv.gpu_counts()[gpu]
            pp = max(1, min(self.model.num_layers, n_gpus // tp))
            per = -(-self.model.num_layers // pp)
            need = cost.memory_need(gpu, per, True, pp == 1, 1, tp, none, pp,
                                    max(1, n_gpus // (tp * pp)), 0.0, False, tp > 1)
            parts.append(f"{gpu}: {need.total / 1e9:.1f} GB needed per GPU, {need.capacity / 1e9:.0f} GB "
                         f"available (all {n_gpus} of them as TP={tp} x PP={pp}, {per} layers per "
                         "stage, full recompute, micro-batch 1)")
        return (f"{self.model.name} does not fit on {self.inv.source} under any plan the search "
                f"covers; the leanest single-type stage needs: " + "; ".join(parts))


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


def tune(model: ModelSpec, inventory: Inventory, global_batch_size: int, *,
         profiles: Mapping[str, DeviceProfile] = {}, options: TuneOptions | None = None) -> TuneResult:
    """Search the fastest plan for ``model`` on ``inventory``; see the module docstring."""
    options = options or TuneOptions()
    t0, c0 = time.perf_counter(), time.process_time()
    search = _Search(model, inventory, global_batch_size, profiles, options)
    if not search.tp_sizes():
        m = model
        raise InfeasibleError(
            f"tensor-parallel sizes {list(options.tensor_parallel_sizes or ())}: none divides "
            f"{m.name}'s {m.num_attention_heads} attention heads and {m.num_query_groups} query "
            f"groups and fits in a node of {inventory.source}")
    structures = search.structures()
    if not structures:
        raise InfeasibleError(
            f"global batch size {global_batch_size}: no micro-batch size among "
            f"{list(options.micro_batch_sizes)} divides it; expected a multiple of one of them")
    progress = None
    tick = lambda: None  # noqa: E731
    if options.progress and len(structures) > 2000:
        from rich.progress import Progress
        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task("searching plans", total=2 * len(structures))
        tick = lambda: progress.advance(task)  # noqa: E731
    try:
        tuned = search.walk([(lb, st) for lb, st in structures
                             if st.vp <= options.max_virtual_pipeline_size],
                            baseline=False, tick=tick)
        L = model.num_layers
        plain = [(lb, st) for lb, st in structures  # what plain Megatron can express at all
                 if L % (st.pp * st.vp) == 0 and (global_batch_size // st.mbs) % st.num_pipelines == 0
                 and (st.vp == 1 or (global_batch_size // st.mbs // st.num_pipelines) % st.pp == 0)]
        base = search.walk(plain, baseline=True, tick=tick)
    finally:
        if progress is not None:
            progress.stop()
    best = search.best_simulated(tuned)
    base_best = search.best_simulated(base)
    if best is None and base_best is None:
        raise InfeasibleError(search.infeasible_message())
    fell_back = False
    if best is None or (base_best is not None
                        and base_best[1].step_time_s < best[1].step_time_s * (1 - 1e-9)):
        best, fell_back = base_best, True
    plan, sim = best
    upper = upper_bound_step_time(model, inventory, global_batch_size,
                                  search.cost(search.precision_for(search.types)))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    plan.prediction = {"step_time_s": round(sim.step_time_s, 6),
                       "tokens_per_s": round(sim.tokens_per_s, 3), "mfu": round(sim.mfu, 6),
                       "baseline_step_time_s": round(base_best[1].step_time_s, 6) if base_best else None,
                       "upper_bound_step_time_s": round(upper, 6)}
    if plan.prediction["baseline_step_time_s"] is None:
        del plan.prediction["baseline_step_time_s"]
    plan.gpus = embedded_gpus(plan, inventory.catalog)  # the runtime then knows custom types
    return TuneResult(plan=plan, sim=sim, baseline_plan=base_best[0] if base_best else None,
                      baseline_sim=base_best[1] if base_best else None,
                      upper_bound_step_time_s=upper, search_time_s=elapsed, search_cpu_s=cpu,
                      structures_evaluated=search.evaluated, fell_back_to_baseline=fell_back)
