"""Memory emulation: live saved-activation accounting, the cap and its refusal message."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_hetero.emulate.memory import (MemoryCapError, MemoryMeter, cpu_rank_bytes,
                                            memory_caps, plan_cost_model)
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.plan import plan_from_data


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def test_activations_counted_while_alive_and_released_after_backward():
    model = _mlp()
    meter = MemoryMeter(rank=0, pipeline=0, stage=0, device_type="A100-SXM-80GB")
    static = meter.count_static([model])
    assert static == sum(p.numel() * 4 for p in model.parameters())
    x = torch.randn(32, 64)
    with meter.saved_activations():
        loss = model(x).square().sum()
    held = meter.activation_bytes
    # at least the hidden activation (32 x 256 fp32) is saved for the backward; never the weights
    assert held >= 32 * 256 * 4
    assert held < static + 10 * x.numel() * 4 + 4 * 32 * 256 * 4
    loss.backward()
    del loss
    gc.collect()
    assert meter.activation_bytes == 0
    assert meter.peak_bytes == static + held
    # two micro-batches in flight hold twice the activations
    with meter.saved_activations():
        l1 = model(x).square().sum()
        l2 = model(x + 1).square().sum()
    assert meter.activation_bytes == 2 * held
    del l1, l2


def test_optimizer_state_counts_once_it_exists():
    model = _mlp()
    opt = torch.optim.Adam(model.parameters())
    meter = MemoryMeter(rank=0, pipeline=0, stage=0, device_type="A100-SXM-80GB")
    before = meter.count_static([model], opt)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    after = meter.count_static([model], opt)
    params = sum(p.numel() for p in model.parameters())
    assert after - before >= 3 * params * 4  # grads + two Adam moments (+ step counters)


def test_cap_refusal_names_rank_stage_device_need_and_cap():
    model = _mlp()
    meter = MemoryMeter(rank=3, pipeline=1, stage=1, device_type="V100-SXM2-32GB",
                        device_bytes=32e9, scale=1e-5)
    static = meter.count_static([model])
    meter.cap = static + 1000
    with pytest.raises(MemoryCapError) as info:
        with meter.saved_activations():
            model(torch.randn(32, 64)).sum()
    msg = str(info.value)
    assert "rank 3 (pipeline 1, stage 1, V100-SXM2-32GB)" in msg
    assert "saving activations" in msg and "cap" in msg and "32 GB" in msg
    meter.cap = static // 2
    with pytest.raises(MemoryCapError, match="holding weights"):
        meter.count_static([model])


def _plan(hidden, seq, layers_on_v100=6, vocab=32000):
    stages = [{"device_type": "A100-SXM-80GB", "num_layers": 8 - layers_on_v100},
              {"device_type": "V100-SXM2-32GB", "num_layers": layers_on_v100}]
    return plan_from_data({
        "format_version": 1, "precision": "fp16", "global_batch_size": 8,
        "tensor_model_parallel_size": 1,
        "model": {"name": "t", "num_layers": 8, "hidden_size": hidden,
                  "ffn_hidden_size": 4 * hidden, "num_attention_heads": 8, "num_query_groups": 8,
                  "vocab_size": vocab, "seq_length": seq},
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": 8, "stages": stages}],
    })


@pytest.mark.parametrize("hidden,seq", [(4096, 4096), (8192, 4096), (8192, 16384), (2048, 2048)])
def test_shrunk_need_fits_its_cap_exactly_when_the_real_plan_fits(hidden, seq):
    """With the CPU needing what the cost model says, a rank's verdict is the cost model's
    verdict on the real card: the cap only rescales the device to the shrunk model."""
    real, shrunk = _plan(hidden, seq), _plan(64, 64, vocab=256)
    caps = memory_caps(real, shrunk)
    need = cpu_rank_bytes(shrunk)
    cost = plan_cost_model(real, load_catalog(), precision=real.precision,
                           use_distributed_optimizer=real.use_distributed_optimizer)
    assert set(caps) == {0, 1}
    for rank, (cap, device, scale) in caps.items():
        assert 0 < scale < 1 and cap == pytest.approx(device * scale)
        assert (need[rank] <= cap * (1 + 1e-9)) == cost.stage_memory(real, 0, rank).fits
    assert caps[1][1] == 32e9


def test_caps_are_a_share_of_each_rank_device():
    real, shrunk = _plan(8192, 16384), _plan(64, 64, vocab=256)
    caps = memory_caps(real, shrunk)
    assert caps[0][1] == 80e9 and caps[1][1] == 32e9
    # measured activations twice the estimate: the cap grows so that like is compared with like
    wider = memory_caps(real, shrunk, activation_scale=2.0)
    assert all(wider[r][0] > caps[r][0] for r in caps)


def test_calibration_measures_what_a_layer_saves_for_the_backward():
    """The rehearsal scales each device's memory cap by the measured over the estimated bytes
    one shrunk layer saves: the measurement is taken after the forward, while autograd holds
    them (after the backward nothing is held, and the cap fell back to the bare estimate)."""
    from megatron_hetero.emulate.calibration import activation_scale, calibrate
    from megatron_hetero.models import layer_activation_bytes

    from .conftest import tiny_plan
    plan = tiny_plan([2, 2], [(1, 2)])
    cal = calibrate(plan, reps=1)
    measured = cal.layer_activation_bytes[1]
    estimate = 2 * layer_activation_bytes(plan.model, 1, 1, "none", flash_attention=False)
    # the CPU layer saves at least what the formula counts in fp32, and some intermediates
    # the fused GPU kernels do not keep, but not several layers' worth
    assert estimate <= measured <= 4 * estimate
    assert activation_scale(plan, cal) == pytest.approx(measured / estimate)
