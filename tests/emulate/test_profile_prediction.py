"""A prediction made before the run from a profile (issue 33, item 5): ``megatron-hetero
profile`` of this machine's CPU on the shrunk model, then the tuner's simulator predicts a fixed
plan's step from it (:func:`~megatron_hetero.emulate.calibration_file.calibration_from_profile`:
the rehearsal then measures no calibration of its own, and its a-priori prediction is the
profile's), then the rehearsal measures the step.

Bound: the median of 3 (profile, predict, rehearse) of measured / predicted within
[1/PROFILE_BOUND, PROFILE_BOUND] = [0.67, 1.5]. Measured 2026-11-28 01:13-01:23 UTC on this
project's 2-core machine shared with four other sessions' test runs (load average 8 to 17):
single runs 0.979, 1.206, 0.929 (load 15-17), 1.560, 1.163, 1.311 (load 8-9); medians of 3
1.206 (1.184, 1.208, 1.206; load 8.4). The run takes longer than predicted by about 20%: the
profile times the parts back to back, while each rehearsal rank sleeps its stretch between them
(its idle penalty; docs/calibration.md) and shares the cores with the others. A prediction that
drops the backward pass (the deliberate bug tried: ``calibration_from_profile`` keeping the
forward times only) gave 1.915, 3.439, 1.536 (median 1.915, load 14): it fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megatron_hetero.cli import main
from megatron_hetero.cost.profile_file import load_profile
from megatron_hetero.emulate.calibration_file import calibration_from_profile
from megatron_hetero.emulate.rehearse import RehearsalConfig, rehearse
from megatron_hetero.emulate.shrink import shrink_plan
from megatron_hetero.plan import plan_from_data

PROFILE_BOUND = 1.5
"""Measured over the profile's prediction, median of 3 (the module docstring has the runs)."""

MODEL = {"name": "fixed", "num_layers": 6, "hidden_size": 256, "ffn_hidden_size": 688,
         "num_attention_heads": 8, "num_query_groups": 8, "vocab_size": 1000, "seq_length": 256}


def _plan():
    """PP=2 (A100 4 layers, A40 2 layers), 4 micro-batches of 1: fixed, fp32."""
    return plan_from_data({
        "format_version": 1, "model": MODEL, "global_batch_size": 4, "precision": "fp32",
        "tensor_model_parallel_size": 1,
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": 4,
                       "stages": [{"device_type": "A100-SXM-80GB", "num_layers": 4},
                                  {"device_type": "A40-48GB", "num_layers": 2}]}]})


@pytest.mark.slow
def test_profile_taken_before_the_run_predicts_the_step(tmp_path):
    """Three times: profile, predict, rehearse; the median of measured / predicted within
    :data:`PROFILE_BOUND`."""
    plan = _plan()
    shrunk = shrink_plan(plan, 64, plan.catalog)
    model_file = tmp_path / "model.yaml"
    model_file.write_text(yaml.safe_dump(dataclasses.asdict(shrunk.model), sort_keys=False))
    config = RehearsalConfig(steps=4, hidden_size=64, time_scale=5.0, memory_cap=False,
                             meter_memory=False)
    ratios = []
    for k in range(3):
        out = tmp_path / f"profile-{k}.yaml"
        assert main(["profile", "--model", str(model_file), "--micro-batch-sizes", "1",
                     "--tensor-parallel-sizes", "1", "--cpu-threads", "1", "--repeats", "5",
                     "--device", "cpu", "-o", str(out)]) == 0
        calibration = calibration_from_profile(load_profile(out), shrunk)
        result = rehearse(plan, config, calibration=calibration)  # measures no calibration
        ratios.append(result.step_s / result.a_priori_step_s)
        print(f"measured {result.step_s:.3f} s, predicted from the profile "
              f"{result.a_priori_step_s:.3f} s: ratio {ratios[-1]:.3f}")
    assert 1 / PROFILE_BOUND <= sorted(ratios)[1] <= PROFILE_BOUND, ratios
