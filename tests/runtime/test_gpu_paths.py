"""The runtime's GPU branches, run without a GPU (issue 33, item 3): where the CPU backend
(``MEGATRON_HETERO_CPU=1``) still changes behaviour beyond the device and the backend, the
branch a GPU rank takes is executed here with fakes (docs/development.md lists every use of the
CPU mode and where its GPU branch is tested).

* the vendor refusal (a data-parallel group across vendors) fires with and without the CPU
  mode, as ``validate`` refuses the plan; the torch-stack check (``torch_npu``) is a GPU's only;
* a plan across vendors asks for each group on its vendor's backend with the device backend's
  options, the host groups on gloo; the CPU backend puts all of them on gloo, options dropped;
* the optimizer-checkpoint fixes of megatron-core's distributed optimizer over torch's AdamW
  follow the stack (no Apex, no Transformer Engine), not the device: installed on a GPU
  without them, not where Apex or TE is found, and their state-dict fix runs there;
* fp32 optimizer offload is refused off the CPU backend as ``validate`` refuses it:
  ``tests/runtime/test_hooks.py::test_optimizer_offload_with_fp32_params_is_refused_off_the_cpu_backend``.
"""

from __future__ import annotations

import pytest

from megatron_hetero.errors import SchemaError
from megatron_hetero.runtime import placement, vendors

from .plans import A100, make_plan

MI300X = "MI300X-192GB"


@pytest.mark.parametrize("cpu", ["1", None])
def test_vendor_refusal_fires_on_gpus_and_on_the_cpu_backend(monkeypatch, cpu):
    across = make_plan(split=(1, 1), devices=[[A100, A100], [MI300X, MI300X]],
                       replicas=[(1, 1), (1, 1)])
    if cpu is None:
        monkeypatch.delenv(placement.CPU_ENV, raising=False)
    else:
        monkeypatch.setenv(placement.CPU_ENV, cpu)
    with pytest.raises(SchemaError, match="data-parallel"):
        placement.check_device_stacks(across, source="plan.yaml")
    # the boundary on a pipeline edge is accepted either way
    placement.check_device_stacks(make_plan(split=(1, 1), devices=[[A100, MI300X]]),
                                  source="plan.yaml")


class _Recorder:
    """A fake ``parallel_state.create_group`` recording the backend and options asked."""

    def __init__(self):
        self.calls = []

    def __call__(self, ranks, *, timeout=None, backend=None, pg_options=None, **kw):
        self.calls.append((tuple(ranks) if ranks is not None else None, backend, pg_options))
        return object()


@pytest.mark.parametrize("cpu_backend", [False, True])
def test_groups_across_vendors_get_their_vendors_backend_on_gpus(cpu_backend):
    plan = make_plan(split=(1, 1), devices=[[A100, MI300X]], replicas=[(1, 2)])
    groups = vendors.groups_for(plan, cpu_backend=cpu_backend)
    create = _Recorder()
    options = object()  # the device backend's options (NCCL's), meaningless to gloo
    groups.create_group(create, [0], backend=None, pg_options=options)  # one A100: NVIDIA's
    groups.create_group(create, [1], backend="nccl", pg_options=options)  # one MI300X: AMD's
    groups.create_group(create, [0, 1], backend=None, pg_options=options)  # across: the host
    groups.create_group(create, [0], backend="gloo", pg_options=None)  # Megatron's gloo group
    if cpu_backend:
        assert [c[1:] for c in create.calls] == [("gloo", None)] * 4
    else:
        assert create.calls == [((0,), "nccl", options), ((1,), "nccl", options),
                                ((0, 1), "gloo", None), ((0,), "gloo", None)]
    assert [c.backend for c in groups.choices] == ["nccl", "nccl", "gloo", "gloo"]


@pytest.fixture
def fresh_distributed_optimizer(monkeypatch):
    """megatron-core's ``DistributedOptimizer`` with its methods restored after the test."""
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    for name in ("state_dict", "load_state_dict", "_set_main_param_and_optimizer_states"):
        monkeypatch.setattr(cls, name, getattr(cls, name))
    return distrib_optimizer


def test_optimizer_checkpoint_fixes_follow_the_stack_not_the_device(
        monkeypatch, fresh_distributed_optimizer):
    import torch

    from megatron_hetero.mcore.rebind import is_wrapper
    from megatron_hetero.runtime.torch_optimizer import (_wrap_optimizer_state_dict,
                                                         prepare_torch_optimizer_checkpoints)

    dist_opt = fresh_distributed_optimizer
    cls = dist_opt.DistributedOptimizer
    monkeypatch.delenv(placement.CPU_ENV, raising=False)  # a GPU rank
    monkeypatch.setattr(dist_opt, "HAVE_APEX_OR_TE", True)  # Apex or TE installed
    prepare_torch_optimizer_checkpoints()
    assert not any(is_wrapper(getattr(cls, n), "stack") for n in ("state_dict", "load_state_dict"))
    monkeypatch.setattr(dist_opt, "HAVE_APEX_OR_TE", False)  # a GPU image without them
    prepare_torch_optimizer_checkpoints()
    assert all(is_wrapper(getattr(cls, n), "stack") for n in
               ("state_dict", "load_state_dict", "_set_main_param_and_optimizer_states"))

    # the state-dict fix on a GPU rank: a fresh torch AdamW's empty state is allocated with
    # step 0 before Megatron's state_dict reads the steps
    param = torch.nn.Parameter(torch.zeros(3))
    inner = torch.optim.AdamW([param])
    seen = {}

    class Fake:
        optimizer, config = inner, None

        @staticmethod
        def init_state_fn(opt, config):
            opt.state[param]["exp_avg"] = torch.zeros(3)

    def original(self):
        seen.update(inner.state[param])
        return "state"

    assert _wrap_optimizer_state_dict(original)(Fake()) == "state"
    assert float(seen["step"]) == 0.0 and "exp_avg" in seen
