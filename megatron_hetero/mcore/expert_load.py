"""The tokens megatron-core's router sends to each expert, counted on one rank while the
telemetry measures a step (:class:`ExpertTokenCounter`; the runtime's and the rehearsal's
telemetry attach one to an MoE model's chunks).

A forward hook on every router (``megatron.core.transformer.moe.router.Router``: top-k and its
subclasses) adds the router's routing map summed over the tokens (``routing_map.sum(0)``,
``[num_experts]``: the tokens this rank routed to each expert, after any capacity drop) to a
per-layer tensor on the routing map's device. Nothing is read back inside the step (on a GPU
the sum is queued like any kernel); :meth:`ExpertTokenCounter.take` reads the counts once the
step is over, as the telemetry's CUDA-event clock reads its marks. Only forwards with autograd
on are counted: a recomputed layer routes its tokens twice, first without autograd (inside
the activation checkpoint) and again in the backward, and is counted once.

A layer is numbered as megatron-core numbers it on a one-grid plan, from 1 over the whole
model: its index in its chunk's ``decoder.layers`` past the chunk's first layer in the model
(:meth:`~megatron_hetero.plan.Plan.chunk_first_layers`, handed in), plus 1. (The router's own
``layer_number`` is that only where megatron-core knows the pipeline offset; a chain of meshes
builds each chunk as a model of its own.)
"""

from __future__ import annotations

import re

__all__ = ["ExpertTokenCounter"]


_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
"""A router's place in its chunk's decoder (multi-token prediction's layers are not counted)."""


class ExpertTokenCounter:
    """Counts the tokens routed to each expert of each MoE layer of a rank's model chunks while
    :attr:`armed` (``model_chunks``: what megatron-core's schedules run, in chunk order;
    ``first_layers``: the model's index of each chunk's first layer; a dense model has no
    router and :attr:`routers` is 0)."""

    def __init__(self, model_chunks, first_layers: list[int]):
        from megatron.core.transformer.moe.router import Router

        self.armed = False
        """Whether forwards are counted now (the telemetry arms it for a measured step)."""
        self._counts: dict[int, object] = {}
        self._layers: dict[int, int] = {}  # id(router) -> its layer (from 1)
        self._handles = []
        for chunk, first in zip(model_chunks, first_layers, strict=True):
            for name, module in chunk.named_modules():
                place = _LAYER.search(name)
                if isinstance(module, Router) and place:
                    self._layers[id(module)] = first + int(place.group(1)) + 1
                    self._handles.append(module.register_forward_hook(self._routed))

    @property
    def routers(self) -> int:
        """The routers counted (the MoE layers on this rank)."""
        return len(self._handles)

    def _routed(self, router, args, output) -> None:
        import torch

        if not self.armed or not torch.is_grad_enabled():
            return
        counts = output[1].sum(dim=0)  # routing_map [tokens, experts] -> per expert
        layer = self._layers[id(router)]
        have = self._counts.get(layer)
        self._counts[layer] = counts if have is None else have + counts

    def take(self) -> dict[int, list[int]]:
        """Layer -> tokens per expert counted since the last :meth:`take` (reads the device
        tensors: call it after the step), and starts again from none."""
        counts, self._counts = self._counts, {}
        return {layer: [int(n) for n in t.tolist()] for layer, t in sorted(counts.items())}

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
