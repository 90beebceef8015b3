"""Tiny mesh plans (4 layers of width 8, global batch 4, fp32, every mesh on RTX3090s) written
to a file, for the tests that train them on CPU ranks against one process."""

from __future__ import annotations

import copy

import yaml

from ..conftest import REPO

BASE = yaml.safe_load((REPO / "examples/meshes/3090-t4-plan.yaml").read_text())


def tiny_mesh_plan(tmp_path, meshes, *, replicas=None, recompute=None, stages=None,
                   chunks=None, fields=None, seq_length: int = 3, warmups=None,
                   device_types=None) -> str:
    """``meshes``: (TP, DP) per mesh, its replicas splitting 2 micro-batches of 2 samples
    (``replicas`` instead where given), one stage of 2 layers (``stages[k]`` the layers of mesh
    ``k``'s stages where given), ``recompute`` on mesh 1's first stage; ``chunks[k]``: the
    ``chunk_layers`` of each of mesh ``k``'s stages (the model then has their layers);
    ``fields``: further top-level fields of the plan; ``seq_length``: the model's (a multiple
    of every TP under ``sequence_parallel``); ``warmups[k]``: the ``warmup_microbatches`` of
    each of mesh ``k``'s stages (None: absent); ``device_types[k]``: mesh ``k``'s GPU type."""
    data = copy.deepcopy(BASE)
    data["model"].update(num_layers=4, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                         num_query_groups=2, vocab_size=64, seq_length=seq_length)
    data["precision"] = "fp32"
    data["global_batch_size"] = 4
    data["meshes"] = [
        {"device_type": (device_types or {}).get(k, "RTX3090-24GB"),
         "tensor_model_parallel_size": tp,
         "replicas": replicas or [{"micro_batch_size": 2 // dp, "num_microbatches": 2}] * dp,
         "stages": [{"num_layers": n} for n in (stages or {}).get(k, [2])]}
        for k, (tp, dp) in enumerate(meshes)]
    if chunks:
        for k, per_stage in chunks.items():
            data["meshes"][k]["stages"] = [{"num_layers": sum(c), "chunk_layers": list(c)}
                                           for c in per_stage]
        data["model"]["num_layers"] = sum(s["num_layers"] for m in data["meshes"]
                                          for s in m["stages"])
    for k, counts in (warmups or {}).items():
        for stage, w in zip(data["meshes"][k]["stages"], counts):
            if w is not None:
                stage["warmup_microbatches"] = w
    data.update(fields or {})
    if recompute:
        data["meshes"][1]["stages"][0]["recompute"] = recompute
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)
