"""The CPU trainer's synthetic dataset: which samples each replica reads, and their tokens.

Sample ``i`` (global index ``step * global_batch_size + position``) is ``seq_length + 1`` tokens
drawn from a generator seeded with ``(seed, i)``. A replica reads its own consecutive share of
the global batch (the replicas in data-parallel rank order, as the runtime's sampler reads
them), except in a chain of meshes whose replicas are alike (:func:`rows_joined`), where
micro-batch ``m`` of a step is positions ``m B .. (m + 1) B - 1`` (``B = D x micro_batch_size``)
and replica ``r`` takes rows ``r b .. (r + 1) b - 1`` of it.
"""

from __future__ import annotations

from ..plan import Plan, Slot

__all__ = ["rows_joined", "sample_tokens", "share_offset", "sample_index", "micro_batches"]


def rows_joined(plan: Plan) -> bool:
    """Whether the plan's replicas read their micro-batches row by row out of micro-batches of
    ``D x micro_batch_size`` (a chain of meshes whose replicas are alike: its bridges join and
    split them so), rather than each its own consecutive share of the global batch."""
    return not plan.one_grid and not plan.per_token_loss


def sample_tokens(index: int, seed: int, seq_length: int, vocab_size: int):
    """Sample ``index`` of the synthetic dataset: ``seq_length + 1`` token ids."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(0, vocab_size, (seq_length + 1,), generator=g)


def share_offset(plan: Plan, slot: Slot) -> int:
    """The first position of ``slot``'s replica's consecutive share of every global batch: its
    mesh's replicas take consecutive shares in data-parallel rank order
    (``Plan.replica_sample_range`` on one grid)."""
    return sum(p.samples for p in plan.meshes[slot.mesh].pipelines[:slot.replica])


def sample_index(plan: Plan, slot: Slot, step: int, micro: int, row: int) -> int:
    """The global sample index of row ``row`` of micro-batch ``micro`` that ``slot``'s replica
    reads in step ``step`` (see the module docstring)."""
    mesh = plan.meshes[slot.mesh]
    b = mesh.pipelines[slot.replica].micro_batch_size
    base = step * plan.global_batch_size
    if rows_joined(plan):
        return base + micro * mesh.data_parallel_size * b + slot.replica * b + row
    return base + share_offset(plan, slot) + micro * b + row


def micro_batches(plan: Plan, slot: Slot, step: int, seed: int):
    """The micro-batches ``slot``'s replica reads in step ``step`` (:func:`sample_index`), as
    the batches ``forward_step`` takes (every stage reads them: the first its tokens, the last
    its labels)."""
    import torch
    m = plan.model
    pipe = plan.meshes[slot.mesh].pipelines[slot.replica]
    for k in range(pipe.num_microbatches):
        rows = [sample_tokens(sample_index(plan, slot, step, k, j), seed, m.seq_length,
                              m.vocab_size) for j in range(pipe.micro_batch_size)]
        tokens = torch.stack(rows)
        yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
               "loss_mask": torch.ones(len(rows), m.seq_length),
               "position_ids": torch.arange(m.seq_length).unsqueeze(0).expand(len(rows), -1)}
