"""What a training script's rank read and computed, for the tests (nothing in the product knows
about it). With ``SAMPLES_LOG`` set, :func:`dump` writes ``$SAMPLES_LOG.<launcher rank>``: the
rank's Megatron rank, its (data-parallel, pipeline, tensor) ranks, ``[iteration, sample index]``
for every sample it read and ``[iteration, lm loss or None, grad norm]`` for every step as
``train_step`` returns them (Megatron's log rounds the norm to 3 decimals, and its second
logged step of a run averages the first two). ``iteration`` counts the steps done before, as
Megatron's ``args.curr_iteration``; the loss is on the last pipeline stage only.

Used by ``pretrain_gpt_recording.py`` (Megatron-LM's own ``pretrain_gpt.py``, mock data) and by
``train_tiny.py`` (the tests' own script, where no Megatron-LM clone is at hand)."""
import json
import os

READ = []
STEPS = []
RANKS = {}


def read(idx) -> None:
    """Record that this rank read sample ``idx`` in the current step."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    if not RANKS:
        RANKS.update(dp=ps.get_data_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                     tp=ps.get_tensor_model_parallel_rank())
    READ.append([int(getattr(get_args(), "curr_iteration", -1)), int(idx)])


def record_steps() -> None:
    """Wrap ``megatron.training.training.train_step`` to record each step's loss and norm."""
    import megatron.training.training as training

    train_step = training.train_step

    def step(*a, **kw):
        result = train_step(*a, **kw)
        from megatron.training import get_args

        losses, norm = result[0], result[5]  # megatron-core 0.17.1: (loss dict, ..., grad norm, ...)
        loss = losses.get("lm loss") if losses else None
        STEPS.append([int(get_args().curr_iteration), None if loss is None else float(loss),
                      None if norm is None else float(norm)])
        return result

    training.train_step = step


def dump() -> None:
    """Write the records where ``SAMPLES_LOG`` says (nothing when it is unset)."""
    out = os.environ.get("SAMPLES_LOG")
    if out:
        launcher = os.environ.get("MEGATRON_HETERO_LAUNCHER_RANK", os.environ["RANK"])
        with open(f"{out}.{launcher}", "w") as f:
            json.dump({"rank": int(os.environ["RANK"]), **RANKS, "read": READ, "steps": STEPS}, f)
