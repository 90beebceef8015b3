"""Each hook on its own: the argument check, the policies, the extra-args provider, the
per-replica schedule wrapper, the replica data loader and the stage config."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from megatron_hetero.plan import chunk_recompute, mesh_plan_from_data
from megatron_hetero.hardware.optional import have_transformer_engine
from megatron_hetero.runtime import hooks, plan_args, policies
from megatron_hetero.runtime.core_run import CoreBackend, CoreRankState, check_warmup_args
from megatron_hetero.runtime.plan_args import ArgumentConflict, check_and_apply

from .plans import A100, V100, make_mesh_plan, make_plan

FULL = {"granularity": "full", "method": "block", "num_layers": 1}


def _args(**kw):
    base = dict(pipeline_model_parallel_layout=None, micro_batch_size=None,
                recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_plan_fills_what_the_command_line_leaves_out():
    plan = make_plan(split=(1, 3), replicas=[(2, 3), (1, 2)])  # gbs 8, uneven
    args = _args(tensor_model_parallel_size=1, lr=0.1)
    check_and_apply(args, plan, ["--lr", "0.1"])
    assert args.pipeline_model_parallel_size == 2 and args.num_layers == 4
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (1, 3)
    assert args.global_batch_size == 8 and args.calculate_per_token_loss is True
    assert args.micro_batch_size == plan_args.virtual_micro_batch_size(plan) == 2
    assert args.add_bias_linear is False and args.swiglu is True and args.lr == 0.1


def test_layout_given_by_the_user_must_be_the_plans():
    plan = make_plan(split=(0, 2, 2))
    args = _args(pipeline_model_parallel_layout="E|t*2|t*2L")
    check_and_apply(args, plan, ["--pipeline-model-parallel-layout", "E|t*2|t*2L"])
    with pytest.raises(ArgumentConflict, match="plan implies 'E\\|t\\*2\\|t\\*2L'"):
        check_and_apply(_args(pipeline_model_parallel_layout="Et|t|ttL"), plan,
                        ["--pipeline-model-parallel-layout", "Et|t|ttL"])


def test_every_conflict_is_listed_once():
    plan = make_plan(split=(2, 2))
    args = _args(pipeline_model_parallel_size=8, tensor_model_parallel_size=1, hidden_size=64,
                 decoder_first_pipeline_num_layers=1, fp16=True, max_position_embeddings=4)
    with pytest.raises(ArgumentConflict) as err:
        check_and_apply(args, plan, ["--pipeline-model-parallel-size", "8", "--hidden-size=64",
                                     "--tensor-model-parallel-size", "1", "--fp16",
                                     "--decoder-first-pipeline-num-layers", "1",
                                     "--max-position-embeddings", "4"], source="p.yaml")
    text = str(err.value)
    assert text.startswith("p.yaml: the command line contradicts the plan")
    for flag in ("--pipeline-model-parallel-size", "--hidden-size", "--fp16",
                 "--decoder-first-pipeline-num-layers", "--max-position-embeddings"):
        assert text.count(f"  {flag}:") == 1, flag
    assert "--tensor-model-parallel-size" not in text


def test_global_batch_not_divisible_by_replicas_is_refused():
    plan = make_plan(replicas=[(2, 1), (1, 1)])  # gbs 3 over 2 replicas
    with pytest.raises(ArgumentConflict, match="not a multiple of the data-parallel size 2"):
        plan_args.virtual_micro_batch_size(plan)


def test_stage_policies_as_args_and_config():
    plan = make_plan(split=(2, 2), recompute=[FULL, {"granularity": "selective"}],
                     offload=[{"optimizer_fraction": 0.5}, None])
    s0, s1 = plan.stage(0, 0), plan.stage(0, 1)
    assert policies.stage_args(s0) == {"recompute_granularity": "full", "recompute_method": "block",
                                       "recompute_num_layers": 1, "optimizer_cpu_offload": True,
                                       "optimizer_offload_fraction": 0.5,
                                       "fine_grained_activation_offloading": False,
                                       "offload_modules": []}
    assert policies.stage_args(s1)["recompute_granularity"] == "selective"
    assert policies.stage_args(s1)["optimizer_cpu_offload"] is False


def test_optimizer_offload_with_fp32_params_is_refused_on_every_device(monkeypatch):
    # megatron-core's HybridDeviceOptimizer rejects the distributed optimizer's fp32 shards on
    # a GPU; the runtime refuses it on CPU ranks too, as validate does (the CPU mode changes
    # only device and backend)
    offload = [{"optimizer_fraction": 0.5}, None]
    with pytest.raises(policies.PolicyUnsupported) as err:
        policies.check_supported(make_plan(split=(2, 2), offload=offload), source="p.yaml")
    assert "pipelines[0].stages[0].offload.optimizer_fraction: megatron-core's CPU-offload " \
           "optimizer does not run with fp32 parameters" in str(err.value)
    assert "stages[1]" not in str(err.value)
    policies.check_supported(make_plan(split=(2, 2), offload=offload, precision="bf16"))
    monkeypatch.setattr(policies, "cpu_backend_enabled", lambda: True)
    with pytest.raises(policies.PolicyUnsupported, match="fp32 parameters"):
        policies.check_supported(make_plan(split=(2, 2), offload=offload))


def test_unsupported_policies_are_refused_at_start():
    plan = make_plan(split=(2, 2), offload=[{"activations": True}, {"optimizer_fraction": 0.3}])
    with pytest.raises(policies.PolicyUnsupported) as err:
        policies.check_supported(plan, source="p.yaml", use_precision_aware_optimizer=False)
    text = str(err.value)
    assert "pipelines[0].stages[0].offload.activations" in text and "PP=2" in text
    assert "pipelines[0].stages[1].offload.optimizer_fraction" in text
    assert "--use-precision-aware-optimizer" in text
    # one stage: megatron-core's config accepts activation offload; it then needs TE to run
    assert policies.activation_offload_supported(1)
    one_stage = make_plan(split=(2,), offload=[{"activations": True}])
    if have_transformer_engine():
        policies.check_supported(one_stage)
    else:
        with pytest.raises(policies.PolicyUnsupported, match="Transformer Engine"):
            policies.check_supported(one_stage)
    with pytest.raises(policies.PolicyUnsupported, match="together with recompute"):
        policies.check_supported(make_plan(split=(2,), offload=[{"activations": True}],
                                           recompute=[FULL]))


def test_unsupported_policies_of_a_mesh_plan_are_refused_with_their_mesh_path():
    """A mesh plan's stages are checked as a format-1 plan's, each named by its mesh and
    stage (every rank of a mesh plan runs its own stage's policies)."""
    data = make_mesh_plan([(1, 1, [2], None), (2, 1, [2], None)]).to_data()
    data["meshes"][0]["stages"][0]["offload"] = {"optimizer_fraction": 0.5,
                                                 "module_inputs": True}
    data["meshes"][1]["stages"][0]["offload"] = {"activations": True}
    plan = mesh_plan_from_data(data, source="p.yaml")
    with pytest.raises(policies.PolicyUnsupported) as err:
        policies.check_supported(plan, source="p.yaml", use_precision_aware_optimizer=False)
    text = str(err.value)
    assert text.startswith("p.yaml: ")
    assert "meshes[1].stages[0].offload.activations" in text and "PP=2" in text
    assert "meshes[0].stages[0].offload.optimizer_fraction" in text
    assert "--use-precision-aware-optimizer" in text
    assert "pipelines[" not in text


def test_the_backend_follows_the_plans_shape():
    """megatron-core's own schedules where every stage shares TP and DP, the multimodule
    backend otherwise, with the chain's own schedule where its stages run model chunks or warm
    up beyond Megatron's; all are Backends (the hooks' one interface)."""
    from megatron_hetero.runtime.backend import Backend
    from megatron_hetero.runtime.mesh_chunks import InterleavedMeshBackend
    from megatron_hetero.runtime.mesh_run import MeshBackend

    assert hooks.backend_class(make_plan(split=(2, 2))) is CoreBackend
    mesh = make_mesh_plan([(1, 1, [2], None), (2, 1, [2], None)])
    assert hooks.backend_class(mesh) is MeshBackend
    chunked = make_mesh_plan([(1, 1, [2], None), (2, 1, [2], None)],
                             chunks={0: [[1, 1]], 1: [[1, 1]]})
    assert hooks.backend_class(chunked) is InterleavedMeshBackend
    warm = make_mesh_plan([(1, 1, [2], None), (2, 1, [2], None)], warmups={0: [2]})
    assert warm.own_chain_schedule and hooks.backend_class(warm) is InterleavedMeshBackend
    assert issubclass(InterleavedMeshBackend, MeshBackend)
    assert issubclass(CoreBackend, Backend) and issubclass(MeshBackend, Backend)
    assert hooks.Runtime().state is None  # a fresh process's: no plan yet


def test_extra_args_provider_adds_the_plugin_arguments_once():
    calls = []

    def user_provider(parser):
        calls.append(1)
        parser.add_argument("--mine", type=int)
        return parser

    parser = hooks.with_hetero_args(user_provider)(argparse.ArgumentParser())
    parsed = parser.parse_args(["--mine", "3", "--hetero-plan", "p.yaml"])
    assert calls == [1] and parsed.mine == 3 and parsed.hetero_plan == "p.yaml"
    again = hooks.with_hetero_args(hooks.with_hetero_args(None))(argparse.ArgumentParser())
    assert again.parse_args(["--hetero-device-type", "H100"]).hetero_device_type == "H100"


def _backend(plan, megatron_rank, args=None) -> CoreBackend:
    """A fresh format-1 backend of Megatron rank ``megatron_rank`` (what ``validate_args``
    starts)."""
    st = CoreRankState(plan=plan, plan_path="p.yaml", launcher_rank=megatron_rank,
                       megatron_rank=megatron_rank, device_type=A100,
                       slot=plan.slot_of_rank(megatron_rank), args=args)
    return CoreBackend(state=st)


def test_schedule_wrapper_runs_this_replicas_micro_batches():
    plan = make_plan(replicas=[(2, 3), (1, 2)])  # gbs 8, virtual mbs 2, 2 micro-batches
    args = SimpleNamespace(micro_batch_size=2)
    backend = _backend(plan, 1, args)
    backend.state.virtual_num_microbatches = 2
    seen = []

    def schedule(**kw):
        seen.append((kw["num_microbatches"], kw["micro_batch_size"], args.micro_batch_size))
        return "losses"

    wrapped = backend.replica_forward_backward(schedule)
    assert wrapped(num_microbatches=2, micro_batch_size=2, forward_only=False) == "losses"
    assert seen == [(2, 1, 1)] and args.micro_batch_size == 2  # restored after the step
    wrapped(num_microbatches=5, micro_batch_size=2)  # not Megatron's step count: untouched
    assert seen[-1] == (5, 2, 2)


def test_evaluation_keeps_the_shares_its_loader_cuts_after_rebalancing():
    """Live rebalancing switches the training shares (``state.plan``) and the training
    sampler; the evaluation loaders keep the start's slices, so a forward-only step runs the
    start's count (``eval_plan``) while a training step runs the new one."""
    plan = make_plan(replicas=[(1, 3), (1, 3)])
    args = SimpleNamespace(micro_batch_size=1)
    backend = _backend(plan, 1, args)
    backend.state.virtual_num_microbatches = 6
    backend.eval_plan = plan
    backend.state.plan = make_plan(replicas=[(1, 5), (1, 1)])  # what a switch leaves
    seen = []
    wrapped = backend.replica_forward_backward(
        lambda **kw: seen.append((kw["forward_only"], kw["num_microbatches"])))
    wrapped(num_microbatches=6, micro_batch_size=1, forward_only=False)
    wrapped(num_microbatches=6, micro_batch_size=1, forward_only=True)
    assert seen == [(False, 1), (True, 3)]


def test_replica_loader_reads_its_share():
    torch = pytest.importorskip("torch")
    plan = make_plan(replicas=[(2, 1), (1, 2)])  # gbs 4: replica 0 takes 0-1, replica 1 2-3
    backend = _backend(plan, 1, SimpleNamespace(num_workers=0))
    data = torch.arange(12)
    loader = backend.replica_data_loader(data, 4)
    assert [b.tolist() for b in loader] == [[6], [7], [10], [11]]


def test_stage_config_hook_sets_exactly_this_stages_recompute():
    from megatron.core.transformer.transformer_config import TransformerConfig

    plan = make_plan(split=(2, 2), devices=[[A100, V100]], recompute=[None, FULL])
    for rank, want in ((0, None), (1, "full")):
        config = _backend(plan, rank).apply_stage_config(
            TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4))
        assert config.recompute_granularity == want
        assert config.recompute_method == ("block" if want else None)
    untouched = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4,
                                  recompute_granularity="selective")
    # no plan: the hooks' config wrapper calls straight through
    no_plan = hooks.Runtime().wrap("transformer_config", lambda: untouched)
    assert no_plan().recompute_granularity == "selective"


# -- interleaved plans (virtual pipeline stages) ---------------------------------------------------
INTERLEAVED = dict(chunks=[[1, 1], [2, 1]], replicas=[(1, 4), (1, 2)])  # layout Et|t*2|t|tL


def test_interleaved_plan_implies_its_layout():
    plan = make_plan(**INTERLEAVED)
    args = _args(tensor_model_parallel_size=1)
    check_and_apply(args, plan, [])
    assert args.pipeline_model_parallel_layout == "Et|t*2|t|tL"  # p x v segments
    assert args.pipeline_model_parallel_size == 2 and args.num_layers == 5
    assert not hasattr(args, "decoder_first_pipeline_num_layers")


@pytest.mark.parametrize("argv, agrees", [
    (["--num-virtual-stages-per-pipeline-rank", "2"], True),
    (["--num-virtual-stages-per-pipeline-rank", "3"], False),
    (["--num-layers-per-virtual-pipeline-stage", "1"], False),  # chunks differ: 1,2,1,1
    (["--no-overlap-p2p-communication"], False),
])
def test_virtual_stage_flags_must_agree_with_the_plan(argv, agrees):
    plan = make_plan(**INTERLEAVED)
    dest = argv[0][2:].replace("-", "_")
    value = int(argv[1]) if len(argv) > 1 else False
    args = _args(**{"overlap_p2p_comm" if dest.startswith("no_") else dest: value})
    if agrees:
        check_and_apply(args, plan, argv)
        assert getattr(args, dest) is None  # the layout carries it (Megatron takes one)
    else:
        with pytest.raises(ArgumentConflict, match=argv[0]):
            check_and_apply(args, plan, argv)


GROUP = "--microbatch-group-size-per-virtual-pipeline-stage"


def test_micro_batch_group_comes_from_the_plan():
    grouped = make_plan(chunks=[[1, 1], [2, 1]], replicas=[(1, 6), (1, 4)], group=4)
    args = _args(tensor_model_parallel_size=1)
    check_and_apply(args, grouped, [])
    assert args.microbatch_group_size_per_vp_stage == 4  # Megatron's attribute for the flag
    check_and_apply(_args(microbatch_group_size_per_vp_stage=4), grouped, [GROUP, "4"])
    with pytest.raises(ArgumentConflict, match=GROUP + ": the command line has 2; the plan implies 4"):
        check_and_apply(_args(microbatch_group_size_per_vp_stage=2), grouped, [GROUP, "2"])
    # a plan without a group was predicted with Megatron's default, the pipeline size
    plain = make_plan(**INTERLEAVED)
    check_and_apply(_args(microbatch_group_size_per_vp_stage=2), plain, [GROUP, "2"])
    with pytest.raises(ArgumentConflict, match=GROUP + ": the command line has 3; the plan implies "
                                               "Megatron's default group"):
        check_and_apply(_args(microbatch_group_size_per_vp_stage=3), plain, [GROUP, "3"])
    with pytest.raises(ArgumentConflict, match="the plan does not interleave"):
        check_and_apply(_args(microbatch_group_size_per_vp_stage=2), make_plan(split=(2, 2)),
                        [GROUP, "2"])


def test_virtual_stage_flags_on_a_plan_without_them():
    even = make_plan(chunks=[[1, 1], [1, 1]], replicas=[(1, 2)])
    args = _args(num_layers_per_virtual_pipeline_stage=1)
    check_and_apply(args, even, ["--num-layers-per-virtual-pipeline-stage", "1"])
    assert args.num_layers_per_virtual_pipeline_stage is None
    with pytest.raises(ArgumentConflict, match="no virtual pipeline stages"):
        check_and_apply(_args(num_virtual_stages_per_pipeline_rank=2), make_plan(split=(2, 2)),
                        ["--num-virtual-stages-per-pipeline-rank", "2"])


def test_stage_recompute_on_every_model_chunk():
    """Block recompute of 3 layers on a stage with chunks 2+2 covers chunk 0 and 1 layer of
    chunk 1; the get_model hook tells the config hook which chunk is being built."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    block3 = {"granularity": "full", "method": "block", "num_layers": 3}
    plan = make_plan(chunks=[[1, 1], [2, 2]], replicas=[(1, 2)], recompute=[None, block3])
    stage = plan.stage(0, 1)
    assert [r.num_layers for r in chunk_recompute(stage.recompute, stage.chunk_layers)] == [2, 1]
    built = []

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, **_):
        config = backend.apply_stage_config(TransformerConfig(num_layers=6, hidden_size=16,
                                                              num_attention_heads=4))
        built.append((vp_stage, config.recompute_granularity, config.recompute_num_layers))

    def get_model(model_provider_func, model_type=None, wrap_with_ddp=True):
        for i in range(2):
            model_provider_func(pre_process=i == 0, post_process=i == 1, vp_stage=i)

    for rank in (0, 1):
        backend = _backend(plan, rank)
        backend.get_model(get_model, provider)
    assert "4 layers in chunks 2+2;" in backend.state.describe()
    assert built == [(0, None, None), (1, None, None), (0, "full", 2), (1, "full", 1)]
    assert backend.building_chunk is None


def test_uniform_recompute_must_divide_every_chunk():
    uniform2 = {"granularity": "full", "method": "uniform", "num_layers": 2}
    policies.check_supported(make_plan(chunks=[[2, 2], [2, 2]], replicas=[(1, 2)],
                                       recompute=[uniform2, None]))
    with pytest.raises(policies.PolicyUnsupported,
                       match=r"pipelines\[0\]\.stages\[1\]\.recompute\.num_layers"):
        policies.check_supported(make_plan(chunks=[[1, 1], [2, 1]], replicas=[(1, 2)],
                                           recompute=[None, uniform2]))


def test_what_the_warmup_schedule_cannot_run_is_refused_at_start():
    from megatron_hetero.errors import HeteroError
    from megatron_hetero.plan import plan_from_data

    plain = make_plan(split=(1, 2), replicas=[(1, 4)])
    data = plain.to_data()
    data["pipelines"][0]["stages"][0]["warmup_microbatches"] = 3
    warm = plan_from_data(data)
    bad = SimpleNamespace(variable_seq_lengths=True, use_ring_exchange_p2p=True,
                          cuda_graph_impl="none")
    check_warmup_args(plain, bad, source="p.yaml")  # Megatron's schedule runs them
    check_warmup_args(warm, SimpleNamespace(), source="p.yaml")
    with pytest.raises(HeteroError, match=r"p\.yaml: the plan's per-stage warm-up "
                       r"\(warmup_microbatches\) runs a schedule that does not support variable "
                       r"sequence lengths .*; ring-exchange p2p"):
        check_warmup_args(warm, bad, source="p.yaml")


def test_runtime_modules_keep_no_rank_state():
    """What the hooks decide lives in the Runtime that install() makes: no runtime module
    rebinds a global (``global``), and none has a test-only ``reset``."""
    import ast
    from pathlib import Path

    import megatron_hetero.runtime as runtime

    found = []
    for path in sorted(Path(runtime.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.name}:{n.lineno} global" for n in ast.walk(tree)
                  if isinstance(n, ast.Global)]
        found += [f"{path.name}:{n.lineno} reset()" for n in tree.body
                  if isinstance(n, ast.FunctionDef) and n.name == "reset"]
    assert not found, found
