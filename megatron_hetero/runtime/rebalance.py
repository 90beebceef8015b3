"""Live rebalancing in the runtime (``--hetero-rebalance``): the replicas' micro-batch shares
move between global batches when the telemetry sees a replica drift from the plan.

Rank 0 decides at each report (:class:`~megatron_hetero.telemetry.rebalance.Rebalancer`) and
the decision reaches every rank in the telemetry's own gloo group. A new split runs from step
``report + 1 + lookahead``: every replica's sampler reads its new slice from that step's global
batch (:meth:`~.sampler.HeteroBatchSampler.switch`), and from that step on the backend runs the
new micro-batch counts. ``lookahead`` is 0 when the data loader reads on demand
(``--num-workers 0``) and covers its prefetch otherwise. Per-token loss
(``--calculate-per-token-loss``, turned on here) keeps every split exact.
"""

from __future__ import annotations

import math
import sys

from ..errors import HeteroError
from ..telemetry.rebalance import (Rebalancer, RebalancePolicy, check_rebalanceable,
                                   with_shares)
from ..telemetry.records import RebalanceNote, StepRecord

__all__ = ["LiveShares", "PREFETCH_FACTOR"]

PREFETCH_FACTOR = 2
"""Micro-batches each data-loader worker reads ahead (torch's default, which the replica's
loader keeps)."""


class LiveShares:
    """One rank's side of live rebalancing (made by :meth:`start`)."""

    def __init__(self, *, backend, policy: RebalancePolicy, num_workers: int):
        self.backend, self.num_workers = backend, num_workers
        self.rebalancer = Rebalancer(policy=policy)
        self.pending = None  # (first step, plan)

    @classmethod
    def start(cls, args, backend, *, source: str) -> "LiveShares | None":
        if not getattr(args, "hetero_rebalance", False):
            return None
        if not getattr(args, "hetero_telemetry", None):
            raise HeteroError("--hetero-rebalance acts on the telemetry's reports; give "
                              "--hetero-telemetry DIR too")
        check_rebalanceable(backend.state.plan, source=source)
        policy = RebalancePolicy(
            threshold=getattr(args, "hetero_rebalance_threshold", None) or 1.15,
            patience=getattr(args, "hetero_rebalance_patience", None) or 2)
        if not getattr(args, "calculate_per_token_loss", False):
            args.calculate_per_token_loss = True  # shares that differ stay exact
            if getattr(args, "rank", 0) == 0:
                print("megatron-hetero: --hetero-rebalance turns on --calculate-per-token-loss",
                      flush=True)
        backend.live_shares = True
        backend.eval_plan = backend.state.plan  # evaluation keeps the start's shares
        return cls(backend=backend, policy=policy,
                   num_workers=getattr(args, "num_workers", 0) or 0)

    def lookahead(self) -> int:
        """Global batches the data loader may have started beyond the current one."""
        if self.num_workers == 0:
            return 0
        least = min(p.num_microbatches for p in self.backend.state.plan.pipelines)
        return 1 + math.ceil(PREFETCH_FACTOR * self.num_workers / least)

    def decide(self, record: StepRecord) -> RebalanceNote | None:
        """Rank 0: the decision at this report, or None."""
        return self.rebalancer.note(self.backend.state.plan, record, lookahead=self.lookahead())

    def schedule(self, note: RebalanceNote | None, *, rank: int) -> None:
        """Every rank: take rank 0's decision (switch this replica's sampler now, its
        micro-batches at the decided step)."""
        if note is None:
            return
        if rank == 0:
            print(f"megatron-hetero rebalance: {note.message}"
                  + (f"; from step {note.from_step}" if note.from_step else ""),
                  file=sys.stderr, flush=True)
        if note.shares is None:
            return
        backend = self.backend
        plan = with_shares(backend.state.plan, note.shares, source=backend.state.plan_path)
        offset, _ = plan.replica_sample_range(backend.state.slot.pipeline)
        pipe = plan.pipelines[backend.state.slot.pipeline]
        if backend.train_sampler is not None:
            backend.train_sampler.switch(from_batch=note.from_step - 1, offset=offset,
                                         num_microbatches=pipe.num_microbatches)
        self.pending = (note.from_step, plan)

    def before_step(self, step: int):
        """At the start of Megatron's step ``step``: the plan it runs if it changes now."""
        if self.pending is None or step < self.pending[0]:
            return None
        plan = self.pending[1]
        self.pending = None
        self.backend.state.plan = plan
        return plan
