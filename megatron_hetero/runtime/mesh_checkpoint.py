"""Megatron's distributed checkpoints (``torch_dist``) of a mesh plan.

A tensor of stacked layers (``decoder.layers.*``, one key for every layer of the model) is
split by each mesh's tensor-parallel size, so its pieces on the ranks of two meshes lie on
two different grids. Megatron's sharding check (``dist_checkpointing.validation``) assumes one
grid per key and asserts every rank's piece has the same shape. Here a key whose pieces differ
is checked grid by grid instead: inside each grid no element is held twice by main replicas, and
the main replicas of all grids together hold exactly the tensor's elements (then torch's DCP
plans the reads and writes as for any uneven sharding). Keys on one grid get Megatron's check.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

__all__ = ["check_mixed_grids"]


def check_mixed_grids(original):
    """``_validate_sharding_for_key`` that accepts a key on several grids (see above)."""
    @functools.wraps(original)
    def _validate_sharding_for_key(rank_sharding):
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from megatron.core.dist_checkpointing.mapping import is_main_replica
        from megatron.core.dist_checkpointing.validation import _compute_shards_access

        shapes = {sh.local_shape for _, sh in rank_sharding}
        if len(shapes) == 1 or not all(sh.has_regular_grid for _, sh in rank_sharding):
            return original(rank_sharding)
        first = rank_sharding[0][1]
        grids = defaultdict(list)
        for rank, sh in rank_sharding:
            if sh.global_shape != first.global_shape or sh.dtype != first.dtype:
                return original(rank_sharding)  # Megatron's own message
            grids[sh.axis_fragmentations].append((rank, sh))
        held = 0
        for shardings in grids.values():
            counts = _compute_shards_access(shardings)
            if int(counts.max()) > 1:
                return [CheckpointingException(f"Invalid access pattern for {first}: {counts}")]
            held += sum(math.prod(sh.local_shape) for _, sh in shardings
                        if is_main_replica(sh.replica_id))
        if held != math.prod(first.global_shape):
            return [CheckpointingException(
                f"Invalid access pattern for {first}: main replicas on {len(grids)} grids hold "
                f"{held} of {math.prod(first.global_shape)} elements")]
        return []
    return _validate_sharding_for_key


def rng_state_per_mesh(original, mesh: int):
    """Megatron's ``get_rng_state``, its ``torch_dist`` object (one per pipeline and tensor rank
    of a ``(PP, TP)`` grid) keyed per mesh: the meshes' grids differ, one key cannot hold them."""
    @functools.wraps(original)
    def get_rng_state(*a, **kw):
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        out = original(*a, **kw)
        if isinstance(out, ShardedObject):
            out.key = f"{out.key}.mesh{mesh}"
        return out
    return get_rng_state
