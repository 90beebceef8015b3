"""Per-stage cost tables: for one stage position and every layer count, the time per
micro-batch and the cheapest memory policy that fits.

A stage position is a :class:`~megatron_hetero.cost.stage.StageShape` without its layers and
policy. Its time and memory are linear in the layer count and in the layers recomputed, so each
table is built from a few evaluations of the cost model: the shape at ``v`` and ``2 v`` layers
with no recompute, with selective recompute, and with the module inputs offloaded; a layer of
full recompute saves its activations less the checkpoint it keeps, on every micro-batch in
flight, and costs one layer's forward. On that linear model :func:`.policy.cheapest` picks, for
every layer count at once, the cheapest policy of each :class:`.policy.Menu` the search uses:

* ``fit``: any policy (full recompute of any number of layers, selective recompute where
  attention is unfused, part or all of the optimizer state offloaded in steps of 5 % with its
  per-step cost spread over the average micro-batch count, and, unless
  ``TuneOptions.activation_offload`` is off, the module inputs offloaded);
* ``rec``: the same without optimizer offload;
* the baseline's: full recompute alone (``base``; with the module inputs offloaded,
  ``base_mi``), and whether selective recompute alone fits (``sel``).

With ``v`` > 1 model chunks per stage (interleaved 1F1B) the memory uses the exact in-flight
peak of the interleaved order (:func:`megatron_hetero.schedule.order.peak_activations`): exact
at multiples of ``v`` layers (even chunks, :func:`even_chunks`) and linear between. A stage's
``block`` recompute covers its first layers in chunk order (the plan's semantics); the
baseline counts its recompute per chunk, as plain Megatron does (:func:`per_chunk_recompute`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from ..schedule.order import peak_activations
from ..cost.stage import Memory, StageShape
from ..plan import Offload, Recompute
from .grid import Grid, build_grids, menu_columns
from .policy import Menu, Option, Policy, leading, pick, timing_position
from .problem import Problem
from .space import Structure

__all__ = ["Choices", "StageTable", "StageTables", "even_chunks", "per_chunk_recompute",
           "stage_shape"]


@lru_cache(maxsize=65536)
def even_chunks(n: int, v: int, early: bool = False) -> tuple[int, ...]:
    """``n`` layers over ``v`` model chunks as evenly as possible, the later chunks taking the
    remainder (fewer of them are in flight: the least memory), or with ``early`` the earlier
    ones (the last stage's last chunk, which also runs the output layer, then holds fewer)."""
    q, r = divmod(n, v)
    return tuple(q + (c < r if early else c >= v - r) for c in range(v))


def per_chunk_recompute(k: int, n: int, v: int) -> int:
    """The baseline's ``k`` layers of full recompute on a stage of ``n`` rounded up to the same
    count in each of ``v`` equal chunks: plain Megatron counts ``--recompute-num-layers`` per
    chunk. (The plan's ``block`` covers the stage's first ``k`` layers in chunk order, which
    saves at least as much memory for the same work, so the baseline is not understated.)"""
    if v == 1 or k <= 0 or k > n:
        return k
    return min(-(-k // v) * v, n)


@dataclass(frozen=True, kw_only=True, slots=True)
class Choices:
    """The cheapest policy of one menu that fits, for every layer count ``n`` (index 0..L)."""

    index: np.ndarray
    """The option (column of ``layers``) chosen at each ``n``."""
    layers: np.ndarray
    """Layers of full recompute of each option at each ``n`` (0 for selective recompute)."""
    kinds: tuple[tuple[bool, bool], ...]
    """(selective, module inputs) of each option."""
    fraction: np.ndarray
    """The optimizer-state fraction offloaded."""
    seconds: np.ndarray
    """Seconds per micro-batch, the offload's per-step cost spread over the average
    micro-batch count; ``inf`` where nothing fits, and at ``n`` = 0."""
    fitting: list[bool]
    """Whether anything fits at each ``n`` (a list: the search looks single counts up)."""
    chosen: list[int]
    """Layers of full recompute of the option chosen at each ``n``."""

    def fits(self, n: int) -> bool:
        return self.fitting[n]

    def option(self, n: int) -> Option | None:
        if not self.fits(n):
            return None
        c = int(self.index[n])
        selective, module_inputs = self.kinds[c]
        return Option(layers=int(self.layers[n, c]), selective=selective,
                      module_inputs=module_inputs)

    def policy(self, n: int) -> Policy:
        """The plan's policy at ``n`` layers (which must fit)."""
        o = self.option(n)
        return Policy(recompute=o.recompute(n),
                      offload=Offload(optimizer_fraction=float(self.fraction[n]),
                                      module_inputs=o.module_inputs))

    def layers_or(self, n: int, otherwise: int) -> int:
        """Layers of full recompute chosen at ``n`` (``otherwise`` where nothing fits)."""
        return self.chosen[n] if self.fitting[n] else otherwise


class StageTable:
    """Per layer count of one stage position: its time per micro-batch without recompute and
    with selective recompute, the per-step seconds of offloading all of the optimizer, and
    the choices of each menu (see the module docstring), each picked when first asked for."""

    def __init__(self, builder: _Builder):
        self._builder = builder
        self.t_none = builder.base_line(False, False)[1]
        self.off_step = builder.off_step

    @cached_property
    def t_sel(self) -> np.ndarray:
        """Seconds per micro-batch with selective recompute (``inf`` where attention is fused:
        it saves nothing there)."""
        b = self._builder
        return b.base_line(True, False)[1] if b.unfused else np.full(b.L + 1, np.inf)

    @cached_property
    def fit(self) -> Choices:
        return self._builder.choose(_FIT[self._builder.module_inputs])

    @cached_property
    def rec(self) -> Choices:
        return self._builder.choose(_REC[self._builder.module_inputs])

    @cached_property
    def base(self) -> Choices:
        return self._builder.choose(_BASE)

    @cached_property
    def base_mi(self) -> Choices:
        return self._builder.choose(_BASE_MI)

    @cached_property
    def sel(self) -> Choices:
        return self._builder.choose(_SEL)


_SETTINGS = ((False,), (False, True))
_FIT = {mi: Menu(module_inputs=mi) for mi in _SETTINGS}
_REC = {mi: Menu(optimizer_offload=False, module_inputs=mi) for mi in _SETTINGS}
_BASE = Menu(selective_recompute=False, optimizer_offload=False, module_inputs=(False,))
_BASE_MI = Menu(selective_recompute=False, optimizer_offload=False, module_inputs=(True,))
_SEL = Menu(full_recompute=False, optimizer_offload=False, module_inputs=(False,))
"""The menus of :class:`StageTable` (``fit`` and ``rec`` per module-input setting), built once."""


class StageTables:
    """The stage tables of one search, each built once."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._tables: dict[tuple, StageTable] = {}
        self._seen: dict[tuple, StageTable] = {}
        self._seconds: dict[tuple, float] = {}
        self._timing_lines: dict[tuple, np.ndarray] = {}
        self._figures: dict[tuple, tuple] = {}

    def table(self, position: StageShape, *, precision: str) -> StageTable:
        """Costs of the stage position ``position`` (its layers and policy aside) for every
        layer count; with ``v`` > 1 chunks, memory is exact at multiples of ``v`` layers
        (even chunks) and linear between."""
        key = (_canonical(position), precision)
        got = self._tables.get(key)
        if got is None:
            builder = _Builder(self.problem, key[0], precision, timing_lines=self._timing_lines,
                               figures=self._figures)
            got = self._tables[key] = builder.build()
        return got

    def seconds(self, st: Structure, types, s: int, *, layers: int, policy: Policy,
                precision: str) -> float:
        """One micro-batch's forward and backward seconds on stage ``s`` of the template
        ``types`` of ``st`` with ``layers`` under ``policy`` (the cost model's, remembered by a
        tuple: the search asks for the same stages again and again; as
        :func:`.policy.timing_position` says, the seconds depend on the stage's place only
        through first and last, and not on the optimizer offload)."""
        quick = (precision, types[s], st.tp, st.mbs, st.vp, s == 0, s == st.pp - 1, layers,
                 policy.recompute, policy.offload.module_inputs, policy.offload.activations,
                 st.ep, st.etp)
        got = self._seconds.get(quick)
        if got is None:
            shape = stage_shape(st, types, s, layers=layers, policy=policy)
            got = self._seconds[quick] = self.problem.cost(precision).times(shape).total_s
        return got

    def for_structure(self, st: Structure, prec: str) -> list[list[StageTable]]:
        """The tables of every (template, stage) of a structure: stage ``s`` of ``p`` with the
        average micro-batch count rounded up to whole groups of ``p`` (the in-flight peak is
        monotone in it)."""
        p, D = st.pp, st.num_pipelines
        m = p * max(1, -(-(self.problem.gbs // st.mbs) // (D * p)))
        out, new = [], {}
        for types, _ in st.templates:
            row = []
            for s in range(p):
                # the search asks for the same positions again and again: find them by a tuple
                # before building their shape
                quick = (prec, types[s], st.tp, st.mbs, st.vp, p, s, m, D, st.ep, st.etp)
                got = self._seen.get(quick)
                if got is None:
                    got = self._seen[quick] = self.table(stage_shape(st, types, s, microbatches=m),
                                                         precision=prec)
                    if not got._builder.grids:
                        new[id(got)] = got._builder
                row.append(got)
            out.append(row)
        _first_grids(list(new.values()))
        return out

    def tables(self, positions: list[StageShape], *, precision: str) -> list[StageTable]:
        """:meth:`table` of each of ``positions`` (the stages of a mesh candidate), the first
        grids of those new built together."""
        out = [self.table(position, precision=precision) for position in positions]
        _first_grids(list({id(t): t._builder for t in out if not t._builder.grids}.values()))
        return out


def _first_grids(builders: list[_Builder]) -> None:
    """Build the first grids of the tables of ``builders`` together (one stack per kind,
    :func:`.grid.build_grids`): every caller picks a menu on each."""
    if builders:
        for b, grid in zip(builders, build_grids(builders, builders[0].module_inputs)):
            b.grids.append(grid)


_NO_RECOMPUTE, _SELECTIVE = Recompute(), Recompute(granularity="selective")
_NO_POLICY = Policy(recompute=_NO_RECOMPUTE, offload=Offload())
_MODULE_INPUTS = {mi: Offload(module_inputs=mi) for mi in (False, True)}
"""The policies the tables' lines are costed under (shared: the tables hold many shapes)."""

@lru_cache(maxsize=64)
def _rows(L: int) -> np.ndarray:
    """The layer counts 0..L as floats, shared by the tables of a model (read-only)."""
    n = np.arange(L + 1, dtype=float)
    n.flags.writeable = False
    return n


@lru_cache(maxsize=256)
def _steps(L: int, unit: int) -> np.ndarray:
    """The layer counts 0..L less ``unit`` (:meth:`_Builder.line`; read-only)."""
    got = _rows(L) - unit
    got.flags.writeable = False
    return got


def stage_shape(st: Structure, types, s: int, *, layers: int = 0, policy: Policy | None = None,
                microbatches: int = 1) -> StageShape:
    """Stage ``s`` of the template ``types`` of ``st`` with ``layers`` in even chunks under
    ``policy`` (default: none), its replica running ``microbatches``."""
    policy = policy or _NO_POLICY
    return StageShape(device_type=types[s], chunk_layers=even_chunks(layers, st.vp),
                      micro_batch_size=st.mbs, tensor_parallel_size=st.tp,
                      sequence_parallel=st.tp > 1, recompute=policy.recompute,
                      offload=policy.offload, pipeline_size=st.pp, stage=s,
                      num_microbatches=microbatches, data_parallel_size=st.num_pipelines,
                      expert_parallel_size=st.ep, expert_tensor_parallel_size=st.etp)


def _canonical(position: StageShape) -> StageShape:
    """A position with the same costs as ``position``, the same for all positions alike: in
    1F1B a stage's costs depend on its place only through whether it is first or last and how
    many micro-batches it holds in flight (``f``), so it becomes stage 0 of ``f`` (first),
    stage 1 of 2 (last) or stage 1 of ``f + 1`` (middle; of at least 3), with ``f``
    micro-batches. Interleaved, the in-flight peak depends on the place only through the
    stages after it (the warm-up, :func:`~megatron_hetero.schedule.order.warmup_count`, is
    ``(p - s - 1) 2 + (v - 1) g``) once the group ``g`` is named: a middle stage becomes stage 1
    of ``p - s + 1``, the last stage 1 of 2, the group named (the first keeps its place); the
    chains of the mesh search share a mesh's tables whatever the meshes before it."""
    if position.virtual_size > 1:
        g = position.microbatch_group or position.pipeline_size
        if position.first:
            return position.but(microbatch_group=g)
        return position.but(pipeline_size=position.pipeline_size - position.stage + 1, stage=1,
                            microbatch_group=g)
    f = min(position.pipeline_size - position.stage, position.num_microbatches)
    if position.first:
        p, s = (1, 0) if position.last else (max(f, 2), 0)
    else:
        p, s = (2, 1) if position.last else (max(f, 2) + 1, 1)
    return position.but(pipeline_size=p, stage=s, num_microbatches=f)


def _choose(grids: Grid, rows: list[int], menu: Menu) -> list[Choices]:
    """:meth:`_Builder.choose` of ``menu`` for the tables ``rows`` of the stack ``grids``, by
    the same operations on each entry as one table's alone."""
    cols, kinds = menu_columns(menu, grids.module_inputs, grids.selective)
    fraction, cost = grids.costs(menu.optimizer_offload)
    if len(rows) < len(grids.owners):
        fraction, cost, layers = fraction[rows], cost[rows], grids.layers[rows]
    else:
        layers = grids.layers
    fraction, cost, layers = fraction[..., cols], cost[..., cols], layers[..., cols]
    if not menu.full_recompute:  # no recompute where it fits, else nothing
        cost = np.where(layers == 0, cost, np.inf)
    got = pick(fraction, cost)
    seconds = got.seconds
    seconds[:, 0] = np.inf  # every stage the search splits holds a layer
    fitting = (seconds < np.inf).tolist()
    chosen = layers[(*leading(got.index.shape), got.index)].tolist()
    return [Choices(index=got.index[i], layers=layers[i], kinds=kinds, fraction=got.fraction[i],
                    seconds=seconds[i], fitting=fitting[i], chosen=chosen[i])
            for i in range(len(rows))]


class _Builder:
    """One table: the linear model of one stage position, and the menus picked on it."""

    def __init__(self, problem: Problem, position: StageShape, precision: str, *,
                 timing_lines: dict[tuple, np.ndarray], figures: dict[tuple, tuple]):
        self.problem, self.pos, self.precision = problem, position, precision
        self.timing = timing_position(position)  # the tables key its lines by D
        self._timing_lines = timing_lines
        self.cost = cost = problem.cost(precision)
        self.L = L = problem.model.num_layers
        self.n = _rows(L)
        self.v = v = position.virtual_size
        pos = position
        b, tp, sp = pos.micro_batch_size, pos.tensor_parallel_size, pos.sp
        if v == 1:
            in_flight = float(min(pos.pipeline_size - pos.stage, pos.num_microbatches))
        else:  # chunks held per layer at the peak, with even chunks
            in_flight = peak_activations(pos.pipeline_size, pos.stage, pos.num_microbatches, v,
                                         [1.0] * v, pos.microbatch_group) / v
        key = (precision, pos.device_type, b, tp, sp)
        got = figures.get(key)
        if got is None:  # what a layer of this device type, batch and TP keeps and costs
            act = cost.layer_activation_bytes(pos.device_type, b, tp, "none", sp=sp)
            ckpt = cost.hidden_bytes(b, tp, sp=sp)
            got = figures[key] = (act, act - ckpt,
                                  act - cost.module_input_bytes(b, tp, sp=sp) - ckpt,
                                  cost.layer_times(pos.device_type, b, tp)[0],
                                  not cost.uses_flash_attention(pos.device_type),
                                  cost.capacity(pos.device_type))
        self.act, kept, kept_mi, self.fwd_layer, self.unfused, self.capacity = got
        self.saving = {False: in_flight * kept, True: in_flight * kept_mi}
        self.m_avg = (problem.gbs // b) / pos.data_parallel_size
        self._lines: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._points: dict[tuple, Memory] = {}
        self.grids: list[Grid] = []
        """The grids built for this table (:meth:`grid`)."""
        self.menus: dict[Menu, Choices] = {}
        """The menus picked (:meth:`choose`)."""

    def memory(self, k: int, recompute: Recompute, offload: Offload) -> Memory:
        """The position's memory with ``k`` layers in even chunks under ``recompute`` and
        ``offload``, each asked of the cost model once (``memory_of``: that shape is not
        built)."""
        key = (k, recompute, offload)
        got = self._points.get(key)
        if got is None:
            got = self._points[key] = self.cost.memory_of(self.pos, even_chunks(k, self.v),
                                                          recompute, offload)
        return got

    def line(self, f, unit: int = 1) -> np.ndarray:
        """``f`` at every layer count, from its values at ``unit`` and ``2 unit`` layers."""
        a, b = f(unit), f(2 * unit)
        if unit == 1:  # dividing by 1 changes nothing
            return a + _steps(self.L, 1) * (b - a)
        return a + _steps(self.L, unit) * (b - a) / unit

    def timing_line(self, what: tuple, f) -> np.ndarray:
        """:meth:`line` of ``f``, which depends on the position only through
        :func:`.policy.timing_position`: shared by the tables of all positions alike
        (read-only)."""
        key = (self.precision, self.timing, what)
        got = self._timing_lines.get(key)
        if got is None:
            got = self._timing_lines[key] = self.line(f)
            got.flags.writeable = False
        return got

    def base_line(self, selective: bool, module_inputs: bool) -> tuple[np.ndarray, np.ndarray]:
        """(memory, seconds per micro-batch) at every layer count, no full recompute."""
        key = (selective, module_inputs)
        if key not in self._lines:
            r = _SELECTIVE if selective else _NO_RECOMPUTE
            cost = self.cost
            offload = _MODULE_INPUTS[module_inputs]
            mem = self.line(lambda k: self.memory(k, r, offload).total, self.v)
            sec = self.timing_line(key, lambda k: cost.times(self.timing.but(
                chunk_layers=even_chunks(k, self.v), recompute=r, offload=offload)).total_s)
            self._lines[key] = (mem, sec)
        return self._lines[key]

    def choose(self, menu: Menu) -> Choices:
        """The cheapest option of ``menu`` at every layer count (each menu picked once), picked
        by :func:`.policy.pick` from the options of a grid (:meth:`grid`), costed once per grid:
        full recompute at the ends of the optimizer fractions and selective recompute
        (:mod:`.grid`). It is picked for every table of the grid's stack that has not picked it
        yet (the search asks each table of a structure for the same menus), one row each."""
        got = self.menus.get(menu)
        if got is None:
            g = self.grid(menu)
            owners = g.owners
            rows = [j for j, b in enumerate(owners) if menu not in b.menus]
            for j, choices in zip(rows, _choose(g, rows, menu)):
                owners[j].menus[menu] = choices
            got = self.menus[menu]
        return got

    def grid(self, menu: Menu) -> Grid:
        """A stack of grids with ``menu``'s options that holds this table's: one built before
        (:meth:`StageTables.for_structure` builds the first grids of many tables together),
        else one of this table alone over every module-input setting (and selective recompute
        where attention is unfused) that serves every later menu of the table (a column's
        figures do not depend on the others)."""
        selective = menu.selective_recompute and self.unfused
        for g in self.grids:
            if g.covers(menu, selective):
                return g
        settings = tuple(mi for mi in (False, True)
                         if mi in self.module_inputs or mi in menu.module_inputs)
        got = build_grids([self], settings)[0]
        self.grids.append(got)
        return got

    def build(self) -> StageTable:
        cost, v = self.cost, self.v
        self.optimizer = self.line(
            lambda k: self.memory(k, _NO_RECOMPUTE, _MODULE_INPUTS[False]).optimizer, v)
        D = self.pos.data_parallel_size
        self.off_step = self.timing_line(("optimizer offload", D), lambda k: cost.optimizer_offload_seconds(
            self.timing.but(chunk_layers=even_chunks(k, v), data_parallel_size=D)))
        self.module_inputs = (False, True) if self.problem.opt.activation_offload else (False,)
        return StageTable(self)
