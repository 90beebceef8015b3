"""Small plans for the runtime tests (built as data, checked by the real plan loader)."""

from __future__ import annotations

from megatron_hetero.plan import Plan, plan_from_data

A100, V100, H100 = "A100-SXM-80GB", "V100-SXM2-32GB", "H100-SXM-80GB"


def make_plan(*, split=(1, 1), devices=None, replicas=((1, 1),), tp=1, recompute=None,
              offload=None, hidden=16, heads=4, vocab=128, seq=8, precision="fp32",
              chunks=None, group=None, distributed_optimizer=False, experts=None,
              expert_model_parallel_size=1) -> Plan:
    """``replicas``: (micro_batch_size, num_microbatches) per pipeline; ``devices[d][s]``,
    ``recompute[s]`` and ``offload[s]`` per stage (recompute/offload the same in every pipeline);
    ``chunks[s]``: an interleaved plan's layers per model chunk of stage s (``split`` follows);
    ``group`` its micro-batch group (``microbatch_group_size``); ``experts`` an MoE model's keys
    (``num_experts`` and the ``moe_*`` keys), ``expert_model_parallel_size`` its EP."""
    if chunks is not None:
        split = tuple(sum(c) for c in chunks)
    devices = devices or [[A100] * len(split) for _ in replicas]
    pipelines = []
    for d, (mbs, n) in enumerate(replicas):
        stages = []
        for s, k in enumerate(split):
            stage = {"device_type": devices[d][s], "num_layers": k}
            if chunks is not None:
                stage["chunk_layers"] = list(chunks[s])
            if recompute and recompute[s]:
                stage["recompute"] = recompute[s]
            if offload and offload[s]:
                stage["offload"] = offload[s]
            stages.append(stage)
        pipelines.append({"micro_batch_size": mbs, "num_microbatches": n, "stages": stages})
    data = {
        "format_version": 1,
        "model": {"name": "tiny", "num_layers": sum(split), "hidden_size": hidden,
                  "ffn_hidden_size": 4 * hidden, "num_attention_heads": heads,
                  "num_query_groups": heads, "vocab_size": vocab, "seq_length": seq},
        "global_batch_size": sum(m * n for m, n in replicas),
        "precision": precision,
        "tensor_model_parallel_size": tp,
        "use_distributed_optimizer": distributed_optimizer,
        "virtual_pipeline_size": len(chunks[0]) if chunks else 1,
        "pipelines": pipelines,
    }
    if group is not None:
        data["microbatch_group_size"] = group
    if experts:
        data["model"].update(experts)
    if expert_model_parallel_size != 1:
        data["expert_model_parallel_size"] = expert_model_parallel_size
    return plan_from_data(data, source="test-plan")


def make_mesh_plan(meshes, *, global_batch=4, num_microbatches=2, replicas=None, devices=None,
                   hidden=16, heads=4, vocab=128, seq=8, precision="fp32",
                   distributed_optimizer=True, offload=None, chunks=None, fields=None,
                   warmups=None):
    """A mesh plan (format 2) of the same tiny model: ``meshes`` is
    ``[(tp, dp, [layers per stage], recompute or None), ...]``; every mesh's replicas run
    ``num_microbatches`` micro-batches of ``global_batch / (dp x num_microbatches)``, or, with
    ``replicas`` (``[(micro_batch_size, num_microbatches), ...]``), those in every mesh;
    ``devices[k]`` mesh k's device type (default A100); ``offload[k]`` the offload of every
    stage of mesh k; ``chunks[k][j]``: the ``chunk_layers`` of mesh k's stage j (summing to its
    layers); ``fields``: more of the plan's top-level fields; ``warmups[k][j]``: the
    ``warmup_microbatches`` of mesh k's stage j (None: absent)."""
    from megatron_hetero.plan import mesh_plan_from_data

    data = {
        "format_version": 2,
        "model": {"name": "tiny", "num_layers": sum(sum(m[2]) for m in meshes),
                  "hidden_size": hidden, "ffn_hidden_size": 4 * hidden,
                  "num_attention_heads": heads, "num_query_groups": heads, "vocab_size": vocab,
                  "seq_length": seq},
        "global_batch_size": global_batch,
        "precision": precision,
        "use_distributed_optimizer": distributed_optimizer,
        "meshes": [{"device_type": devices[k] if devices else A100,
                    "tensor_model_parallel_size": tp,
                    "replicas": ([{"micro_batch_size": b, "num_microbatches": n}
                                  for b, n in replicas] if replicas else
                                 [{"micro_batch_size": global_batch // (dp * num_microbatches),
                                   "num_microbatches": num_microbatches}] * dp),
                    "stages": [{"num_layers": n, **({"recompute": rec} if rec else {}),
                                **({"offload": offload[k]} if offload and k in offload else {}),
                                **({"chunk_layers": list(chunks[k][j])} if chunks else {}),
                                **({"warmup_microbatches": warmups[k][j]}
                                   if warmups and k in warmups and warmups[k][j] is not None
                                   else {})}
                               for j, n in enumerate(layers)]}
                   for k, (tp, dp, layers, rec) in enumerate(meshes)],
    }
    return mesh_plan_from_data({**data, **(fields or {})}, source="test-mesh-plan")
