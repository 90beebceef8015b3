"""Faults the tests inject into the rehearsal's rank processes (product code has no switch for
them). The rehearsal's ``hooks_factory`` runs inside each rank, and the rank imports it by name,
so a test that replaces ``megatron_hetero.emulate.rehearse.rehearsal_hooks`` with a
``functools.partial`` of a function here gets that function run in every rank."""

from __future__ import annotations

from megatron_hetero.emulate import rank_hooks, trainer


def hooks_with_wrong_labels(plan, rank, *, wrong_replica: int, **kwargs):
    """The rehearsal's own hooks, and data-parallel replica ``wrong_replica`` reads wrong labels
    from step 1 on (so that ``--verify`` has a real divergence to catch)."""
    original = getattr(trainer.micro_batches, "_test_original", trainer.micro_batches)

    def micro_batches(plan, slot, step, seed):
        for batch in original(plan, slot, step, seed):
            if slot.replica == wrong_replica and step >= 1:
                batch = dict(batch, labels=(batch["labels"] + 1) % plan.model.vocab_size)
            yield batch

    micro_batches._test_original = original
    trainer.micro_batches = micro_batches
    return rank_hooks.rehearsal_hooks(plan, rank, **kwargs)
