"""The RNG state of every replica of an uneven plan in Megatron's checkpoints.

Megatron seeds every data-parallel replica alike (``seed + 100 x pipeline rank``, unless
``--data-parallel-random-init``) and its replicas run the same micro-batches, so their RNG states
stay equal and a checkpoint keeps one per pipeline and tensor rank (data-parallel rank 0's),
which every replica gets back on resume. The replicas of an uneven plan run different
micro-batch counts and sizes: their dropout draws different amounts, their states part, and
replica 0's state given to all would change the masks of the others after a resume.

:func:`replicas_rng_state` keeps the list of every replica's state instead (the list Megatron
itself keeps with ``--data-parallel-random-init``: entry 0 is replica 0's, so Megatron without
the plugin reads it as its own); :func:`own_rng_state_first` puts this replica's entry first in
a loaded checkpoint, which Megatron then restores. A checkpoint saved with another number of
replicas (a change of plan) is left as it is: every replica gets entry 0, as in Megatron.
"""

from __future__ import annotations

__all__ = ["replicas_rng_state", "own_rng_state_first"]


def replicas_rng_state(saved, group):
    """``saved`` (what Megatron's ``get_rng_state`` returned: the list of this rank's state, or
    its ``torch_dist`` object holding that list) holding the states of every rank of the
    data-parallel ``group``, in rank order (a collective of ``group``)."""
    import torch.distributed as dist

    states = getattr(saved, "data", saved)
    if not isinstance(states, list) or len(states) != 1 or dist.get_world_size(group) == 1:
        return saved  # already gathered (--data-parallel-random-init), or one replica
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, states[0], group=group)
    if hasattr(saved, "data"):
        saved.data = gathered
        return saved
    return gathered


def own_rng_state_first(state_dict, *, rank: int, size: int) -> None:
    """In a loaded checkpoint's ``state_dict``: the RNG state list of ``size`` replicas
    becomes this replica's (``rank``) alone; any other list is left as it is."""
    states = state_dict.get("rng_state") if isinstance(state_dict, dict) else None
    if isinstance(states, list) and len(states) == size > 1:
        state_dict["rng_state"] = [states[rank]]
