"""The hooks on Megatron-LM's own argument path (megatron-core ships megatron.training):
``parse_args`` gets ``--hetero-plan`` through the hooked extra-args provider, ``validate_args``
gets the plan's arguments, this rank's placement and stage policies; conflicts are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from megatron_hetero.plan import save_plan

from ..conftest import mcore_environ
from .plans import A100, V100, make_plan

_CHECKER = textwrap.dedent("""
    import contextlib, io, json, os, socket, sys
    import torch.distributed as dist
    import megatron.training.arguments as margs
    margs.get_device_arch_version = lambda: 9  # no GPU here; validate_args asks for TP > 1
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    from megatron_hetero.runtime import hooks, placement
    from megatron_hetero.runtime.placement import RankInfo
    from megatron_hetero.errors import HeteroError
    runtime = hooks.install()
    assert hooks.install() is runtime and hooks.installed() is runtime  # one per process
    try:  # the names Megatron uses: megatron-core 0.17's initialize
        from megatron.training.initialize import parse_args, validate_args
    except ImportError:  # 0.19: parse_and_validate_args calls its own module's two
        from megatron.training.arguments import parse_args, validate_args
    out = []
    for case in json.loads(sys.stdin.read()):
        # the other launcher ranks' reports, as the rendezvous store would hold them
        store = dist.HashStore()
        for r, t in enumerate(case["types"]):
            store.set(f"megatron_hetero/placement/0/{r}", RankInfo(launcher_rank=r,
                      device_type=t, host=socket.gethostname(), local_rank=r).to_json())
        placement._launcher_store = lambda *a, **k: store
        os.environ.update(WORLD_SIZE=str(len(case["types"])), RANK=str(case["rank"]), LOCAL_RANK=str(case["rank"]),
                          MEGATRON_HETERO_DEVICE_TYPE=case["types"][case["rank"]])
        sys.argv = ["pretrain_gpt.py", *case["argv"]]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                args = parse_args()
                validate_args(args)
        except HeteroError as exc:
            out.append({"error": str(exc)})
            continue
        keys = ["rank", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                "data_parallel_size", "num_layers", "hidden_size", "micro_batch_size",
                "global_batch_size", "calculate_per_token_loss", "recompute_granularity",
                "recompute_method", "recompute_num_layers", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "seq_length", "lr",
                "virtual_pipeline_model_parallel_size", "overlap_p2p_comm",
                "fine_grained_activation_offloading", "offload_modules"]
        got = {k: getattr(args, k, None) for k in keys}
        got["layout"] = str(args.pipeline_model_parallel_layout)
        st = runtime.state
        got["slot"] = [st.slot.pipeline, st.slot.stage]
        got["virtual"] = st.virtual_num_microbatches
        out.append(got)
    print("RESULT" + json.dumps(out))
""")


def _run(env, cases):
    proc = subprocess.run([sys.executable, "-c", _CHECKER], input=json.dumps(cases), text=True,
                          capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


_LAUNCHER_TYPES = [V100, A100, A100, V100]  # differs from the plan's A100, A100, V100, V100


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    """``{test: (plan, [result per case])}``: every case of the tests below through Megatron's
    own parse_args and validate_args, all in one subprocess under the venv's megatron-core."""
    root = tmp_path_factory.mktemp("training_path")
    plan = make_plan(split=(1, 3), devices=[[A100, V100], [A100, V100]],
                     replicas=[(1, 3), (1, 1)],
                     recompute=[None, {"granularity": "full", "method": "uniform", "num_layers": 1}])
    path = str(root / "plan.yaml")
    save_plan(plan, path)
    interleaved = make_plan(chunks=[[1, 1], [2, 1]], devices=[[A100, V100]] * 2,
                            replicas=[(1, 4), (1, 2)])
    ipath = str(root / "interleaved.yaml")
    save_plan(interleaved, ipath)
    offloading = make_plan(split=(2, 2), devices=[[A100, V100]], replicas=[(1, 2)],
                           offload=[{"module_inputs": True}, None])
    opath = str(root / "offloading.yaml")
    save_plan(offloading, opath)
    local = ["--transformer-impl", "local", "--hetero-plan", opath]
    good, itypes = [A100, A100, V100, V100], [A100, A100, V100, V100]
    cases = {
        "applies": (plan, [{"argv": ["--lr", "0.001", "--hetero-plan", path],
                            "types": _LAUNCHER_TYPES, "rank": r} for r in range(4)]),
        "conflicts": (plan, [
            {"argv": ["--pipeline-model-parallel-size", "8", "--hetero-plan", path],
             "types": good, "rank": 0},
            {"argv": ["--num-layers", "4", "--hidden-size", "32", "--hetero-plan", path],
             "types": good, "rank": 0},
            {"argv": ["--recompute-granularity", "selective", "--hetero-plan", path],
             "types": good, "rank": 0},
            {"argv": ["--hetero-plan", path], "types": [A100, V100, V100, V100], "rank": 2},
            {"argv": ["--hetero-plan", path], "types": good + [A100], "rank": 1},
        ]),
        "interleaved": (interleaved, [
            *({"argv": ["--hetero-plan", ipath], "types": itypes, "rank": r} for r in range(4)),
            {"argv": ["--num-virtual-stages-per-pipeline-rank", "2", "--hetero-plan", ipath],
             "types": itypes, "rank": 0},
            {"argv": ["--no-overlap-p2p-communication", "--hetero-plan", ipath],
             "types": itypes, "rank": 0}]),
        "module_inputs": (offloading, [
            *({"argv": local, "types": [A100, V100], "rank": r} for r in range(2)),
            {"argv": ["--hetero-plan", opath], "types": [A100, V100], "rank": 0}]),
    }
    results = _run(mcore_environ(), [c for _, test in cases.values() for c in test])
    out = {}
    for name, (p, test) in cases.items():
        out[name], results = (p, results[:len(test)]), results[len(test):]
    return out


def test_megatron_training_path_applies_the_plan(checked):
    plan, results = checked["applies"]
    # launcher order V100, A100, A100, V100 differs from the plan's A100, A100, V100, V100
    types = _LAUNCHER_TYPES
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    for launcher, got in enumerate(results):
        slot = plan.slot_of_rank(got["rank"])
        assert [slot.pipeline, slot.stage] == got["slot"]
        assert plan.stage(slot.pipeline, slot.stage).device_type == types[launcher]
        assert (got["tensor_model_parallel_size"], got["pipeline_model_parallel_size"],
                got["data_parallel_size"]) == (1, 2, 2)
        assert got["num_layers"] == 4 and got["hidden_size"] == plan.model.hidden_size
        assert got["decoder_first_pipeline_num_layers"] == 1
        assert got["decoder_last_pipeline_num_layers"] == 3
        assert got["global_batch_size"] == 4 and got["calculate_per_token_loss"] is True
        # Megatron's accounting: micro-batch size x DP x count = the global batch
        assert got["micro_batch_size"] * 2 * got["virtual"] == 4
        assert got["lr"] == 0.001  # not the plan's business: passes through
        if slot.stage == 1:
            assert (got["recompute_granularity"], got["recompute_method"],
                    got["recompute_num_layers"]) == ("full", "uniform", 1)
        else:
            assert got["recompute_granularity"] is None


def test_conflicts_and_mismatches_are_clear_errors(checked):
    _, results = checked["conflicts"]
    assert "--pipeline-model-parallel-size: the command line has 8; the plan implies 2" in \
        results[0]["error"]
    assert "--hidden-size: the command line has 32; the plan implies 16" in results[1]["error"]
    assert "--num-layers" not in results[1]["error"]  # agrees with the plan
    assert "--recompute-granularity" in results[2]["error"]
    assert f"{A100}: plan wants 2, found 1" in results[3]["error"]
    assert "needs world size 4" in results[4]["error"] and "started 5" in results[4]["error"]


def test_interleaved_plan_sets_virtual_pipeline_stages(checked):
    """Megatron's own validate_args takes the virtual pipeline size from the plan's layout (p x v
    segments) and keeps overlapped p2p (which its interleaved schedule needs on 2 stages)."""
    _, (*ranks, agreeing, refused) = checked["interleaved"]
    for got in ranks + [agreeing]:
        assert got["virtual_pipeline_model_parallel_size"] == 2
        assert got["layout"] == "Et|t*2|t|tL" and got["overlap_p2p_comm"] is True
        assert got["pipeline_model_parallel_size"] == 2 and got["num_layers"] == 5
        assert got["micro_batch_size"] * 2 * got["virtual"] == 6
    assert "--no-overlap-p2p-communication" in refused["error"]


def test_module_input_offload_passes_megatrons_checks_with_the_local_layers(checked):
    """Megatron-LM's validate_args asserts Transformer Engine for fine-grained activation
    offloading; megatron-core's local layers run it too (runtime/stack.py, measured on a
    GPU in docs/gpu.md): with --transformer-impl local the offloading stage keeps it. Without TE
    (this machine) the default layers are refused before anything is built."""
    _, (offloading, other, default_layers) = checked["module_inputs"]
    assert offloading["slot"] == [0, 0] and offloading["fine_grained_activation_offloading"]
    assert offloading["offload_modules"]
    assert other["slot"] == [0, 1] and not other["fine_grained_activation_offloading"]
    assert ("pipelines[0].stages[0].offload.module_inputs: megatron-core's fine-grained "
            "activation offloading runs on Transformer Engine's layers, which is not installed"
            ) in default_layers["error"]
