"""The arguments `args` prints pass Megatron-LM's own parse_args + validate_args (the venv's
megatron-core, 0.19.2, ships megatron.training) and mean the plan's split, sizes and batches."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from megatron_hetero.plan.megatron_args import megatron_args, split_args
from megatron_hetero.plan import load_plan, plan_from_data

from .conftest import EXAMPLE_PLANS, REPO, mcore_environ

BASE = yaml.safe_load((REPO / "tests/data/plan_a100_v100.yaml").read_text())


def _variant(split, *, tp=1, heads=32, groups=32, micro=(1, 1), counts=(70, 58), sp=False,
             offload=0.0, chunks=None, overlap=False, module_inputs=False, group=None):
    data = copy.deepcopy(BASE)
    data["overlap_grad_reduce"] = overlap
    if group is not None:
        data["microbatch_group_size"] = group
    if chunks is not None:  # interleaved: the layers of each stage's model chunks
        split = [sum(c) for c in chunks]
        data["virtual_pipeline_size"] = len(chunks[0])
    data["tensor_model_parallel_size"] = tp
    data["sequence_parallel"] = sp
    data["precision"] = "bf16" if offload else data["precision"]
    data["model"].update(num_layers=sum(split), num_attention_heads=heads, num_query_groups=groups)
    proto = data["pipelines"][0]["stages"][0]
    data["pipelines"] = [
        {"micro_batch_size": m, "num_microbatches": n,
         "stages": [dict(copy.deepcopy(proto), num_layers=k, recompute={"granularity": "none"},
                         device_type="A100-SXM-80GB",
                         offload={"optimizer_fraction": offload if s == 0 else 0.0,
                                  "module_inputs": module_inputs and s == 0})
                    | ({"chunk_layers": list(chunks[s])} if chunks is not None else {})
                    for s, k in enumerate(split)]}
        for m, n in zip(micro, counts)]
    data["global_batch_size"] = sum(m * n for m, n in zip(micro, counts))
    return plan_from_data(data, source="variant")


VARIANTS = {
    "first-last": _variant([14, 18]),
    "layout-zero-first": _variant([0, 11, 11, 10]),
    "layout-uneven-middle": _variant([6, 9, 8, 9]),
    "first-last-3-stage": _variant([5, 9, 9, 9]),
    "even-uniform-dp": _variant([8, 8, 8, 8], counts=(32, 32)),
    "gqa-tp2-uneven-mbs": _variant([16, 16], tp=2, heads=64, groups=8, micro=(2, 1), counts=(20, 24)),
    "sequence-parallel": _variant([16, 16], tp=4, sp=True),
    "optimizer-offload": _variant([16, 16], offload=0.5),
    "interleaved-even": _variant(None, chunks=[[8, 8], [8, 8]], counts=(32, 32)),
    "interleaved-uneven": _variant(None, chunks=[[7, 9], [8, 8]]),
    "interleaved-3x3-empty-ends": _variant(None, chunks=[[0, 4, 4], [4, 4, 4], [4, 4, 0]],
                                           counts=(69, 57)),
    "interleaved-tp2": _variant(None, tp=2, sp=True, chunks=[[3, 5, 4, 4], [4, 4, 4, 4]],
                                counts=(64, 64), overlap=True),
    "overlap-grad-reduce": _variant([14, 18], overlap=True),
    "module-input-offload": _variant([16, 16], module_inputs=True),
    "module-input-offload-interleaved": _variant(None, chunks=[[7, 9], [8, 8]], module_inputs=True),
    "interleaved-group": _variant(None, chunks=[[7, 9], [8, 8]], group=5),  # 70 % 5 = 0, 58 % 5 = 3
}


def test_split_arguments_choose_the_exact_form():
    assert split_args(VARIANTS["first-last"]) == [
        "--decoder-first-pipeline-num-layers", "14", "--decoder-last-pipeline-num-layers", "18"]
    assert split_args(VARIANTS["first-last-3-stage"]) == ["--decoder-first-pipeline-num-layers", "5"]
    assert split_args(VARIANTS["layout-zero-first"]) == [
        "--pipeline-model-parallel-layout", "E|t*11|t*11|t*10L"]
    assert split_args(VARIANTS["even-uniform-dp"]) == []
    # interleaved: one layout segment per virtual stage, chunk-major
    assert split_args(VARIANTS["interleaved-uneven"]) == [
        "--pipeline-model-parallel-layout", "Et*7|t*8|t*9|t*8L"]
    assert split_args(VARIANTS["interleaved-3x3-empty-ends"]) == [
        "--pipeline-model-parallel-layout", "E|t*4|t*4|t*4|t*4|t*4|t*4|t*4|L"]
    assert split_args(VARIANTS["interleaved-even"]) == [
        "--pipeline-model-parallel-layout", "Et*8|t*8|t*8|t*8L"]
    assert "--calculate-per-token-loss" not in megatron_args(VARIANTS["even-uniform-dp"])
    assert "--calculate-per-token-loss" in megatron_args(VARIANTS["first-last"])
    # the interleaved schedule's micro-batch group goes with the layout when the plan sets one
    assert split_args(VARIANTS["interleaved-group"]) == [
        "--pipeline-model-parallel-layout", "Et*7|t*8|t*9|t*8L",
        "--microbatch-group-size-per-virtual-pipeline-stage", "5"]


_CHECKER = textwrap.dedent("""
    import contextlib, io, json, os, sys
    import megatron.training.arguments as margs
    from megatron.training.arguments import parse_args, validate_args
    # validate_args asks the GPU's compute capability when TP > 1; this machine has no GPU, so
    # answer as an H100 would (what the check uses it for is a CUDA_DEVICE_MAX_CONNECTIONS hint).
    margs.get_device_arch_version = lambda: 9
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron_hetero.runtime.arguments import add_hetero_args
    out = []
    for case in json.loads(sys.stdin.read()):
        sys.argv = ["pretrain_gpt.py", *case["argv"]]
        os.environ["WORLD_SIZE"] = str(case["world_size"])
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(extra_args_provider=add_hetero_args)
            validate_args(args)
        pp = args.pipeline_model_parallel_size
        vpp = args.virtual_pipeline_model_parallel_size or 1
        chunks = None
        if args.pipeline_model_parallel_layout is not None:
            layout = args.pipeline_model_parallel_layout
            if isinstance(layout, str):
                layout = PipelineParallelLayerLayout(layout, pp)
            layout.validate_layer_layout(args.num_layers, None)  # what TransformerConfig checks
            assert layout.virtual_pipeline_model_parallel_size == vpp
            chunks = [[layout.layout[r][c].count(LayerType.decoder) for c in range(vpp)]
                      for r in range(pp)]
            split = [sum(row) for row in chunks]
        else:
            first = args.decoder_first_pipeline_num_layers
            last = args.decoder_last_pipeline_num_layers
            rest_stages = pp - (first is not None) - (last is not None)
            rest = args.num_layers - (first or 0) - (last or 0)
            mid = rest // rest_stages if rest_stages else 0
            split = [first if first is not None else mid] + [mid] * (pp - 2) + (
                [last if last is not None else mid] if pp > 1 else [])
            split = split[:pp]
        out.append(dict(tp=args.tensor_model_parallel_size, pp=pp, dp=args.data_parallel_size,
                        vpp=vpp, chunks=chunks, overlap=args.overlap_grad_reduce,
                        group=args.microbatch_group_size_per_vp_stage,
                        split=split, gbs=args.global_batch_size, mbs=args.micro_batch_size,
                        groups=(args.num_query_groups if args.group_query_attention
                                else args.num_attention_heads), per_token=args.calculate_per_token_loss,
                        plan=args.hetero_plan, sp=args.sequence_parallel,
                        precision_aware=args.use_precision_aware_optimizer))
    print("RESULT" + json.dumps(out))
""")


def _cases() -> dict:
    cases = {f"example:{p.relative_to(REPO)}": (load_plan(p), str(p)) for p in EXAMPLE_PLANS}
    cases.update({name: (plan, f"{name}.yaml") for name, plan in VARIANTS.items()})
    return cases


def test_megatron_training_accepts_the_arguments(checked):
    cases = _cases()
    results = checked["accepts"]
    assert len(results) == len(cases)
    for (name, (plan, path)), got in zip(cases.items(), results):
        assert got["tp"] == plan.tensor_model_parallel_size, name
        assert got["pp"] == plan.pipeline_model_parallel_size, name
        assert got["dp"] == plan.data_parallel_size, name
        assert got["split"] == plan.layer_split, name
        assert got["vpp"] == plan.virtual_pipeline_size, name
        assert got["overlap"] == plan.overlap_grad_reduce, name
        assert got["group"] == plan.microbatch_group_size, name
        if plan.virtual_pipeline_size > 1:
            assert got["chunks"] == [s.chunk_layers for s in plan.pipelines[0].stages], name
        assert got["gbs"] == plan.global_batch_size, name
        assert got["mbs"] == plan.pipelines[0].micro_batch_size, name
        assert got["groups"] == plan.model.num_query_groups, name
        assert got["per_token"] == (not plan.uniform_data_parallel), name
        assert got["plan"] == path, name
        assert got["sp"] == plan.sequence_parallel, name
        assert got["precision_aware"] == plan.offloads_optimizer, name


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_arguments_are_one_shell_line(name):
    import shlex

    from megatron_hetero.plan.megatron_args import megatron_args_line
    plan = VARIANTS[name]
    line = megatron_args_line(plan, "my plans/plan.yaml")
    assert shlex.split(line) == megatron_args(plan, "my plans/plan.yaml")
    assert line.endswith("--hetero-plan 'my plans/plan.yaml'")


def test_interleaved_block_recompute_stays_with_the_runtime():
    # Megatron counts --recompute-num-layers per model chunk, the plan per stage (its first
    # layers in chunk order): only the runtime may apply it; uniform means the same in both
    data = VARIANTS["interleaved-uneven"].to_data()
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            stage["recompute"] = {"granularity": "full", "method": "block", "num_layers": 3}
    args = megatron_args(plan_from_data(data))
    assert "--recompute-granularity" not in args and "--recompute-num-layers" not in args
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            stage["recompute"] = {"granularity": "full", "method": "uniform", "num_layers": 1}
    args = megatron_args(plan_from_data(data))
    assert args[args.index("--recompute-method") + 1] == "uniform"


_PER_RANK_CHECKER = textwrap.dedent("""
    import contextlib, io, json, os, sys
    import megatron.core.utils as mcore_utils
    from packaging.version import Version
    from megatron.training.arguments import (core_transformer_config_from_args, parse_args,
                                             validate_args)
    from megatron_hetero.plan import load_plan
    from megatron_hetero.runtime import policies
    from megatron_hetero.runtime.arguments import add_hetero_args
    case = json.loads(sys.stdin.read())
    plan = load_plan(case["plan"])
    out = []
    for pipeline, stage, te_version, v1_env in case["runs"]:
        sys.argv = ["pretrain_gpt.py", *case["argv"], "--no-rope-fusion"]  # no TE here
        os.environ["WORLD_SIZE"] = str(plan.world_size)
        os.environ.pop("NVTE_CPU_OFFLOAD_V1", None)
        if v1_env:
            os.environ["NVTE_CPU_OFFLOAD_V1"] = v1_env
        mcore_utils._te_version = Version(te_version)  # what Megatron's TE check reads
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args(extra_args_provider=add_hetero_args)
            for key, value in policies.stage_args(plan.stage(pipeline, stage)).items():
                if hasattr(args, key) or key.startswith("recompute_"):  # as the hooks do
                    setattr(args, key, value)
            try:
                validate_args(args)
            except AssertionError as exc:
                out.append({"refused": str(exc)})
                continue
            config = core_transformer_config_from_args(args)
        out.append({"args": [args.fine_grained_activation_offloading, args.offload_modules],
                    "config": [config.fine_grained_activation_offloading,
                               config.offload_modules]})
    print("RESULT" + json.dumps(out))
""")


# Both checkers in one subprocess under the venv's megatron-core, each with its own input, in turn
# (the per-rank one sets megatron-core's TE version: it goes second).
_BOTH = textwrap.dedent("""
    import contextlib, io, json, sys
    out = []
    for source, payload in json.loads(sys.stdin.read()):
        sys.stdin, printed = io.StringIO(payload), io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(source, {"__name__": "__main__"})
        out.append(json.loads(printed.getvalue().split("RESULT", 1)[1]))
    print("BOTH" + json.dumps(out))
""")
_OFFLOAD_RUNS = [(0, 0, "0.0.0", None), (0, 1, "0.0.0", None), (0, 0, "2.10.0", None),
                 (0, 0, "2.10.0", "1"), (0, 1, "2.10.0", None)]


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    """What ``_CHECKER`` found for every case of :func:`_cases` (``accepts``) and
    ``_PER_RANK_CHECKER`` for the module-input offload variant's ranks (``per-rank``)."""
    cases = _cases()
    accepts = [{"argv": megatron_args(plan, path), "world_size": plan.world_size}
               for plan, path in cases.values()]
    path = tmp_path_factory.mktemp("per_rank") / "plan.yaml"
    plan = VARIANTS["module-input-offload"]
    path.write_text(yaml.safe_dump(plan.to_data()))
    per_rank = {"plan": str(path), "argv": megatron_args(plan, str(path)), "runs": _OFFLOAD_RUNS}
    proc = subprocess.run([sys.executable, "-c", _BOTH], text=True, capture_output=True,
                          input=json.dumps([[_CHECKER, json.dumps(accepts)],
                                            [_PER_RANK_CHECKER, json.dumps(per_rank)]]),
                          env=mcore_environ(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(["accepts", "per-rank"], json.loads(proc.stdout.split("BOTH", 1)[1])))


def test_module_input_offload_is_set_per_rank_and_megatron_accepts_it(checked, tmp_path):
    """The line has no offload flags (megatron_args' docstring); each rank's own args from
    the plan pass Megatron's validate_args and reach its TransformerConfig, which checks the
    modules. With TE >= 2.10 Megatron asserts NVTE_CPU_OFFLOAD_V1=1 (launch sets it)."""
    from megatron_hetero.mcore.stage_policies import MODULE_INPUTS

    plan = VARIANTS["module-input-offload"]
    argv = megatron_args(plan, str(tmp_path / "plan.yaml"))
    assert not any(a.startswith("--") and "offload" in a for a in argv)
    on, off = [True, list(MODULE_INPUTS)], [False, []]
    assert checked["per-rank"] == [
        {"args": on, "config": on}, {"args": off, "config": off},
        {"refused": "For fine-grained activation offloading with TE >= 2.10.0, "
                    "NVTE_CPU_OFFLOAD_V1 should be set to 1 to avoid offloading weights."},
        {"args": on, "config": on}, {"args": off, "config": off}]
