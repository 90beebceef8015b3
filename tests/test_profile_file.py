"""profile.yaml: strict schema, round trip, and the cost model's view (tier 1, no torch)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megatron_hetero._schema import to_data
from megatron_hetero.cost.profile_file import (
    ProfileUsage, load_profile, load_profiles, save_profile,
)
from megatron_hetero.cost.profile_schema import (
    FORMAT_VERSION, BandwidthSample, Communication, DeviceInfo, MemoryFigures, PartTimes,
    PipelineEntry, PipelineFigures, PipelineStageTimes, ProfileData, ProfileEntry, Software,
    StepPenalty, Timing,
)
from megatron_hetero.cost.profile_protocol import DeviceProfile
from megatron_hetero.errors import SchemaError
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.plan import ModelSpec

from .shapes import stage

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
    (lambda d: d.update(format_version=3), "format_version"),
    (lambda d: d.update(efficiency=1.5), "efficiency"),
    (lambda d: d.update(optimizer_factor=0.0), "optimizer_factor"),
    (lambda d: d.update(optimizer_factor="fast"), "optimizer_factor"),
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


def _calibrate_script():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "calibrate.py"
    spec = importlib.util.spec_from_file_location("calibrate", path)
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    return cal


def _calibration_from_script(profile: ProfileData):
    """What scripts/calibrate.py makes of ``profile`` for its second quick plan:
    (the script, the profile loaded, the plan, the base calibration, the result)."""
    from megatron_hetero.emulate.calibration import Calibration

    cal = _calibrate_script()
    data = dataclasses.replace(profile, model=cal.MODEL)
    data.device.peak_matmul_tflops = 0.1
    prof = load_profile_from(data)
    _, plan = cal.plans(quick=True)[1]
    base = Calibration(p2p_latency_s=1e-4, bandwidth_gb_s=2.0)
    return cal, prof, plan, base, cal.calibration_from(prof, plan, base, "profile")


def test_calibration_script_builds_rehearsal_inputs_from_a_profile():
    """scripts/calibrate.py feeds the rehearsal's predictor the profile's own figures."""
    cal, prof, plan, base, got = _calibration_from_script(_profile())
    assert got.parts[("layer", 1)] == prof.times("layer", model=plan.model, micro_batch_size=1,
                                                  tensor_parallel_size=1)
    assert (got.p2p_latency_s, got.bandwidth_gb_s) == (1e-4, 2.0)
    assert cal.calibration_from(prof, plan, base, "rehearsal") is base
    eff = cal.calibration_from(prof, plan, base, "efficiency only")
    assert not eff.parts and eff.layer_flops_per_s == pytest.approx(0.1e12 * 0.4)


# -- format 2: the pipeline measurement, the p2p latency, idle-timed CPU profiles ----------------

def _stage(f, b, pf, pb):
    return PipelineStageTimes(forward_s=f, backward_s=b, parts_forward_s=pf, parts_backward_s=pb)


def _pipe_entry(mbs: int, fo: float, bo: float) -> PipelineEntry:
    return PipelineEntry(micro_batch_size=mbs, first=_stage(1e-2 + fo, 2e-2 + bo, 1e-2, 2e-2),
                         last=_stage(3e-2 + fo, 4e-2 + bo, 3e-2, 4e-2),
                         forward_overhead_s=fo, backward_overhead_s=bo)


def _profile_v2(**kw) -> ProfileData:
    data = dataclasses.replace(_profile(), format_version=2, **kw)
    data.timing.idle_factor = 4.0
    data.communication = Communication(
        ranks=2, backend="gloo",
        p2p=[BandwidthSample(bytes=4096, seconds=5e-5, gb_s=0.08),
             BandwidthSample(bytes=1 << 20, seconds=4e-4, gb_s=2.6)],
        all_reduce=[BandwidthSample(bytes=1 << 20, seconds=8e-4, gb_s=1.3)],
        p2p_latency_s=5e-5)
    data.pipeline = PipelineFigures(stages=2, layers_per_stage=2, microbatches=4, entries=[
        _pipe_entry(1, 1e-3, 2e-3), _pipe_entry(4, 3e-3, -1e-3)])
    data.entries[0].idle_penalty = StepPenalty(forward_s=4e-4, backward_s=-1e-4)
    return data


def test_format_2_round_trip_and_format_1_still_read(tmp_path):
    assert FORMAT_VERSION == 2
    path = tmp_path / "v2.yaml"
    data = _profile_v2()
    save_profile(data, path)
    loaded = load_profile(path)
    assert to_data(loaded.data) == to_data(data)
    assert loaded.data.communication.p2p_latency_s == 5e-5
    assert loaded.data.timing.idle_factor == 4.0
    assert loaded.data.entries[0].idle_penalty == StepPenalty(forward_s=4e-4, backward_s=-1e-4)
    # a format-1 file (no pipeline section, no latency, no idle factor) loads as before
    old = tmp_path / "v1.yaml"
    save_profile(_profile(), old)
    v1 = load_profile(old)
    assert v1.data.format_version == 1 and v1.data.pipeline is None
    assert v1.pipeline_overhead(model=MODEL, micro_batch_size=1, tensor_parallel_size=1) is None


@pytest.mark.parametrize("edit", [
    lambda d: d.update(format_version=1),  # format-2 fields in a file that says format 1
    lambda d: (d.update(format_version=1, pipeline=None, communication=None),
               d["timing"].update(idle_factor=0.0)),  # still: entries[0].idle_penalty
    lambda d: d.update(format_version=3),
])
def test_format_version_checked_against_the_fields(tmp_path, edit):
    data = to_data(_profile_v2())
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SchemaError) as err:
        load_profile(path)
    assert err.value.path == "format_version"
    assert str(path) in str(err.value)


def test_format_3_asks_to_re_run_the_profiler(tmp_path):
    data = to_data(_profile())
    data["format_version"] = 3
    path = tmp_path / "future.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SchemaError, match="re-run `megatron-hetero profile`"):
        load_profile(path)


def test_pipeline_overhead_exact_interpolated_clamped_and_missing():
    p = load_profile_from(_profile_v2())
    assert p.pipeline_overhead(model=MODEL, micro_batch_size=1, tensor_parallel_size=1) == \
        pytest.approx((1e-3, 2e-3))
    # mbs 2 is a third of the way from 1 to 4: forward 1e-3 + (3e-3 - 1e-3) / 3; backward
    # 2e-3 + (-1e-3 - 2e-3) / 3 = 1e-3
    assert p.pipeline_overhead(model=MODEL, micro_batch_size=2, tensor_parallel_size=1) == \
        pytest.approx((1e-3 + 2e-3 / 3, 1e-3))
    # a negative measurement (scatter) counts as no overhead
    assert p.pipeline_overhead(model=MODEL, micro_batch_size=4, tensor_parallel_size=1) == \
        pytest.approx((3e-3, 0.0))
    # TP > 1 uses the TP=1 figure; outside the measured sizes or another shape: None
    assert p.pipeline_overhead(model=MODEL, micro_batch_size=1, tensor_parallel_size=2) == \
        pytest.approx((1e-3, 2e-3))
    assert p.pipeline_overhead(model=MODEL, micro_batch_size=8, tensor_parallel_size=1) is None
    wider = dataclasses.replace(MODEL, hidden_size=128)
    assert p.pipeline_overhead(model=wider, micro_batch_size=1, tensor_parallel_size=1) is None


def _cost(profiles=None, **kw):
    from megatron_hetero.cost.model import CostModel
    from megatron_hetero.hardware.inventory import inventory_from_data

    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1,
                                           "gpus_per_node": 8}]}, source="<test>")
    return CostModel(MODEL, inv, profiles=profiles or {}, **kw)


def test_cost_model_adds_the_pipeline_overhead_to_pipeline_stages_only():
    """Hand-worked: the profile's parts at mbs 1 are layer (1, 2) ms, embedding (0.1, 0.2) ms,
    output (0.5, 1.0) ms; its pipeline overhead at mbs 1 is (1, 2) ms per micro-batch and
    stage."""
    p = load_profile_from(_profile_v2())
    cost = _cost({"A100-SXM-80GB": p})
    one = cost.times(stage("A100-SXM-80GB", 2, place="only"))  # a single stage: no overhead
    assert (one.forward_s, one.backward_s) == pytest.approx((2.6e-3, 5.2e-3))
    first = cost.times(stage("A100-SXM-80GB", 2, place="first"))
    assert (first.forward_s, first.backward_s) == pytest.approx((2.1e-3 + 1e-3, 4.2e-3 + 2e-3))
    middle = cost.times(stage("A100-SXM-80GB", 3, place="middle"))
    assert (middle.forward_s, middle.backward_s) == pytest.approx((4e-3, 8e-3))
    last = cost.times(stage("A100-SXM-80GB", 2, place="last"))
    assert (last.forward_s, last.backward_s) == pytest.approx((2.5e-3 + 1e-3, 5e-3 + 2e-3))


def test_cost_model_overhead_default_without_a_measurement():
    # a format-1 profile measured no pipeline: the option's default, 0, applies
    p = load_profile_from(_profile())
    plain = _cost({"A100-SXM-80GB": p}).times(stage("A100-SXM-80GB", 2, place="first"))
    assert (plain.forward_s, plain.backward_s) == pytest.approx((2.1e-3, 4.2e-3))
    given = _cost({"A100-SXM-80GB": p}, pipeline_overhead_s=(1e-4, 3e-4))
    t = given.times(stage("A100-SXM-80GB", 2, place="first"))
    assert (t.forward_s, t.backward_s) == pytest.approx((2.1e-3 + 1e-4, 4.2e-3 + 3e-4))
    # no profile at all (catalog figures): the same default, and nothing on a single stage
    est = _cost()
    a = est.times(stage("A100-SXM-80GB", 2, place="first"))
    b = est.times(stage("A100-SXM-80GB", 2, place="only"))
    assert a.forward_s < b.forward_s  # the output layer, not an overhead, makes the difference


def test_calibration_script_carries_the_pipeline_overhead_and_latency():
    from megatron_hetero.emulate.prediction import EmulatedProfile

    cal, prof, plan, base, got = _calibration_from_script(_profile_v2())
    assert got.pipeline_overhead[1] == pytest.approx((1e-3, 2e-3))
    assert got.step_overhead[1] == pytest.approx((4e-4, -1e-4))  # the entry's idle penalty
    assert got.p2p_latency_s == 5e-5  # the profile's own alpha
    assert not base.pipeline_overhead and not base.step_overhead  # left alone
    emu_step = EmulatedProfile(device_type="x", factor=3.0, calibration=got).step_overhead(
        model=plan.model, micro_batch_size=1, tensor_parallel_size=1)
    assert emu_step == pytest.approx((1.2e-3, 0.0))  # stretched; negative scatter counts as 0
    # the emulated device stretches the overhead by its factor, like the parts
    emu = EmulatedProfile(device_type="x", factor=3.0, calibration=got)
    assert emu.pipeline_overhead(model=plan.model, micro_batch_size=1,
                                 tensor_parallel_size=1) == pytest.approx((3e-3, 6e-3))
    assert emu.pipeline_overhead(model=plan.model, micro_batch_size=2,
                                 tensor_parallel_size=1) is None


def test_rehearsal_times_its_parts_with_each_devices_idle_gaps(monkeypatch):
    """``rehearse`` calibrates the CPU the way its ranks run: every step followed by the sleep of
    the device the rank plays, factor - 1 times the step; one calibration per distinct factor,
    the fastest device first."""
    from megatron_hetero.emulate import rehearse as R
    from megatron_hetero.emulate.calibration import Calibration
    from megatron_hetero.emulate.speed import device_slowdowns

    asked = []

    class Stop(Exception):
        pass

    metered = []

    def fake_calibrate(shrunk, **kw):
        asked.append(kw["idle_factor"])
        metered.append(kw["meter"])
        if len(asked) == 2:
            raise Stop
        return Calibration()

    monkeypatch.setattr(R, "calibrate", fake_calibrate)
    cal = _calibrate_script()
    _, plan = cal.plans(quick=True)[1]  # A100 and A40
    slow = device_slowdowns(plan)[cal.SLOW]
    assert slow > 1 and device_slowdowns(plan)[cal.FAST] == 1
    with pytest.raises(Stop):
        R.rehearse(plan, R.RehearsalConfig(hidden_size=256, time_scale=3.0))
    assert asked == [pytest.approx(2.0), pytest.approx(3.0 * slow - 1.0, abs=1e-3)]
    asked.clear()
    with pytest.raises(Stop):
        R.rehearse(plan, R.RehearsalConfig(hidden_size=256, time_scale=1.0))
    assert asked[0] == 0.0  # the fastest device runs back to back at factor 1
    assert all(metered)  # the ranks count saved activations by default: so does the calibration
    metered.clear()
    asked.clear()
    with pytest.raises(Stop):
        R.rehearse(plan, R.RehearsalConfig(hidden_size=256, time_scale=1.0, memory_cap=False,
                                           meter_memory=False))
    assert metered == [False, False]  # calibration runs: no accounting, in the ranks or here


def test_predict_takes_one_calibration_per_device():
    """Each emulated device computes at its own calibration's speed; links are the fastest's."""
    from megatron_hetero.emulate.calibration import Calibration
    from megatron_hetero.emulate.prediction import emulated_cluster

    fast = Calibration(layer_flops_per_s=2e9, allreduce_gb_s=1.5,
                       parts={("layer", 1): (1e-3, 2e-3)})
    slow = Calibration(layer_flops_per_s=1e9, allreduce_gb_s=0.5,
                       parts={("layer", 1): (3e-3, 6e-3)})
    factors = {"A": 2.0, "B": 4.0}
    inv, profiles, options = emulated_cluster({"A": 1, "B": 1}, {"A": fast, "B": slow}, factors)
    assert inv.spec("CPU-as-A").bf16_tflops == pytest.approx(2e9 / 2.0 / 1e12)
    assert inv.spec("CPU-as-B").bf16_tflops == pytest.approx(1e9 / 4.0 / 1e12)
    assert inv.spec("CPU-as-B").intra_node_bandwidth_gb_s == pytest.approx(1.5)
    got = profiles["CPU-as-B"].times("layer", model=None, micro_batch_size=1,
                                     tensor_parallel_size=1)
    assert got == pytest.approx((12e-3, 24e-3))  # the slow calibration, stretched 4x


def test_idle_sleeps_the_factor_times_the_step(monkeypatch):
    import time

    from megatron_hetero.emulate.calibration import idle_gap

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    idle_gap(4.0, 0.01)
    idle_gap(0.0, 0.01)
    idle_gap(4.0, 0.0)
    assert slept == [pytest.approx(0.04)]


class _StepProfile:
    """A DeviceProfile with parts of (1, 2) ms per layer and a per-step overhead."""

    device_type = "A100-SXM-80GB"
    efficiency = None

    def times(self, part, *, model, micro_batch_size, tensor_parallel_size):
        return {"layer": (1e-3, 2e-3), "embedding": (1e-4, 2e-4), "output": (5e-4, 1e-3)}[part]

    def step_overhead(self, *, model, micro_batch_size, tensor_parallel_size):
        return (3e-4, 5e-4)


def test_cost_model_adds_the_step_overhead_once_per_step_of_every_stage():
    """Hand-worked: 3 layers on a single stage: 3 x (1, 2) + embedding (0.1, 0.2) + output
    (0.5, 1.0) ms, plus the step overhead (0.3, 0.5) ms once, not per layer; a middle pipeline
    stage of 2 layers: (2, 4) + (0.3, 0.5) ms (no pipeline overhead measured: 0)."""
    cost = _cost({"A100-SXM-80GB": _StepProfile()})
    one = cost.times(stage("A100-SXM-80GB", 3, place="only"))
    assert (one.forward_s, one.backward_s) == pytest.approx((3.9e-3, 7.7e-3))
    mid = cost.times(stage("A100-SXM-80GB", 2, place="middle"))
    assert (mid.forward_s, mid.backward_s) == pytest.approx((2.3e-3, 4.5e-3))
    # a measured profile of a GPU has no step overhead: nothing is added
    assert _cost({"A100-SXM-80GB": load_profile_from(_profile_v2())}).step_overhead(
        "A100-SXM-80GB", 1, 1) == (0.0, 0.0)


def test_measured_activation_bytes_exact_interpolated_and_missing():
    p = load_profile_from(_profile(mbs=(1, 4)))
    assert p.activation_bytes(model=MODEL, micro_batch_size=1, tensor_parallel_size=1) == 500
    # between two measured sizes: linear (activations grow with the micro-batch)
    assert p.activation_bytes(model=MODEL, micro_batch_size=2, tensor_parallel_size=1) == 1000
    assert p.activation_bytes(model=MODEL, micro_batch_size=8, tensor_parallel_size=1) is None
    assert p.activation_bytes(model=MODEL, micro_batch_size=1, tensor_parallel_size=4) is None
    wider = dataclasses.replace(MODEL, hidden_size=128)
    assert p.activation_bytes(model=wider, micro_batch_size=1, tensor_parallel_size=1) is None
    assert p.unfused_attention  # megatron-core's local layers
    te = dataclasses.replace(_profile(), timing=dataclasses.replace(
        _profile().timing, layer_spec="transformer_engine"))
    assert not load_profile_from(te).unfused_attention


def test_cost_model_keeps_what_the_profile_measured_a_layer_keeping():
    """A profile's activation bytes per layer replace the analytic estimate of a layer without
    recompute at the shapes it measured (on an H200 with the local layers the estimate was 35%
    under the allocator's peak, the measurement 6%: docs/gpu.md); recompute stays analytic,
    and the profiled layer spec decides whether attention's s x s matrices are kept."""
    from megatron_hetero import models as M

    measured = _cost({"A100-SXM-80GB": load_profile_from(_profile())})
    analytic = _cost()
    a100 = "A100-SXM-80GB"
    assert measured.layer_activation_bytes(a100, 2, 1, "none") == 1000
    assert analytic.layer_activation_bytes(a100, 2, 1, "none") == M.layer_activation_bytes(
        MODEL, 2, 1, "none", flash_attention=True)  # bf16 catalog entry, no profile
    assert measured.layer_activation_bytes(a100, 8, 1, "none") == M.layer_activation_bytes(
        MODEL, 8, 1, "none", flash_attention=False)  # unmeasured size: local layers, unfused
    for policy in ("selective", "full"):
        assert measured.layer_activation_bytes(a100, 2, 1, policy) == \
            analytic.layer_activation_bytes(a100, 2, 1, policy)
    assert not measured.uses_flash_attention(a100) and analytic.uses_flash_attention(a100)
    # a stage's memory follows: 2 layers of one micro-batch in flight, measured bytes each
    one = stage(a100, 2, place="only", micro_batch_size=2)
    assert measured.memory(one).activations < analytic.memory(one).activations
    # the setting still wins over the profile
    forced = _cost({a100: load_profile_from(_profile())}, flash_attention=True)
    assert forced.uses_flash_attention(a100)
