"""The cheapest memory policy that fits a stage: which layers to recompute, how much of the
optimizer state to keep on the host, whether to offload the layers' module inputs.

One function, :func:`cheapest`, makes the choice for every caller: the stage tables (for every
layer count at once, on the tables' linear memory model), the local search (for one stage, on
the exact memory model, :func:`cheapest_for_stage`) and the baseline (on menus restricted to
what plain Megatron expresses). A caller lists the options of a :class:`Menu` (recompute and
module inputs; :func:`menu_options`) with the memory each needs and its seconds; for each
option :func:`option_costs` finds the least optimizer-state fraction that makes it fit (in
steps of 1 / :data:`OFFLOAD_STEPS`, where the menu allows offload) and adds that fraction of the
offload's cost, and :func:`pick` takes the cheapest option; ties go to the earlier option. An
option's cost does not depend on the others, so the tables cost all their options once and
pick each menu's from them.

Over the options "full recompute of ``k`` layers" for every ``k`` with its least fraction, the
pick is the cheapest pair of (recompute, fraction) that fits: for each fraction, the fewest
layers that fit it are among the options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from weakref import WeakKeyDictionary

import numpy as np

from ..cost.model import CostModel
from ..cost.stage import StageShape
from ..plan import Offload, Recompute

__all__ = ["OFFLOAD_STEPS", "Menu", "Option", "Policy", "Pick", "menu_options", "option_costs",
           "pick", "leading", "cheapest",
           "cheapest_for_stage", "timing_position"]

OFFLOAD_STEPS = 20
"""Optimizer-state fractions are offloaded in steps of 1/20 (5 %)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Menu:
    """The memory policies a stage may take; no recompute is always one."""

    full_recompute: bool = True
    """Full recompute of any number of the stage's layers (Megatron's ``block`` method; all of
    them as ``uniform`` groups of one: :meth:`~megatron_hetero.plan.Recompute.full_layers`)."""
    selective_recompute: bool = True
    """Selective recompute (core attention), offered only where attention is unfused: a fused
    kernel stores no ``s x s`` matrices, so there it saves nothing."""
    optimizer_offload: bool = True
    """Part or all of the optimizer state on the host, where the rest does not fit."""
    module_inputs: tuple[bool, ...] = (False, True)
    """The module-input offload settings tried (fine-grained activation offloading)."""


@dataclass(frozen=True, slots=True)
class Option:
    """One recompute and module-input setting of a stage of ``n`` layers, before any
    optimizer offload: ``layers`` of full recompute (0: none), or selective recompute."""

    layers: int = 0
    selective: bool = False
    module_inputs: bool = False

    def recompute(self, n: int) -> Recompute:
        """The plan's recompute of this option on a stage of ``n`` layers."""
        if self.selective:
            return Recompute(granularity="selective")
        return Recompute.full_layers(self.layers, of=n)


@dataclass(frozen=True, slots=True)
class Policy:
    """A stage's memory policy, as the plan writes it."""

    recompute: Recompute
    offload: Offload


@dataclass(frozen=True, slots=True)
class Pick:
    """:func:`cheapest`'s answer: per entry of the leading axes, the index of the option
    chosen, the optimizer fraction it offloads and its seconds with that offload (``inf``:
    nothing fits; the index is then meaningless)."""

    index: np.ndarray
    fraction: np.ndarray
    seconds: np.ndarray


def menu_options(menu: Menu, *, max_layers: int, unfused_attention: bool) -> tuple[Option, ...]:
    """The options of ``menu`` for stages of up to ``max_layers`` layers, in the order ties
    are broken: per module-input setting, no recompute, full recompute of 1, 2, ... layers,
    then selective recompute."""
    return _menu_options(menu, max_layers, unfused_attention)


@lru_cache(maxsize=1024)
def _menu_options(menu: Menu, max_layers: int, unfused_attention: bool) -> tuple[Option, ...]:
    out = []
    for mi in menu.module_inputs:
        out.append(Option(module_inputs=mi))
        if menu.full_recompute:
            out += [Option(layers=k, module_inputs=mi) for k in range(1, max_layers + 1)]
        if menu.selective_recompute and unfused_attention:
            out.append(Option(selective=True, module_inputs=mi))
    return tuple(out)


def option_costs(memory: np.ndarray, seconds: np.ndarray, *, optimizer: np.ndarray,
                 capacity: float, offload_seconds: np.ndarray,
                 optimizer_offload: bool) -> tuple[np.ndarray, np.ndarray]:
    """What each option costs, entry by entry: (the optimizer fraction it offloads, its
    seconds with that offload; ``inf``: it does not fit).

    ``memory``: bytes each option needs with all its optimizer state on the device (``inf``:
    not an option here); ``seconds``: its cost without offload; ``optimizer``: the bytes of
    optimizer state, ``offload_seconds`` what offloading all of it adds to the cost (both
    broadcast against the leading axes). An option that does not fit offloads the least
    fraction, in steps of 1 / :data:`OFFLOAD_STEPS`, that makes it fit, where
    ``optimizer_offload`` allows; it costs ``seconds + fraction x offload_seconds``."""
    if not optimizer_offload:
        return np.zeros(memory.shape), np.where(memory <= capacity, seconds, np.inf)
    optimizer = np.asarray(optimizer, dtype=float)[..., None]
    offload_seconds = np.asarray(offload_seconds, dtype=float)[..., None]
    fits = memory <= capacity
    # in place, each entry by the same operations as
    # fraction = ceil((memory - capacity) (1 + 1e-9) / optimizer x STEPS) / STEPS
    fraction = memory - capacity
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction *= 1 + 1e-9
        fraction /= optimizer
        fraction *= OFFLOAD_STEPS
        np.ceil(fraction, out=fraction)
        fraction /= OFFLOAD_STEPS
        np.copyto(fraction, 0.0, where=fits)
        ok = memory - fraction * optimizer <= capacity
        ok &= fraction <= 1.0
        ok &= optimizer > 0
        ok |= fits
        # entries that are not ok (an infinite fraction times 0 s among them) are dropped
        cost = fraction * offload_seconds
        cost += seconds
    bad = ~ok
    np.copyto(cost, np.inf, where=bad)
    np.copyto(fraction, 0.0, where=bad)
    return fraction, cost


def pick(fraction: np.ndarray, cost: np.ndarray) -> Pick:
    """The cheapest option along the last axis of :func:`option_costs`' answer; ties go to
    the earlier option."""
    if cost.shape[-1] == 0:  # an empty menu: nothing fits
        lead = cost.shape[:-1]
        return Pick(index=np.zeros(lead, dtype=np.int64), fraction=np.zeros(lead),
                    seconds=np.full(lead, np.inf))
    index = np.argmin(cost, axis=-1)
    lead = (*leading(index.shape), index)
    return Pick(index=index, fraction=fraction[lead], seconds=cost[lead])


@lru_cache(maxsize=256)
def leading(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The indices of every entry of an array of ``shape``, one array per axis, each
    broadcasting against the others (``np.indices(shape, sparse=True)``; read-only, shared):
    with an index along a last axis, they pick one entry per row."""
    got = np.indices(shape, sparse=True)
    for axis in got:
        axis.flags.writeable = False
    return tuple(got)


def cheapest(memory: np.ndarray, seconds: np.ndarray, *, optimizer: np.ndarray,
             capacity: float, offload_seconds: np.ndarray, optimizer_offload: bool) -> Pick:
    """The cheapest option that fits, along the last axis: :func:`pick` of
    :func:`option_costs` (arguments as there)."""
    return pick(*option_costs(memory, seconds, optimizer=optimizer, capacity=capacity,
                              offload_seconds=offload_seconds,
                              optimizer_offload=optimizer_offload))


@lru_cache(maxsize=4096)
def _settings(menu: Menu, n: int, unfused: bool) -> tuple[tuple[Recompute, Offload], ...]:
    """The recompute and offload (before optimizer offload) of each of ``menu``'s options on a
    stage of ``n`` layers (:func:`menu_options`), built once."""
    return tuple((o.recompute(n), Offload(module_inputs=o.module_inputs))
                 for o in _menu_options(menu, n, unfused))


def timing_position(position: StageShape) -> StageShape:
    """A position with the same seconds per micro-batch and optimizer step as ``position``,
    the same for all positions alike: a stage's times depend on its place only through
    whether it is first or last (every stage of a pipeline pays the pipeline overhead), not
    on its micro-batches, group or warm-up; its optimizer step depends on its data-parallel
    size, which is set to 1 here (callers that need it set it back)."""
    first, last = position.first, position.last
    p, s = (1, 0) if first and last else (2, 0) if first else (2, 1) if last else (3, 1)
    return position.but(pipeline_size=p, stage=s, num_microbatches=1, microbatch_group=None,
                        warmup_microbatches=None, data_parallel_size=1)


_OPTION_SECONDS: WeakKeyDictionary[CostModel, dict] = WeakKeyDictionary()
"""Per cost model, :func:`_option_seconds` by timing position and menu."""


def _option_seconds(cost: CostModel, shape: StageShape, menu: Menu,
                    settings: tuple[tuple[Recompute, Offload], ...]) -> list[float]:
    """The seconds of one micro-batch's forward and backward on ``shape`` under each of
    ``settings`` (``menu``'s on the stage's layers): the cost model's, kept per
    :func:`timing_position`, which the stage positions of one place share (the local search
    asks for every middle stage of a pipeline). :meth:`CostModel.times` costs the stage as a
    whole, so an interleaved stage's chunks are one chunk of its layers here (the climb moves
    layers between chunks)."""
    timing = timing_position(shape)
    if timing.virtual_size > 1:
        timing = timing.but(chunk_layers=(timing.num_layers,))
    memo = _OPTION_SECONDS.get(cost)
    if memo is None:
        memo = _OPTION_SECONDS[cost] = {}
    key = (timing, menu)
    got = memo.get(key)
    if got is None:
        got = memo[key] = [cost.times(timing.but(recompute=recompute, offload=offload)).total_s
                           for recompute, offload in settings]
    return got


def cheapest_for_stage(cost: CostModel, shape: StageShape, menu: Menu) -> Policy | None:
    """The cheapest policy of ``menu`` that fits ``shape`` (its recompute and offload are
    replaced) under the exact memory model, by its seconds per step: the replica's
    micro-batches through the stage plus the offloaded optimizer's extra step. None: nothing
    fits.

    An option costs at least its seconds without offload, so one whose seconds are no less
    than those of an earlier option that fits without offload can be neither cheaper nor, ties
    going to the earlier option, picked: its memory (the expensive part) is not asked, and
    :func:`cheapest` sees it as not an option. The pick is the same as over every option."""
    n, m = shape.num_layers, shape.num_microbatches
    unfused = not cost.uses_flash_attention(shape.device_type)
    settings = _settings(menu, n, unfused)
    capacity = cost.capacity(shape.device_type)
    mems, secs = [], []
    bound = math.inf  # the seconds of the cheapest option so far that fits without offload
    for (recompute, offload), total in zip(settings, _option_seconds(cost, shape, menu,
                                                                     settings)):
        seconds = m * total
        memory = math.inf
        if seconds < bound:
            memory = cost.memory_of(shape, shape.chunk_layers, recompute, offload).total
            if memory <= capacity:
                bound = seconds
        mems.append(memory)
        secs.append(seconds)
    plain = shape.but(offload=Offload())
    best = cheapest(np.array(mems, dtype=float), np.array(secs, dtype=float),
                    optimizer=cost.memory(plain).optimizer, capacity=capacity,
                    offload_seconds=cost.optimizer_offload_seconds(plain),
                    optimizer_offload=menu.optimizer_offload)
    if not np.isfinite(best.seconds):
        return None
    recompute, offload = settings[int(best.index)]
    return Policy(recompute=recompute,
                  offload=Offload(optimizer_fraction=float(best.fraction),
                                  module_inputs=offload.module_inputs))
