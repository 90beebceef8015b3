"""profile.yaml: strict schema, round trip, and the cost model's view (tier 1, no torch)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megatron_hetero._schema import to_data
from megatron_hetero.cost.profile_file import (
    DeviceInfo, MemoryFigures, PartTimes, ProfileData, ProfileEntry, ProfileUsage, Software, Timing,
    load_profile, load_profiles, save_profile,
)
from megatron_hetero.cost.profile_protocol import DeviceProfile
from megatron_hetero.errors import SchemaError
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.plan import ModelSpec

MODEL = ModelSpec(name="tiny", num_layers=4, hidden_size=64, ffn_hidden_size=172,
                  num_attention_heads=4, num_query_groups=4, vocab_size=512, seq_length=32)


def _entry(mbs: int, tp: int, scale: float = 1.0) -> ProfileEntry:
    t = lambda f: PartTimes(forward_s=f * mbs * scale, backward_s=2 * f * mbs * scale)
    return ProfileEntry(micro_batch_size=mbs, tensor_parallel_size=tp, layer=t(1e-3),
                        embedding=t(1e-4), output=t(5e-4),
                        memory=MemoryFigures(method="saved-tensors", parameter_bytes_per_layer=1000,
                                             activation_bytes_per_layer=500 * mbs,
                                             peak_bytes=3000 + 500 * mbs))


def _profile(device_type: str = "A100-SXM-80GB", mbs=(1, 2, 4)) -> ProfileData:
    return ProfileData(
        format_version=1,
        device=DeviceInfo(name="NVIDIA A100-SXM4-80GB", type=device_type, backend="cuda"),
        software=Software(megatron_hetero="0.1.0", python="3.11", torch="2.13.0",
                          megatron_core="0.16.1"),
        timing=Timing(method="cuda-events", warmup=2, repeats=5, layer_spec="local",
                      precision="bf16"),
        model=MODEL, entries=[_entry(m, 1) for m in mbs] + [_entry(1, 2, 0.6)],
        created="2026-11-22T03:00:00Z", efficiency=0.4)


def test_round_trip(tmp_path):
    data = _profile()
    path = tmp_path / "p.yaml"
    save_profile(data, path)
    loaded = load_profile(path)
    assert to_data(loaded.data) == to_data(data)
    assert isinstance(loaded, DeviceProfile)


@pytest.mark.parametrize("edit, field_path", [
    (lambda d: d["entries"][0]["layer"].update(sideways_s=1.0), "entries[0].layer.sideways_s"),
    (lambda d: d["entries"][1]["layer"].pop("backward_s"), "entries[1].layer.backward_s"),
    (lambda d: d["entries"][0]["layer"].update(forward_s=-1.0), "entries[0].layer.forward_s"),
    (lambda d: d["timing"].update(repeats=0), "timing.repeats"),
    (lambda d: d["entries"].append(d["entries"][0]), "entries[4]"),
    (lambda d: d.update(format_version=2), "format_version"),
    (lambda d: d.update(efficiency=1.5), "efficiency"),
    (lambda d: d["device"].update(backend="tpu"), "device.backend"),
])
def test_bad_files_name_the_field(tmp_path, edit, field_path):
    data = to_data(_profile())
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SchemaError) as err:
        load_profile(path)
    assert err.value.path == field_path
    assert str(path) in str(err.value)


def test_device_type_resolved_against_catalog(tmp_path):
    path = tmp_path / "p.yaml"
    save_profile(_profile(device_type="NVIDIA A100-SXM4-80GB"), path)
    cat = load_catalog()
    if cat.resolve("NVIDIA A100-SXM4-80GB") is None:
        pytest.skip("catalog has no such alias")
    assert load_profile(path, catalog=cat).device_type == "A100-SXM-80GB"
    save_profile(_profile(device_type="Not-A-GPU"), path)
    with pytest.raises(SchemaError) as err:
        load_profile(path, catalog=cat)
    assert err.value.path == "device.type"


def test_two_profiles_for_one_type_rejected(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    save_profile(_profile(), a)
    save_profile(_profile(), b)
    with pytest.raises(SchemaError, match="one profile per device type"):
        load_profiles([a, b])


def test_times_exact_interpolated_and_missing():
    p = load_profile_from(_profile())
    fwd, bwd = p.times("layer", model=MODEL, micro_batch_size=2, tensor_parallel_size=1)
    assert (fwd, bwd) == pytest.approx((2e-3, 4e-3))
    # mbs 3 lies between measured 2 and 4: linear in between
    assert p.times("layer", model=MODEL, micro_batch_size=3, tensor_parallel_size=1) == \
        pytest.approx((3e-3, 6e-3))
    # outside the measured range, and unmeasured TP: no answer (the cost model estimates)
    assert p.times("layer", model=MODEL, micro_batch_size=8, tensor_parallel_size=1) is None
    assert p.times("layer", model=MODEL, micro_batch_size=1, tensor_parallel_size=4) is None
    assert p.times("output", model=MODEL, micro_batch_size=1, tensor_parallel_size=2) == \
        pytest.approx((5e-4 * 0.6, 1e-3 * 0.6))


def test_shape_must_match_but_depth_does_not():
    p = load_profile_from(_profile())
    deeper = dataclasses.replace(MODEL, num_layers=40, name="other")
    assert p.times("layer", model=deeper, micro_batch_size=1, tensor_parallel_size=1) is not None
    wider = dataclasses.replace(MODEL, hidden_size=128)
    assert p.times("layer", model=wider, micro_batch_size=1, tensor_parallel_size=1) is None
    # the vocabulary matters to the embedding and output, not to a layer
    vocab = dataclasses.replace(MODEL, vocab_size=1024)
    assert p.times("layer", model=vocab, micro_batch_size=1, tensor_parallel_size=1) is not None
    assert p.times("output", model=vocab, micro_batch_size=1, tensor_parallel_size=1) is None


def test_usage_records_measured_and_estimated():
    p = load_profile_from(_profile())
    usage = ProfileUsage({p.device_type: p})
    wrapped = usage.wrap()[p.device_type]
    assert isinstance(wrapped, DeviceProfile)
    assert wrapped.efficiency == 0.4
    wrapped.times("layer", model=MODEL, micro_batch_size=1, tensor_parallel_size=1)
    wrapped.times("layer", model=MODEL, micro_batch_size=3, tensor_parallel_size=1)
    wrapped.times("layer", model=MODEL, micro_batch_size=16, tensor_parallel_size=1)
    report = usage.report(["A100-SXM-80GB", "V100-SXM2-32GB"])
    a100 = report["A100-SXM-80GB"]
    assert (a100["lookups_measured"], a100["lookups_interpolated"], a100["lookups_estimated"]) \
        == (1, 1, 1)
    assert a100["source"] == "partly measured"
    assert report["V100-SXM2-32GB"]["source"] == "catalog"
    assert len(usage.summary_lines(["V100-SXM2-32GB"])) == 2
    assert usage.report(["V100-SXM2-32GB"])["A100-SXM-80GB"]["source"].startswith("unused")


def load_profile_from(data: ProfileData):
    from megatron_hetero.cost.profile_file import MeasuredProfile
    return MeasuredProfile(data, source="<test>")


def test_calibration_script_builds_rehearsal_inputs_from_a_profile():
    """scripts/calibrate.py feeds the rehearsal's predictor the profile's own figures."""
    import importlib.util
    import pathlib

    from megatron_hetero.emulate.rehearse import Calibration

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "calibrate.py"
    spec = importlib.util.spec_from_file_location("calibrate", path)
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    data = dataclasses.replace(_profile(), model=cal.MODEL)
    data.device.peak_matmul_tflops = 0.1
    prof = load_profile_from(data)
    _, plan = cal.plans(quick=True)[1]
    base = Calibration(p2p_latency_s=1e-4, bandwidth_gb_s=2.0)
    got = cal.calibration_from(prof, plan, base, "profile")
    assert got.parts[("layer", 1)] == prof.times("layer", model=plan.model, micro_batch_size=1,
                                                  tensor_parallel_size=1)
    assert (got.p2p_latency_s, got.bandwidth_gb_s) == (1e-4, 2.0)
    assert cal.calibration_from(prof, plan, base, "rehearsal") is base
    eff = cal.calibration_from(prof, plan, base, "efficiency only")
    assert not eff.parts and eff.layer_flops_per_s == pytest.approx(0.1e12 * 0.4)
