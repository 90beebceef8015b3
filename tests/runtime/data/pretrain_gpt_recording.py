"""Megatron-LM's own ``pretrain_gpt.py`` (the file beside this one: the tests copy this wrapper
into the Megatron-LM checkout they extract), run unchanged, while this wrapper records which
dataset samples this rank read in which training step, and every step's loss and gradient norm
as ``train_step`` returns them (Megatron's log rounds the norm to 3 decimals, and its second
logged step of a run averages the first two). With ``SAMPLES_LOG`` set, each rank writes
``$SAMPLES_LOG.<launcher rank>``: its Megatron rank, its (data-parallel, pipeline, tensor) ranks,
``[iteration, sample index]`` for every sample it read and ``[iteration, lm loss or None,
grad norm]`` for every step (``iteration`` counts the steps done before, as Megatron's
``args.curr_iteration``; the loss is on the last pipeline stage only)."""
import json
import os
import runpy
import sys
from pathlib import Path

from megatron.core.datasets.gpt_dataset import GPTDataset

READ = []
STEPS = []
RANKS = {}
_getitem = GPTDataset.__getitem__


def _recording_getitem(self, idx):
    if idx is not None:
        from megatron.core import parallel_state as ps
        from megatron.training import get_args

        if not RANKS:
            RANKS.update(dp=ps.get_data_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                         tp=ps.get_tensor_model_parallel_rank())
        READ.append([int(getattr(get_args(), "curr_iteration", -1)), int(idx)])
    return _getitem(self, idx)


GPTDataset.__getitem__ = _recording_getitem


def _recording(train_step):
    def step(*a, **kw):
        result = train_step(*a, **kw)
        from megatron.training import get_args

        losses, norm = result[0], result[5]  # megatron-core 0.17.1: (loss dict, ..., grad norm, ...)
        loss = losses.get("lm loss") if losses else None
        STEPS.append([int(get_args().curr_iteration), None if loss is None else float(loss),
                      None if norm is None else float(norm)])
        return result
    return step

if __name__ == "__main__":
    here = Path(__file__).resolve().with_name("pretrain_gpt.py")
    import megatron.training.training as training

    training.train_step = _recording(training.train_step)
    sys.argv[0] = str(here)
    try:
        runpy.run_path(str(here), run_name="__main__")
    finally:  # --exit-interval ends the run with sys.exit
        out = os.environ.get("SAMPLES_LOG")
        if out:
            launcher = os.environ.get("MEGATRON_HETERO_LAUNCHER_RANK", os.environ["RANK"])
            with open(f"{out}.{launcher}", "w") as f:
                json.dump({"rank": int(os.environ["RANK"]), **RANKS, "read": READ,
                           "steps": STEPS}, f)
