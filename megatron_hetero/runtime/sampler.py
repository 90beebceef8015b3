"""Uneven data parallelism: each replica reads exactly its share of every global batch.

Global batch ``k`` is samples ``[k*G, (k+1)*G)`` of the dataset (``G`` = global batch size),
as in Megatron's own ``MegatronPretrainingSampler``. Replica ``d`` reads the consecutive slice
``Plan.replica_sample_range(d)`` of it, cut into its own micro-batches. Over all replicas every
sample of every full global batch is read exactly once; a job resumed from ``consumed_samples``
(a multiple of ``G``) continues with global batch ``consumed_samples / G``.

Shares may change between global batches (live rebalancing, :mod:`.rebalance`):
:meth:`HeteroBatchSampler.switch` gives the replica a new slice from a global batch on, and
every replica switches at the same batch, so each sample is still read exactly once. The
sampler computes a batch's slice when it starts that batch, so a switch must name a batch it
has not started (the data loader's prefetch counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..plan import Plan

__all__ = ["HeteroBatchSampler", "sampler_for_replica"]


@dataclass(kw_only=True, slots=True)
class HeteroBatchSampler:
    """Batch sampler of one data-parallel replica: yields lists of dataset indices, one list per
    micro-batch, ``num_microbatches`` micro-batches per global batch."""

    total_samples: int
    """Length of the dataset."""
    consumed_samples: int
    """Samples all replicas together consumed before this sampler starts (a multiple of
    ``global_batch_size``)."""
    global_batch_size: int
    offset: int
    """Where this replica's share starts inside each global batch."""
    micro_batch_size: int
    num_microbatches: int
    """Micro-batches this replica reads per global batch."""
    switches: list[tuple[int, int, int]] = field(default_factory=list)
    """(first global batch, offset, micro-batches) of each change of this replica's slice, in
    order of the batch (:meth:`switch`)."""
    started: int = field(default=-1, init=False)
    """The last global batch the sampler started (-1: none yet)."""

    def __post_init__(self) -> None:
        if self.total_samples < 0:
            raise ValueError(f"total_samples must be >= 0, got {self.total_samples}")
        if self.micro_batch_size < 1 or self.num_microbatches < 1:
            raise ValueError("micro_batch_size and num_microbatches must be positive")
        share = self.micro_batch_size * self.num_microbatches
        if not 0 <= self.offset <= self.global_batch_size - share:
            raise ValueError(f"replica share [{self.offset}, {self.offset + share}) does not fit "
                             f"in a global batch of {self.global_batch_size}")
        if self.consumed_samples < 0 or self.consumed_samples % self.global_batch_size:
            raise ValueError(
                f"consumed_samples ({self.consumed_samples}) must be a non-negative multiple of "
                f"the global batch size ({self.global_batch_size}) to resume an uneven plan")

    def switch(self, *, from_batch: int, offset: int, num_microbatches: int) -> None:
        """From global batch ``from_batch`` on, read ``num_microbatches`` micro-batches from
        ``offset`` of each batch. A batch the sampler has started cannot change."""
        if from_batch <= self.started:
            raise ValueError(f"global batch {from_batch} is already being read (the sampler is "
                             f"at batch {self.started}); switch from a later one")
        if self.switches and from_batch < self.switches[-1][0]:
            raise ValueError("switches must come in order of their batch")
        if num_microbatches < 1 or not 0 <= offset <= self.global_batch_size - \
                num_microbatches * self.micro_batch_size:
            raise ValueError(f"replica share at {offset} of {num_microbatches} micro-batches does "
                             f"not fit in a global batch of {self.global_batch_size}")
        self.switches.append((from_batch, offset, num_microbatches))

    def share(self, batch: int) -> tuple[int, int]:
        """(offset, micro-batches) of this replica in global batch ``batch``."""
        offset, count = self.offset, self.num_microbatches
        for first, o, m in self.switches:
            if batch >= first:
                offset, count = o, m
        return offset, count

    def __len__(self) -> int:
        """Micro-batches left."""
        g = self.global_batch_size
        first, last = self.consumed_samples // g, self.total_samples // g
        if last <= first:
            return 0
        edges = [(first, self.share(first)[1])] + [(b, m) for b, _, m in self.switches
                                                    if first < b < last]
        return sum(m * (end - b) for (b, m), (end, _) in zip(edges, edges[1:] + [(last, 0)]))

    def __iter__(self) -> Iterator[list[int]]:
        g, mbs = self.global_batch_size, self.micro_batch_size
        start = self.consumed_samples
        while start + g <= self.total_samples:  # full global batches only, like drop_last
            self.started = start // g
            offset, count = self.share(self.started)
            first = start + offset
            for m in range(count):
                lo = first + m * mbs
                yield list(range(lo, lo + mbs))
            start += g


def sampler_for_replica(plan: Plan, pipeline: int, *, total_samples: int,
                        consumed_samples: int) -> HeteroBatchSampler:
    """The batch sampler of replica ``pipeline`` of ``plan``."""
    offset, _ = plan.replica_sample_range(pipeline)
    pipe = plan.pipelines[pipeline]
    return HeteroBatchSampler(total_samples=total_samples, consumed_samples=consumed_samples,
                              global_batch_size=plan.global_batch_size, offset=offset,
                              micro_batch_size=pipe.micro_batch_size,
                              num_microbatches=pipe.num_microbatches)
