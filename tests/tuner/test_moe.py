"""Mixtures of experts (issue 30, the planning side): the model keys and their counts, expert
parallelism in plans (both formats, ``validate``'s refusals at their field paths, ``args``),
the cost model's all-to-alls and expert memory, and EP in the search."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hetero import models as M
from megatron_hetero._schema import from_data, to_data
from megatron_hetero.cost import CostModel
from megatron_hetero.cost.stage import StageShape
from megatron_hetero.errors import SchemaError
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.plan import ModelSpec, Pipeline, Stage, any_plan_from_data, uniform_plan
from megatron_hetero.plan.megatron_args import megatron_args
from megatron_hetero.sim.step import simulate
from megatron_hetero.tuner import TuneOptions, tune

H100, A100, MI300X = "H100-SXM-80GB", "A100-SXM-80GB", "MI300X-192GB"
MIXTRAL, QWEN3 = M.PRESETS["mixtral-8x7b"], M.PRESETS["qwen3-30b-a3b"]


def _total(m: ModelSpec) -> int:
    return M.model_layer_params(m) + M.embedding_params(m) + M.output_params(m, single_stage=True)


# -- the model ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, published", [
    # mistralai/Mixtral-8x7B-v0.1: config.json (32 layers, hidden 4096, 8 experts of 14336,
    # 8 KV heads, vocab 32000, untied); its safetensors hold 46,702,792,704 parameters
    ("mixtral-8x7b", 46_702_792_704),
    # Qwen/Qwen3-30B-A3B: config.json (48 layers, hidden 2048, 128 experts of 768, top 8,
    # 32 heads x 128, 4 KV heads, QK norms, vocab 151936, untied); 30,532,122,624 in its
    # safetensors ("30.5B" on the model card)
    ("qwen3-30b-a3b", 30_532_122_624),
])
def test_parameter_counts_are_the_published_ones(name, published):
    assert _total(M.PRESETS[name]) == published


def test_shared_expert_preset_counts_its_shared_expert_and_gate():
    """Qwen2-57B-A14B: 64 experts of 2560 and a gated shared expert of 20480 on every layer,
    QKV bias: 57.4 B in all (its model card), about 14 B active per token."""
    m = M.PRESETS["qwen2-57b-a14b"]
    assert round(_total(m) / 1e9, 1) == 57.4
    no_gate = dataclasses.replace(m, moe_shared_expert_gate=False)
    assert _total(m) - _total(no_gate) == m.num_layers * m.hidden_size
    active = M.layer_forward_flops(m, 1) - M.core_attention_forward_flops(m, 1)
    assert 13e9 < active * m.num_layers / (2 * m.seq_length) + m.hidden_size * m.vocab_size < 15e9


def test_mixed_layers_count_each_layer():
    """``moe_layer_freq`` 2 makes layers 0, 2, 4... MoE layers; a list says it per layer, and
    the two agree with Megatron's reading."""
    every_other = dataclasses.replace(MIXTRAL, moe_layer_freq=2)
    listed = dataclasses.replace(MIXTRAL, moe_layer_freq=[1, 0] * 16)
    assert every_other.moe_layer_pattern == listed.moe_layer_pattern == (1, 0) * 16
    dense = dataclasses.replace(MIXTRAL, num_experts=None, moe_router_topk=2)
    moe_layer = M.model_layer_params(MIXTRAL) // 32
    assert M.model_layer_params(every_other) == 16 * moe_layer + 16 * M.layer_params(dense)
    rest, experts = M.layer_param_parts(every_other)
    assert 32 * (rest + experts) == pytest.approx(M.model_layer_params(every_other))
    # active FLOPs: top-2 of 8 experts in half the layers, dense MLPs in the other half
    assert M.layer_forward_flops(dense, 1) < M.layer_forward_flops(every_other, 1) < \
        M.layer_forward_flops(MIXTRAL, 1)


def test_dense_models_write_no_moe_keys():
    data = to_data(M.PRESETS["llama3-8b"])
    assert not any(k.startswith("moe") or k == "num_experts" for k in data)
    assert from_data(ModelSpec, to_data(QWEN3), source="t") == QWEN3


@pytest.mark.parametrize("change, path", [
    ({"num_experts": None, "moe_router_topk": 4}, "moe_router_topk"),
    ({"moe_router_topk": 9}, "moe_router_topk"),
    ({"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq"),
    ({"moe_layer_freq": [0] * 32}, "moe_layer_freq"),
    ({"moe_layer_freq": 0}, "moe_layer_freq"),
    ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
    ({"moe_router_load_balancing_type": "best"}, "model.moe_router_load_balancing_type"),
])
def test_model_refusals_name_the_key(change, path):
    data = {**to_data(MIXTRAL), **change}
    data = {k: v for k, v in data.items() if v is not None}
    plan = _plan_data(data, ep=1)
    with pytest.raises(SchemaError) as err:
        any_plan_from_data(plan)
    assert err.value.path.endswith(path)


# -- plans ----------------------------------------------------------------------------------------
def _pipes(types, counts, layers=(16, 16), mbs=1):
    return [Pipeline(micro_batch_size=mbs, num_microbatches=n,
                     stages=[Stage(device_type=t, num_layers=k) for k in layers])
            for t, n in zip(types, counts)]


def _plan_data(model: dict, *, ep: int, types=(H100,) * 8, counts=(4,) * 8, tp=1, **extra):
    plan = uniform_plan(model=MIXTRAL, global_batch_size=sum(counts),
                        tensor_model_parallel_size=1, pipelines=_pipes(types, counts))
    data = plan.to_data() | {"model": model, "tensor_model_parallel_size": tp} | extra
    if ep != 1:
        data["expert_model_parallel_size"] = ep
    return data


def test_format1_round_trip_and_args():
    data = _plan_data(to_data(MIXTRAL), ep=8, types=(H100,) * 4 + (A100,) * 4)
    plan = any_plan_from_data(data)
    assert plan.meshes[0].expert_model_parallel_size == 8
    assert plan.to_data() == data
    args = megatron_args(plan)
    for flag, value in (("--num-experts", "8"), ("--moe-router-topk", "2"),
                        ("--expert-model-parallel-size", "8"),
                        ("--expert-tensor-parallel-size", "1"),
                        ("--moe-token-dispatcher-type", "alltoall")):
        assert args[args.index(flag) + 1] == value


def test_format2_round_trip_with_ep_per_mesh():
    mesh = {"tensor_model_parallel_size": 1, "stages": [{"num_layers": 16}],
            "replicas": [{"micro_batch_size": 1, "num_microbatches": 8}] * 4}
    data = {"format_version": 2, "model": to_data(QWEN3), "global_batch_size": 32,
            "meshes": [mesh | {"device_type": H100, "expert_model_parallel_size": 4},
                       mesh | {"device_type": A100, "stages": [{"num_layers": 32}],
                               "expert_model_parallel_size": 2}]}
    plan = any_plan_from_data(data)
    assert [m.expert_model_parallel_size for m in plan.meshes] == [4, 2]
    again = any_plan_from_data(plan.to_data())
    assert again.to_data() == plan.to_data()
    assert "--expert-model-parallel-size" not in megatron_args(plan)  # each mesh its own
    assert "--num-experts" in megatron_args(plan)


@pytest.mark.parametrize("edit, path", [
    (dict(ep=3), "expert_model_parallel_size"),                       # 3 does not divide 8
    (dict(ep=16, counts=(4,) * 8), "expert_model_parallel_size"),     # 16 > the 8 ranks
    (dict(ep=4, counts=(4, 4, 4, 5, 4, 4, 4, 4)), "pipelines[3].num_microbatches"),
    (dict(ep=2, types=(H100, MI300X) * 4), "pipelines[1].stages[0].device_type"),
    (dict(ep=1, tp=2, sequence_parallel=False), "tensor_model_parallel_size"),
    (dict(ep=1, expert_tensor_parallel_size=3), "expert_tensor_parallel_size"),
])
def test_validate_refuses_at_the_field_path(edit, path):
    with pytest.raises(SchemaError) as err:
        any_plan_from_data(_plan_data(to_data(MIXTRAL), **edit))
    assert err.value.path == path


def test_expert_keys_on_a_dense_model_are_refused():
    dense = to_data(M.PRESETS["llama2-7b"])
    with pytest.raises(SchemaError) as err:
        any_plan_from_data(_plan_data(dense, ep=2))
    assert err.value.path == "expert_model_parallel_size"
    mesh = {"device_type": H100, "tensor_model_parallel_size": 1, "expert_model_parallel_size": 2,
            "stages": [{"num_layers": 32}], "replicas": [{"micro_batch_size": 1,
                                                          "num_microbatches": 4}] * 2}
    with pytest.raises(SchemaError) as err:
        any_plan_from_data({"format_version": 2, "model": dense, "global_batch_size": 8,
                            "meshes": [mesh]})
    assert err.value.path == "meshes[0].expert_model_parallel_size"


def test_mesh_plan_moe_needs_tp_one():
    mesh = {"device_type": H100, "tensor_model_parallel_size": 2,
            "stages": [{"num_layers": 32}], "replicas": [{"micro_batch_size": 1,
                                                          "num_microbatches": 4}] * 2}
    with pytest.raises(SchemaError) as err:
        any_plan_from_data({"format_version": 2, "model": to_data(MIXTRAL),
                            "global_batch_size": 8, "meshes": [mesh]})
    assert err.value.path == "meshes[0].tensor_model_parallel_size"


# -- the cost model -------------------------------------------------------------------------------
def _inventory(inter_gb_s: float = 50.0):
    return inventory_from_data({"groups": [
        {"gpu": H100, "nodes": 2, "gpus_per_node": 8, "inter_node_bandwidth_gb_s": inter_gb_s},
        {"gpu": A100, "nodes": 2, "gpus_per_node": 8, "inter_node_bandwidth_gb_s": inter_gb_s}]})


def _shape(ep: int, **kw) -> StageShape:
    return StageShape(device_type=H100, chunk_layers=(16,), micro_batch_size=1,
                      pipeline_size=2, stage=1, num_microbatches=8, data_parallel_size=16,
                      expert_parallel_size=ep, **kw)


def test_expert_memory_shards_over_ep_and_optimizer_over_expert_data_parallel():
    cost = CostModel(MIXTRAL, _inventory())
    one, eight = cost.memory(_shape(1)), cost.memory(_shape(8))
    rest, experts = M.layer_param_parts(MIXTRAL)
    # EP 1 holds every expert, as a dense model of that many parameters would
    assert cost.stage_params(_shape(1)) == pytest.approx(16 * (rest + experts)
                                                         + M.output_params(MIXTRAL))
    assert one.params - eight.params == pytest.approx(16 * experts * 7 / 8 * cost.param_bytes)
    # the distributed optimizer: dense over D, experts over T D / EP: the same shard either way
    assert one.optimizer == pytest.approx(eight.optimizer)
    dense = CostModel(MIXTRAL, _inventory(), use_distributed_optimizer=False)
    assert dense.memory(_shape(8)).optimizer < dense.memory(_shape(1)).optimizer


def test_alltoall_share_grows_as_links_slow():
    """Qwen3-30B-A3B at EP 16 spans two nodes: its all-to-alls take a larger share of the
    stage as the inter-node link slows; EP 8 stays inside a node and does not care."""
    shares = []
    for gb_s in (400.0, 50.0, 5.0):
        cost = CostModel(QWEN3, _inventory(gb_s))
        total = cost.times(_shape(16)).total_s
        shares.append(16 * 2 * cost.alltoall_seconds(_shape(16)) / total)
        assert cost.alltoall_seconds(_shape(8)) == CostModel(QWEN3, _inventory()).alltoall_seconds(_shape(8))
    assert 0 < shares[0] < shares[1] < shares[2] < 1
    assert CostModel(QWEN3, _inventory()).alltoall_seconds(_shape(1)) == 0.0


def test_load_imbalance_slows_experts_and_alltoalls():
    even, skewed = CostModel(MIXTRAL, _inventory()), CostModel(MIXTRAL, _inventory(),
                                                                  moe_load_imbalance=1.5)
    assert skewed.layer_times(H100, 1, 1)[0] > even.layer_times(H100, 1, 1)[0]
    # the bytes scale with it, the message latency does not
    assert skewed.alltoall_seconds(_shape(8)) == pytest.approx(1.5 * even.alltoall_seconds(_shape(8)),
                                                               rel=0.05)


def test_simulator_prices_the_links_the_ep_group_spans():
    """The same plan at EP 8 (one node per EP group) and EP 16 (two nodes): the simulator
    reads the EP group's link off the placement."""
    inv = _inventory(25.0)
    steps = {}
    for ep in (8, 16):
        plan = uniform_plan(model=QWEN3, global_batch_size=32, tensor_model_parallel_size=1,
                            pipelines=_pipes((H100,) * 16, (2,) * 16, layers=(48,)),
                            expert_model_parallel_size=ep)
        steps[ep] = simulate(plan, CostModel(QWEN3, inv), record_events=False)
    assert steps[16].step_time_s > steps[8].step_time_s
    assert steps[16].stages[0].memory.params < steps[8].stages[0].memory.params


# -- the search -----------------------------------------------------------------------------------
def test_search_takes_ep_where_memory_needs_it():
    """16 A100-80GB, TP 1 and at most 2 stages, no offload: at EP 1 a stage holds half of
    Mixtral's 46.7 B parameters (140 GB with their gradients), so only expert parallelism
    fits."""
    inv = inventory_from_data({"groups": [{"gpu": A100, "nodes": 2, "gpus_per_node": 8}]})
    opt = TuneOptions(tensor_parallel_sizes=(1,), max_pipeline_stages=2, micro_batch_sizes=(1,),
                      optimizer_offload=False, activation_offload=False)
    got = tune(MIXTRAL, inv, 32, options=opt)
    assert got.sim.fits_memory
    assert got.plan.meshes[0].expert_model_parallel_size > 1
    again = any_plan_from_data(got.plan.to_data())
    assert again.meshes[0].expert_model_parallel_size == got.plan.meshes[0].expert_model_parallel_size


def test_search_takes_expert_tp_where_ep_runs_out():
    """32 A100-40GB, TP 4 and one stage: a rank holds the whole model but Mixtral's 8 experts;
    EP 8 at expert TP 1 shards them 8 ways (a block of 8 ranks) and does not fit. Expert TP
    shards each expert further (a block of ETP x EP = 16 or 32 ranks over the replicas), so
    the search finds a plan; it validates and round-trips."""
    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-40GB", "nodes": 4,
                                           "gpus_per_node": 8}]})
    opt = TuneOptions(tensor_parallel_sizes=(4,), max_pipeline_stages=1)
    got = tune(MIXTRAL, inv, 256, options=opt)
    mesh = got.plan.meshes[0]
    etp = mesh.expert_tensor_parallel_size or mesh.tensor_model_parallel_size
    assert got.sim.fits_memory and etp > 1
    assert etp * mesh.expert_model_parallel_size > MIXTRAL.num_experts
    ep1 = uniform_plan(model=MIXTRAL, global_batch_size=256, tensor_model_parallel_size=4,
                       pipelines=got.plan.pipelines, sequence_parallel=True,
                       expert_model_parallel_size=8, expert_tensor_parallel_size=1,
                       use_distributed_optimizer=got.plan.use_distributed_optimizer)
    cost = CostModel(MIXTRAL, inv)
    assert not simulate(ep1, cost, record_events=False).fits_memory  # EP alone runs out
    again = any_plan_from_data(got.plan.to_data())
    assert again.meshes[0].expert_tensor_parallel_size == mesh.expert_tensor_parallel_size


@settings(max_examples=60, deadline=None)
@given(experts=st.sampled_from([2, 4, 8, 16, 64]), tp=st.sampled_from([1, 2, 4, 8]),
       replicas=st.sampled_from([1, 2, 4, 8, 16]), ffn=st.sampled_from([96, 256, 768]),
       bias=st.booleans())
def test_every_expert_grid_the_search_offers_validates(experts, tp, replicas, ffn, bias):
    """:func:`expert_grids`: each (EP, expert TP) validates on a stage of ``tp x replicas``
    ranks; expert TP is 1 past EP 1 up to the widest block EP reaches alone, beyond it the
    least expert TP of each wider block, at EP 1 Megatron's default (TP); with biases 1."""
    from megatron_hetero.tuner.experts import expert_grids

    model = dataclasses.replace(MIXTRAL, num_layers=2, num_experts=experts,
                                moe_router_topk=min(2, experts), moe_ffn_hidden_size=ffn,
                                add_bias_linear=bias)
    grids = expert_grids(model, tp, [((H100,), replicas)], replicas * 2)
    assert len(set(grids)) == len(grids)
    pure = [ep * tp if etp is None else ep * etp for ep, etp in grids
            if ep > 1 and (etp or tp) == 1]
    for ep, etp in grids:
        e = tp if etp is None else etp
        assert etp != tp and (e == 1 or not bias)
        assert ep > 1 or e == tp
        if ep > 1 and e > 1:
            assert e * ep > max(pure, default=0)
            assert not any(x * ep == e * ep for x in range(1, e) if tp % x == 0 and ffn % x == 0
                           and (ep, None if x == tp else x) in grids)
        plan = uniform_plan(model=model, global_batch_size=replicas * 2,
                            tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                            pipelines=_pipes((H100,) * replicas, (2,) * replicas, layers=(2,)),
                            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        assert plan.meshes[0].expert_model_parallel_size == ep


@st.composite
def _moe_models(draw):
    heads = draw(st.sampled_from([4, 8]))
    layers = draw(st.integers(2, 8))
    experts = draw(st.sampled_from([2, 4, 8, 16]))
    freq = draw(st.one_of(st.integers(1, layers),
                          st.lists(st.integers(0, 1), min_size=layers, max_size=layers)
                          .filter(lambda x: 1 in x)))
    return ModelSpec(name="rand", num_layers=layers, hidden_size=64 * heads, ffn_hidden_size=512,
                     num_attention_heads=heads, num_query_groups=heads // 2, vocab_size=1024,
                     seq_length=256, num_experts=experts,
                     moe_router_topk=draw(st.integers(1, experts)),
                     moe_ffn_hidden_size=draw(st.sampled_from([64, 128, 256])),
                     moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 128])),
                     moe_layer_freq=freq)


@settings(max_examples=40, deadline=None)
@given(model=_moe_models(), ep_index=st.integers(0, 4))
def test_random_moe_plans_keep_their_invariants(model, ep_index):
    """Every EP dividing the experts (and the 8 replicas) validates, round-trips and holds
    fewer expert parameters per rank than a smaller one; the per-layer means add up to the
    exact count; the all-to-alls cost nothing at EP 1."""
    eps = [e for e in (1, 2, 4, 8) if model.num_experts % e == 0]
    ep = eps[min(ep_index, len(eps) - 1)]
    rest, experts = M.layer_param_parts(model)
    assert model.num_layers * (rest + experts) == pytest.approx(M.model_layer_params(model))
    plan = uniform_plan(model=model, global_batch_size=16, tensor_model_parallel_size=1,
                        pipelines=_pipes((H100,) * 8, (2,) * 8, layers=(model.num_layers,)),
                        expert_model_parallel_size=ep)
    assert any_plan_from_data(plan.to_data()).to_data() == plan.to_data()
    cost = CostModel(model, _inventory())
    shape = StageShape.of(plan, 0, 0)
    smaller = shape.but(expert_parallel_size=1)
    assert cost.stage_params(shape) <= cost.stage_params(smaller)
    assert cost.memory(shape).optimizer == pytest.approx(cost.memory(smaller).optimizer)
    assert cost.alltoall_seconds(smaller) == 0.0
    assert (cost.alltoall_seconds(shape) > 0) == (ep > 1)
    assert simulate(plan, cost, record_events=False).step_time_s > 0


# -- models that mix MoE and dense layers ---------------------------------------------------------
def test_stages_of_a_mixed_model_are_priced_by_their_own_layers():
    """Dense layers first (DeepSeek's ``first_k_dense_replace``), then MoE: the simulator
    prices each stage at its own mix, so the dense stage is cheaper in time and memory than
    an MoE stage of as many layers, and the mix of all stages adds up to the model."""
    model = dataclasses.replace(MIXTRAL, moe_layer_freq=[0] * 16 + [1] * 16)
    plan = uniform_plan(model=model, global_batch_size=8, tensor_model_parallel_size=1,
                        pipelines=_pipes((H100,) * 8, (1,) * 8), expert_model_parallel_size=8)
    shapes = [StageShape.of(plan, 0, s) for s in range(2)]
    assert [s.moe_layers for s in shapes] == [0, 16]
    cost = CostModel(model, _inventory())
    dense, moe = (cost.times(s).total_s for s in shapes)
    assert dense < moe
    assert cost.memory(shapes[0]).params < cost.memory(shapes[1]).params
    assert cost.alltoall_seconds(shapes[0]) == 0 < cost.alltoall_seconds(shapes[1])
    rest, experts = M.layer_param_parts(MIXTRAL)  # a layer of MoE throughout
    dense_layer = M.layer_params(M.mixed_model(model, 0, 1))
    assert cost.stage_params(shapes[0]) == pytest.approx(16 * dense_layer + M.embedding_params(model))
    assert cost.stage_params(shapes[1]) == pytest.approx(16 * (rest + experts / 8)
                                                         + M.output_params(model))


@settings(max_examples=30, deadline=None)
@given(pattern=st.lists(st.integers(0, 1), min_size=4, max_size=9).filter(
    lambda x: 0 in x and 1 in x),
       p=st.integers(2, 3), seed=st.integers(0, 10**6))
def test_the_weighted_split_is_the_brute_force_one(pattern, p, seed):
    """:func:`min_max_split` with :func:`split_scale` finds the least slowest stage that an
    exhaustive search over splits finds, each stage costed by its own layers."""
    import itertools
    import numpy as np

    from megatron_hetero.tuner.experts import split_scale
    from megatron_hetero.schedule.split import min_max_split

    L = len(pattern)
    model = dataclasses.replace(QWEN3, num_layers=L, moe_layer_freq=pattern)
    rng = np.random.default_rng(seed)
    costs = np.cumsum(rng.uniform(0.5, 1.5, size=(p, L + 1)), axis=1)  # grows with layers
    scale = split_scale(model)
    got = min_max_split(costs, L, scale)
    best = min(max(costs[s, n] * scale[sum(split[:s + 1]), n - 1] for s, n in enumerate(split))
               for split in (c for c in itertools.product(range(1, L + 1), repeat=p)
                             if sum(c) == L))
    assert got is not None and got[0] == pytest.approx(best)
    assert split_scale(dataclasses.replace(model, moe_layer_freq=1)) is None  # layers alike


def test_a_profile_sets_the_load_imbalance(tmp_path):
    """``moe_load_imbalance`` in a profile file: read back, refused below 1 at its field, and
    what the cost model slows that device type's experts by."""
    import yaml

    from megatron_hetero.cost.profile_file import load_profile, save_profile

    from ..test_profile_file import _profile

    data = dataclasses.replace(_profile(device_type=H100), moe_load_imbalance=1.4)
    path = tmp_path / "p.yaml"
    save_profile(data, path)
    prof = load_profile(path)
    assert prof.moe_load_imbalance == 1.4
    cost = CostModel(MIXTRAL, _inventory(), profiles={H100: prof})
    assert cost.load_imbalance(H100) == 1.4 and cost.load_imbalance(A100) == 1.0
    bad = to_data(data) | {"moe_load_imbalance": 0.5}
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(SchemaError) as err:
        load_profile(path)
    assert err.value.path == "moe_load_imbalance"


def test_mesh_search_chooses_ep_per_mesh():
    """``--meshes`` on Mixtral over 16 H100 + 16 A100: each mesh at TP 1 with its own EP
    (the A100 mesh holds few layers and no EP, the H100 mesh most layers over EP groups); the
    plan validates, and ``args`` leaves the sizes to each mesh."""
    got = tune(MIXTRAL, _inventory(), 256, options=TuneOptions(meshes=True))
    plan = got.mesh_plan
    assert plan is not None and got.mesh_sim.fits_memory
    assert all(m.tensor_model_parallel_size == 1 for m in plan.meshes)
    assert any(m.expert_model_parallel_size > 1 for m in plan.meshes)
    again = any_plan_from_data(plan.to_data())
    assert [m.expert_model_parallel_size for m in again.meshes] == \
        [m.expert_model_parallel_size for m in plan.meshes]
    eps = {m.expert_model_parallel_size for m in plan.meshes}
    assert ("--expert-model-parallel-size" in megatron_args(plan)) == (len(eps) == 1)
