"""Faults the tests inject into the rehearsal's rank processes (product code has no switch for
them). The rehearsal's ``hooks_factory`` runs inside each rank, and the rank imports it by name,
so a test that replaces ``megatron_hetero.emulate.rehearse.rehearsal_hooks`` with a
``functools.partial`` of a function here gets that function run in every rank."""

from __future__ import annotations

from megatron_hetero.emulate import rank_hooks, trainer


def hooks_with_wrong_labels(plan, rank, *, wrong_replica: int, **kwargs):
    """The rehearsal's own hooks, and data-parallel replica ``wrong_replica`` reads wrong labels
    from step 1 on (so that ``--verify`` has a real divergence to catch)."""
    _read_wrong_labels(wrong_replica)
    return rank_hooks.rehearsal_hooks(plan, rank, **kwargs)


def wrong_labels(plan, rank, *, wrong_replica: int):
    """No emulation: data-parallel replica ``wrong_replica`` reads wrong labels from step 1 on
    (the trainer's own hooks otherwise; for :func:`megatron_hetero.emulate.trainer.train_plan`)."""
    _read_wrong_labels(wrong_replica)
    return trainer.RankHooks()


def _read_wrong_labels(wrong_replica: int) -> None:
    """Make this rank's trainer feed replica ``wrong_replica`` labels shifted by one from step 1
    on (the trainer reads ``micro_batches`` by name at every step)."""
    original = getattr(trainer.micro_batches, "_test_original", trainer.micro_batches)

    def micro_batches(plan, slot, step, seed):
        for batch in original(plan, slot, step, seed):
            if slot.replica == wrong_replica and step >= 1:
                batch = dict(batch, labels=(batch["labels"] + 1) % plan.model.vocab_size)
            yield batch

    micro_batches._test_original = original
    trainer.micro_batches = micro_batches


def overflow_on_replica(plan, rank, *, replica: int, step: int):
    """No emulation: data-parallel replica ``replica`` puts an infinity into one gradient
    element of its first model chunk in step ``step`` (after its last backward): fp16's found
    inf must stop every replica's step, not only this one's."""
    import math

    state = {"step": 0, "ddps": None}
    slot = plan.slot_of_rank(rank)

    def on_built(ddps, optimizer):
        state["ddps"] = ddps

    def on_step_end(k, wall_s):
        state["step"] = k + 1

    class Compute:
        def __init__(self, kind):
            self.kind = kind

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            if self.kind == "backward" and slot.replica == replica and state["step"] == step:
                param = next(p for p in state["ddps"][0].parameters() if p.requires_grad)
                param.main_grad.view(-1)[0] = math.inf
            return False

    return trainer.RankHooks(compute=Compute, on_step_end=on_step_end, on_built=on_built)
