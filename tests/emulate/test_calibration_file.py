"""``rehearse --calibration FILE``: the calibration round-trips through its file, and a file
measured for another rehearsal (model, micro-batch sizes, metering, devices' idle gaps) is
refused naming what differs."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.emulate.calibration import Calibration
from megatron_hetero.emulate.calibration_file import (calibration_key, load_calibrations,
                                                      save_calibrations)
from megatron_hetero.errors import HeteroError

from .conftest import tiny_plan

PLAN = tiny_plan([2, 4], [(1, 3), (2, 1)])


def _calibration(scale: float) -> Calibration:
    return Calibration(parts={("layer", 1): (1e-3 * scale, 2e-3 * scale),
                              ("embedding", 2): (1e-4, 2e-4), ("output", 1): (3e-4, 5e-4)},
                       layer_flops_per_s=1.2e9, p2p_latency_s=6e-5, bandwidth_gb_s=2.5,
                       allreduce_gb_s=1.5, layer_activation_bytes={1: 4096.0, 2: 8192.0},
                       optimizer_gb_s=0.7, pipeline_overhead={1: (1e-4, -2e-5)},
                       step_overhead={2: (3e-4, 1e-4)})


def test_calibrations_round_trip(tmp_path):
    key = calibration_key(PLAN, {"A100-SXM-80GB": 0.0, "V100-SXM2-32GB": 2.1234}, True)
    assert key["micro_batch_sizes"] == [1, 2] and key["idle_factors"]["V100-SXM2-32GB"] == 2.123
    cals = {"A100-SXM-80GB": _calibration(1.0), "V100-SXM2-32GB": _calibration(1.5)}
    path = tmp_path / "calibration.yaml"
    save_calibrations(path, cals, key)
    assert load_calibrations(path, key, source="plan.yaml") == cals


@pytest.mark.parametrize("change", ["model", "micro_batch_sizes", "metered", "idle_factors"])
def test_a_calibration_of_another_rehearsal_is_refused(tmp_path, change):
    key = calibration_key(PLAN, {"A100-SXM-80GB": 0.0}, True)
    path = tmp_path / "calibration.yaml"
    save_calibrations(path, {"A100-SXM-80GB": _calibration(1.0)}, key)
    other = {
        "model": lambda: calibration_key(dataclasses.replace(
            PLAN, model=dataclasses.replace(PLAN.model, hidden_size=64)),
            {"A100-SXM-80GB": 0.0}, True),
        "micro_batch_sizes": lambda: calibration_key(tiny_plan([2, 4], [(1, 4)]),
                                                     {"A100-SXM-80GB": 0.0}, True),
        "metered": lambda: calibration_key(PLAN, {"A100-SXM-80GB": 0.0}, False),
        "idle_factors": lambda: calibration_key(PLAN, {"A100-SXM-80GB": 1.0}, True),
    }[change]()
    with pytest.raises(HeteroError, match=f"plan.yaml \\(--calibration .*measured for another "
                                          f"rehearsal: its {change} differ"):
        load_calibrations(path, other, source="plan.yaml")


def test_a_file_that_is_not_a_calibration_is_refused(tmp_path):
    path = tmp_path / "calibration.yaml"
    path.write_text("kind: something else\nversion: 1\n")
    with pytest.raises(HeteroError, match="not a rehearsal calibration"):
        load_calibrations(path, calibration_key(PLAN, {"A100-SXM-80GB": 0.0}, True),
                          source="plan.yaml")
