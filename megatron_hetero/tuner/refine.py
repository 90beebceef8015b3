"""Local search on the simulator around the best plan the structured search found.

The structured search (:mod:`.search`) ranks candidates by an estimate: stages balanced by a
dynamic program on per-stage times, chunks split evenly, micro-batches water-filled on the
estimate's fill and drain. The simulator sees what the estimate leaves out (the bubbles of
unequal chunks, where the fill and drain really fall, the overlapped gradient reduction), so
the last few percent are found by moving things one step at a time and keeping what the
simulator says is faster:

* a layer across each boundary of the model's sequence of virtual stages (chunk ``c`` of stage
  ``s`` is virtual stage ``c p + s``): between stages, and in effect between chunks;
* a layer between two chunks of one stage;
* the chunk count ``v`` (1 up to ``max_virtual_pipeline_size``), each stage's layers spread
  evenly, the remainder on the early or the late chunks; an end chunk may be left with just
  the embedding or the loss (which the structured search does not try);
* one unit of micro-batches (``p`` when interleaved, else 1) from the pipeline that finishes
  last to the one that finishes first.

After every move each (pipeline, stage) takes the cheapest memory policy that fits under the
exact memory model: the fewest layers of ``block`` recompute (or selective recompute where
attention is unfused), with or without the layers' module inputs offloaded to the host, with
part or all of the optimizer state offloaded where that is cheaper (:class:`_Policies`). Each
round simulates every move and keeps the best (best improvement); the walk stops at a local
optimum or after ``max_rounds``. It is deterministic: moves are
generated in a fixed order and ties keep the earlier one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..cost.model import CostModel
from ..errors import InfeasibleError, SchemaError
from ..plan import Offload, Pipeline, Plan, Stage
from ..simulate import SimResult, simulate
from .tables import SELECTIVE, even_chunks, recompute_code_key, recompute_policy

__all__ = ["refine", "Layout"]


@dataclass(frozen=True, slots=True)
class Layout:
    """What a move changes: layers per virtual stage (model order), chunks per stage, and the
    micro-batches of each pipeline."""

    seq: tuple[int, ...]
    v: int
    microbatches: tuple[int, ...]

    def chunks(self, p: int, s: int) -> tuple[int, ...]:
        return tuple(self.seq[c * p + s] for c in range(self.v))

    def valid(self, p: int) -> bool:
        """Every virtual stage holds a layer but the two ends (embedding or loss only), and with
        ``v`` > 1 every pipeline's micro-batches form whole groups of ``p``."""
        inner = self.seq[1:-1] if len(self.seq) > 1 else self.seq
        if min(inner, default=1) < 1 or min(self.seq) < 0:
            return False
        if self.v == 1 and min(self.seq) < 1:
            return False
        if self.v > 1 and any(m % p for m in self.microbatches):
            return False
        return min(self.microbatches) >= 1


def layout_of(plan: Plan) -> Layout:
    return Layout(tuple(plan.virtual_stage_layers), plan.virtual_pipeline_size,
                  tuple(pl.num_microbatches for pl in plan.pipelines))


class _Policies:
    """The cheapest memory policy that fits, per stage position, under the exact memory model:
    for each count ``k`` of recomputed layers (and selective recompute on unfused attention),
    the least optimizer offload (steps of 5 %) that makes it fit; the cheapest of those by the
    stage's seconds per step (``m`` micro-batches plus the offloaded optimizer's extra step)."""

    def __init__(self, cost: CostModel, plan: Plan, allow_offload: bool,
                 allow_module_inputs: bool = True):
        self.cost, self.allow_offload = cost, allow_offload
        self.module_inputs = (False, True) if allow_module_inputs else (False,)
        self.tp, self.p, self.D = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size, \
            plan.data_parallel_size
        self.sp = cost.sequence_parallel_of(plan)
        self._memo: dict[tuple, tuple[int, float, bool] | None] = {}

    def choose(self, gpu: str, chunks: tuple[int, ...], s: int, mbs: int,
               m: int) -> tuple[int, float, bool] | None:
        key = (gpu, chunks, s, mbs, m)
        if key in self._memo:
            return self._memo[key]
        cost, tp, p, D, sp = self.cost, self.tp, self.p, self.D, self.sp
        first, last, n = s == 0, s == p - 1, sum(chunks)
        params = cost.stage_params(n, first, last, tp)
        off_step = cost.optimizer_seconds(gpu, params, D, 1.0) - cost.optimizer_seconds(gpu, params, D, 0.0)

        def need(code: int, f: float, mi: bool):
            rk = recompute_code_key(code)
            if len(chunks) > 1:
                return cost.chunked_memory_need(gpu, chunks, first, last, mbs, tp, rk, p, s, m, D,
                                                f, False, sp, mi)
            return cost.memory_need(gpu, n, first, last, mbs, tp, rk, min(p - s, m), D, f, False,
                                    sp, mi)

        codes = list(range(n + 1))
        if not cost.uses_flash_attention(gpu):
            codes.append(SELECTIVE)
        best = None
        for mi in self.module_inputs:
            for code in codes:
                mem = need(code, 0.0, mi)
                f = 0.0
                if not mem.fits:
                    if not self.allow_offload or mem.optimizer <= 0:
                        continue
                    f = math.ceil((mem.total - mem.capacity) * (1 + 1e-9) / mem.optimizer * 20) / 20
                    if f > 1.0 or not need(code, f, mi).fits:
                        continue
                t = m * cost.compute_times(gpu, n, first, last, mbs, tp, recompute_code_key(code),
                                           False, sp, mi).total_s + f * off_step
                if best is None or t < best[0] - 1e-12:
                    best = (t, code, f, mi)
        got = None if best is None else best[1:]
        self._memo[key] = got
        return got


def _build(plan: Plan, lay: Layout, policies: _Policies) -> Plan | None:
    """``plan`` reshaped to ``lay``, every stage on its cheapest fitting policy (None: some
    stage fits under no policy, or Megatron could not run it)."""
    p = plan.pipeline_model_parallel_size
    pipelines = []
    for d, pipe in enumerate(plan.pipelines):
        m = lay.microbatches[d]
        stages = []
        for s, old in enumerate(pipe.stages):
            chunks = lay.chunks(p, s)
            pol = policies.choose(old.device_type, chunks, s, pipe.micro_batch_size, m)
            if pol is None:
                return None
            code, f, mi = pol
            n = sum(chunks)
            stages.append(Stage(device_type=old.device_type, num_layers=n,
                                recompute=recompute_policy(code, n),
                                offload=Offload(optimizer_fraction=f, module_inputs=mi),
                                chunk_layers=list(chunks) if lay.v > 1 else None))
        pipelines.append(Pipeline(micro_batch_size=pipe.micro_batch_size, num_microbatches=m,
                                  stages=stages))
    try:
        return Plan(format_version=1, model=plan.model, global_batch_size=plan.global_batch_size,
                    tensor_model_parallel_size=plan.tensor_model_parallel_size, pipelines=pipelines,
                    precision=plan.precision, use_distributed_optimizer=plan.use_distributed_optimizer,
                    sequence_parallel=plan.sequence_parallel, virtual_pipeline_size=lay.v,
                    overlap_grad_reduce=plan.overlap_grad_reduce)
    except SchemaError:
        return None


def _spread(totals: list[int], v: int, early: bool) -> tuple[int, ...]:
    """Stage totals over ``v`` chunks each (:func:`.tables.even_chunks`); model order."""
    per = [even_chunks(n, v, early) for n in totals]
    return tuple(per[s][c] for c in range(v) for s in range(len(totals)))


def _regroup(mb: tuple[int, ...], unit: int) -> tuple[int, ...] | None:
    """Micro-batch counts rounded to multiples of ``unit`` with the same total (largest
    remainders first; None when the total is not a multiple)."""
    total = sum(mb)
    if total % unit:
        return None
    base = [m // unit for m in mb]
    left = total // unit - sum(base)
    order = sorted(range(len(mb)), key=lambda d: (-(mb[d] % unit), d))
    for d in order[:left]:
        base[d] += 1
    if min(base) < 1:
        return None
    return tuple(b * unit for b in base)


def _moves(lay: Layout, p: int, max_v: int, sim: SimResult):
    """Neighbouring layouts of ``lay``, in a fixed order."""
    seq, v = list(lay.seq), lay.v
    # a layer across each boundary of the virtual-stage sequence, then between two chunks of
    # one stage (``p`` apart in the sequence)
    shifts = [pair for i in range(len(seq) - 1) for pair in ((i, i + 1), (i + 1, i))]
    if v > 1 and p > 1:
        shifts += [(ca * p + s, cb * p + s) for s in range(p) for ca in range(v) for cb in range(v)
                   if ca != cb]
    for a, b in shifts:
        if seq[a] > 0:
            new = seq.copy()
            new[a] -= 1
            new[b] += 1
            yield Layout(tuple(new), v, lay.microbatches)
    # the chunk count, each stage's layers spread evenly
    if p > 1:
        totals = [sum(lay.seq[c * p + s] for c in range(v)) for s in range(p)]
        for w in range(1, max_v + 1):
            if w == v:
                continue
            mb = lay.microbatches if w == 1 else _regroup(lay.microbatches, p)
            if mb is None:
                continue
            for early in ((False, True) if w > 1 else (False,)):
                yield Layout(_spread(totals, w, early), w, mb)
    # one unit of micro-batches from the pipeline that finishes last to the one first done
    D = len(lay.microbatches)
    if D > 1:
        unit = p if v > 1 else 1
        finish = [max(r.busy_s + r.bubble_s for r in sim.stages if r.pipeline == d) for d in range(D)]
        late = max(range(D), key=lambda d: (finish[d], -d))
        early_d = min(range(D), key=lambda d: (finish[d], d))
        if late != early_d and lay.microbatches[late] > unit:
            mb = list(lay.microbatches)
            mb[late] -= unit
            mb[early_d] += unit
            yield Layout(lay.seq, v, tuple(mb))


def refine(plan: Plan, sim: SimResult, cost: CostModel, *, max_virtual_pipeline_size: int,
           optimizer_offload: bool = True, activation_offload: bool = True,
           max_rounds: int = 8) -> tuple[Plan, SimResult, int]:
    """Hill-climb from ``plan`` (simulated as ``sim``); returns the best plan found, its
    simulation and the number of simulations run. ``optimizer_offload`` and
    ``activation_offload`` (module inputs) allow those policies."""
    p = plan.pipeline_model_parallel_size
    policies = _Policies(cost, plan, optimizer_offload, activation_offload)
    best_plan, best_sim = plan, sim
    lay = layout_of(plan)
    seen = {lay}
    sims = 0
    for _ in range(max_rounds):
        winner = None
        for cand in _moves(lay, p, max(max_virtual_pipeline_size, lay.v), best_sim):
            if cand in seen or not cand.valid(p):
                continue
            seen.add(cand)
            new = _build(plan, cand, policies)
            if new is None:
                continue
            try:
                got = simulate(new, cost, record_events=False)
            except InfeasibleError:
                continue
            sims += 1
            if not got.fits_memory:
                continue
            ref = winner[2] if winner else best_sim
            if got.step_time_s < ref.step_time_s * (1 - 1e-9):
                winner = (cand, new, got)
        if winner is None:
            break
        lay, best_plan, best_sim = winner
    return best_plan, best_sim, sims
