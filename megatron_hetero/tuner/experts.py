"""Expert parallelism in the search: which (EP, expert TP) grids a structure can run (its
micro-batch shares keep every expert block's replicas on one count:
:func:`megatron_hetero.schedule.shares.fill_shares`).

An MoE model's structures carry an expert-parallel size (``Structure.ep``) and an expert
tensor-parallel size (``Structure.etp``): the tables price its stages with the all-to-alls over
the EP group's link, the expert-TP gathers and the experts sharded over both
(:mod:`megatron_hetero.cost.experts`), so EP and ETP are weighed together with TP, the stage
count and types, the layer split and the data-parallel shares. A larger EP holds fewer experts
per rank (less memory, so fewer recomputed layers or more micro-batches in flight) and pays
all-to-alls over a wider, and past one node slower, group; a larger ETP shards each expert
inside the tensor group instead, and pays gathers over NVLink.

Expert TP is a size ``validate`` accepts that stays inside a tensor group (a divisor of TP and
of the experts' FFN size; 1 with biases): ``etp * ep`` ranks form one expert block, which
covers whole tensor groups or fits in one. It is offered where it pays: at EP 1, Megatron's
default (ETP = TP: each expert split over the tensor group); past EP 1, expert TP 1 (EP takes
the tensor ranks, Megatron's common choice) up to the largest block EP alone reaches, and
beyond it, at the least expert TP, the blocks only expert TP reaches (Mixtral's 8 experts over
16 ranks at EP 8 x ETP 2: each rank holds half an expert). Below that largest block a larger
ETP at the same block size ``B`` holds the same expert memory and FLOPs per rank and trades
all-to-all bytes, ``(ep - 1) / ep`` of the routed bytes over the block's slowest link, for
``etp - 1`` times them gathered over NVLink: raising ETP from ``e`` to ``c e`` saves
``(c - 1) / B`` of the bytes on the slow link and costs at least ``c - 1`` of them on NVLink,
so it pays only where NVLink is more than ``B`` times faster than the block's slowest link:
never inside a node, and past one node (``B > 8``) rarely.

The stage tables price a stage of ``n`` layers as ``n`` mean layers (the model's share of MoE
layers); where a model mixes MoE and dense layers, the layer split weighs each stage by its own
layers (:func:`split_scale`), and the plans it gives are simulated stage by stage at their own
mix (:attr:`~megatron_hetero.cost.stage.StageShape.moe_layers`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import models as M
from ..plan import ModelSpec

__all__ = ["expert_grids", "expert_sizes", "block_replicas", "split_scale"]


def expert_tp_sizes(model: ModelSpec, tp: int) -> list[int]:
    """Expert TP sizes a structure of TP ``tp`` may run (module docstring): divisors of ``tp``
    that divide the experts' FFN size, only 1 with biases."""
    if model.add_bias_linear:
        return [1]
    return [e for e in range(1, tp + 1) if tp % e == 0 and model.expert_ffn_hidden_size % e == 0]


def block_replicas(tp: int, ep: int, etp: int | None) -> int:
    """The replicas one expert block (``etp x ep`` ranks; ETP None: TP) spans: they run one
    micro-batch count."""
    return max(1, (tp if etp is None else etp) * ep // tp)


def expert_grids(model: ModelSpec, tp: int, templates,
                 microbatches: int) -> list[tuple[int, int | None]]:
    """The (EP, expert TP) grids a structure of TP ``tp`` and these templates can run; expert
    TP None where it is TP, Megatron's default (``[(1, None)]`` for a dense model): EP a
    divisor of ``num_experts``, expert TP one of :func:`expert_tp_sizes`, their block of
    ``etp x ep`` ranks covering whole tensor groups or fitting in one and never straddling two
    templates (each template's pipelines form whole blocks), so that the replicas of one block
    can take one micro-batch count (the search shares them by block); the ``microbatches``
    must split evenly over the blocks (0: replicas alike, nothing to split); expert TP where it
    pays (module docstring). The bound is the same for every grid (the
    all-to-alls are left out of it): the search weighs them."""
    if not model.is_moe:
        return [(1, None)]
    fits = []  # (block, etp, ep) of every grid that runs
    for ep in range(1, model.num_experts + 1):
        if model.num_experts % ep:
            continue
        for etp in expert_tp_sizes(model, tp):
            block = etp * ep
            if (block > tp and block % tp) or (block < tp and tp % block):
                continue
            g = max(1, block // tp)
            if all(n % g == 0 for _, n in templates) and microbatches % g == 0:
                fits.append((block, etp, ep))
    widest = max((b for b, etp, ep in fits if etp == 1 and ep > 1), default=0)
    out, beyond = [], {}
    for block, etp, ep in sorted(fits):
        if (ep == 1 and etp == tp) or (ep > 1 and etp == 1):
            out.append((ep, None if etp == tp else etp))
        elif ep > 1 and block > widest and block not in beyond:
            beyond[block] = (ep, None if etp == tp else etp)  # the least ETP: sorted by it
    return out + list(beyond.values())


def expert_sizes(model: ModelSpec, tp: int, templates, microbatches: int) -> list[int]:
    """The expert-parallel sizes of :func:`expert_grids`, each once."""
    return sorted({ep for ep, _ in expert_grids(model, tp, templates, microbatches)})


def split_scale(model: ModelSpec) -> np.ndarray | None:
    """For :func:`megatron_hetero.schedule.split.min_max_split`: per (layers so far ``l``, a
    stage's layers ``n``) its layers' forward FLOPs over ``n`` mean layers' (MoE and dense
    layers by their own FLOPs);
    None where the layers are alike (a dense model, or MoE layers throughout)."""
    pattern = model.moe_layer_pattern
    if not model.is_moe or all(pattern):
        return None
    moe = M.layer_forward_flops(dataclasses.replace(model, moe_layer_freq=1), 1)
    dense = M.layer_forward_flops(M.mixed_model(model, 0, 1), 1)
    mean = M.layer_forward_flops(model, 1)
    prefix = np.concatenate([[0.0], np.cumsum([moe if x else dense for x in pattern])])
    L = model.num_layers
    ends = np.arange(L + 1)[:, None]
    sizes = np.arange(1, L + 1)[None, :]
    starts = np.clip(ends - sizes, 0, None)
    out = (prefix[ends] - prefix[starts]) / (sizes * mean)
    out[ends < sizes] = 1.0  # a stage longer than the layers so far: never read
    return out
