#!/usr/bin/env python3
"""megatron-core's MoE transformer layer against a dense one on one device: forward and backward
time, peak memory, and the tokens each expert received (load imbalance).

    python scripts/gpu_moe_profile.py --out moe.json [--cases mixtral:alltoall,...] [--cpu]

Each case builds one ``TransformerLayer`` from megatron-core's local layer spec
(``get_gpt_layer_local_spec``: its own attention, its router, its token dispatcher and
``SequentialMLP`` experts, since neither Transformer Engine nor grouped_gemm is assumed),
bf16, sequence 4096, micro-batch size 1, expert-parallel size 1 on a one-rank process group.
The layer runs on a random input ``[s, b, h]`` with the model's rotary embedding; times are CUDA
events (CPU: wall clock), the median of ``--repeats`` after ``--warmup``. For each case also the
MLP block alone (``layer.mlp``: router + dispatch + experts + combine for an MoE layer). Memory:
``torch.cuda.max_memory_allocated`` over one forward and backward of the layer, less what was
allocated before (parameters, input). Tokens per expert: the router's ``routing_map`` summed
over tokens, from a forward hook (random weights and input: the router's imbalance at
initialization, not after training).

Dense cases (``dense-*``) use the same attention and a dense SwiGLU MLP of ``topk x moe_ffn``
(the MoE layer's active FLOPs). ``--cpu`` runs tiny shapes through megatron-hetero's CPU
backend, fp32, to rehearse the script. Each case records its failure and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

# model shapes: hidden, attention heads, query groups, head dim, MoE ffn, experts, top-k
SHAPES = {
    "mixtral": dict(hidden=4096, heads=32, groups=8, head_dim=128, moe_ffn=14336, experts=8,
                    topk=2, qk_norm=False),
    "qwen3-30b-a3b": dict(hidden=2048, heads=32, groups=4, head_dim=128, moe_ffn=768,
                          experts=128, topk=8, qk_norm=True),
}
TINY = {
    "mixtral": dict(hidden=64, heads=4, groups=2, head_dim=16, moe_ffn=96, experts=4, topk=2,
                    qk_norm=False),
    "qwen3-30b-a3b": dict(hidden=64, heads=4, groups=2, head_dim=16, moe_ffn=32, experts=16,
                          topk=4, qk_norm=True),
}
CASES = ("mixtral:alltoall", "mixtral:allgather", "dense-mixtral",
         "qwen3-30b-a3b:alltoall", "qwen3-30b-a3b:allgather", "dense-qwen3-30b-a3b")


def setup(cpu: bool):
    import torch
    import torch.distributed as dist

    # megatron-core's modules first: the CPU backend patches torch.cuda after their import
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.moe.moe_layer  # noqa: F401
    if cpu:
        from megatron_hetero.mcore.cpu_backend import enable_cpu_backend
        enable_cpu_backend()
    else:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        store = tempfile.mkdtemp(prefix="moe-profile-")
        dist.init_process_group("gloo" if cpu else "nccl", init_method=f"file://{store}/s",
                                rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             expert_model_parallel_size=1)


def build(shape: dict, *, dispatcher: str | None, cpu: bool):
    """One transformer layer of ``shape``: MoE with ``dispatcher``, or dense (None)."""
    import torch
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.float32 if cpu else torch.bfloat16
    moe = dispatcher is not None
    kwargs = dict(
        num_layers=1, hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        num_query_groups=shape["groups"], kv_channels=shape["head_dim"],
        ffn_hidden_size=shape["moe_ffn"] * (1 if moe else shape["topk"]),
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, qk_layernorm=shape["qk_norm"], params_dtype=dtype,
        pipeline_dtype=dtype, bf16=not cpu, use_cpu_initialization=cpu,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=False)
    if moe:
        kwargs.update(num_moe_experts=shape["experts"], moe_router_topk=shape["topk"],
                      moe_ffn_hidden_size=shape["moe_ffn"], moe_token_dispatcher_type=dispatcher,
                      moe_grouped_gemm=False, moe_router_load_balancing_type="aux_loss",
                      moe_aux_loss_coeff=1e-2)
    config = TransformerConfig(**kwargs)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = get_gpt_layer_local_spec(num_experts=shape["experts"] if moe else None,
                                    moe_grouped_gemm=False, qk_layernorm=shape["qk_norm"])
    layer = build_module(spec, config=config, layer_number=1)
    rope = RotaryEmbedding(kv_channels=shape["head_dim"], rotary_percent=1.0,
                           use_cpu_initialization=cpu)
    if not cpu:
        layer = layer.cuda()
    return layer.to(dtype), rope, dtype


def timer(cpu: bool):
    import torch

    def wall(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def events(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    return wall if cpu else events


def time_fwd_bwd(fwd, clock, warmup: int, repeats: int) -> dict:
    """Median forward and backward seconds of ``fwd`` (returns the output to backpropagate)."""
    import torch

    fw, bw = [], []
    for k in range(warmup + repeats):
        holder = {}

        def forward():
            holder["out"] = fwd()

        f = clock(forward)
        out = holder["out"]
        grad = torch.ones_like(out)
        b = clock(lambda: out.backward(grad))
        if k >= warmup:
            fw.append(f)
            bw.append(b)
    return {"forward_s": statistics.median(fw), "backward_s": statistics.median(bw)}


def run_case(case: str, *, cpu: bool, seq: int, mbs: int, warmup: int, repeats: int) -> dict:
    import torch

    dense = case.startswith("dense-")
    name, _, dispatcher = case.removeprefix("dense-").partition(":")
    shape = (TINY if cpu else SHAPES)[name]
    dispatcher = None if dense else (dispatcher or "alltoall")
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    layer, rope, dtype = build(shape, dispatcher=dispatcher, cpu=cpu)
    build_s = time.perf_counter() - t0
    rope_emb = rope(seq).to(dev)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    hidden = torch.randn(seq, mbs, shape["hidden"], generator=gen).to(dev, dtype)
    counts = []
    hook = None
    if not dense:
        def record(_module, _inputs, output):
            counts.append(output[1].reshape(-1, shape["experts"]).sum(0).float().cpu())
        hook = layer.mlp.router.register_forward_hook(record)

    def layer_fwd():
        out = layer(hidden.detach().requires_grad_(), attention_mask=None,
                    rotary_pos_emb=rope_emb)
        return out[0] if isinstance(out, tuple) else out

    def mlp_fwd():
        out = layer.mlp(hidden.detach().requires_grad_())
        return out[0] if isinstance(out, tuple) else out

    clock = timer(cpu)
    result = {"case": case, "kind": "dense" if dense else "moe", "dispatcher": dispatcher,
              "shape": {**shape, "seq_length": seq, "micro_batch_size": mbs,
                        "dense_ffn": None if not dense else shape["moe_ffn"] * shape["topk"]},
              "dtype": str(dtype).removeprefix("torch."), "build_s": round(build_s, 3),
              "parameters": sum(p.numel() for p in layer.parameters()),
              "mlp_parameters": sum(p.numel() for p in layer.mlp.parameters())}
    # memory first, on a fresh peak: one forward and backward of the layer
    if not cpu:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = layer_fwd()
        torch.cuda.synchronize()
        after_fwd = torch.cuda.memory_allocated()
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        result["memory"] = {"before_bytes": base,
                            "activation_bytes": after_fwd - base - out.numel() * out.element_size(),
                            "peak_above_before_bytes": torch.cuda.max_memory_allocated() - base,
                            "max_allocated_bytes": torch.cuda.max_memory_allocated()}
        del out
    counts.clear()
    result["layer"] = time_fwd_bwd(layer_fwd, clock, warmup, repeats)
    layer_counts = list(counts)  # the MLP alone below routes another input (no attention)
    result["mlp"] = time_fwd_bwd(mlp_fwd, clock, warmup, repeats)
    if hook is not None:
        hook.remove()
        counts = layer_counts
        per_expert = counts[0]  # the same input every time: the first forward's routing
        mean = float(per_expert.mean())
        result["tokens_per_expert"] = [int(x) for x in per_expert.tolist()]
        result["imbalance_max_over_mean"] = round(float(per_expert.max()) / mean, 4)
        result["routing_repeats_identical"] = all(bool((c == per_expert).all()) for c in counts)
    del layer
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seq-length", type=int)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=120,
                    help="start no new case after this many seconds")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU backend, fp32")
    a = ap.parse_args(argv)
    seq = a.seq_length or (64 if a.cpu else 4096)
    t_start = time.perf_counter()
    report = {"cases": [], "skipped": [], "failed": []}
    try:
        setup(a.cpu)
        import megatron.core
        report["megatron_core"] = getattr(megatron.core, "__version__", None)
    except Exception:  # noqa: BLE001 - recorded
        report["failed"].append({"case": "setup", "traceback": traceback.format_exc()[-3000:]})
        cases = []
    else:
        cases = [c for c in a.cases.split(",") if c]
    for case in cases:
        if time.perf_counter() - t_start > a.budget_s:
            report["skipped"].append(case)
            continue
        t0 = time.perf_counter()
        try:
            r = run_case(case, cpu=a.cpu, seq=seq, mbs=a.micro_batch_size, warmup=a.warmup,
                         repeats=a.repeats)
            r["wall_s"] = round(time.perf_counter() - t0, 2)
            report["cases"].append(r)
            print(f"{case}: layer fwd {r['layer']['forward_s'] * 1e3:.2f} ms bwd "
                  f"{r['layer']['backward_s'] * 1e3:.2f} ms; mlp fwd "
                  f"{r['mlp']['forward_s'] * 1e3:.2f} ms bwd {r['mlp']['backward_s'] * 1e3:.2f} ms"
                  + (f"; imbalance {r['imbalance_max_over_mean']}"
                     if "imbalance_max_over_mean" in r else "")
                  + (f"; peak +{r['memory']['peak_above_before_bytes'] / 2**30:.2f} GiB"
                     if "memory" in r else "") + f" ({r['wall_s']} s)", flush=True)
        except Exception:  # noqa: BLE001 - recorded, the next case runs
            report["failed"].append({"case": case, "traceback": traceback.format_exc()[-3000:]})
            print(f"{case}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)
        finally:
            if not a.cpu:
                import torch
                torch.cuda.empty_cache()
    report["wall_s"] = round(time.perf_counter() - t_start, 2)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if report["cases"] and not report["failed"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.exit(main())
