"""The options grid of stage tables (:mod:`.tables`): per layer count (rows), one column per
option a menu may pick from; built for many tables at once.

Per module-input setting a grid has the full-recompute columns of :func:`_full_recompute` and,
where attention is unfused, a selective-recompute column; :func:`.policy.option_costs` costs
its options once per optimizer-offload flag. A table's arrays have 81 rows on a model of 80
layers, where a numpy call costs more than its arithmetic, so the tables a structure needs
first are built together (:func:`build_grids`): every array has the tables on a first axis,
and every entry is computed by the same operations as one table's alone (the figures are the
same floats).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np

from .policy import Menu, option_costs

__all__ = ["Grid", "build_grids", "menu_columns"]



class _Builder(Protocol):
    """What a grid reads of a table's builder (:class:`.tables._Builder` passes itself in)."""

    L: int
    n: np.ndarray
    unfused: bool
    capacity: float
    optimizer: np.ndarray
    off_step: np.ndarray
    m_avg: float
    saving: dict[bool, float]
    act: float
    fwd_layer: float

    def base_line(self, selective: bool, module_inputs: bool) -> tuple[np.ndarray, np.ndarray]:
        ...


FULL_COLUMNS = 3
"""The full-recompute options of a grid per module-input setting (:func:`_full_recompute`)."""


@lru_cache(maxsize=256)
def menu_columns(menu: Menu, module_inputs: tuple[bool, ...], selective: bool
                 ) -> tuple[slice | np.ndarray, tuple[tuple[bool, bool], ...]]:
    """Where ``menu``'s options are among the columns of a grid over the ``module_inputs``
    settings, with a selective-recompute column each where ``selective``, in the order ties
    are broken (a slice where they are contiguous); and each option's (selective, module
    inputs)."""
    width = FULL_COLUMNS + selective  # columns per module-input setting
    full = FULL_COLUMNS if menu.optimizer_offload else 1
    cols, kinds = [], []
    for mi in menu.module_inputs:
        first = module_inputs.index(mi) * width
        cols += range(first, first + full)
        kinds += [(False, mi)] * full
        if menu.selective_recompute and selective:
            cols.append(first + FULL_COLUMNS)
            kinds.append((True, mi))
    if cols == list(range(cols[0], cols[-1] + 1)):
        return slice(cols[0], cols[-1] + 1), tuple(kinds)
    got = np.array(cols)
    got.flags.writeable = False
    return got, tuple(kinds)


@dataclass(frozen=True, kw_only=True, slots=True)
class Grid:
    """The grids of several tables (a stack), each array with the tables on its first axis."""

    owners: list[_Builder]
    """The tables' builders, in that order."""
    module_inputs: tuple[bool, ...]
    """The module-input settings, in the order of their columns."""
    selective: bool
    """A selective-recompute column per module-input setting."""
    layers: np.ndarray
    """Layers of full recompute of each option (0 for selective recompute)."""
    memory: np.ndarray
    """Bytes each option needs with all its optimizer state on the device (``inf``: none)."""
    seconds: np.ndarray
    """Its seconds per micro-batch without optimizer offload."""
    optimizer: np.ndarray
    """Bytes of optimizer state per table and layer count."""
    capacity: np.ndarray
    """Each table's device memory, shaped to broadcast against ``memory``."""
    offload_seconds: np.ndarray
    """Per table and layer count, what offloading all of the optimizer adds per micro-batch."""
    costed: dict[bool, tuple[np.ndarray, np.ndarray]]
    """(fraction, cost) of each option, per optimizer-offload flag (filled when asked)."""

    def covers(self, menu: Menu, selective: bool) -> bool:
        """Whether the stack has ``menu``'s options (``selective``: its selective recompute)."""
        return set(menu.module_inputs) <= set(self.module_inputs) and self.selective >= selective

    def costs(self, optimizer_offload: bool) -> tuple[np.ndarray, np.ndarray]:
        """(fraction, cost) of every option by :func:`.policy.option_costs`, once per flag."""
        got = self.costed.get(optimizer_offload)
        if got is None:
            got = self.costed[optimizer_offload] = option_costs(
                self.memory, self.seconds, optimizer=self.optimizer, capacity=self.capacity,
                offload_seconds=self.offload_seconds, optimizer_offload=optimizer_offload)
        return got


def build_grids(builders: list[_Builder], module_inputs: tuple[bool, ...]) -> list[Grid]:
    """The grids over the ``module_inputs`` settings of the tables of ``builders`` (built,
    :meth:`~.tables._Builder.build`), with a selective-recompute column where attention is
    unfused: one stack per kind (fused or not); each builder's stack, in the builders' order."""
    out: dict[int, Grid] = {}
    for selective in (False, True):
        group = [i for i, b in enumerate(builders) if b.unfused == selective]
        if group:
            stack = _stack([builders[i] for i in group], module_inputs, selective)
            out.update((i, stack) for i in group)
    return [out[i] for i in range(len(builders))]


def _lines(builders: list[_Builder], selective: bool, module_inputs: tuple[bool, ...]
           ) -> tuple[np.ndarray, np.ndarray]:
    """(memory, seconds) per table, layer count and setting of ``module_inputs`` (a last axis of
    one) without full recompute (:meth:`~.tables._Builder.base_line`)."""
    shape = (len(builders), builders[0].L + 1, len(module_inputs), 1)
    mem, sec = np.empty(shape), np.empty(shape)
    for i, b in enumerate(builders):
        for j, mi in enumerate(module_inputs):
            mem[i, :, j, 0], sec[i, :, j, 0] = b.base_line(selective, mi)
    return mem, sec


def _stack(builders: list[_Builder], module_inputs: tuple[bool, ...], selective: bool) -> Grid:
    k, mem, sec = _full_recompute(builders, module_inputs)
    if selective:
        m, t = _lines(builders, True, module_inputs)
        k = np.concatenate((k, np.zeros_like(k[..., :1])), axis=3)
        mem = np.concatenate((mem, m), axis=3)
        sec = np.concatenate((sec, t), axis=3)
    columns = (len(builders), builders[0].L + 1, -1)
    capacity = np.array([b.capacity for b in builders])[:, None, None]
    offload = np.stack([b.off_step / b.m_avg for b in builders])
    return Grid(owners=builders, module_inputs=module_inputs, selective=selective,
                layers=k.reshape(columns), memory=mem.reshape(columns),
                seconds=sec.reshape(columns), optimizer=np.stack([b.optimizer for b in builders]),
                capacity=capacity, offload_seconds=offload, costed={})


def _full_recompute(builders: list[_Builder], module_inputs: tuple[bool, ...]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(layers, memory, seconds) per table, layer count and setting of ``module_inputs`` (the
    first three axes) of three options (the last axis), one per room: the fewest layers of full
    recompute that fit with no optimizer state offloaded; none (to fit, it offloads the least
    optimizer fraction that makes it); the fewest layers that fit with all of it offloaded.
    Memory is before offload (``inf`` where no count fits), seconds are per micro-batch.

    On the linear model these are the only ones worth weighing: a further step of optimizer
    fraction saves a fixed number of bytes, so it spares a fixed share of a layer's recompute
    at a fixed cost; the cost is linear in the fraction, and its least is at an end of the
    fractions that still need recompute (none, or where no layer does, or all). Ties go to the
    earlier column."""
    m0, t0 = _lines(builders, False, module_inputs)
    n, rows = len(builders), builders[0].L + 1
    # the room with none of the optimizer state offloaded, without a limit (so no recompute),
    # and with all of it offloaded
    room = np.empty((n, rows, 1, FULL_COLUMNS))
    capacity = np.array([b.capacity for b in builders])
    room[..., 0] = capacity[:, None, None]
    room[..., 1] = np.inf
    for i, b in enumerate(builders):
        room[i, :, 0, 2] = b.capacity + b.optimizer
    saving = np.array([[b.saving[mi] for mi in module_inputs] for b in builders])[:, None, :, None]
    act = np.array([b.act for b in builders])[:, None, None, None]
    # in place, each entry by the same operations: the fewest layers that fit
    # (ceil((m0 + act - room) / saving), at least 1; none where m0 fits; inf where a layer
    # saves nothing), 0 where that is more than the stage has
    top = m0 + act
    k = top - room
    with np.errstate(divide="ignore", invalid="ignore"):
        k /= saving
    np.ceil(k, out=k)
    np.maximum(k, 1, out=k)
    if (saving <= 0).any():
        np.copyto(k, np.inf, where=saving <= 0)
    np.copyto(k, 0.0, where=m0 <= room)
    ok = k <= builders[0].n[:, None, None]
    np.copyto(k, 0.0, where=~ok)
    k = k.astype(np.int64)
    # a layer of full recompute keeps its checkpoint; one layer is rebuilt at once
    mem = top - k * saving
    np.copyto(mem, m0, where=k == 0)
    np.copyto(mem, np.inf, where=~ok)
    fwd = np.array([b.fwd_layer for b in builders])[:, None, None, None]
    return k, mem, t0 + k * fwd
