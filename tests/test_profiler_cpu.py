"""`megatron-hetero profile` on the CPU backend for a tiny model, fed to the tuner's cost model
(tier 3: real megatron-core in subprocesses; TP=2 runs on 2 gloo processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_hetero.cost.profile_file import (
    ProfileUsage, inventory_entry, load_profile,
)
from megatron_hetero.plan import ModelSpec

pytestmark = pytest.mark.slow

TINY = """\
name: tiny
num_layers: 4
hidden_size: 64
ffn_hidden_size: 176
num_attention_heads: 4
num_query_groups: 4
vocab_size: 256
seq_length: 32
"""


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    (tmp / "tiny.yaml").write_text(TINY)
    out = tmp / "cpu-profile.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_hetero.cli", "profile", "--model", str(tmp / "tiny.yaml"),
         "--micro-batch-sizes", "1,2", "--tensor-parallel-sizes", "1,2", "--warmup", "1",
         "--repeats", "3", "-q", "-o", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, out


def _inventory(tmp, profile):
    import yaml
    inv = {"groups": [{"gpu": "CPU", "nodes": 1, "gpus_per_node": 4}],
           "gpus": {"CPU": inventory_entry(profile.data)}}
    path = tmp / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def test_profile_file_contents(profiled):
    _, out = profiled
    p = load_profile(out)
    d = p.data
    assert d.device.backend == "cpu" and d.device.type == "CPU" and d.device.ranks == 2
    assert d.software.megatron_core and d.software.torch
    assert d.timing.layer_spec == "local"
    assert sorted((e.tensor_parallel_size, e.micro_batch_size) for e in d.entries) == \
        [(1, 1), (1, 2), (2, 1), (2, 2)]
    by = {(e.tensor_parallel_size, e.micro_batch_size): e for e in d.entries}
    # saved activations scale with the micro-batch; TP=2 halves the split weights of a layer
    act1, act2 = (by[(1, b)].memory.activation_bytes_per_layer for b in (1, 2))
    assert 1.8 <= act2 / act1 <= 2.2
    p1, p2 = by[(1, 1)].memory.parameter_bytes_per_layer, by[(2, 1)].memory.parameter_bytes_per_layer
    assert 0.45 <= p2 / p1 <= 0.6
    assert by[(2, 1)].clock == "synchronize-wall-clock"  # TP=2 waits for gloo: wall clock
    assert d.communication is not None and d.communication.ranks == 2
    assert all(s.gb_s > 0 for s in d.communication.p2p + d.communication.all_reduce)
    assert d.efficiency is not None and 0 < d.efficiency <= 1
    assert d.format_version == 2 and d.timing.idle_factor == 0
    assert all(e.idle_penalty is None for e in d.entries)  # not asked for
    assert d.communication.p2p_latency_s == pytest.approx(d.communication.p2p[0].seconds, rel=1e-5)
    assert d.communication.p2p_latency_s > 0
    assert d.communication.p2p[0].bytes == 4096  # the smallest message gives the latency


def test_profile_pipeline_section(profiled):
    """The 2-stage pipeline ran through Megatron's 1F1B schedule at each micro-batch size; its
    reference is the sum of the parts of the same file, and the overhead is their difference."""
    _, out = profiled
    d = load_profile(out).data
    pipe = d.pipeline
    assert pipe is not None and pipe.stages == 2 and pipe.layers_per_stage == d.timing.layers
    assert pipe.microbatches == 4
    assert [e.micro_batch_size for e in pipe.entries] == [1, 2]
    by = {e.micro_batch_size: e for e in d.entries if e.tensor_parallel_size == 1}
    n = pipe.layers_per_stage
    for e in pipe.entries:
        parts = by[e.micro_batch_size]
        assert e.first.parts_forward_s == pytest.approx(
            parts.embedding.forward_s + n * parts.layer.forward_s, rel=1e-4)
        assert e.last.parts_backward_s == pytest.approx(
            n * parts.layer.backward_s + parts.output.backward_s, rel=1e-4)
        for st in (e.first, e.last):
            assert st.forward_s > 0 and st.backward_s > 0
        assert e.forward_overhead_s == pytest.approx(
            ((e.first.forward_s - e.first.parts_forward_s)
             + (e.last.forward_s - e.last.parts_forward_s)) / 2, rel=1e-3, abs=1e-8)


def test_idle_factor_measures_the_idle_penalty(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY)
    out = tmp_path / "idle.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_hetero.cli", "profile", "--model",
         str(tmp_path / "tiny.yaml"), "--micro-batch-sizes", "1", "--tensor-parallel-sizes", "1",
         "--warmup", "1", "--repeats", "2", "--no-pipeline", "--no-bandwidth",
         "--idle-factor", "1.5", "-q", "-o", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = load_profile(out).data
    assert d.timing.idle_factor == 1.5
    assert d.pipeline is None and d.communication is None and d.device.ranks == 1
    (entry,) = d.entries
    # measured, per step; its sign and size are the machine's (scatter can make it negative)
    pen = entry.idle_penalty
    assert pen is not None
    assert abs(pen.forward_s) < 10 * entry.layer.forward_s * d.timing.layers
    assert abs(pen.backward_s) < 10 * entry.layer.backward_s * d.timing.layers


def test_idle_penalty_is_the_cost_of_a_step_after_a_gap(monkeypatch):
    """What the idle factor measures, on a clock of the test's own: a forward that follows a
    sleep costs 0.3 s more than one right after other work, a backward 0.5 s more; the penalty
    is exactly those, once per step, whatever the warm-up and repeats (the measured run above
    can only bound it: a real machine's scatter gives either sign)."""
    import torch

    from megatron_hetero.profiler import parts

    state = {"idle": False}
    extra = {"forward": 0.3, "backward": 0.5}
    weight = torch.ones(3, requires_grad=True)

    def fwd():
        return weight * 2.0

    def timer(fn):
        kind = "forward" if fn is fwd else "backward"
        out = fn()
        seconds = {"forward": 1.0, "backward": 2.0}[kind] + (extra[kind] if state["idle"] else 0)
        state["idle"] = False
        return seconds, out

    monkeypatch.setattr(parts.time, "sleep", lambda s: state.__setitem__("idle", s > 0))
    for warmup, repeats in ((0, 1), (1, 3)):
        pen = parts.time_idle_penalty(fwd, timer, warmup, repeats, idle_factor=1.5)
        assert (pen.forward_s, pen.backward_s) == (0.3, 0.5)
    pen = parts.time_idle_penalty(fwd, timer, 1, 3, idle_factor=0.0)  # no gap, no penalty
    assert (pen.forward_s, pen.backward_s) == (0.0, 0.0)


def test_cost_model_uses_measured_figures(profiled):
    from megatron_hetero.cost.model import CostModel
    from megatron_hetero.hardware.inventory import load_inventory

    tmp, out = profiled
    p = load_profile(out)
    inventory = load_inventory(_inventory(tmp, p))
    model = ModelSpec(name="tiny-deeper", num_layers=12, hidden_size=64, ffn_hidden_size=176,
                      num_attention_heads=4, num_query_groups=4, vocab_size=256, seq_length=32)
    usage = ProfileUsage({"CPU": p})
    cost = CostModel(model, inventory, profiles=usage.wrap(), precision="fp32")
    entry = next(e for e in p.data.entries if (e.tensor_parallel_size, e.micro_batch_size) == (1, 2))
    assert cost.layer_times("CPU", 2, 1) == pytest.approx((entry.layer.forward_s,
                                                           entry.layer.backward_s))
    assert cost.output_times("CPU", 2, 1) == pytest.approx((entry.output.forward_s,
                                                            entry.output.backward_s))
    cost.layer_times("CPU", 8, 1)  # not measured: analytic, at the measured efficiency
    report = usage.report(["CPU"])["CPU"]
    assert report["lookups_measured"] == 2 and report["lookups_estimated"] == 1
    assert report["source"] == "partly measured"
    json.dumps(report)  # the tuner's JSON report embeds it
    plain = CostModel(model, inventory, precision="fp32")
    assert plain.layer_times("CPU", 2, 1) != cost.layer_times("CPU", 2, 1)
    assert plain.efficiency("CPU") == cost.efficiency("CPU") == p.efficiency  # via the inventory entry


def test_tune_takes_the_profile_and_says_what_was_measured(profiled):
    import yaml

    tmp, out = profiled
    p = load_profile(out)
    inv = _inventory(tmp, p)
    model = dict(yaml.safe_load(TINY), name="tiny-deeper", num_layers=8)
    (tmp / "tiny-deeper.yaml").write_text(yaml.safe_dump(model))

    def tune(*extra):
        report = tmp / f"report{len(extra)}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_hetero.cli", "tune", str(inv), "--model",
             str(tmp / "tiny-deeper.yaml"), "--global-batch-size", "8", "--micro-batch-sizes",
             "1,2", "--tensor-parallel-sizes", "1,2", "-q", "-o", str(tmp / "plan.yaml"),
             "--report", str(report), *extra],
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(report.read_text()), proc.stdout

    # the search is held to the profiled TP sizes and micro-batch sizes, so whichever plan the
    # (noisy) measured figures favour, every layer lookup of its prediction was measured
    measured, stdout = tune("--profile", str(out))
    src = measured["figure_sources"]["CPU"]
    assert src["profile"] == str(out)
    assert src["lookups_measured"] > 0 and src["lookups_interpolated"] == 0
    assert src["source"] in ("measured", "partly measured")
    plan = yaml.safe_load((tmp / "plan.yaml").read_text())
    assert plan["tensor_model_parallel_size"] in (1, 2)
    assert "figures: CPU:" in stdout and "measured" in stdout
    estimated, stdout = tune()
    assert estimated["figure_sources"]["CPU"]["source"] == "catalog"
    assert "no --profile given" in stdout
    assert measured["predicted_step_time_s"] != estimated["predicted_step_time_s"]
