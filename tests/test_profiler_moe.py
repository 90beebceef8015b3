"""`megatron-hetero profile` times megatron-core's mixture-of-experts layer (router, all-to-all
dispatcher on one rank, sequential experts) on the CPU backend, and its measured layer holds
exactly the parameters the cost model counts for an MoE layer (tier 3: a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_hetero.cost.profile_file import load_profile
from megatron_hetero.models import layer_param_parts, layer_params
from megatron_hetero.plan import ModelSpec

pytestmark = pytest.mark.slow

TINY_MOE = dict(name="tiny-moe", num_layers=4, hidden_size=64, ffn_hidden_size=176,
                num_attention_heads=4, num_query_groups=4, vocab_size=256, seq_length=32,
                num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
                moe_shared_expert_intermediate_size=64)


def test_profile_of_an_moe_layer_counts_its_experts(tmp_path):
    import yaml

    (tmp_path / "model.yaml").write_text(yaml.safe_dump(TINY_MOE))
    out = tmp_path / "profile.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_hetero.cli", "profile", "--model",
         str(tmp_path / "model.yaml"), "--warmup", "1", "--repeats", "2", "--no-bandwidth",
         "--no-pipeline", "-q", "-o", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = load_profile(out)
    assert profile.data.model.num_experts == 8
    [entry] = profile.data.entries
    model = ModelSpec(**TINY_MOE)
    shared, routed = layer_param_parts(model)
    # fp32 on the CPU: 4 bytes a parameter; every layer is an MoE layer (moe_layer_freq 1)
    assert entry.memory.parameter_bytes_per_layer == 4 * (shared + routed)
    assert routed > layer_params(model)  # the experts outweigh the dense layer they replace
    assert entry.layer.forward_s > 0 and entry.layer.backward_s > 0
