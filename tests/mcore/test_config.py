"""The ``TransformerConfig`` the profiler times (mcore/config.py) is the one Megatron-LM trains
with, except where a difference is known and deliberate: a field megatron-core and Megatron-LM
default differently made the profiler time another layer than the one trained (the fp32 softmax:
12% of a Llama-2 7B layer on an H200, docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Megatron-LM argument defaults our config sets otherwise, each for a reason.
EXPLAINED = {
    # fused kernels: they need CUDA extensions, Apex or TE (the training runs of docs/gpu.md pass
    # --no-masked-softmax-fusion, --no-bias-dropout-fusion, --no-rope-fusion and
    # --no-gradient-accumulation-fusion)
    "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion",
    "gradient_accumulation_fusion",
    # no dropout: Llama trains without it (the training runs pass 0)
    "hidden_dropout", "attention_dropout",
    # filled in by Megatron-LM's validate_args or its config builder, not parse_args
    "num_query_groups", "kv_channels", "embedding_init_method_std", "use_cpu_initialization",
    "expert_tensor_parallel_size", "microbatch_group_size_per_vp_stage", "recompute_modules",
    "cp_comm_type", "overlap_p2p_comm",
    # megatron-core 0.19: parse_args leaves it None, validate_args makes it the enum's ``none``
    "inference_cuda_graph_scope",
}

_DIFF = textwrap.dedent("""
    import dataclasses, json, sys
    sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                "--ffn-hidden-size", "176", "--num-attention-heads", "4", "--seq-length", "128",
                "--max-position-embeddings", "128", "--micro-batch-size", "1", "--swiglu",
                "--normalization", "RMSNorm", "--disable-bias-linear", "--bf16",
                "--position-embedding-type", "rope"]
    from megatron.training.arguments import parse_args
    args = parse_args()
    from megatron_hetero.mcore.config import transformer_config
    from megatron_hetero.plan import ModelSpec
    model = ModelSpec(name="t", num_layers=2, hidden_size=64, ffn_hidden_size=176,
                      num_attention_heads=4, num_query_groups=4, vocab_size=128, seq_length=128)
    config = transformer_config(model, precision="bf16")
    diff = {}
    for f in dataclasses.fields(config):
        ours = getattr(config, f.name)
        if hasattr(args, f.name) and not callable(ours) and getattr(args, f.name) != ours:
            diff[f.name] = [repr(getattr(args, f.name)), repr(ours)]
    print("RESULT" + json.dumps(diff))
""")


def test_profiled_layers_are_configured_as_megatron_lm_trains_them(mcore_env):
    proc = subprocess.run([sys.executable, "-c", _DIFF], capture_output=True, text=True,
                          env=mcore_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert "attention_softmax_in_fp32" not in diff
    unexplained = {k: v for k, v in diff.items() if k not in EXPLAINED}
    assert not unexplained, f"Megatron-LM default / ours: {unexplained}"
