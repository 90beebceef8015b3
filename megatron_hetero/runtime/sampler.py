"""Uneven data parallelism: each replica reads exactly its share of every global batch.

Global batch ``k`` is samples ``[k*G, (k+1)*G)`` of the dataset (``G`` = global batch size),
as in Megatron's own ``MegatronPretrainingSampler``. Replica ``d`` reads the consecutive slice
``Plan.replica_sample_range(d)`` of it, cut into its own micro-batches. Over all replicas every
sample of every full global batch is read exactly once; a job resumed from ``consumed_samples``
(a multiple of ``G``) continues with global batch ``consumed_samples / G``.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def __len__(self) -> int:
        """Micro-batches left."""
        batches = (self.total_samples - self.consumed_samples) // self.global_batch_size
        return max(batches, 0) * self.num_microbatches

    def __iter__(self) -> Iterator[list[int]]:
        g, mbs = self.global_batch_size, self.micro_batch_size
        start = self.consumed_samples
        while start + g <= self.total_samples:  # full global batches only, like drop_last
            first = start + self.offset
            for m in range(self.num_microbatches):
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
