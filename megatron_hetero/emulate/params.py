"""The CPU trainer's parameters under layout-independent names: initialized alike under every
plan of a model, and gathered back into full tensors.

Layout-independent names: ``decoder.layers.<global layer index>.<rest>``, the embedding, the
final norm and the output layer under their megatron-core names; a routed expert of an MoE
layer under its global index (``...mlp.experts.local_experts.<expert>.<rest>``: the experts of
expert-parallel rank ``e`` are ``e x local .. (e + 1) x local - 1``). Tensor-parallel shards are
gathered along their partition dimension (fused SwiGLU ``linear_fc1`` shards are un-interleaved
as gate and up halves). Each parameter is initialized from a generator seeded by its name, so
any plan of the same model starts from the same weights.
"""

from __future__ import annotations

import zlib
from typing import Any

from ..plan import Plan

__all__ = ["canonical_names", "init_params", "local_params", "merge_params", "merge_shards"]


_EXPERTS = ".mlp.experts.local_experts."


def canonical_names(model, tied_last_stage: bool, *, layer_offset: int = 0,
                    expert_offset: int = 0) -> dict[str, str]:
    """Local parameter name -> layout-independent name (``layer_offset``: the model's layers
    before this one's first, where its layers number from 1: a mesh plan's stage;
    ``expert_offset``: the routed experts of each MoE layer before this rank's first, its
    expert-parallel rank times its local experts)."""
    names = {}
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    for name, _ in model.named_parameters():
        canon = name
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            if rest.startswith(_EXPERTS[1:]):
                expert, tail = rest[len(_EXPERTS) - 1:].split(".", 1)
                rest = f"{_EXPERTS[1:]}{int(expert) + expert_offset}.{tail}"
            canon = f"decoder.layers.{layers[int(local)].layer_number - 1 + layer_offset}.{rest}"
        elif name == "output_layer.weight" and tied_last_stage:
            canon = "embedding.word_embeddings.weight"
        names[name] = canon
    return names


def _is_glu(name: str, plan: Plan) -> bool:
    return plan.model.swiglu and ".mlp.linear_fc1." in name


def _full_shape(param, tp: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return shape


def _shard(full, param, tp: int, tp_rank: int, glu: bool):
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if glu:
        assert dim == 0
        halves = full.view(2, full.shape[0] // 2, *full.shape[1:])
        return halves.chunk(tp, dim=1)[tp_rank].reshape(-1, *full.shape[1:])
    return full.chunk(tp, dim=dim)[tp_rank]


def init_params(model, plan: Plan, seed: int, std: float, tp_rank: int, tied_last: bool, *,
                tensor_parallel_size: int | None = None, layer_offset: int = 0,
                expert_offset: int = 0) -> None:
    """Every parameter of ``model`` (one model chunk, on tensor rank ``tp_rank``) drawn from a
    generator seeded by ``seed`` and its layout-independent name: biases small, norms near 1,
    matrices with standard deviation ``std``; this rank's shard of the full tensor.
    ``tensor_parallel_size`` (default the plan's) and ``layer_offset`` (see
    :func:`canonical_names`) place a mesh plan's stage, ``expert_offset`` an expert-parallel
    rank's experts."""
    import torch
    names = canonical_names(model, tied_last, layer_offset=layer_offset,
                            expert_offset=expert_offset)
    tp = tensor_parallel_size or plan.tensor_model_parallel_size
    with torch.no_grad():
        for name, param in model.named_parameters():
            canon = names[name]
            g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(canon.encode()))
            shape = _full_shape(param, tp)
            if canon.endswith("bias"):
                full = 0.01 * torch.randn(shape, generator=g)
            elif len(shape) == 1:
                full = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                full = std * torch.randn(shape, generator=g)
            param.copy_(_shard(full, param, tp, tp_rank, _is_glu(canon, plan)))


def local_params(models, chunks: list[tuple[bool, bool]], plan: Plan,
                 tied: bool, *, layer_offset: int = 0,
                 expert_offset: int = 0) -> dict[str, tuple[Any, int | None, bool]]:
    """This rank's parameters of its model chunks (``chunks``: (pre, post) of each): name ->
    (tensor copy, tensor-parallel partition dim or None, is fused GLU), without the last stage's
    copy of a shared embedding (``layer_offset``, ``expert_offset``: see
    :func:`canonical_names`)."""
    params = {}
    for model, (pre, post) in zip(models, chunks):
        tied_copy = tied and post and not pre
        names = canonical_names(model, tied_copy, layer_offset=layer_offset,
                                expert_offset=expert_offset)
        for name, p in model.named_parameters():
            if tied_copy and name == "output_layer.weight":
                continue  # the last stage's copy of the shared embedding
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            params[names[name]] = (p.detach().clone(), dim, _is_glu(name, plan))
    return params


def merge_params(plan: Plan, ranks) -> dict[str, Any]:
    """Full parameters by layout-independent name, from the ``RankResult.params`` of data-parallel
    replica 0's ranks (tensor-parallel shards concatenated), and the routed experts that other
    replicas hold (expert parallelism is carved out of data parallelism)."""
    by_name: dict[str, dict[int, tuple]] = {}
    holder: dict[str, int] = {}  # the replica whose copy of a parameter is taken
    for r in sorted(ranks, key=lambda r: r.pipeline):  # replica 0 first
        for name, (tensor, dim, glu) in r.params.items():
            if (r.pipeline == 0 or _EXPERTS in name) and holder.setdefault(name, r.pipeline) \
                    == r.pipeline:
                by_name.setdefault(name, {})[r.tensor_rank] = (tensor, dim, glu)
    return merge_shards(by_name)


def merge_shards(by_name: dict[str, dict[int, tuple]]) -> dict[str, Any]:
    """Full parameters from every tensor rank's shard: ``by_name[name][tensor rank]`` =
    (tensor, partition dim or None, is fused GLU)."""
    import torch
    merged: dict[str, Any] = {}
    for name, shards in by_name.items():
        tp = len(shards)
        tensor, dim, glu = shards[0]
        if dim is None or tp == 1:
            merged[name] = tensor
        elif glu:
            halves = [shards[t][0].view(2, -1, *tensor.shape[1:]) for t in range(tp)]
            full = torch.cat(halves, dim=1)
            merged[name] = full.reshape(-1, *tensor.shape[1:])
        else:
            merged[name] = torch.cat([shards[t][0] for t in range(tp)], dim=dim)
    return merged
