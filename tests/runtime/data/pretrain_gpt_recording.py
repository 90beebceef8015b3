"""Megatron-LM's own ``pretrain_gpt.py`` (the file beside this one: the tests copy this wrapper
and ``recording.py`` into the Megatron-LM checkout they extract), run unchanged, while
``recording.py`` records which mock-dataset samples this rank read in which step, and every
step's loss and gradient norm."""
import runpy
import sys
from pathlib import Path

from megatron.core.datasets.gpt_dataset import GPTDataset

import recording

_getitem = GPTDataset.__getitem__


def _recording_getitem(self, idx):
    if idx is not None:
        recording.read(idx)
    return _getitem(self, idx)


GPTDataset.__getitem__ = _recording_getitem

if __name__ == "__main__":
    here = Path(__file__).resolve().with_name("pretrain_gpt.py")
    recording.record_steps()
    recording.record_offload()
    sys.argv[0] = str(here)
    try:
        runpy.run_path(str(here), run_name="__main__")
    finally:  # --exit-interval ends the run with sys.exit
        recording.dump()
