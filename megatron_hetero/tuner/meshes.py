"""Mesh plans in the search (:mod:`megatron_hetero.plan.format2`): each device type of a mixed
pool its own tensor- and data-parallel size.

The space, the simplest one that is real: one mesh per device type, the types memory-rich
first along the pipeline or the reverse; per type a TP size among those that divide the
heads and fit its node (4-GPU and 8-GPU nodes differ) and a pipeline depth, its replicas
taking all of its GPUs in whole TP groups (``D = GPUs / (T x P)``), where consecutive meshes'
``D`` divide one another (``BridgeCommunicator``); a micro-batch ``b`` per replica of the mesh
with the most replicas, every other mesh's replicas taking the same samples per micro-batch
(``b x D_max / D``), all of them the same micro-batch count. Each stage position's costs and
cheapest fitting memory policy come from the stage tables (:mod:`.tables`, at the mesh's TP
without sequence parallelism: a bridge carries whole ``[s, b, h]`` tensors); the layer split
from :func:`.split.min_max_split` on seconds per micro-batch (every stage runs the same
micro-batches). Candidates are visited in order of a lower bound on their estimate (``(m + P -
1)`` times the least slowest stage of a split of whole layers were every stage at its
no-recompute speed, the embedding and the output layer on the end stages:
:func:`whole_layers_bound`), until it passes the best few estimates, which are simulated
(:func:`megatron_hetero.sim.step.simulate`). An estimate is ``(m + P - 1)`` times the slowest
stage, or, where more, the slowest stage's compute that many times plus the longest per-step
optimizer offload of a stage, which runs after the pipeline drains (:func:`_estimate`).

With ``TuneOptions.mesh_chunks`` the same chains also run ``v`` model chunks a stage
(interleaved 1F1B across the meshes, issue 28; run on CPU ranks, its Megatron-LM runtime
pending): ``v`` from 2 to
``refine_max_virtual_pipeline_size`` while every stage keeps a layer a chunk, each stage's
layers in even chunks (:func:`.tables.even_chunks`), the micro-batches in whole groups
(:func:`~megatron_hetero.schedule.rules.whole_group`), the stage tables at the interleaved
in-flight peak, and the fill and drain ``v`` times shorter in the bound and the estimate
(``(m + (P - 1) / v)`` times the slowest stage; a chain's bound with chunks is raised to that
times its unchunked estimate's slowest stage before it is evaluated, since chunks hold more
micro-batches in flight). They are searched apart
(:func:`best_mesh_plan` with ``chunks``), after the search without chunks, and only while
their bound is below the faster of the uniform plan's step and the best mesh plan's without
chunks (:func:`mesh_results`): a chunked plan that cannot beat them is not looked for.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from ..cost.stage import StageShape
from ..errors import InfeasibleError
from ..placement.inventory import embedded_gpus
from ..plan import Format2Mesh, MeshStage, Plan, Replica, mesh_plan
from ..schedule.rules import whole_group
from ..sim.step import SimResult, simulate
from . import space
from .problem import Problem
from .experts import expert_sizes, split_scale
from ..schedule.split import min_max_split, whole_layers_bound
from .tables import StageTables, even_chunks

__all__ = ["MeshSearch", "best_mesh_plan", "mesh_results"]


@dataclass(frozen=True, slots=True)
class _MeshShape:
    """One mesh of a candidate: device type, TP, pipeline depth, replicas, micro-batch."""

    device_type: str
    tp: int
    pp: int
    dp: int
    mbs: int
    ep: int = 1
    """Expert parallelism of the mesh (an MoE model; its TP is 1, :mod:`megatron_hetero.plan.experts`)."""


class MeshSearch:
    """Candidate mesh plans of one problem, ranked by estimate."""

    def __init__(self, problem: Problem, tables: StageTables):
        self.problem, self.tables = problem, tables
        self.evaluated = 0
        self._slowest: dict[tuple, float | None] = {}
        """Per (meshes, micro-batches): the slowest stage of its unchunked estimate (None:
        nothing fits), from every evaluation without chunks."""
        self._pairs: list | None = None
        self._whole: dict[int, float] = {}
        """Per entry of :meth:`pairs`: :meth:`bound`, once computed."""

    def layouts(self) -> list[list[tuple[str, int, int, int, int]]]:
        """Every (type, TP, PP, DP, EP) chain: one mesh per type, the types memory-rich first
        (:attr:`.problem.Problem.types`) or the reverse; an MoE model's meshes at TP 1, each
        with every expert-parallel size its replicas allow (:func:`.experts.expert_sizes`)."""
        p, inv = self.problem, self.problem.inv
        counts = inv.gpu_counts()
        per_type = {}
        for gpu in p.types:
            widest = max(g.gpus_per_node for g in inv.groups if g.gpu == gpu)
            options = []
            for tp in space.tp_sizes(p):
                if tp > widest:
                    continue
                groups = space.slots(inv, tp).get(gpu, 0)
                if groups * tp != counts[gpu]:
                    continue  # a TP size that strands GPUs of the type
                if tp > 1 and p.model.is_moe:
                    continue  # an MoE mesh runs TP 1 (the search sets no sequence parallelism)
                for pp in range(1, min(groups, p.model.num_layers) + 1):
                    if groups % pp == 0:
                        for ep in expert_sizes(p.model, tp, ((gpu, groups // pp),), 0):
                            options.append((gpu, tp, pp, groups // pp, ep))
            per_type[gpu] = options
        out = []
        for types in (p.types, p.types[::-1]):
            for chain in itertools.product(*(per_type[t] for t in types)):
                dps = [c[3] for c in chain]
                if all(max(a, b) % min(a, b) == 0 for a, b in zip(dps, dps[1:])) \
                        and sum(c[2] for c in chain) <= min(p.model.num_layers,
                                                            p.opt.max_pipeline_stages):
                    out.append(list(chain))
        return out

    def chunk_counts(self, chunks: bool) -> list[int]:
        """The model chunks a stage searched: 1, or with ``chunks`` 2 up to the options'
        ``refine_max_virtual_pipeline_size``."""
        if not chunks:
            return [1]
        return list(range(2, max(2, self.problem.opt.refine_max_virtual_pipeline_size) + 1))

    def pairs(self) -> list[tuple[float, list, int, int, int, list | None]]:
        """Every (layout, micro-batch) in listing order whose stages can hold the model's
        weights (:meth:`_room`), computed once: a lower bound on its slowest stage (each stage
        at its no-recompute speed, the embedding on the first and the output layer on the
        last, the layers split in fractions), the chain, the samples of a micro-batch over the
        mesh with most replicas, the micro-batches, the pipeline stages, and the stages as
        :func:`whole_layers_bound` takes them (None where layers differ, an MoE model's
        mixed ones: the bound then takes the mean layer's speed)."""
        if self._pairs is not None:
            return self._pairs
        p = self.problem
        L = p.model.num_layers
        whole = split_scale(p.model) is None
        cost = self.problem.cost(self.problem.precision_for(p.types))
        layer: dict[tuple, float] = {}  # one layer's seconds per micro-batch, by (type, mbs, TP)
        ends: dict[tuple, tuple[float, float]] = {}  # the embedding's and the output layer's
        room: dict[tuple, int] = {}  # layers a stage of (type, TP) can hold at most
        out = []
        for chain in self.layouts():
            if not p.model.is_moe and sum(c[2] * self._room(cost, c[0], c[1], room)
                                          for c in chain) < L:
                continue
            dmax = max(c[3] for c in chain)
            P = sum(c[2] for c in chain)
            for b in p.opt.micro_batch_sizes:
                batch = b * dmax
                if p.gbs % batch or any(batch % c[3] for c in chain):
                    continue
                keys = [(t, batch // dp, tp) for t, tp, _, dp, _ in chain]
                for key in keys:
                    if key not in layer:
                        layer[key] = sum(cost.layer_times(*key))
                        ends[key] = (sum(cost.embedding_times(*key)),
                                     sum(cost.output_times(*key)))
                if whole:
                    stages = _linear_stages(chain, keys, layer, ends)
                    bound = (L + sum(k * e / a for a, e, k in stages)) \
                        / sum(k / a for a, _, k in stages) * (1 - 1e-9)
                else:
                    stages, bound = None, L / sum(c[2] / layer[k] for k, c in zip(keys, chain))
                out.append((bound, chain, batch, p.gbs // batch, P, stages))
        self._pairs = out
        return out

    def bound(self, i: int) -> float:
        """A lower bound on the slowest stage of :meth:`pairs`' entry ``i``: the least slowest
        stage of a split of whole layers (:func:`whole_layers_bound`), computed once."""
        got = self._whole.get(i)
        if got is None:
            base, *_, stages = self.pairs()[i]
            got = base if stages is None else \
                whole_layers_bound(stages, self.problem.model.num_layers) * (1 - 1e-9)
            self._whole[i] = got = max(got, base)
        return got

    @staticmethod
    def _room(cost, gpu: str, tp: int, memo: dict) -> int:
        """The most layers a stage of ``gpu`` at ``tp`` can hold: a stage of ``n`` layers keeps
        at least their 16-bit weights and gradients besides the workspace (the optimizer state
        may go to the host, activations count on top); a dense model's (an MoE model's experts
        split further and are not bounded here)."""
        got = memo.get((gpu, tp))
        if got is None:
            per = cost.params(1, first=False, last=False, tp=tp) * (cost.param_bytes
                                                                    + cost.grad_bytes)
            got = memo[gpu, tp] = int((cost.capacity(gpu) - cost.workspace_bytes) // per) + 1
        return got

    def candidates(self, keep: int, *, chunks: bool = False,
                   beat: float = float("inf")) -> list[tuple[float, Plan]]:
        """The ``keep`` best estimates over every layout, micro-batch size and (``chunks``)
        chunk count, visited in order of a lower bound on their estimate until it passes the
        ``keep``-th or ``beat`` (the step a plan must beat to matter: an estimate leaves out
        the bubbles and the bridges, so it is below the simulated step).

        The bound: ``(m + (P - 1) / v)`` times :meth:`bound`'s slowest stage; each entry
        first goes in at the split of fractions of layers (:meth:`pairs`) and, when it comes
        out, back in at the whole-layer bound (no lower; computed only for the entries the
        walk reaches). With chunks, one entry
        per (layout, micro-batch) at its most chunks comes first; once visited, its unchunked
        estimate's slowest stage bounds each chunk count's (chunks hold more in flight, so
        their slowest stage is no faster), and those go back in order."""
        L = self.problem.model.num_layers
        counts = self.chunk_counts(chunks)
        todo = []  # (bound, listing index, chunks (0: every count, to expand), chain, batch)
        for i, (base, chain, batch, m, P, _) in enumerate(self.pairs()):
            base = self._whole.get(i, base)
            if not chunks:
                todo.append(((m + P - 1) * base, i, 1, chain, batch))
            elif P > 1 and L >= 2 * P and whole_group(P, [m]) is not None:
                top = max(v for v in counts if L >= P * v)
                todo.append(((m + (P - 1) / top) * base, i, 0, chain, batch))
        heapq.heapify(todo)  # in order of the bound (then of listing): a sorted walk
        best: list[tuple[float, Plan]] = []
        while todo:
            lb, i, v, chain, batch = heapq.heappop(todo)
            if lb >= beat or len(best) >= keep and lb >= best[-1][0]:
                break
            base, _, _, m, P, _ = self._pairs[i]
            if v <= 1 and i not in self._whole:  # in again at the whole-layer bound
                heapq.heappush(todo, (lb / base * self.bound(i), i, v, chain, batch))
                continue
            shapes = [_MeshShape(device_type=t, tp=tp, pp=pp, dp=dp, mbs=batch // dp, ep=ep)
                      for t, tp, pp, dp, ep in chain]
            if v == 0:
                key = (tuple(shapes), m)
                if key not in self._slowest:
                    self.evaluate(shapes, m, 1, build=False)
                if self._slowest[key] is not None:
                    for c in counts:
                        if L >= P * c:
                            heapq.heappush(todo, ((m + (P - 1) / c) * max(self.bound(i), self._slowest[key]),
                                                  i, c, chain, batch))
                continue
            got = self.evaluate(shapes, m, v)
            if got is not None:
                best.append(got)
                best.sort(key=lambda x: x[0])
                del best[keep:]
        return best

    def evaluate(self, meshes: list[_MeshShape], m: int, v: int = 1, *,
                 build: bool = True) -> tuple[float, Plan | None] | None:
        """The split and policies of one candidate of ``v`` model chunks a stage, and its
        estimated step (None: nothing fits, or the micro-batches make no whole groups); without
        ``build`` the estimate alone (the plan None)."""
        self.evaluated += 1
        p = self.problem
        L, P = p.model.num_layers, sum(x.pp for x in meshes)
        group = None
        if v > 1:
            g = whole_group(P, [m])
            if g is None:
                return None
            group = None if g == P else g
        prec = p.precision_for({x.device_type for x in meshes})
        positions = [StageShape(device_type=x.device_type, chunk_layers=(0,) * v,
                                micro_batch_size=x.mbs, tensor_parallel_size=x.tp,
                                pipeline_size=P, stage=s, num_microbatches=m,
                                microbatch_group=group, data_parallel_size=x.dp,
                                expert_parallel_size=x.ep)
                     for s, x in enumerate(x for x in meshes for _ in range(x.pp))]
        tables = self.tables.tables(positions, precision=prec)
        rows = [t.fit for t in tables]
        got = min_max_split(np.stack([r.seconds for r in rows]), L, split_scale(p.model))
        if v == 1:
            self._slowest[tuple(meshes), m] = None if got is None else got[0]
        if got is None:
            return None
        slowest, split = got
        if v > 1 and min(split) < v:
            return None  # every chunk holds a layer
        estimate = _estimate(tables, rows, split, slowest, m, m + (P - 1) / v)
        if not build:
            return estimate, None
        policies = iter([r.policy(n) for r, n in zip(rows, split)])
        layers = iter(split)
        plan = mesh_plan(
            model=p.model, global_batch_size=p.gbs, precision=prec,
            overlap_grad_reduce=p.opt.overlap_grad_reduce, microbatch_group_size=group,
            meshes=[Format2Mesh(device_type=x.device_type, tensor_model_parallel_size=x.tp,
                                expert_model_parallel_size=x.ep,
                                replicas=[Replica(micro_batch_size=x.mbs, num_microbatches=m)] * x.dp,
                                stages=[_stage(next(layers), next(policies), v)
                                        for _ in range(x.pp)])
                    for x in meshes])
        return estimate, plan


def _estimate(tables, rows, split, slowest: float, m: int, turns: float) -> float:
    """A candidate's estimated step: ``turns`` (the micro-batches plus the fill and drain)
    times its slowest stage, or, where more, the slowest stage's compute alone that many
    times plus the longest per-step optimizer offload: a stage's offload runs after the
    pipeline drains (:func:`megatron_hetero.sim.step.simulate`), not spread over its
    ``m`` micro-batches as the stage tables count it for the split, so one on a stage that is not
    the slowest still lengthens the step. (Never below the first: the search's bounds hold.)"""
    off = [r.fraction[n] * t.off_step[n] for t, r, n in zip(tables, rows, split)]
    if not any(off):
        return turns * slowest
    compute = max(r.seconds[n] - o / m for r, n, o in zip(rows, split, off))
    return max(turns * slowest, turns * compute + max(off))


def _linear_stages(chain, keys, layer: dict, ends: dict) -> list[tuple[float, float, int]]:
    """The chain's stages as :func:`whole_layers_bound` takes them: each mesh's at its
    layer's seconds (``layer``), the first stage with the embedding's, the last with the output
    layer's (``ends``)."""
    a = [layer[k] for k in keys]
    first, last = ends[keys[0]][0], ends[keys[-1]][1]
    if len(chain) == 1 and chain[0][2] == 1:
        return [(a[0], first + last, 1)]
    inner = [c[2] for c in chain]
    inner[0] -= 1
    inner[-1] -= 1
    return [(a[0], first, 1), (a[-1], last, 1)] + [(x, 0.0, k) for x, k in zip(a, inner) if k > 0]


def _early_chunks(plan: Plan) -> Plan:
    """``plan`` with every stage's remainder layers on its early chunks
    (:func:`.tables.even_chunks` with ``early``)."""
    v = plan.virtual_pipeline_size
    meshes = []
    for mesh in plan.meshes:
        stages = [dataclasses.replace(st, chunk_layers=list(even_chunks(st.num_layers, v, True)))
                  for st in mesh.pipelines[0].stages]
        meshes.append(dataclasses.replace(mesh, pipelines=[dataclasses.replace(p, stages=stages)
                                                           for p in mesh.pipelines]))
    return dataclasses.replace(plan, meshes=meshes)


def _stage(n: int, policy, v: int) -> MeshStage:
    return MeshStage(num_layers=n, recompute=policy.recompute, offload=policy.offload,
                     chunk_layers=list(even_chunks(n, v)) if v > 1 else None)


def best_mesh_plan(problem: Problem, tables: StageTables, *, uniform: SimResult,
                   upper_bound_s: float, chunks: bool = False, search: MeshSearch | None = None,
                   beat: float = float("inf")) -> tuple[Plan, SimResult, int] | None:
    """The fastest simulated of the best estimated mesh plans that fits (its ``prediction``
    beside the ``uniform`` plan's step and the upper bound), and the candidates estimated;
    ``chunks``: of the plans with model chunks (:meth:`MeshSearch.chunk_counts`) instead;
    ``search``: a search to go on with (its estimates reused), ``beat``: the step a plan must
    beat (:meth:`MeshSearch.candidates`). None
    on a pool of one device type (one mesh is a uniform plan, which the main search covers), on
    a pool of several vendors' collective libraries (their bridges run staged through host
    memory, :func:`~megatron_hetero.plan.checks.host_bridges`, untried on two vendors'
    hardware: the search keeps to format 1 there), for a model whose
    output layer is tied to its embedding, or where none fits."""
    libraries = {problem.inv.catalog.get(t).stack.library for t in problem.types}
    if len(problem.types) < 2 or len(libraries) > 1 \
            or not problem.model.untie_embeddings_and_output_weights:
        return None  # bridges of one library run; a mesh plan cannot tie the embeddings
    search = search or MeshSearch(problem, tables)
    before, best = search.evaluated, None
    finalists = [plan for _, plan in search.candidates(problem.opt.finalists, chunks=chunks,
                                                       beat=beat)]
    if chunks:  # the remainder layers on the early chunks too: the estimate misses the bubbles
        finalists += [_early_chunks(plan) for plan in finalists]  # of unequal chunks
    for plan in finalists:
        try:
            sim = simulate(plan, problem.cost(plan.precision), record_events=False)
        except InfeasibleError:
            continue
        if sim.fits_memory and (best is None or sim.step_time_s < best[1].step_time_s):
            best = (plan, sim)
    if best is None:
        return None
    plan, sim = best
    plan.prediction = {"step_time_s": round(sim.step_time_s, 6),
                       "tokens_per_s": round(sim.tokens_per_s, 3), "mfu": round(sim.mfu, 6),
                       "uniform_step_time_s": round(uniform.step_time_s, 6),
                       "upper_bound_step_time_s": round(upper_bound_s, 6)}
    plan.gpus = embedded_gpus(plan, problem.inv.catalog)
    return plan, sim, search.evaluated - before


def mesh_results(problem: Problem, tables: StageTables, *, uniform: SimResult,
                 upper_bound_s: float) -> dict:
    """The :class:`~megatron_hetero.tuner.search.TuneResult` fields of the mesh search the
    options ask for (``meshes``, ``mesh_chunks``): the best mesh plan without model chunks, the
    best with them that can beat both the uniform plan and that mesh plan, and the candidates
    estimated (nothing without ``meshes``). The search with chunks goes on from the one
    without (its estimates bound the chunked ones) and stops once its bound passes the faster
    of those two steps: what keeps its time near the search without chunks."""
    if not problem.opt.meshes:
        return {}
    out: dict = {"mesh_candidates": 0}
    search = MeshSearch(problem, tables)
    for chunks, plan_field, sim_field in ((False, "mesh_plan", "mesh_sim"),
                                          (True, "chunked_mesh_plan", "chunked_mesh_sim")):
        if chunks and not problem.opt.mesh_chunks:
            continue
        beat = float("inf")
        if chunks:
            beat = min([uniform.step_time_s] + ([out["mesh_sim"].step_time_s]
                                                if "mesh_sim" in out else []))
        got = best_mesh_plan(problem, tables, uniform=uniform, upper_bound_s=upper_bound_s,
                             chunks=chunks, search=search, beat=beat)
        if got is not None:
            out[plan_field], out[sim_field] = got[0], got[1]
            out["mesh_candidates"] += got[2]
    return out
