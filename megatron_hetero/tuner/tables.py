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
peak of the interleaved order (:func:`megatron_hetero.cost.schedule.peak_activations`): exact
at multiples of ``v`` layers (even chunks, :func:`even_chunks`) and linear between. A stage's
``block`` recompute covers its first layers in chunk order (the plan's semantics); the
baseline counts its recompute per chunk, as plain Megatron does (:func:`per_chunk_recompute`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from ..cost.schedule import peak_activations
from ..cost.stage import StageShape
from ..plan import Offload, Recompute
from .policy import OFFLOAD_STEPS, Menu, Option, Policy, option_costs, pick
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

    layers: np.ndarray
    """Layers of full recompute chosen at each ``n``."""
    selective: np.ndarray
    """Whether selective recompute is chosen instead."""
    module_inputs: np.ndarray
    fraction: np.ndarray
    """The optimizer-state fraction offloaded."""
    seconds: np.ndarray
    """Seconds per micro-batch, the offload's per-step cost spread over the average
    micro-batch count; ``inf`` where nothing fits, and at ``n`` = 0."""

    def fits(self, n: int) -> bool:
        return float(self.seconds[n]) < np.inf

    def option(self, n: int) -> Option | None:
        if not self.fits(n):
            return None
        return Option(layers=int(self.layers[n]), selective=bool(self.selective[n]),
                      module_inputs=bool(self.module_inputs[n]))

    def policy(self, n: int) -> Policy:
        """The plan's policy at ``n`` layers (which must fit)."""
        o = self.option(n)
        return Policy(recompute=o.recompute(n),
                      offload=Offload(optimizer_fraction=float(self.fraction[n]),
                                      module_inputs=o.module_inputs))

    def layers_or(self, n: int, otherwise: int) -> int:
        """Layers of full recompute chosen at ``n`` (``otherwise`` where nothing fits)."""
        return int(self.layers[n]) if self.fits(n) else otherwise


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
        return self._builder.choose(Menu(module_inputs=self._builder.module_inputs))

    @cached_property
    def rec(self) -> Choices:
        return self._builder.choose(Menu(optimizer_offload=False,
                                         module_inputs=self._builder.module_inputs))

    @cached_property
    def base(self) -> Choices:
        return self._builder.choose(Menu(selective_recompute=False, optimizer_offload=False,
                                         module_inputs=(False,)))

    @cached_property
    def base_mi(self) -> Choices:
        return self._builder.choose(Menu(selective_recompute=False, optimizer_offload=False,
                                         module_inputs=(True,)))

    @cached_property
    def sel(self) -> Choices:
        return self._builder.choose(Menu(full_recompute=False, optimizer_offload=False,
                                         module_inputs=(False,)))


class StageTables:
    """The stage tables of one search, each built once."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._tables: dict[tuple, StageTable] = {}
        self._seen: dict[tuple, StageTable] = {}
        self._seconds: dict[tuple, float] = {}

    def table(self, position: StageShape, *, precision: str) -> StageTable:
        """Costs of the stage position ``position`` (its layers and policy aside) for every
        layer count; with ``v`` > 1 chunks, memory is exact at multiples of ``v`` layers
        (even chunks) and linear between."""
        key = (_canonical(position), precision)
        got = self._tables.get(key)
        if got is None:
            got = self._tables[key] = _Builder(self.problem, key[0], precision).build()
        return got

    def seconds(self, st: Structure, types, s: int, *, layers: int, policy: Policy,
                precision: str) -> float:
        """One micro-batch's forward and backward seconds on stage ``s`` of the template
        ``types`` of ``st`` with ``layers`` under ``policy`` (the cost model's, remembered by a
        tuple: the search asks for the same stages again and again)."""
        quick = (precision, types[s], st.tp, st.mbs, st.vp, st.pp, s, layers, policy)
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
        out = []
        for types, _ in st.templates:
            row = []
            for s in range(p):
                # the search asks for the same positions again and again: find them by a tuple
                # before building their shape
                quick = (prec, types[s], st.tp, st.mbs, st.vp, p, s, m, D)
                got = self._seen.get(quick)
                if got is None:
                    got = self._seen[quick] = self.table(stage_shape(st, types, s, microbatches=m),
                                                         precision=prec)
                row.append(got)
            out.append(row)
        return out


_FULL_COLUMNS = 3
"""The full-recompute options of a table (:meth:`_Builder.full_recompute`)."""


def _columns(blocks: list[np.ndarray]) -> np.ndarray:
    """Column blocks side by side."""
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)


def stage_shape(st: Structure, types, s: int, *, layers: int = 0, policy: Policy | None = None,
                microbatches: int = 1) -> StageShape:
    """Stage ``s`` of the template ``types`` of ``st`` with ``layers`` in even chunks under
    ``policy`` (default: none), its replica running ``microbatches``."""
    policy = policy or Policy(recompute=Recompute(), offload=Offload())
    return StageShape(device_type=types[s], chunk_layers=even_chunks(layers, st.vp),
                      micro_batch_size=st.mbs, tensor_parallel_size=st.tp,
                      sequence_parallel=st.tp > 1, recompute=policy.recompute,
                      offload=policy.offload, pipeline_size=st.pp, stage=s,
                      num_microbatches=microbatches, data_parallel_size=st.num_pipelines)


def _canonical(position: StageShape) -> StageShape:
    """A position with the same costs as ``position``, the same for all positions alike: in
    1F1B a stage's costs depend on its place only through whether it is first or last and how
    many micro-batches it holds in flight (``f``), so it becomes stage 0 of ``f`` (first),
    stage 1 of 2 (last) or stage 1 of ``f + 1`` (middle; of at least 3), with ``f``
    micro-batches."""
    if position.virtual_size > 1:
        return position
    f = min(position.pipeline_size - position.stage, position.num_microbatches)
    if position.first:
        p, s = (1, 0) if position.last else (max(f, 2), 0)
    else:
        p, s = (2, 1) if position.last else (max(f, 2) + 1, 1)
    return position.but(pipeline_size=p, stage=s, num_microbatches=f)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Grid:
    """A table's options with one module-input setting, costed at every layer count (rows):
    full recompute per optimizer fraction step, then selective recompute where offered."""

    layers: np.ndarray
    """Layers of full recompute of each full-recompute column."""
    fraction: np.ndarray
    """The optimizer-state fraction each option offloads."""
    cost: np.ndarray
    """Its seconds per micro-batch with that offload (``inf``: it does not fit)."""


class _Builder:
    """One table: the linear model of one stage position, and the menus picked on it."""

    def __init__(self, problem: Problem, position: StageShape, precision: str):
        self.problem, self.pos = problem, position
        self.cost = cost = problem.cost(precision)
        self.L = L = problem.model.num_layers
        self.n = np.arange(L + 1, dtype=float)
        self.rows = np.arange(L + 1)
        self.v = v = position.virtual_size
        pos = position
        b, tp, sp = pos.micro_batch_size, pos.tensor_parallel_size, pos.sp
        if v == 1:
            in_flight = float(min(pos.pipeline_size - pos.stage, pos.num_microbatches))
        else:  # chunks held per layer at the peak, with even chunks
            in_flight = peak_activations(pos.pipeline_size, pos.stage, pos.num_microbatches, v,
                                         [1.0] * v, pos.microbatch_group) / v
        self.act = cost.layer_activation_bytes(pos.device_type, b, tp, "none", sp=sp)
        ckpt = cost.hidden_bytes(b, tp, sp=sp)
        self.saving = {False: in_flight * (self.act - ckpt),
                       True: in_flight * (self.act - cost.module_input_bytes(b, tp, sp=sp) - ckpt)}
        self.fwd_layer = cost.layer_times(pos.device_type, b, tp)[0]
        self.unfused = not cost.uses_flash_attention(pos.device_type)
        self.m_avg = (problem.gbs // b) / pos.data_parallel_size
        self._lines: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._shapes: dict[tuple, StageShape] = {}
        self._full: dict[bool, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._costed: dict[tuple[bool, bool], _Grid] = {}
        self.capacity = cost.capacity(pos.device_type)
        self.no_layers = np.zeros((L + 1, 1), dtype=np.int64)
        self.n_column = self.n[:, None]

    def shape(self, k: int, recompute: Recompute = Recompute(), *,
              module_inputs: bool = False) -> StageShape:
        """The position with ``k`` layers in even chunks (each built once)."""
        key = (k, recompute, module_inputs)
        got = self._shapes.get(key)
        if got is None:
            got = self._shapes[key] = self.pos.but(chunk_layers=even_chunks(k, self.v),
                                                   recompute=recompute,
                                                   offload=Offload(module_inputs=module_inputs))
        return got

    def line(self, f, unit: int = 1) -> np.ndarray:
        """``f`` at every layer count, from its values at ``unit`` and ``2 unit`` layers."""
        a, b = f(unit), f(2 * unit)
        return a + (self.n - unit) * (b - a) / unit

    def base_line(self, selective: bool, module_inputs: bool) -> tuple[np.ndarray, np.ndarray]:
        """(memory, seconds per micro-batch) at every layer count, no full recompute."""
        key = (selective, module_inputs)
        if key not in self._lines:
            r = Recompute(granularity="selective") if selective else Recompute()
            cost = self.cost
            mem = self.line(lambda k: cost.memory(self.shape(k, r, module_inputs=module_inputs)).total,
                            self.v)
            sec = self.line(lambda k: cost.times(self.shape(k, r, module_inputs=module_inputs)).total_s)
            self._lines[key] = (mem, sec)
        return self._lines[key]

    def choose(self, menu: Menu) -> Choices:
        """The cheapest option of ``menu`` at every layer count, picked by :func:`.policy.pick`
        from the options costed once per table (:meth:`costed`): full recompute at the ends
        of the optimizer fractions (:meth:`full_recompute`) and selective recompute."""
        width = _FULL_COLUMNS if menu.optimizer_offload else 1
        fraction, cost, layers, selective, mi = [], [], [], [], []
        for module_inputs in menu.module_inputs:
            grid = self.costed(module_inputs, optimizer_offload=menu.optimizer_offload)
            k = grid.layers[:, :width]
            fraction.append(grid.fraction[:, :width])
            # without full recompute: no recompute where it fits, else nothing
            cost.append(grid.cost[:, :width] if menu.full_recompute
                        else np.where(k == 0, grid.cost[:, :width], np.inf))
            layers.append(k)
            selective += [False] * width
            mi += [module_inputs] * width
            if menu.selective_recompute and self.unfused:
                fraction.append(grid.fraction[:, -1:])
                cost.append(grid.cost[:, -1:])
                layers.append(self.no_layers)
                selective.append(True)
                mi.append(module_inputs)
        got = pick(_columns(fraction), _columns(cost))
        seconds = got.seconds
        seconds[0] = np.inf  # every stage the search splits holds a layer
        return Choices(layers=_columns(layers)[self.rows, got.index],
                       selective=np.array(selective)[got.index],
                       module_inputs=np.array(mi)[got.index], fraction=got.fraction,
                       seconds=seconds)

    def costed(self, module_inputs: bool, *, optimizer_offload: bool) -> _Grid:
        """The table's options with ``module_inputs`` at every layer count, costed by
        :func:`.policy.option_costs`: the full-recompute columns of :meth:`full_recompute`,
        then selective recompute where attention is unfused."""
        key = (module_inputs, optimizer_offload)
        got = self._costed.get(key)
        if got is None:
            k, mem, sec = self.full_recompute(module_inputs)
            if self.unfused:
                m1, t1 = self.base_line(True, module_inputs)
                mem = np.concatenate((mem, m1[:, None]), axis=1)
                sec = np.concatenate((sec, t1[:, None]), axis=1)
            fraction, cost = option_costs(mem, sec, optimizer=self.optimizer,
                                          capacity=self.capacity,
                                          offload_seconds=self.off_step / self.m_avg,
                                          optimizer_offload=optimizer_offload)
            got = self._costed[key] = _Grid(layers=k, fraction=fraction, cost=cost)
        return got

    def full_recompute(self, module_inputs: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(layers, memory, seconds) per layer count (rows) of three options (columns): the
        fewest layers of full recompute that fit with no optimizer state offloaded; none
        (to fit, it offloads the least optimizer fraction that makes it); the fewest layers
        that fit with all of it offloaded. Memory is before offload (``inf`` where no count
        fits), seconds are per micro-batch.

        On the linear model these are the only ones worth weighing: a further step of
        optimizer fraction saves a fixed number of bytes, so it spares a fixed share of a
        layer's recompute at a fixed cost; the cost is linear in the fraction, and its least is
        at an end of the fractions that still need recompute (none, or where no layer does,
        or all). Ties go to the earlier column."""
        got = self._full.get(module_inputs)
        if got is not None:
            return got
        m0, t0 = (x[:, None] for x in self.base_line(False, module_inputs))
        room = self.room
        saving = self.saving[module_inputs]
        if saving > 0:
            k = np.maximum(np.ceil((m0 + self.act - room) / saving), 1)
        else:
            k = np.full(room.shape, np.inf)
        k = np.where(m0 <= room, 0, k)
        ok = k <= self.n_column
        k = np.where(ok, k, 0).astype(np.int64)
        # a layer of full recompute keeps its checkpoint; one layer is rebuilt at once
        mem = np.where(ok, np.where(k == 0, m0, m0 + self.act - k * saving), np.inf)
        sec = t0 + k * self.fwd_layer
        zero = self.no_layers
        got = self._full[module_inputs] = (
            np.concatenate((k[:, :1], zero, k[:, 1:]), axis=1),
            np.concatenate((mem[:, :1], m0, mem[:, 1:]), axis=1),
            np.concatenate((sec[:, :1], t0, sec[:, 1:]), axis=1))
        return got

    def build(self) -> StageTable:
        cost, v = self.cost, self.v
        self.optimizer = self.line(lambda k: cost.memory(self.shape(k)).optimizer, v)
        self.off_step = self.line(lambda k: cost.optimizer_offload_seconds(self.shape(k)))
        # the room with none and with all of the optimizer state offloaded
        self.room = self.capacity + np.array([0.0, 1.0]) * self.optimizer[:, None]
        self.module_inputs = (False, True) if self.problem.opt.activation_offload else (False,)
        return StageTable(self)
