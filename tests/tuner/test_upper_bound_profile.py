"""Issue 32 A.11: the upper bound uses the figures the plans are priced with, so a profile whose
measured layers beat its own efficiency figure (a CPU profile gave `efficiency 1.005`) cannot
put a plan above the bound."""

from __future__ import annotations

from megatron_hetero import models as M
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.models import model_preset
from megatron_hetero.tuner.problem import TuneOptions
from megatron_hetero.tuner.search import tune

GPU = "A100-SXM-80GB"


class _FastProfile:
    """Measured layers and output at 90% of the peak, an efficiency figure of 40%."""

    device_type = GPU
    efficiency = 0.4

    def __init__(self, peak: float):
        self.rate = 0.9 * peak

    def times(self, part, *, model, micro_batch_size, tensor_parallel_size):
        b, tp = micro_batch_size, tensor_parallel_size
        if part == "layer":
            fwd = M.layer_forward_flops(model, b) / tp / self.rate
        elif part == "output":
            fwd = M.output_forward_flops(model, b, tp) / tp / self.rate
        else:
            return None
        return fwd, 2 * fwd


def test_a_profile_faster_than_its_efficiency_stays_under_the_bound():
    inv = inventory_from_data({"groups": [{"gpu": GPU, "nodes": 1, "gpus_per_node": 4}]})
    model = model_preset("llama2-7b", seq_length=1024)
    profile = _FastProfile(inv.spec(GPU).bf16_tflops * 1e12)
    result = tune(model, inv, 32, profiles={GPU: profile},
                  options=TuneOptions(micro_batch_sizes=(1, 2)))
    efficiency = result.upper_bound_step_time_s / result.sim.step_time_s
    assert efficiency <= 1.0
    # the bound moved to the measured rate: at the efficiency figure's it was 2.25x slower
    flops = M.step_model_flops(model, 32)
    assert result.upper_bound_step_time_s < flops / (4 * 0.4 * inv.spec(GPU).bf16_tflops * 1e12) / 2
