"""Which RNG state each replica of an uneven plan gets back from a checkpoint
(``runtime/replica_rng.py``; the runs: ``test_launch.py::test_dropout_resume_and_change_of_plan``)."""

from __future__ import annotations

from megatron_hetero.runtime.replica_rng import own_rng_state_first


def test_each_replica_gets_its_own_state_from_a_checkpoint_of_as_many_replicas():
    for rank in range(3):
        loaded = {"rng_state": ["r0", "r1", "r2"], "model": {}}
        own_rng_state_first(loaded, rank=rank, size=3)
        assert loaded == {"rng_state": [f"r{rank}"], "model": {}}


def test_another_number_of_replicas_or_one_state_is_left_to_megatron():
    for states, size in ((["r0", "r1"], 3), (["r0"], 2), (["r0", "r1"], 1)):
        loaded = {"rng_state": list(states)}
        own_rng_state_first(loaded, rank=size - 1, size=size)
        assert loaded == {"rng_state": states}  # Megatron then restores entry 0
    for loaded in ({}, {"rng_state": {"(0, 0)": ["r0", "r1"]}}):  # no list: nothing to choose
        before = {k: v for k, v in loaded.items()}
        own_rng_state_first(loaded, rank=1, size=2)
        assert loaded == before
