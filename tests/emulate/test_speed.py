"""Speed emulation: a wrapped step sleeps (factor - 1) x the CPU time it used, and only that.

The checks compare the sleep the rule asked for with the CPU time measured in the same step, so
they hold on a loaded machine too (a sleep may overshoot, never return early).
"""

from __future__ import annotations

import time

import pytest

from megatron_hetero.emulate.speed import SpeedEmulation, device_slowdowns
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.plan import plan_from_data


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


@pytest.mark.parametrize("slowdown,time_scale", [(2.5, 1.0), (1.0, 2.0), (1.5, 2.0)])
def test_sleep_is_factor_minus_one_times_cpu(slowdown, time_scale):
    emu = SpeedEmulation(slowdown=slowdown, time_scale=time_scale)
    for _ in range(3):
        with emu.step():
            _burn(0.02)
    factor = slowdown * time_scale
    assert emu.steps == 3
    assert emu.cpu_s >= 0.06
    assert emu.requested_s == pytest.approx((factor - 1) * emu.cpu_s, rel=1e-9)
    assert emu.slept_s >= emu.requested_s * 0.999
    assert emu.busy_s >= emu.cpu_s + emu.slept_s * 0.999


def test_waiting_is_not_stretched():
    """A step that waits (sleeps, as a rank does on a receive) used no CPU: nothing is added."""
    emu = SpeedEmulation(slowdown=4.0)
    with emu.step():
        time.sleep(0.05)
    assert emu.cpu_s < 0.01
    assert emu.requested_s < 0.03


def test_fastest_device_is_not_stretched():
    emu = SpeedEmulation(slowdown=1.0)
    with emu.step():
        _burn(0.02)
    assert emu.slept_s == 0.0 and emu.requested_s == 0.0


def test_disabled_only_measures():
    emu = SpeedEmulation(slowdown=3.0, enabled=False)
    with emu.step():
        _burn(0.02)
    assert emu.slept_s == 0.0 and emu.cpu_s > 0.015


def test_bad_slowdown_rejected():
    with pytest.raises(ValueError, match="slowdown"):
        SpeedEmulation(slowdown=0.5)
    with pytest.raises(ValueError, match="time_scale"):
        SpeedEmulation(slowdown=1.0, time_scale=0.5)


def test_slowdowns_follow_catalog_achievable_flops():
    catalog = load_catalog()
    fast, slow = "A100-SXM-80GB", "V100-SXM2-32GB"
    plan = plan_from_data({
        "format_version": 1, "precision": "fp16", "global_batch_size": 4,
        "tensor_model_parallel_size": 1,
        "model": {"name": "t", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
                  "num_attention_heads": 4, "num_query_groups": 4, "vocab_size": 128,
                  "seq_length": 32},
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": 4, "stages": [
            {"device_type": fast, "num_layers": 1}, {"device_type": slow, "num_layers": 3}]}],
    })
    s = device_slowdowns(plan, catalog)
    assert s[fast] == 1.0
    a, v = catalog.get(fast), catalog.get(slow)
    assert s[slow] == pytest.approx(a.bf16_tflops * a.efficiency / (v.bf16_tflops * v.efficiency))


def test_absorb_contention_counts_lost_wall_time_against_the_sleep():
    """A step that waited (as when another process held the core) sleeps less: it lasts
    factor x CPU time, not wall + (factor - 1) x CPU time."""
    emu = SpeedEmulation(slowdown=4.0, absorb_contention=True)
    with emu.step():
        _burn(0.02)
        time.sleep(0.03)  # wall time that is not this step's work
    assert emu.requested_s <= 3.0 * emu.cpu_s - 0.029
    assert emu.busy_s - 4.0 * emu.cpu_s == pytest.approx(emu.drift_s, abs=1e-9)
    plain = SpeedEmulation(slowdown=4.0)
    with plain.step():
        _burn(0.02)
        time.sleep(0.03)
    assert plain.requested_s == pytest.approx(3.0 * plain.cpu_s, rel=1e-9)


def test_time_lost_beyond_one_steps_budget_is_made_up_in_the_next():
    emu = SpeedEmulation(slowdown=10.0, absorb_contention=True)
    with emu.step():
        _burn(0.01)
        time.sleep(0.2)  # far more than this step's budget of 9 x 0.01 s
    lag, cpu, requested = emu.drift_s, emu.cpu_s, emu.requested_s
    assert lag >= 0.2 - 9 * emu.cpu_s - 1e-3
    with emu.step():
        _burn(0.03)
    assert emu.busy_s - 10.0 * emu.cpu_s == pytest.approx(emu.drift_s, abs=1e-9)
    # the second step slept the lag less than its own 9 x CPU time (whatever the wall time its
    # work took on a loaded machine: a bound on the sleep the rule asks for, not on a timing)
    second = emu.cpu_s - cpu
    assert emu.requested_s - requested <= max(0.0, 9.0 * second - lag) + 1e-9


def test_slowdowns_of_a_plan_defined_type_come_from_the_plan():
    """A plan that carries its own catalog entry (``gpus:``) needs no catalog argument."""
    acme = {"vendor": "Acme", "bf16_tflops": 100.0, "bf16": True, "fp32_tflops": 25.0,
            "memory_gb": 32, "memory_bandwidth_gb_s": 1000, "intra_node_link": "PCIe4",
            "intra_node_bandwidth_gb_s": 32, "efficiency": 0.5}
    fast = "A100-SXM-80GB"
    plan = plan_from_data({
        "format_version": 1, "global_batch_size": 4, "tensor_model_parallel_size": 1,
        "gpus": {"Acme-NPU": acme},
        "model": {"name": "t", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
                  "num_attention_heads": 4, "num_query_groups": 4, "vocab_size": 128,
                  "seq_length": 32},
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": 4, "stages": [
            {"device_type": fast, "num_layers": 3}, {"device_type": "Acme-NPU", "num_layers": 1}]}],
    })
    a = load_catalog().get(fast)
    assert device_slowdowns(plan)["Acme-NPU"] == pytest.approx(a.achievable_flops / (100e12 * 0.5))
