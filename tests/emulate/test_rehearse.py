"""``megatron-hetero rehearse``: shrinking, host limits, the CLI run, --verify, the memory cap."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_hetero.cli import main
from megatron_hetero.emulate import rehearse
from megatron_hetero.emulate.host import check_host_capacity
from megatron_hetero.emulate.shrink import shrink_plan
from megatron_hetero.errors import HeteroError
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.models import model_preset, shrink_model
from megatron_hetero.plan import plan_from_data

from ..conftest import REPO
from .conftest import assert_prediction_is_the_runs
from .faults import hooks_with_wrong_labels


def _plan_data(stages, pipelines=1, micro=2, model=None, precision="fp16"):
    model = model or {"name": "tiny", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688,
                      "num_attention_heads": 8, "num_query_groups": 8, "vocab_size": 1000,
                      "seq_length": 256}
    return {"format_version": 1, "model": model, "global_batch_size": pipelines * micro,
            "precision": precision, "tensor_model_parallel_size": 1,
            "pipelines": [{"micro_batch_size": 1, "num_microbatches": micro,
                           "stages": [{"device_type": d, "num_layers": n} for d, n in stages]}
                          for _ in range(pipelines)]}


def _write(tmp_path, data, name="plan.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-70b", "llama3-8b"])
@pytest.mark.parametrize("hidden,tp", [(64, 1), (32, 1), (64, 2), (128, 4)])
def test_shrunk_model_is_valid_and_keeps_depth_and_ratios(name, hidden, tp):
    real = model_preset(name)
    m = shrink_model(real, hidden, tp)
    assert m.num_layers == real.num_layers and m.hidden_size == hidden
    assert hidden % m.num_attention_heads == 0 and m.num_attention_heads % m.num_query_groups == 0
    assert m.num_attention_heads % tp == 0 and m.num_query_groups % tp == 0
    assert hidden // m.num_attention_heads >= 8
    r = hidden / real.hidden_size
    assert m.ffn_hidden_size == pytest.approx(real.ffn_hidden_size * r, abs=8 * tp)
    assert m.vocab_size == pytest.approx(real.vocab_size * r, abs=16 * tp)


def test_shrunk_plan_keeps_split_devices_and_micro_batches():
    plan = plan_from_data(_plan_data([("A100-SXM-80GB", 1), ("V100-SXM2-32GB", 3)], pipelines=2))
    shrunk = shrink_plan(plan, 32)
    assert shrunk.layer_split == plan.layer_split
    assert [[s.device_type for s in p.stages] for p in shrunk.pipelines] == \
        [[s.device_type for s in p.stages] for p in plan.pipelines]
    assert [p.num_microbatches for p in shrunk.pipelines] == \
        [p.num_microbatches for p in plan.pipelines]
    assert shrunk.model.hidden_size == 32


def test_too_many_ranks_refused_with_a_hint():
    plan = plan_from_data(_plan_data([("A100-SXM-80GB", 4)], pipelines=17, micro=1))
    with pytest.raises(HeteroError, match=r"17 ranks.*at most 16.*--hidden-size"):
        check_host_capacity(shrink_plan(plan, 32))


@pytest.mark.slow
def test_cli_rehearses_a_two_rank_plan(tmp_path, capsys):
    path = _write(tmp_path, _plan_data([("A100-SXM-80GB", 1), ("V100-SXM2-32GB", 3)]))
    assert main(["rehearse", path, "--steps", "2", "--hidden-size", "32"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if "-SXM" in line and "|" in line]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "0", "A100-SXM-80GB"),
                                                  ("0", "1", "V100-SXM2-32GB")]
    fast, slow = (float(r[5].rstrip("x")) for r in rows)
    a, v = load_catalog().get("A100-SXM-80GB"), load_catalog().get("V100-SXM2-32GB")
    assert slow / fast == pytest.approx(a.achievable_flops / v.achievable_flops, rel=0.01)
    assert "measured/predicted" in out and "losses:" in out


@pytest.mark.slow
def test_verify_names_the_first_diverging_step(tmp_path, capsys, monkeypatch):
    """Replica 1 reads wrong labels from step 1 on (a fault this test injects into the rank
    processes, see tests/emulate/faults.py): --verify of an fp32 plan (exact) must say so."""
    path = _write(tmp_path, _plan_data([("A100-SXM-80GB", 4)], pipelines=2, precision="fp32"))
    monkeypatch.setattr(rehearse, "rehearsal_hooks",
                        functools.partial(hooks_with_wrong_labels, wrong_replica=1))
    assert main(["rehearse", path, "--steps", "2", "--hidden-size", "32", "--verify"]) == 1
    out = capsys.readouterr().out
    assert "verify: FAILED" in out and "step 1: loss" in out
    monkeypatch.undo()
    assert main(["rehearse", path, "--steps", "2", "--hidden-size", "32", "--verify"]) == 0
    assert "verify: losses and final parameters match" in capsys.readouterr().out


@pytest.mark.slow
def test_interleaved_plan_rehearses_and_verifies(tmp_path, capsys):
    """PP=2 with 2 model chunks per stage (1+1 and 3+1 layers), replicas of 4 and 2
    micro-batches on different GPU types: the rehearsal runs Megatron's interleaved schedule on
    4 CPU ranks at each device's speed and --verify matches one process."""
    data = _plan_data([("A100-SXM-80GB", 2), ("A100-SXM-80GB", 4)], pipelines=2, micro=4,
                      precision="fp32")  # exact verification
    data["virtual_pipeline_size"] = 2
    data["model"]["num_layers"] = 6
    slow = data["pipelines"][1]
    slow["num_microbatches"] = 2
    data["global_batch_size"] = 6
    for pipe in data["pipelines"]:
        for stage, chunks in zip(pipe["stages"], ([1, 1], [3, 1])):
            stage["chunk_layers"] = chunks
    for stage in slow["stages"]:
        stage["device_type"] = "V100-SXM2-32GB"
    path = _write(tmp_path, data)
    assert main(["rehearse", path, "--steps", "2", "--hidden-size", "32", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "interleaved: 2 model chunks per stage of [[1, 1], [3, 1]] layers" in out
    rows = [line.split() for line in out.splitlines() if "-SXM" in line and "|" in line]
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [
        ("0", "0", "A100-SXM-80GB", "4"), ("0", "1", "A100-SXM-80GB", "4"),
        ("1", "0", "V100-SXM2-32GB", "2"), ("1", "1", "V100-SXM2-32GB", "2")]
    assert "verify: losses and final parameters match" in out


@pytest.mark.slow
def test_offloading_replica_rehearses_below_its_peak_without_offload(tmp_path, mcore_env):
    """Two replicas of one 4-layer stage (a real layer input of 1024 x 1024 elements: at
    megatron-core's offload threshold), replica 0 offloading its module inputs and half its
    optimizer state, on the venv's megatron-core (0.19.2): the rehearsal runs both offloads (megatron-core's
    offload summary), replica 0's measured peak is below replica 1's, within its cap, and the
    run trains equal to one process (verified in fp32: the CPU stack offloads fp32 only)."""
    model = {"name": "wide", "num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 2816,
             "num_attention_heads": 8, "num_query_groups": 8, "vocab_size": 4000,
             "seq_length": 1024}
    data = _plan_data([("A100-SXM-80GB", 4)], pipelines=2, model=model)
    data.update(precision="bf16", use_distributed_optimizer=True)
    data["pipelines"][0]["stages"][0]["offload"] = {"module_inputs": True,
                                                    "optimizer_fraction": 0.5}
    out = subprocess.run([sys.executable, "-m", "megatron_hetero.cli", "rehearse",
                          _write(tmp_path, data), "--steps", "2", "--hidden-size", "32",
                          "--verify"], env=mcore_env | {"PYTHONWARNINGS": "ignore"},
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    text = out.stdout
    summary = next(line.split() for line in text.splitlines() if line.startswith("Rank 0 "))
    assert float(summary[-1]) > 0  # MB of module inputs replica 0 offloaded in a step
    rows = [line.split() for line in text.splitlines() if "-SXM" in line and "|" in line]
    (peak, cap), (peak_plain, _) = (map(float, r[-2].split("/")) for r in rows)
    assert peak < peak_plain and peak < cap and not rows[0][-2].endswith("!")
    assert "note: offload.module_inputs" not in text
    # a plan that offloads optimizer state verifies exactly, in fp32 (the CPU stack's offload)
    assert "verify: losses and final parameters match" in text and "Adam in fp32" in text


@pytest.mark.slow
def test_plan_that_does_not_fit_fails_like_the_real_card(tmp_path, capsys):
    """28 layers of Llama-2 7B on a 16 GB T4 cannot fit (about 6 GB of weights, 12 GB of fp32
    gradients and Adam state): the rank playing it fails, named with its stage and device."""
    seven_b = {"name": "llama2-7b", "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 11008,
               "num_attention_heads": 32, "num_query_groups": 32, "vocab_size": 32000,
               "seq_length": 4096}
    data = _plan_data([("A100-SXM-80GB", 4), ("T4-16GB", 28)], micro=2, model=seven_b)
    path = _write(tmp_path, data)
    assert main(["rehearse", path, "--steps", "2", "--hidden-size", "32"]) == 1
    err = capsys.readouterr().err
    assert "rank 1 (pipeline 0, stage 1, T4-16GB) ran out of memory" in err
    assert "MiB cap" in err


@pytest.mark.slow
def test_custom_devices_of_the_plan_play_at_their_relative_speed(tmp_path, capsys):
    # The plan carries the entries of its custom types (`gpus:`, as `tune` writes them): no
    # --inventory needed.
    gpu = {"vendor": "Acme", "bf16": True, "fp32_tflops": 10, "memory_gb": 40,
           "memory_bandwidth_gb_s": 1000, "intra_node_link": "PCIe4",
           "intra_node_bandwidth_gb_s": 32, "efficiency": 0.5}
    gpus = {"Acme-Fast": {**gpu, "bf16_tflops": 250.0}, "Acme-Slow": {**gpu, "bf16_tflops": 100.0}}
    data = _plan_data([("Acme-Fast", 3), ("Acme-Slow", 1)])
    data["precision"] = "bf16"
    bare = _write(tmp_path, data, "bare.yaml")
    data["gpus"] = gpus
    path = _write(tmp_path, data)
    assert main(["rehearse", path, "--steps", "2", "--hidden-size", "32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[2:3] in (["Acme-Fast"], ["Acme-Slow"])]
    fast, slow = (float(r[5].rstrip("x")) for r in rows)
    assert slow / fast == pytest.approx(2.5, rel=0.01)
    # without the entries (a hand-written plan) the types are unknown: one clear line, exit 1
    assert main(["rehearse", bare, "--steps", "2"]) == 1
    assert "found 'Acme-Fast'; expected a GPU in the catalog" in capsys.readouterr().err
    # an inventory whose figures differ from the plan's: refused before any rank starts
    inventory = {"gpus": {**gpus, "Acme-Slow": {**gpu, "bf16_tflops": 125.0}},
                 "groups": [{"gpu": "Acme-Fast", "nodes": 1, "gpus_per_node": 1},
                            {"gpu": "Acme-Slow", "nodes": 1, "gpus_per_node": 1}]}
    inv = _write(tmp_path, inventory, "inventory.yaml")
    assert main(["rehearse", path, "--inventory", inv, "--steps", "2"]) == 1
    assert "gpus.Acme-Slow.bf16_tflops: found 100.0; expected 125.0" in capsys.readouterr().err


# -- two vendors: the pipeline edge between them is the host path ---------------------------------
_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "rehearse" / "a100-mi300x"
"""plan.yaml: an A100 stage (NVIDIA, 1 layer) feeding an MI300X stage (AMD, 3 layers), 4
micro-batches; tcp.yaml: one node of each, TCP NICs."""


def test_link_across_vendors_is_the_host_path_as_the_cost_model_prices_it():
    """The rehearsal's link between an A100 and an MI300X rank is the host path (device to
    host, the TCP NIC, host to device): a shrunk message takes the rehearsal's stretch times
    what the cost model charges the real one, and the prediction charges it on the pipeline."""
    from megatron_hetero.placement.host_path import host_path
    from megatron_hetero.cost.model import CostModel
    from megatron_hetero.emulate.calibration import Calibration
    from megatron_hetero.emulate.links import rehearsal_links
    from megatron_hetero.emulate.prediction import predict
    from megatron_hetero.emulate.speed import device_slowdowns
    from megatron_hetero.hardware.inventory import load_inventory
    from megatron_hetero.plan import load_plan

    inventory = load_inventory(str(_EXAMPLES / "tcp.yaml"))
    plan = load_plan(str(_EXAMPLES / "plan.yaml"), catalog=inventory.catalog)
    shrunk = shrink_plan(plan, 64)
    calibration = Calibration(layer_flops_per_s=1e9, allreduce_gb_s=1.0, p2p_latency_s=1e-4,
                              parts={(part, 1): (1e-2, 2e-2)
                                     for part in ("layer", "embedding", "output")})
    factors = device_slowdowns(plan, inventory.catalog)
    assert factors["MI300X-192GB"] == 1.0 and factors["A100-SXM-80GB"] > 2
    links, stretch = rehearsal_links(plan, shrunk, inventory, calibration=calibration,
                                     factor=1.0, latency_s=20e-6)
    staged = host_path(inventory, (0, 1))
    assert links[(0, 1)].host_path == links[(1, 0)].host_path == staged and not staged.rdma
    assert staged.bandwidth_gb_s == pytest.approx(1 / (2 / 25 + 1 / 2.5))
    cost = CostModel(plan.model, inventory, precision="bf16")
    assert stretch == pytest.approx(0.03 / sum(cost.layer_times("MI300X-192GB", 1, 1)))
    real = cost.p2p_seconds(1, staged.bandwidth_gb_s)  # 20 us + the bytes over the legs
    shrunk_bytes = 4.0 * shrunk.model.seq_length * shrunk.model.hidden_size
    assert links[(0, 1)].seconds(shrunk_bytes) == pytest.approx(stretch * real)
    alone = predict(shrunk, calibration, factors).step_time_s
    staged_step = predict(shrunk, calibration, factors, links=links).step_time_s
    assert staged_step > alone + 2 * links[(0, 1)].seconds(shrunk_bytes)  # fill and drain


@pytest.mark.slow
def test_two_vendor_rehearsal_waits_its_emulated_links():
    """A100 -> MI300X with the edge staged through the hosts over TCP NICs (the link is about
    half of the step), rehearsed once: the report names the host path's legs; the measured step
    and the prediction are there, the prediction made from the run's own CPU time and charging
    the link on the fill and the drain beside the slowest stage's compute; every measured step
    lasts at least the link waits the emulation owes the first stage (each of its m forward
    sends held until the message arrives, then the last backward's crossing back: m + 1
    crossings, sleeps that no load shortens). How close the measured step comes to the
    prediction (issue 14: within 10%, median of 3) is a benchmark's figure:
    ``scripts/bench_mesh_rehearse.py --plans a100-mi300x-tcp,a100-mi300x-rdma``."""
    from megatron_hetero.hardware.inventory import load_inventory
    from megatron_hetero.plan import load_plan

    inventory = load_inventory(str(_EXAMPLES / "tcp.yaml"))
    plan = load_plan(str(_EXAMPLES / "plan.yaml"), catalog=inventory.catalog)
    config = rehearse.RehearsalConfig(steps=3, time_scale=3.0, emulate_links=True)
    result = rehearse.rehearse(plan, config, inventory=inventory)
    out = rehearse.format_report(result)
    assert ("host-staged: ranks 0 <-> 1 (A100-SXM-80GB <-> MI300X-192GB): device-to-host "
            "25 GB/s, network 2.5 GB/s (TCP), host-to-device 25 GB/s one after another: "
            "2.08 GB/s + 20 us a message") in out
    assert result.step_s > 0 and result.predicted_step_s > 0 and result.a_priori_step_s > 0
    assert_prediction_is_the_runs(result)
    m, pipe = result.plan.model, result.plan.pipelines[0]
    link = result.links[(0, 1)].seconds(4.0 * pipe.micro_batch_size * m.seq_length
                                        * m.hidden_size)  # one fp32 [s, b, h] message
    assert link > 0
    crossings = pipe.num_microbatches + 1
    assert min(result.step_times) >= crossings * link, (result.step_times, link)
    busiest = max(st.predicted_busy_s for st in result.stages)
    assert result.predicted_step_s >= busiest + 2 * link
