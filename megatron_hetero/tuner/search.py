"""Plan search: the walk over the search space (:mod:`.space`), candidate estimates from the
stage tables (:mod:`.tables`), simulation of the finalists, and :func:`tune`.

Each structure gets the layer split from a dynamic program (:func:`.split.min_max_split`) that
minimises the slowest stage relative to each template's balanced ideal, with each stage's
cost the time of its cheapest memory policy that fits (:mod:`.tables`); then micro-batch counts
by exact min-max water-filling (:func:`megatron_hetero.schedule.shares.water_fill`). Structures are visited in order of
a lower bound on their step time and the walk stops once the bound passes the best estimate
found. The best few estimates are simulated (:func:`megatron_hetero.sim.step.simulate`) and
the best simulated plan wins; a local search on the simulator (:mod:`.refine`) then moves
layers, chunks and micro-batches one step at a time while that is faster. With TP > 1 every plan, the baseline's too, runs Megatron's
sequence parallelism.

Interleaved structures (``v`` model chunks per stage) are evaluated where every stage can hold
``v`` layers: their micro-batch shares are water-filled in units of ``p``, each stage's layers
go evenly over its chunks, and the chosen split's memory is checked exactly. Where a structure
fits nowhere without interleaving, or dividing its fill and drain by ``v`` cannot beat the
estimates kept, it is not interleaved. The best two estimates of every chunk count are simulated
too (the estimate misses the bubbles of unequal chunks).

The baseline is the same walk restricted to what plain Megatron expresses: the same layers on
every stage (and chunk), the same micro-batches on every replica, one recompute setting
everywhere; an interleaved baseline then takes the micro-batch group (Megatron's
``--microbatch-group-size-per-virtual-pipeline-stage``) that simulates fastest, as the local
search does for the tuned plan (:func:`best_group`). Every plan overlaps its gradient reduction (``TuneOptions.overlap_grad_reduce``).
Everything iterates in sorted order, so the result depends only on the input.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..placement.host_path import staged_ring_gb_s
from ..cost.model import CostModel
from ..placement.nodes import between_groups_gb_s
from ..cost.profile_protocol import DeviceProfile
from ..errors import InfeasibleError
from ..hardware.inventory import Inventory
from ..plan import ModelSpec, Pipeline, Plan, Stage, uniform_plan
from ..placement.inventory import embedded_gpus
from ..schedule.rules import named_group, whole_group
from ..sim.step import SimResult, simulate
from . import space
from .baseline import baseline_policies, best_group
from .meshes import mesh_results
from .policy import Policy
from .problem import Problem, TuneOptions
from .refine import climb, refine_chunk_cap
from ..schedule.shares import fill_shares
from .space import Structure, upper_bound_step_time
from .experts import split_scale
from ..schedule.split import min_max_split
from .tables import StageTables, even_chunks, stage_shape
from .warmup import FLAT_WARMUP_CANDIDATES, warmups_or_flat

# TuneOptions, Structure and upper_bound_step_time live in .problem and .space; named here too
__all__ = ["TuneOptions", "TuneResult", "Structure", "tune", "upper_bound_step_time"]


@dataclass(slots=True)
class _Candidate:
    structure: Structure
    split: list[int]
    policies: list[list[Policy]]
    """The memory policy of each template's stages."""
    microbatches: list[int]
    """Per pipeline, in template order."""
    score: float
    precision: str
    fill: float = 0.0
    """The largest fill-and-drain seconds of a pipeline in the estimate (what interleaving
    divides)."""

    @property
    def offloads_optimizer(self) -> bool:
        return any(pol.offload.optimizer_fraction > 0 for row in self.policies for pol in row)


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
    searched_step_time_s: float | None = None
    """Simulated step of the structured search's best plan, before the local search
    (:mod:`.refine`); None when it found none."""
    refine_simulations: int = 0
    warmup_gain: float = 1.0
    """Megatron's 1F1B step over the tuned plan's with its per-stage warm-ups (:mod:`.warmup`;
    1.0: Megatron's counts kept)."""
    mesh_plan: Plan | None = None
    """The best mesh plan (:mod:`.meshes`: TP and DP per device type), where the pool mixes
    types, ``TuneOptions.meshes`` is on and one fits; ``plan`` stays the best uniform-TP plan."""
    mesh_sim: SimResult | None = None
    mesh_candidates: int = 0
    """Mesh candidates estimated."""
    chunked_mesh_plan: Plan | None = None
    """The best mesh plan with model chunks (``TuneOptions.mesh_chunks``; Megatron-LM runtime
    pending) among those whose estimate beats the uniform plan and the mesh plan without
    chunks (None where none does, :func:`.meshes.mesh_results`)."""
    chunked_mesh_sim: SimResult | None = None

    @property
    def mesh_wins(self) -> bool:
        """A mesh plan (with model chunks or without) is strictly faster than the uniform one."""
        return self.best[0] is not self.plan

    @property
    def best(self) -> tuple[Plan, SimResult]:
        """The plan that wins: the fastest mesh plan where strictly faster than the others."""
        best = (self.plan, self.sim)
        for plan, sim in ((self.mesh_plan, self.mesh_sim),
                          (self.chunked_mesh_plan, self.chunked_mesh_sim)):
            if sim is not None and sim.step_time_s < best[1].step_time_s * (1 - 1e-9):
                best = (plan, sim)
        return best


class _Search:
    """The state of one search: the stage tables, the link bandwidths met, the structures
    evaluated."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.model, self.inv, self.gbs, self.opt = problem.model, problem.inv, problem.gbs, problem.opt
        self.tables = StageTables(problem)
        self.scale = split_scale(problem.model)
        self._links: dict[tuple, float] = {}
        self.evaluated = 0

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, st: Structure, *, baseline: bool, offload: bool = True) -> _Candidate | None:
        self.evaluated += 1
        L = self.model.num_layers
        p, tp, mbs, D, v = st.pp, st.tp, st.mbs, st.num_pipelines, st.vp
        total = self.gbs // mbs
        if baseline and (L % (p * v) or total % D or (v > 1 and (total // D) % p)):
            return None
        unit = whole_group(p, [total]) if v > 1 else 1  # micro-batch groups when interleaved
        if v > 1 and (unit is None or total // unit < D or L < p * v):
            return None
        prec = self.problem.precision_for({t for types, _ in st.templates for t in types})
        cost = self.problem.cost(prec)
        tables = self.tables.for_structure(st, prec)
        if baseline:
            split = [L // p] * p
            policies = baseline_policies(st, tables, split[0], self.tables, precision=prec,
                                         module_inputs=self.opt.activation_offload)
        else:
            split, policies = _tuned_split(st, tables, L, offload=offload, scale=self.scale)
        if policies is None:
            return None
        fixed, per = [], []
        offload_tail = 0.0
        for ti, (types, count) in enumerate(st.templates):
            stage_t = []
            for s in range(p):
                pol = policies[ti][s]
                stage_t.append(self.tables.seconds(st, types, s, layers=split[s], policy=pol,
                                                   precision=prec))
                offload_tail = max(offload_tail, pol.offload.optimizer_fraction
                                   * float(tables[ti][s].off_step[split[s]]))
            sends = sum(2 * cost.p2p_seconds(mbs, self._link_estimate(types, s, tp, D), tp=tp,
                                             sp=tp > 1)
                        for s in range(p - 1))
            c = max(stage_t)
            if v > 1:  # fill and drain shrink v times; every chunk boundary is a send
                wrap = 2 * cost.p2p_seconds(mbs, self._link_estimate((types[-1], types[0]), 0, tp, D),
                                            tp=tp, sp=tp > 1)
                fixed += [(sum(stage_t) - c) / v + v * sends + (v - 1) * wrap] * count
            else:
                fixed += [sum(stage_t) - c + sends] * count
            per += [c] * count
        if baseline:
            mb = [total // D] * D
        elif v > 1:  # whole micro-batch groups (Megatron's interleaved schedule)
            mb = fill_shares(fixed, per, total, unit=unit)
            if mb is None:
                return None
        else:
            mb = fill_shares(fixed, per, total, alike=st.block_replicas)
            if mb is None:
                return None
        if v > 1 and not self._chunks_fit(st, cost, split, policies, mb):
            return None
        g = st.block_replicas
        if any(len(set(mb[i:i + g])) > 1 for i in range(0, D, g)):
            return None  # an EP group's replicas run one count (interleaved groups may not)
        step = max(a + k * c for a, c, k in zip(fixed, per, mb))
        step += self._sync_estimate(st, split, cost) + offload_tail
        return _Candidate(st, split, policies, mb, step, prec, max(fixed))

    def _chunks_fit(self, st: Structure, cost: CostModel, split, policies, mb) -> bool:
        """Exact memory of an interleaved candidate (the tables interpolate between multiples of
        the chunk count): every (template, stage) at its template's most micro-batches."""
        d = 0
        for ti, (types, count) in enumerate(st.templates):
            m = max(mb[d:d + count])
            d += count
            for s in range(st.pp):
                if not cost.memory(stage_shape(st, types, s, layers=split[s], policy=policies[ti][s],
                                               microbatches=m)).fits:
                    return False
        return True

    def _link_estimate(self, types: tuple[str, ...], s: int, tp: int, D: int) -> float:
        """Bandwidth between stages ``s`` and ``s + 1`` under :func:`~megatron_hetero.cost.place`
        (stage-major filling): the same node when a node holds both stages of all pipelines."""
        a, b = types[s], types[s + 1]
        if a != b:
            got = self._links.get((a, b))
            if got is None:
                ga, gb = (next(i for i, g in enumerate(self.inv.groups) if g.gpu == t) for t in (a, b))
                got = self._links[(a, b)] = between_groups_gb_s(self.inv, ga, gb)
            return got
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
                staged = staged_ring_gb_s(self.inv, groups, D)
                if staged is not None:  # across vendors: gloo on the host path
                    bw = staged
                elif len(groups) > 1:
                    bw = self.inv.inter_group_bandwidth_gb_s
                elif D * st.tp <= self.inv.groups[groups[0]].gpus_per_node:
                    bw = self.inv.intra_node_bandwidth(groups[0])
                else:
                    bw = self.inv.inter_node_bandwidth(groups[0])
                self._links[key] = bw
            params = cost.params(split[s], first=s == 0, last=s == st.pp - 1, tp=st.tp)
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
                                recompute=cand.policies[ti][s].recompute,
                                offload=cand.policies[ti][s].offload,
                                chunk_layers=list(chunks[s]) if v > 1 else None)
                          for s in range(st.pp)]
                pipelines.append(Pipeline(micro_batch_size=st.mbs,
                                          num_microbatches=cand.microbatches[d], stages=stages))
                d += 1
        return uniform_plan(model=self.model, global_batch_size=self.gbs,
                    tensor_model_parallel_size=st.tp, pipelines=pipelines,
                    precision=cand.precision,
                    use_distributed_optimizer=self.opt.use_distributed_optimizer,
                    sequence_parallel=st.tp > 1, virtual_pipeline_size=v,
                    microbatch_group_size=named_group(st.pp, v, cand.microbatches),
                    overlap_grad_reduce=self.opt.overlap_grad_reduce,
                    expert_model_parallel_size=st.ep, expert_tensor_parallel_size=st.etp)

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
            if cand.offloads_optimizer:
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
        return next(iter(self.fastest_simulated(cands, 1)), None)

    def fastest_simulated(self, cands: list[_Candidate], keep: int) -> list[tuple[Plan, SimResult]]:
        """The ``keep`` fastest of ``cands`` that fit, simulated, fastest first."""
        out = []
        for cand in cands:
            best = None
            # interleaved: the remainder layers on the late chunks (least memory) or the early
            # ones (a lighter last chunk beside the output layer); the simulator picks
            for early in ((False, True) if cand.structure.vp > 1 else (False,)):
                plan = self.to_plan(cand, early)
                try:
                    sim = simulate(plan, self.problem.cost(cand.precision), record_events=False)
                except InfeasibleError:
                    continue
                if sim.fits_memory and (best is None or sim.step_time_s < best[1].step_time_s):
                    best = (plan, sim)
            out += [best] if best is not None else []
        out.sort(key=lambda x: x[1].step_time_s)  # stable: listing order among ties
        return out[:keep]


def _tuned_split(st: Structure, tables, L: int, *, offload: bool, scale=None):
    """The layer split that minimises the slowest stage relative to each template's balanced
    ideal, every stage at its cheapest fitting policy (``offload``: optimizer offload allowed;
    ``scale``: :func:`.experts.split_scale`); and each (template, stage)'s policy. (None, None) when no split fits."""
    v = st.vp
    norm = []
    for rows in tables:
        j = min(2, L)  # the tables are linear in the layers; a 1-layer model has two rows
        layer = [tb.t_none[j] - tb.t_none[j - 1] for tb in rows]
        norm.append(1.0 / sum(1.0 / x for x in layer))
    menu = (lambda tb: tb.fit) if offload else (lambda tb: tb.rec)  # noqa: E731
    costs = np.max(np.stack([np.stack([menu(tb).seconds for tb in rows]) / w
                             for rows, w in zip(tables, norm)]), axis=0)
    if v > 1:  # every chunk holds a layer
        costs = costs.copy()
        costs[:, :v] = np.inf
    got = min_max_split(costs, L, scale)
    if got is None:
        return None, None
    split = got[1]
    return split, [[menu(tb).policy(split[s]) for s, tb in enumerate(rows)] for rows in tables]


def tune(model: ModelSpec, inventory: Inventory, global_batch_size: int, *,
         profiles: Mapping[str, DeviceProfile] = {}, options: TuneOptions | None = None) -> TuneResult:
    """Search the fastest plan for ``model`` on ``inventory``; see the module docstring.

    Python's cyclic garbage collector is paused during the search: the search makes millions
    of small objects and holds about a hundred thousand in its caches (stage tables, the cost
    model's), which every collection of the oldest generation walks again, yet they form no
    cycles, so reference counting frees whatever the search drops. On the 2-core CI machine
    the collector took about a fifth of the search's CPU time on the small pools."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _tune(model, inventory, global_batch_size, profiles=profiles,
                     options=options or TuneOptions())
    finally:
        if enabled:
            gc.enable()


def _tune(model: ModelSpec, inventory: Inventory, global_batch_size: int, *,
          profiles: Mapping[str, DeviceProfile], options: TuneOptions) -> TuneResult:
    t0, c0 = time.perf_counter(), time.process_time()
    problem = Problem(model, inventory, global_batch_size, profiles, options)
    search = _Search(problem)
    if not space.tp_sizes(problem):
        m = model
        raise InfeasibleError(
            f"tensor-parallel sizes {list(options.tensor_parallel_sizes or ())}: none divides "
            f"{m.name}'s {m.num_attention_heads} attention heads and {m.num_query_groups} query "
            f"groups and fits in a node of {inventory.source}")
    structures = space.structures(problem)
    if not structures:
        raise InfeasibleError(
            f"global batch size {global_batch_size}: no micro-batch size among "
            f"{list(options.micro_batch_sizes)} divides it; expected a multiple of one of them")
    progress = None
    tick = lambda: None  # noqa: E731
    climbed: Callable[[int, int], None] | None = None
    if options.progress and len(structures) > 2000:
        from rich.progress import Progress
        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task("searching plans", total=2 * len(structures))
        tick = lambda: progress.advance(task)  # noqa: E731

        def climbed(done: int, total: int) -> None:
            progress.update(local, completed=done, total=total)
    try:
        tuned = search.walk([(lb, st) for lb, st in structures
                             if st.vp <= options.max_virtual_pipeline_size],
                            baseline=False, tick=tick)
        L = model.num_layers
        plain = [(lb, st) for lb, st in structures  # what plain Megatron can express at all
                 if L % (st.pp * st.vp) == 0 and (global_batch_size // st.mbs) % st.num_pipelines == 0
                 and (st.vp == 1 or (global_batch_size // st.mbs // st.num_pipelines) % st.pp == 0)]
        base = search.walk(plain, baseline=True, tick=tick)
        if progress is not None:  # the walks stop early once the bound passes the best
            progress.update(task, completed=2 * len(structures))
        best = search.best_simulated(tuned)
        searched, sims, warmup_gain = None, 0, 1.0
        if best is not None:
            searched = best[1].step_time_s
            if options.refine_rounds > 0:
                if progress is not None:
                    local = progress.add_task("local search on the simulator", total=None)
                plan1, sim1, sims = climb(problem, *best, chunk_cap=refine_chunk_cap(options),
                                          climbed=climbed)
                best = (plan1, sim1)
        if best is not None and options.per_stage_warmup:
            best, warmup_gain, more = warmups_or_flat(problem, best, lambda: search.fastest_simulated(
                [c for c in tuned if c.structure.vp == 1], FLAT_WARMUP_CANDIDATES))
            sims += more
    finally:
        if progress is not None:
            progress.stop()
    base_best = search.best_simulated(base)
    if base_best is not None:
        base_best = best_group(*base_best, problem.cost(base_best[0].precision))
    if best is None and base_best is None:
        raise InfeasibleError(space.infeasible_message(problem))
    fell_back = False
    if best is None or (base_best is not None
                        and base_best[1].step_time_s < best[1].step_time_s * (1 - 1e-9)):
        best, fell_back = base_best, True
    plan, sim = best
    upper = upper_bound_step_time(model, inventory, global_batch_size,
                                  problem.cost(problem.precision_for(problem.types)),
                                  [(b, t) for b in options.micro_batch_sizes
                                   for t in space.tp_sizes(problem)])
    meshes = mesh_results(problem, search.tables, uniform=sim, upper_bound_s=upper)
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
                      structures_evaluated=search.evaluated, fell_back_to_baseline=fell_back,
                      searched_step_time_s=searched, refine_simulations=sims,
                      warmup_gain=1.0 if fell_back else warmup_gain,
                      **meshes)
