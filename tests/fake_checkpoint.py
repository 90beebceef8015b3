"""A Megatron-LM ``torch_dist`` checkpoint folder written without torch or Megatron: the files
:mod:`megatron_hetero.launch.checkpoint` reads (tracker, ``metadata.json``, ``common.pt``,
``.metadata``, one ``.distcp``), with the saved arguments given, so that tests can damage any
of them in milliseconds (tests/test_replan.py trains a real one, minutes)."""

from __future__ import annotations

import argparse
import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["ARGS", "write_checkpoint"]

ARGS: dict[str, Any] = dict(
    num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
    group_query_attention=False, num_query_groups=None, vocab_size=1000, padded_vocab_size=1024,
    seq_length=128, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
    untie_embeddings_and_output_weights=True, add_bias_linear=False, global_batch_size=16,
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, bf16=True,
    use_distributed_optimizer=False, make_vocab_size_divisible_by=128, world_size=2)
"""The saved arguments of a small Llama-like model run on 2 GPUs."""


class _Size:
    def __init__(self, shape):
        self.shape = tuple(shape)

    def __reduce__(self):  # as torch.Size pickles: the class and its tuple
        return (_Size, (self.shape,))


class _Meta:
    def __init__(self, **state):
        self.__dict__.update(state)


def write_checkpoint(folder: Path, *, args: dict[str, Any] | None = None, iteration: int = 2,
                     content_metadata: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """Write the checkpoint of ``args`` (default :data:`ARGS`) into ``folder``; saved
    arguments named in ``drop`` are left out."""
    args = dict(ARGS if args is None else args)
    for key in drop:
        args.pop(key, None)
    sub = folder / f"iter_{iteration:07d}"
    sub.mkdir(parents=True, exist_ok=True)
    (folder / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    (sub / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    common = {"args": argparse.Namespace(**args), "iteration": iteration,
              "content_metadata": content_metadata or {}}
    with zipfile.ZipFile(sub / "common.pt", "w") as z:
        z.writestr("common/data.pkl", pickle.dumps(common, protocol=2))
    (sub / "__0_0.distcp").write_bytes(b"\0" * 64)
    rows, hidden = args.get("padded_vocab_size", 1024), args.get("hidden_size", 256)
    shapes = {"embedding.word_embeddings.weight": _Meta(size=_Size((rows, hidden)))}
    pieces = {0: _Meta(relative_path="__0_0.distcp", offset=0, length=64)}
    index = _Meta(state_dict_metadata=shapes, storage_data=pieces)
    (sub / ".metadata").write_bytes(pickle.dumps(index, protocol=2))
    return folder
