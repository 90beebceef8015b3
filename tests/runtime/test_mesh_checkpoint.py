"""The sharding check of a mesh plan's checkpoint (``runtime/mesh_checkpoint.py``) on
megatron-core's own ``ShardedTensor`` (no process group): a stacked-layer tensor whose layers
1-2 are whole (TP 1) and layers 3-4 split over two tensor ranks (TP 2) passes; a missing piece
or a piece held twice is refused, as Megatron's own check refuses them on one grid."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.validation import _validate_sharding_for_key  # noqa: E402

from megatron_hetero.runtime.mesh_checkpoint import check_mixed_grids  # noqa: E402

check = check_mixed_grids(_validate_sharding_for_key)


def _piece(layer: int, tp_rank: int, tp: int, *, replica: int = 0):
    """Layer ``layer`` of 4 stacked ``[16, 16]`` weights, split on its last dimension."""
    return ShardedTensor.from_rank_offsets(
        "decoder.layers.w", torch.zeros(16, 16 // tp), (0, layer, 4), (2, tp_rank, tp),
        replica_id=(0, 0, replica), prepend_axis_num=1)


def _mesh_plan_pieces():
    pieces = [_piece(0, 0, 1), _piece(1, 0, 1)]
    pieces += [_piece(layer, t, 2) for layer in (2, 3) for t in (0, 1)]
    return list(enumerate(pieces))


def test_two_grids_covering_the_tensor_pass():
    pieces = _mesh_plan_pieces()
    with pytest.raises(AssertionError):  # Megatron's own check: one grid per key
        _validate_sharding_for_key(pieces)
    assert check(pieces) == []


def test_a_missing_piece_is_refused():
    errors = check(_mesh_plan_pieces()[:-1])
    assert len(errors) == 1 and "hold 896 of 1024 elements" in str(errors[0])


def test_a_piece_held_twice_is_refused():
    pieces = _mesh_plan_pieces()
    pieces.append((len(pieces), _piece(2, 1, 2)))
    errors = check(pieces)
    assert len(errors) == 1 and "Invalid access pattern" in str(errors[0])


def test_a_data_parallel_copy_is_no_second_holder():
    pieces = _mesh_plan_pieces()
    pieces.append((len(pieces), _piece(2, 1, 2, replica=1)))  # a second replica: not main
    assert check(pieces) == []


def test_one_grid_gets_megatrons_own_check():
    pieces = [(t, _piece(layer, t, 2)) for layer in range(4) for t in (0, 1)]
    assert not check(pieces)  # Megatron's answer ([] on 0.17, None on 0.16)
    assert check(pieces) == _validate_sharding_for_key(pieces)
