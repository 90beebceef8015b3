"""Helpers of the CPU-backend tests: tiny plans of one tiny model (6 layers, width 32)."""

from __future__ import annotations

from megatron_hetero.plan import Plan, plan_from_data


def tiny_plan(split: list[int], pipes: list[tuple[int, int]], *, tp: int = 1,
              recompute: list[dict | None] | None = None,
              use_distributed_optimizer: bool = False, chunks: list[list[int]] | None = None,
              overlap_grad_reduce: bool = False, microbatch_group_size: int | None = None,
              expert_model_parallel_size: int = 1, **model) -> Plan:
    """A plan of the tiny model: ``split`` layers per stage, ``pipes`` = [(micro_batch_size,
    num_microbatches)] per data-parallel replica; ``chunks`` (interleaved plans) the layers of
    each stage's model chunks (``split`` is then their sums), ``microbatch_group_size`` their
    schedule's micro-batch group, ``expert_model_parallel_size`` an MoE model's EP; ``model``
    overrides model fields."""
    if chunks is not None:
        split = [sum(c) for c in chunks]

    def stages():
        out = []
        for s, n in enumerate(split):
            stage = {"device_type": "A100-SXM-80GB", "num_layers": n}
            if chunks is not None:
                stage["chunk_layers"] = list(chunks[s])
            if recompute and recompute[s]:
                stage["recompute"] = recompute[s]
            out.append(stage)
        return out

    spec = {"name": "tiny", "num_layers": sum(split), "hidden_size": 32, "ffn_hidden_size": 64,
            "num_attention_heads": 4, "num_query_groups": 4, "vocab_size": 64, "seq_length": 8}
    spec.update(model)
    return plan_from_data({
        "format_version": 1, "model": spec, "precision": "fp32",
        "use_distributed_optimizer": use_distributed_optimizer,
        "virtual_pipeline_size": len(chunks[0]) if chunks else 1,
        "overlap_grad_reduce": overlap_grad_reduce,
        **({"microbatch_group_size": microbatch_group_size} if microbatch_group_size else {}),
        **({"expert_model_parallel_size": expert_model_parallel_size}
           if expert_model_parallel_size != 1 else {}),
        "global_batch_size": sum(m * n for m, n in pipes), "tensor_model_parallel_size": tp,
        "pipelines": [{"micro_batch_size": m, "num_microbatches": n, "stages": stages()}
                      for m, n in pipes]})


def assert_prediction_is_the_runs(result) -> None:
    """The prediction of a rehearsal (``RehearsalResult``) is made from its own run: for each
    device, its stages' predicted compute over the device's factor is the CPU seconds its ranks
    measured (the start-up calibration rescaled by the CPU drift; a prediction off by a unit or
    a time scale fails it). An identity, not a timing: it holds on any load."""
    import pytest

    for device in {st.device_type for st in result.stages}:
        mine = [st for st in result.stages if st.device_type == device]
        assert sum(st.predicted_busy_s / st.factor for st in mine) == pytest.approx(
            sum(st.cpu_s for st in mine), rel=1e-6), device
