"""``Offload.module_inputs`` at run time: megatron-core's fine-grained activation offloading set
per rank (args and every model chunk's config), refused where it cannot run, the other ranks
joining its start-up summary collectives, the launch environment and the rehearsal's note."""

from __future__ import annotations

import pytest
import yaml

from megatron_hetero.emulate.memory import memory_caps
from megatron_hetero.emulate.report import module_inputs_note
from megatron_hetero.emulate.shrink import shrink_plan, without_module_inputs
from megatron_hetero.mcore import cpu_offload
from megatron_hetero.mcore.stage_policies import stage_config_kwargs
from megatron_hetero.runtime import hooks, policies
from megatron_hetero.runtime.core_run import CoreBackend, CoreRankState
from megatron_hetero.runtime.plan_args import ArgumentConflict, check_and_apply

from .plans import make_plan

ON = {"module_inputs": True}
OFFLOADING = {"fine_grained_activation_offloading": True,
              "offload_modules": ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]}
NOT_OFFLOADING = {"fine_grained_activation_offloading": False, "offload_modules": []}


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.setattr(cpu_offload, "_joined", [False])
    yield


def _subset(d: dict, keys) -> dict:
    return {k: d[k] for k in keys}


def test_every_rank_sets_module_input_offload_on_or_off():
    plan = make_plan(split=(2, 2), offload=[ON, None])
    on, off = plan.stage(0, 0), plan.stage(0, 1)
    assert _subset(stage_config_kwargs(on), OFFLOADING) == OFFLOADING
    assert _subset(stage_config_kwargs(off), NOT_OFFLOADING) == NOT_OFFLOADING
    assert _subset(policies.stage_args(on), OFFLOADING) == OFFLOADING
    assert _subset(policies.stage_args(off), NOT_OFFLOADING) == NOT_OFFLOADING
    # the other policies of the stage are still there, and nothing turns cpu_offloading on
    assert policies.stage_args(on)["recompute_granularity"] is None
    assert "cpu_offloading" not in stage_config_kwargs(on)


def test_every_model_chunk_of_an_interleaved_stage_offloads():
    plan = make_plan(chunks=[[2, 1], [1, 2]], replicas=[(1, 2)], offload=[None, ON],
                     recompute=[None, {"granularity": "full", "method": "block", "num_layers": 1}])
    stage = plan.stage(0, 1)
    for chunk in (0, 1):
        kw = stage_config_kwargs(stage, chunk)
        assert _subset(kw, OFFLOADING) == OFFLOADING, chunk
    # block recompute of 1 layer still covers only chunk 0's first layer
    assert stage_config_kwargs(stage, 0)["recompute_num_layers"] == 1
    assert stage_config_kwargs(stage, 1)["recompute_granularity"] is None
    for chunk in (0, 1):
        assert _subset(stage_config_kwargs(plan.stage(0, 0), chunk),
                       NOT_OFFLOADING) == NOT_OFFLOADING


def test_apply_stage_config_sets_this_ranks_chunks():
    from types import SimpleNamespace

    from .plans import A100

    plan = make_plan(chunks=[[1, 1], [1, 1]], replicas=[(1, 2)], offload=[ON, None])
    for rank, want in ((0, OFFLOADING), (1, NOT_OFFLOADING)):
        backend = CoreBackend(state=CoreRankState(
            plan=plan, plan_path="p.yaml", launcher_rank=rank, megatron_rank=rank,
            device_type=A100, slot=plan.slot_of_rank(rank)))
        for chunk in (0, 1):
            config = backend.apply_stage_config(
                SimpleNamespace(fine_grained_activation_offloading=not want[
                    "fine_grained_activation_offloading"], offload_modules=["x"]), chunk)
            assert _subset(vars(config), want) == want, (rank, chunk)
        # the start-up line of each rank says whether it offloads
        offloads = want["fine_grained_activation_offloading"]
        assert ("module inputs offloaded to host" in backend.state.describe()) == offloads


def _refusal(plan, **kw) -> str:
    with pytest.raises(policies.PolicyUnsupported) as err:
        policies.check_supported(plan, source="p.yaml", **kw)
    return str(err.value)


def _fake_te(monkeypatch, *, v1_env_needed: bool):
    monkeypatch.setattr(policies, "have_transformer_engine", lambda: True)
    monkeypatch.setattr(policies, "_te_needs_v1_env", lambda: v1_env_needed)


def test_without_transformer_engine_it_needs_the_local_layers(monkeypatch):
    monkeypatch.setattr(policies, "have_transformer_engine", lambda: False)
    plan = make_plan(split=(2, 2), offload=[None, ON])
    for impl, named in ((None, "the default, transformer_engine"),
                        ("transformer_engine", "transformer_engine")):
        text = _refusal(plan, transformer_impl=impl)
        assert text.splitlines()[1].strip() == (
            "pipelines[0].stages[1].offload.module_inputs: megatron-core's fine-grained "
            "activation offloading runs on Transformer Engine's layers, which is not installed, "
            "or on megatron-core's local layers: pass --transformer-impl local (the command "
            f"line has {named})")
        assert "stages[0]" not in text
    # the local layers run it on a GPU too (runtime/stack.py; docs/gpu.md)
    policies.check_supported(plan, transformer_impl="local")


def test_cpu_ranks_run_it_on_the_local_layers_without_transformer_engine(monkeypatch):
    # runtime/cpu_offload.py stands in for what it needs of TE (the chain of
    # tests/runtime/test_checkpoint_resume.py runs it)
    monkeypatch.setattr(policies, "have_transformer_engine", lambda: False)
    monkeypatch.setattr(policies, "cpu_backend_enabled", lambda: True)
    policies.check_supported(make_plan(split=(2, 2), offload=[None, ON]), transformer_impl="local")
    # what megatron-core itself refuses still is
    assert "cannot run with cpu_offloading" in _refusal(
        make_plan(split=(2,), offload=[{"module_inputs": True, "activations": True}]))


def test_refused_by_a_megatron_core_without_the_feature(monkeypatch):
    monkeypatch.setattr(policies, "module_input_offload_supported", lambda: False)
    text = _refusal(make_plan(split=(2, 2), offload=[ON, ON]))
    for s in (0, 1):
        assert (f"pipelines[0].stages[{s}].offload.module_inputs: the installed megatron-core has "
                f"no fine-grained activation offloading") in text


def test_the_installed_megatron_core_has_the_feature():
    assert policies.module_input_offload_supported()


def test_refused_together_with_cpu_offloading():
    # Megatron's TransformerConfig asserts not cpu_offloading (also with TE, also at PP=1)
    text = _refusal(make_plan(split=(2,), offload=[{"module_inputs": True, "activations": True}]))
    assert "pipelines[0].stages[0].offload.module_inputs: megatron-core's fine-grained " \
           "activation offloading cannot run with cpu_offloading" in text


def test_transformer_engine_2_10_needs_the_v1_environment(monkeypatch):
    plan = make_plan(split=(2, 2), offload=[ON, None])
    _fake_te(monkeypatch, v1_env_needed=True)
    monkeypatch.delenv(policies.NVTE_ENV, raising=False)
    assert "pipelines[0].stages[0].offload.module_inputs: with Transformer Engine >= 2.10" \
           in _refusal(plan)
    assert "NVTE_CPU_OFFLOAD_V1=1" in _refusal(plan)
    monkeypatch.setenv(policies.NVTE_ENV, "1")
    policies.check_supported(plan)
    _fake_te(monkeypatch, v1_env_needed=False)
    monkeypatch.delenv(policies.NVTE_ENV)
    policies.check_supported(plan)  # older TE: no such variable
    policies.check_supported(plan, transformer_impl="transformer_engine")
    # TE's layers are not the only ones: the local layers need no TE setting
    _fake_te(monkeypatch, v1_env_needed=True)
    policies.check_supported(plan, transformer_impl="local")


def test_the_command_line_may_not_set_it():
    from types import SimpleNamespace

    plan = make_plan(split=(2, 2), offload=[ON, None])
    args = SimpleNamespace(pipeline_model_parallel_layout=None, micro_batch_size=None,
                           fine_grained_activation_offloading=True, offload_modules=["core_attn"])
    with pytest.raises(ArgumentConflict) as err:
        check_and_apply(args, plan, ["--fine-grained-activation-offloading",
                                     "--offload-modules", "core_attn"], source="p.yaml")
    text = str(err.value)
    assert "--fine-grained-activation-offloading: the command line has True" in text
    assert "--offload-modules: the command line has ['core_attn']" in text
    assert text.count("offload.module_inputs") == 2


def _recording_summary(monkeypatch) -> list:
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    calls = []
    monkeypatch.setattr(fgo, "print_offload_summary_table", lambda table: calls.append(table))
    return calls


def test_ranks_that_offload_nothing_join_the_summary_once(monkeypatch):
    calls = _recording_summary(monkeypatch)
    plan = make_plan(split=(2, 2), offload=[ON, None])
    steps = []

    def fb(**kw):
        steps.append(kw)
        return "losses"

    # the offloading stage: Megatron itself runs the summary; unchanged
    assert cpu_offload.join_offload_summary(fb, plan, plan.stage(0, 0)) is fb
    # a plan that offloads nowhere: unchanged
    plain = make_plan(split=(2, 2))
    assert cpu_offload.join_offload_summary(fb, plain, plain.stage(0, 1)) is fb
    # the other stage: after its first step, once, with nothing of its own
    joined = cpu_offload.join_offload_summary(fb, plan, plan.stage(0, 1))
    assert joined(num_microbatches=2) == "losses" and calls == [{}]
    again = cpu_offload.join_offload_summary(fb, plan, plan.stage(0, 1))  # next step's fb
    again(num_microbatches=2)
    assert calls == [{}] and len(steps) == 2


def test_get_forward_backward_func_hook_joins_on_the_non_offloading_rank(monkeypatch):
    from .plans import A100

    calls = _recording_summary(monkeypatch)
    plan = make_plan(split=(2, 2), offload=[ON, None])
    runtime = hooks.Runtime()
    wrapped = runtime.wrap("forward_backward_func", lambda: (lambda **kw: "losses"))
    for rank, joins in ((0, []), (1, [{}])):
        monkeypatch.setattr(cpu_offload, "_joined", [False])
        calls.clear()
        runtime.backend = CoreBackend(state=CoreRankState(
            plan=plan, plan_path="p.yaml", launcher_rank=rank, megatron_rank=rank,
            device_type=A100, slot=plan.slot_of_rank(rank)))
        assert wrapped()(num_microbatches=1) == "losses"
        assert calls == joins, rank


def _summary_rank(rank, world_size, offloads):
    """One rank of a gloo group: the offloading rank runs megatron-core's summary as its
    manager does after the first step; the other runs the plan's joined schedule."""
    import contextlib
    import io

    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    plan = make_plan(split=(2, 2), offload=[ON if offloads else None, None])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if rank == 0:
            fgo.print_offload_summary_table({"attn_norm": 3 * 2**20})
        else:
            cpu_offload.join_offload_summary(lambda: None, plan, plan.stage(0, 1))()
    return out.getvalue()


@pytest.mark.slow
def test_joined_summary_completes_between_real_processes():
    from megatron_hetero.mcore.spawn import spawn

    outs = spawn(_summary_rank, 2, args=(True,), timeout_s=120)
    assert "Activation Offload Summary" in outs[0] and "3.00" in outs[0]
    assert outs[1] == ""


def test_launch_sets_the_v1_environment_for_such_plans(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(make_plan(split=(2, 2), offload=[ON, None]).to_data()))
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(make_plan(split=(2, 2)).to_data()))
    env: dict = {}
    assert policies.set_launch_env(["--lr", "1", "--hetero-plan", str(path)], env)
    assert env == {"NVTE_CPU_OFFLOAD_V1": "1"}
    env = {"NVTE_CPU_OFFLOAD_V1": "0"}  # the user's own choice stays (and is refused later)
    assert policies.set_launch_env([f"--hetero-plan={path}"], env)
    assert env == {"NVTE_CPU_OFFLOAD_V1": "0"}
    env = {}
    assert not policies.set_launch_env(["--hetero-plan", str(plain)], env) and env == {}
    assert not policies.set_launch_env(["--lr", "1"], env) and env == {}


def test_rehearsal_without_fine_grained_offloading_keeps_the_inputs_and_says_why():
    """Where the installed megatron-core has no fine-grained activation offloading the
    rehearsal runs the plan without it (0.16.1 and 0.17.1 have it: tests/emulate/test_rehearse.py
    rehearses it)."""
    real = make_plan(split=(2, 2), offload=[ON, None], hidden=512, heads=8, seq=512,
                     replicas=[(2, 4)], precision="bf16")
    shrunk, slots = without_module_inputs(shrink_plan(real, 32))
    assert slots == [(0, 0)] and not shrunk.offloads_module_inputs
    as_run = memory_caps(real, shrunk)
    if_offloaded = memory_caps(real, shrink_plan(real, 32))
    # the CPU rank keeps the module inputs: its cap grows by what the offload saves on the card
    assert as_run[0][0] > if_offloaded[0][0]
    assert as_run[1] == if_offloaded[1]
    note = module_inputs_note(slots)
    assert note.startswith("note: offload.module_inputs") and "pipeline 0 stage 0" in note
    assert "has no fine-grained activation offloading (megatron-core 0.16.1 and 0.17.1" in note
